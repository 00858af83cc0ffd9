"""A worker of tests/test_integration_transformers.py's two-rank test: plain Trainer or OffloadTrainer
on each rank of a torchrun launch, one after the other in the same processes (one start for both);
each rank reports, per kind, its per-step (loss, learning rate, grad norm)."""

import os
import sys

from tests.test_integration_transformers import Tokens, arguments, logged, nvme_config, tiny_gpt2
from tests.torchrun import finish, report


def main(kinds: str, out: str) -> None:
    """Train with each of the comma-separated ``kinds`` ("offload", "plain") in turn; report them all."""
    report({kind: train(kind, out) for kind in kinds.split(",")})
    finish()


def train(kind: str, out: str) -> dict:
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
    return logged(trainer)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
