"""Loss scaling for fp16 training, with DeepSpeed's semantics: a static scale, or a dynamic one that
halves on overflow (after ``hysteresis`` overflows) and doubles after ``loss_scale_window`` good steps.

One step of the engine, in order::

    scaler.scale_loss(loss).backward()
    overflow = scaler.has_overflow(grads)   # every rank gets the same answer
    if not overflow:                        # an overflowing step is skipped (and so is the lr schedule's step)
        scaler.unscale_(grads); ...optimizer step...
    scaler.update(overflow)                 # a skipped step still counts for the dynamic scale

With gradient clipping, ``offload.clip.clip_grad_norm_(grads, max_norm, loss_scale=scaler.loss_scale)``
unscales and clips in one pass instead of ``unscale_``.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

import torch
import torch.distributed as dist

from offload.config.training import Fp16Config
from offload.device import collective_device

__all__ = ["DynamicLossScaler", "LossScaler", "StaticLossScaler", "build_loss_scaler"]

_SCALE_FACTOR = 2.0


class LossScaler:
    """What both scalers share: the current scale, scaling the loss, unscaling and the overflow check."""

    def __init__(self, loss_scale: float) -> None:
        self._scale = _positive_finite("loss_scale", loss_scale)

    @property
    def loss_scale(self) -> float:
        """The factor the loss is multiplied by before backward."""
        return self._scale

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """Return ``loss * loss_scale`` (call ``.backward()`` on the result)."""
        return loss * self._scale

    def unscale_(self, grads: Iterable[torch.Tensor]) -> None:
        """Divide each gradient in place by the loss scale (before clipping and the optimizer step)."""
        inverse = 1.0 / self._scale
        for grad in grads:
            grad.mul_(inverse)

    def has_overflow(self, grads: Iterable[torch.Tensor | None], *, group: dist.ProcessGroup | None = None) -> bool:
        """True if any gradient holds an inf or a NaN, on this rank or, when a process group is initialized,
        on any rank of ``group`` (default: the world): an all_reduce MAX of one flag, which every rank of
        the group must call. ``None`` entries (parameters without a gradient) are skipped.

        Each gradient is summed (one read, no copy; fp16 and bf16 in float32): a non-finite element makes
        the sum non-finite. As in DeepSpeed, finite gradients whose sum exceeds the range of float32 (of
        float64 for float64 gradients) also count as an overflow; their norm would overflow too.
        """
        overflow = any(grad is not None and not torch.isfinite(_sum(grad)) for grad in grads)
        if dist.is_available() and dist.is_initialized():
            # NCCL reduces only device tensors, gloo CPU ones
            flag = torch.tensor([1.0 if overflow else 0.0], device=collective_device(group))
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
            overflow = bool(flag.item())
        return overflow

    def update(self, overflow: bool) -> None:
        """Record one step's outcome; the static scaler ignores it."""

    def state_dict(self) -> dict[str, Any]:
        """The scaler's state, as plain Python numbers."""
        return {"loss_scale": self._scale}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a ``state_dict()``. Raises KeyError naming a missing entry, ValueError for a bad value."""
        self._scale = _positive_finite("loss_scale", _entry(state, "loss_scale"))


class StaticLossScaler(LossScaler):
    """A fixed loss scale (``fp16.loss_scale`` > 0). Overflowing steps are still detected and skipped."""


class DynamicLossScaler(LossScaler):
    """DeepSpeed's dynamic loss scale.

    Starts at ``2**initial_scale_power``. On an overflow the step is skipped; the first
    ``hysteresis - 1`` overflows only use up hysteresis, after that each overflow halves the scale, never
    below ``min_loss_scale``. Hysteresis is refilled only when the scale grows (or after every good step
    with ``consecutive_hysteresis``). After an overflow at step k (counting ``update`` calls from 0; k = -1
    at the start), the scale doubles at steps k + 1 + window, k + 1 + 2 * window, ... while no overflow
    comes: on the (window + 1)-th consecutive good step, then every window good steps (DeepSpeed's count).

    Args:
        initial_scale_power, loss_scale_window, hysteresis, min_loss_scale: as in ``Fp16Config``.
        consecutive_hysteresis: refill hysteresis after every good step (DeepSpeed's key of that name).
        raise_at_min_scale: as DeepSpeed does, raise when an overflow would lower a scale that is already
            at ``min_loss_scale`` (training has diverged); False keeps skipping steps instead.

    Raises ValueError naming the argument when a value is out of range.
    """

    def __init__(
        self,
        initial_scale_power: int = 16,
        loss_scale_window: int = 1000,
        hysteresis: int = 2,
        min_loss_scale: float = 1.0,
        *,
        consecutive_hysteresis: bool = False,
        raise_at_min_scale: bool = True,
    ) -> None:
        if not 0 <= initial_scale_power <= 64:
            raise ValueError(f"initial_scale_power: {initial_scale_power} is not allowed; use 0 to 64")
        super().__init__(2.0**initial_scale_power)
        self.loss_scale_window = _at_least_one("loss_scale_window", loss_scale_window)
        self.hysteresis = _at_least_one("hysteresis", hysteresis)
        self.min_loss_scale = _positive_finite("min_loss_scale", min_loss_scale)
        self.consecutive_hysteresis = consecutive_hysteresis
        self.raise_at_min_scale = raise_at_min_scale
        self._iteration = 0
        self._last_overflow = -1
        self._hysteresis_left = self.hysteresis

    def update(self, overflow: bool) -> None:
        """Record whether this step overflowed and adjust the scale (see the class docstring).

        Raises RuntimeError on an overflow when hysteresis is used up, the scale is already at
        ``min_loss_scale`` and ``raise_at_min_scale`` is set.
        """
        if overflow:
            if self._hysteresis_left > 1:
                self._hysteresis_left -= 1
            elif self._scale == self.min_loss_scale and self.raise_at_min_scale:
                raise RuntimeError(
                    f"fp16 gradients overflowed at the minimum loss scale {self.min_loss_scale}: training has "
                    f"diverged; lower the learning rate, enable gradient clipping, use bf16, or lower "
                    f"fp16.min_loss_scale"
                )
            else:
                self._scale = max(self._scale / _SCALE_FACTOR, self.min_loss_scale)
            self._last_overflow = self._iteration
        else:
            if self.consecutive_hysteresis:
                self._hysteresis_left = self.hysteresis
            stable = self._iteration - self._last_overflow - 1
            if stable > 0 and stable % self.loss_scale_window == 0:
                self._hysteresis_left = self.hysteresis
                self._scale *= _SCALE_FACTOR
        self._iteration += 1

    def state_dict(self) -> dict[str, Any]:
        """The scale and the counters behind it, as plain Python numbers."""
        return {
            "loss_scale": self._scale,
            "iteration": self._iteration,
            "last_overflow_iteration": self._last_overflow,
            "hysteresis_left": self._hysteresis_left,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a ``state_dict()`` (the settings stay as constructed).

        Raises KeyError naming a missing entry (a static scaler's state has only ``loss_scale``) and
        ValueError for a value out of range.
        """
        scale = _positive_finite("loss_scale", _entry(state, "loss_scale"))
        iteration = int(_entry(state, "iteration"))
        last_overflow = int(_entry(state, "last_overflow_iteration"))
        left = int(_entry(state, "hysteresis_left"))
        if not 1 <= left <= self.hysteresis:
            raise ValueError(f"hysteresis_left: {left} is outside 1..hysteresis ({self.hysteresis})")
        if not -1 <= last_overflow < max(iteration, 0) or iteration < 0:
            raise ValueError(
                f"iteration {iteration}, last_overflow_iteration {last_overflow}: not a state this scaler writes"
            )
        self._scale, self._iteration, self._last_overflow, self._hysteresis_left = scale, iteration, last_overflow, left


def build_loss_scaler(config: Fp16Config) -> LossScaler:
    """The scaler an ``fp16`` section asks for: static when ``loss_scale`` > 0, else dynamic. When fp16 is
    disabled (fp32 or bf16 training), a static scale of 1, as DeepSpeed does: no scaling, but overflow
    checks still work.
    """
    if not config.enabled:
        return StaticLossScaler(1.0)
    if config.loss_scale > 0:
        return StaticLossScaler(config.loss_scale)
    return DynamicLossScaler(
        initial_scale_power=config.initial_scale_power,
        loss_scale_window=config.loss_scale_window,
        hysteresis=config.hysteresis,
        min_loss_scale=config.min_loss_scale,
    )


def _sum(grad: torch.Tensor) -> torch.Tensor:
    return grad.sum(dtype=torch.float32 if grad.dtype in (torch.float16, torch.bfloat16) else None)


def _entry(state: Mapping[str, Any], key: str) -> Any:
    if key not in state:
        raise KeyError(f"loss scaler state has no {key!r}; pass a state_dict() of the same kind of scaler")
    return state[key]


def _positive_finite(name: str, value: float) -> float:
    value = float(value)
    if not 0 < value < float("inf"):
        raise ValueError(f"{name}: {value} is not allowed; use a finite number > 0")
    return value


def _at_least_one(name: str, value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}: {value!r} is not allowed; use an integer >= 1")
    return value
