"""A worker of tests/test_integration_transformers.py's torchrun test: plain Trainer or OffloadTrainer
on two ranks; rank 0 prints the per-step (loss, learning rate, grad norm) as JSON."""

import json
import os
import sys

from tests.test_integration_transformers import Tokens, arguments, logged, nvme_config, tiny_gpt2


def main(kind: str, out: str) -> None:
    import transformers

    from offload.integrations.transformers import OffloadTrainer

    args = arguments(os.path.join(out, kind), max_steps=6, per_device_train_batch_size=1)
    if kind == "plain":
        trainer = transformers.Trainer(model=tiny_gpt2(), args=args, train_dataset=Tokens(48))
    else:
        trainer = OffloadTrainer(model=tiny_gpt2(), args=args, train_dataset=Tokens(48), offload_config=nvme_config(out))
    trainer.train()
    if kind != "plain":
        trainer.save_model(os.path.join(out, "saved"))
        trainer.engine.close()
    if int(os.environ["RANK"]) == 0:
        print("LOGS " + json.dumps(logged(trainer)), flush=True)
    # End the process group before the interpreter's shutdown frees what its collectives used (gloo's
    # teardown may otherwise abort: docs/engine.md, engine.close()).
    import gc

    import torch.distributed as dist

    del trainer
    gc.collect()
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
