"""A worker of tests/test_integration_accelerate.py's two-rank test: the loop of Accelerate's docs with
plain ``Accelerator`` (DDP) or `OffloadAccelerator` on each rank of an ``accelerate launch --multi_gpu
--num_processes 2`` launch; each rank reports its (loss, lr) per micro batch and grad norms."""

import sys

from tests.test_integration_accelerate import ACCUMULATION, config, parts, run
from tests.torchrun import finish, report


def main(kind: str, out: str) -> None:
    import accelerate

    from offload.integrations.accelerate import OffloadAccelerator

    if kind == "plain":
        accelerator = accelerate.Accelerator(gradient_accumulation_steps=ACCUMULATION, cpu=True)
    else:
        accelerator = OffloadAccelerator(offload_config=config(out), gradient_accumulation_steps=ACCUMULATION, cpu=True)
    assert accelerator.num_processes == 2
    seen, norms = run(accelerator, accelerator.prepare(*parts()))
    if kind != "plain":
        accelerator.engine.close()
    report({"seen": seen, "norms": norms})
    del accelerator
    finish()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
