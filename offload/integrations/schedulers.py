"""Moving a learning-rate scheduler built on a trainer's optimizer onto the engine's."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["rebind_scheduler"]

_SCHEDULE_KEYS = ("initial_lr", "lr", "max_lr", "min_lr", "base_momentum", "max_momentum")
"""Param-group keys torch's schedulers write into the optimizer they are built on."""


def rebind_scheduler(scheduler: Any, built_on: torch.optim.Optimizer | None, engine_optimizer: torch.optim.Optimizer
                     ) -> None:
    """Make ``scheduler`` (built on ``built_on``, whose param groups the engine's optimizer took over one
    for one) drive ``engine_optimizer``: it then sets the learning rates the engine steps with, as a
    scheduler built on DeepSpeed's wrapped optimizer does.

    Raises ValueError when the two optimizers' param groups differ in number (a group the engine could
    not map) or the scheduler has no ``optimizer`` to rebind.
    """
    if not hasattr(scheduler, "optimizer"):
        raise ValueError(f"lr scheduler: a {type(scheduler).__name__} has no optimizer to move onto the engine's; "
                         f"use a torch.optim.lr_scheduler scheduler")
    groups = engine_optimizer.param_groups
    if built_on is not None:
        if len(built_on.param_groups) != len(groups):
            raise ValueError(f"lr scheduler: its optimizer has {len(built_on.param_groups)} param groups, the "
                             f"engine's {len(groups)} (a group without trainable parameters?); drop empty groups")
        for theirs, ours in zip(built_on.param_groups, groups):
            ours.update({key: theirs[key] for key in _SCHEDULE_KEYS if key in theirs})
    scheduler.optimizer = engine_optimizer
    # torch's check that optimizer.step() ran before the first scheduler.step() does not apply: the engine
    # runs the update itself (during backward, in the next forward or in step()), not always through it.
    engine_optimizer._opt_called = True
