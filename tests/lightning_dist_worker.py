"""A worker of tests/test_integration_lightning.py's two-rank test: Lightning's ``ddp`` or
`OffloadStrategy` with ``devices=2`` on each rank of a torchrun launch (Lightning takes the ranks from
torchrun's environment), one after the other in the same processes (one start for both); each rank
reports, per kind, its (loss, lr) per micro batch and its validation losses."""

import sys

from tests.test_integration_lightning import Module, loader, nvme, trainer
from tests.torchrun import finish, report


def main(kinds: str, out: str) -> None:
    """Fit with each of the comma-separated ``kinds`` ("offload", "plain") in turn; report them all."""
    report({kind: fit(kind, out) for kind in kinds.split(",")})
    finish()


def fit(kind: str, out: str) -> dict:
    from pathlib import Path

    module = Module()
    strategy = "ddp" if kind == "plain" else nvme(Path(out))
    # Lightning's DistributedSampler (no shuffling for a plain loader) gives each rank half the batches.
    run = trainer(Path(out) / kind, strategy, devices=2, use_distributed_sampler=True, enable_checkpointing=False)
    run.fit(module, loader(), loader(4))
    assert run.world_size == 2
    if kind != "plain":
        assert run.strategy.engine.world_size == 2
        run.strategy.engine.close()
    return {"seen": module.seen, "val": module.val_losses, "steps": run.global_step}


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
