"""Learning-rate schedules ``WarmupLR`` and ``WarmupDecayLR`` with DeepSpeed's formulas and step count.

Both set ``lr`` in every param group of the optimizer. As in DeepSpeed, constructing one sets the rate
for iteration -1 (``warmup_min_lr``), and each ``step()`` after an optimizer step moves to the next
iteration, so the first two optimizer steps both run at ``warmup_min_lr``. With iteration i:

* warm-up (i < warmup_num_steps): ``min + (max - min) * gamma`` with gamma = log(i + 1) / log(warmup_num_steps)
  ("log") or i / warmup_num_steps ("linear");
* then ``max`` (WarmupLR), or ``min + (max - min) * max(0, (total - i) / max(1, total - warmup_num_steps))``
  (WarmupDecayLR: linear decay, reaching ``warmup_min_lr``, 0 by default, at ``total_num_steps``).

``warmup_num_steps`` below 2 counts as 2, as in DeepSpeed (log(1) would divide by zero).
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

import torch

from offload.config.training import SchedulerConfig

__all__ = ["WarmupDecayLR", "WarmupLR", "build_scheduler"]

WARMUP_TYPES = ("log", "linear")


class WarmupLR:
    """Warm the learning rate up from ``warmup_min_lr`` to ``warmup_max_lr`` over ``warmup_num_steps``
    steps, then hold it.

    Args:
        optimizer: anything with ``param_groups`` (a ``torch.optim.Optimizer``, ``OffloadAdam``).
        warmup_min_lr, warmup_max_lr: one rate for every param group, or a sequence of one per group.
        warmup_num_steps: steps of the warm-up (below 2 counts as 2).
        warmup_type: "log" or "linear".
        last_batch_iteration: the iteration reached so far; -1 for a fresh start, which also sets the
            optimizer's rates to ``warmup_min_lr``.

    Raises ValueError naming the argument for a negative rate or step count, an unknown warmup_type, or
    a sequence whose length is not the number of param groups.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        warmup_min_lr: float | Sequence[float] = 0.0,
        warmup_max_lr: float | Sequence[float] = 1e-3,
        warmup_num_steps: int = 1000,
        warmup_type: str = "log",
        last_batch_iteration: int = -1,
    ) -> None:
        if warmup_type not in WARMUP_TYPES:
            raise ValueError(f"warmup_type: {warmup_type!r} is not supported; use one of {', '.join(WARMUP_TYPES)}")
        if isinstance(warmup_num_steps, bool) or not isinstance(warmup_num_steps, int) or warmup_num_steps < 0:
            raise ValueError(f"warmup_num_steps: {warmup_num_steps!r} is not allowed; use an integer >= 0")
        self.optimizer = optimizer
        self.min_lrs = _per_group(optimizer, "warmup_min_lr", warmup_min_lr)
        self.max_lrs = _per_group(optimizer, "warmup_max_lr", warmup_max_lr)
        self.warmup_num_steps = max(2, warmup_num_steps)
        self.warmup_type = warmup_type
        self.last_batch_iteration = last_batch_iteration
        self._last_lr = self._apply() if last_batch_iteration == -1 else None

    def get_lr(self) -> list[float]:
        """The rate of each param group at ``last_batch_iteration`` (``warmup_min_lr`` before iteration 0)."""
        if self.last_batch_iteration < 0:
            return list(self.min_lrs)
        gamma = self._gamma()
        return [low + (high - low) * gamma for low, high in zip(self.min_lrs, self.max_lrs)]

    def get_last_lr(self) -> list[float]:
        """The rates last set in the optimizer. Raises RuntimeError if none were set yet (a scheduler
        constructed with ``last_batch_iteration`` >= 0 sets them at its first ``step()``).
        """
        if self._last_lr is None:
            raise RuntimeError("no learning rate set yet: call step() first")
        return list(self._last_lr)

    def step(self, last_batch_iteration: int | None = None) -> None:
        """Move to the next iteration (or to ``last_batch_iteration``) and set its rates in the optimizer."""
        if last_batch_iteration is None:
            last_batch_iteration = self.last_batch_iteration + 1
        self.last_batch_iteration = last_batch_iteration
        self._last_lr = self._apply()

    def state_dict(self) -> dict[str, Any]:
        """``{"last_batch_iteration": ...}``, as DeepSpeed saves it."""
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume at the saved iteration and set its rates in the optimizer.

        Raises KeyError if ``last_batch_iteration`` is missing.
        """
        if "last_batch_iteration" not in state:
            raise KeyError("scheduler state has no 'last_batch_iteration'; pass a WarmupLR/WarmupDecayLR state_dict()")
        self.last_batch_iteration = int(state["last_batch_iteration"])
        self._last_lr = self._apply()

    def _gamma(self) -> float:
        if self.last_batch_iteration < self.warmup_num_steps:
            return self._warmup_gamma()
        return 1.0

    def _warmup_gamma(self) -> float:
        if self.warmup_type == "log":
            # multiply by the inverse, as DeepSpeed does, so that the rates match its bit for bit
            return (1.0 / math.log(self.warmup_num_steps)) * math.log(self.last_batch_iteration + 1)
        return self.last_batch_iteration / self.warmup_num_steps

    def _apply(self) -> list[float]:
        rates = self.get_lr()
        for group, rate in zip(self.optimizer.param_groups, rates):
            group["lr"] = rate
        return rates


class WarmupDecayLR(WarmupLR):
    """``WarmupLR``, then a linear decay that reaches ``warmup_min_lr`` (0 by default) at ``total_num_steps``.

    Args:
        optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type, last_batch_iteration:
            as for WarmupLR.
        total_num_steps: the iteration at which the decay ends; at least ``warmup_num_steps``.

    Raises ValueError naming the argument, as WarmupLR, and when total_num_steps < warmup_num_steps.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        total_num_steps: int,
        warmup_min_lr: float | Sequence[float] = 0.0,
        warmup_max_lr: float | Sequence[float] = 1e-3,
        warmup_num_steps: int = 1000,
        warmup_type: str = "log",
        last_batch_iteration: int = -1,
    ) -> None:
        valid = isinstance(total_num_steps, int) and not isinstance(total_num_steps, bool)
        if not valid or total_num_steps < warmup_num_steps:
            raise ValueError(
                f"total_num_steps: {total_num_steps!r} is not allowed; use an integer >= warmup_num_steps "
                f"({warmup_num_steps})"
            )
        self.total_num_steps = total_num_steps
        super().__init__(optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type, last_batch_iteration)

    def _gamma(self) -> float:
        if self.last_batch_iteration < self.warmup_num_steps:
            return self._warmup_gamma()
        remaining = self.total_num_steps - self.last_batch_iteration
        return max(0.0, remaining / max(1.0, self.total_num_steps - self.warmup_num_steps))


def build_scheduler(config: SchedulerConfig, optimizer: torch.optim.Optimizer) -> WarmupLR:
    """The schedule a ``scheduler`` section describes, driving ``optimizer``'s rates from now on."""
    params = config.params
    common = dict(
        warmup_min_lr=params.warmup_min_lr, warmup_max_lr=params.warmup_max_lr,
        warmup_num_steps=params.warmup_num_steps, warmup_type=params.warmup_type,
    )
    if config.type == "WarmupDecayLR":
        assert params.total_num_steps is not None  # SchedulerConfig requires it for this type
        return WarmupDecayLR(optimizer, params.total_num_steps, **common)
    return WarmupLR(optimizer, **common)


def _per_group(optimizer: torch.optim.Optimizer, name: str, value: float | Sequence[float]) -> list[float]:
    groups = len(optimizer.param_groups)
    values = list(value) if isinstance(value, (list, tuple)) else [value] * groups
    if len(values) != groups:
        raise ValueError(f"{name}: {len(values)} values for {groups} param groups; give one per group or one number")
    for rate in values:
        if not isinstance(rate, (int, float)) or isinstance(rate, bool) or not 0 <= rate < math.inf:
            raise ValueError(f"{name}: {rate!r} is not allowed; use a finite number >= 0")
    return [float(rate) for rate in values]
