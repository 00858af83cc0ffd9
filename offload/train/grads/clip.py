"""The global gradient norm over partitioned gradients, and clipping to it (``gradient_clipping``)."""

from __future__ import annotations

import math
from typing import Any, Iterable

import torch
import torch.distributed as dist

from offload.device import collective_device

__all__ = ["clip_coefficient", "clip_grad_norm_", "grad_norm", "step_factor", "total_norm"]

_EPS = 1e-6
_SIXTEEN_BIT = (torch.float16, torch.bfloat16)


def grad_norm(grads: Iterable[torch.Tensor | None], *, group: dist.ProcessGroup | None = None) -> float:
    """The L2 norm of all gradients together: this rank's sum of squares, summed over the ranks of
    ``group`` (default: the world) by an all_reduce when a process group is initialized, then the root.

    Pass each rank's partitions: elements no rank owns twice, padding as zeros. Every rank of the group
    must call this, even with no gradients. ``None`` entries are skipped. Returns inf or nan when a
    gradient holds one, and inf when a tensor's norm exceeds its dtype's range (float32 for fp16 and
    bf16, whose norms are taken in float32) or the global norm exceeds 1e154 (its square overflows).
    Each tensor's norm is taken on its device, then squared and summed in float64 on the CPU.
    """
    squares = torch.zeros((), dtype=torch.float64)
    for grad in grads:
        if grad is not None:
            dtype = torch.float32 if grad.dtype in _SIXTEEN_BIT else None
            squares += torch.linalg.vector_norm(grad, dtype=dtype).to("cpu", torch.float64) ** 2
    if dist.is_available() and dist.is_initialized():
        squares = squares.to(collective_device(group))  # NCCL reduces only device tensors, gloo CPU ones
        dist.all_reduce(squares, op=dist.ReduceOp.SUM, group=group)
    return math.sqrt(squares.item())


def clip_grad_norm_(
    grads: Iterable[torch.Tensor | None],
    max_norm: float,
    *,
    loss_scale: float = 1.0,
    group: dist.ProcessGroup | None = None,
) -> float:
    """Scale the gradients in place so that their global L2 norm (see ``grad_norm``) is at most
    ``max_norm``: by ``max_norm / (norm + 1e-6)`` when the norm is above it, as DeepSpeed and torch do.

    ``loss_scale``: the gradients are still multiplied by this fp16 loss scale; they are unscaled and
    clipped in one pass over them (one multiply, as DeepSpeed's combined scale), and the norm is that of
    the unscaled gradients.

    Returns the (unscaled) norm before clipping. A non-finite norm (inf or nan) is returned and nothing
    is scaled: the step should be skipped. Raises ValueError if max_norm or loss_scale is not a finite
    number > 0.
    """
    if not 0 < max_norm < math.inf:
        raise ValueError(f"max_norm: {max_norm!r} is not allowed; use a finite number > 0 (0 means: do not clip)")
    if not 0 < loss_scale < math.inf:
        raise ValueError(f"loss_scale: {loss_scale!r} is not allowed; use a finite number > 0 (1: not scaled)")
    grads = [grad for grad in grads if grad is not None]
    norm = grad_norm(grads, group=group) / loss_scale
    if not math.isfinite(norm):
        return norm
    coefficient = (max_norm / (norm + _EPS) if norm > max_norm else 1.0) / loss_scale
    if coefficient != 1.0:
        for grad in grads:
            grad.mul_(coefficient)
    return norm


def total_norm(norms: list[torch.Tensor], *, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """The global L2 norm (a float32 0-d tensor) from each gradient partition's own L2 norm.

    Without a process group, exactly as ``torch.nn.utils.clip_grad_norm_`` computes it from the same
    per-tensor norms (the norm of their stack, in float32), so that a clipped step is bit-identical to
    plain PyTorch's; with one, `grad_norm` over every rank of ``group`` (summed in float64). Every rank
    must call it.
    """
    if dist.is_available() and dist.is_initialized():
        return torch.tensor(grad_norm(norms, group=group), dtype=torch.float32)
    if not norms:
        return torch.zeros((), dtype=torch.float32)
    return torch.linalg.vector_norm(torch.stack([norm.to(torch.float32) for norm in norms]))


def clip_coefficient(norm: torch.Tensor, max_norm: float) -> float:
    """``torch.nn.utils.clip_grad_norm_``'s multiplier for a global ``norm`` (float32 0-d): ``max_norm /
    (norm + 1e-6)``, at most 1, computed as torch computes it (so the same float32 value)."""
    return float(torch.clamp(max_norm / (norm + _EPS), max=1.0))


def step_factor(norms: list[torch.Tensor], *, loss_scaler: Any, clipping: float,
                group: dist.ProcessGroup | None = None) -> float | None:
    """From the gradient partitions' norms (this rank's; every rank calls this): the factor each gradient is
    multiplied by in the update, the clip coefficient times the inverse loss scale, or None when fp16
    overflowed (the step is skipped; the loss scale is updated either way).

    As ``torch.nn.utils.clip_grad_norm_`` (bit for bit at world size 1): multiplied by ``max_norm /
    (norm + 1e-6)`` when that is below 1, ``norm`` the global norm of the unscaled gradients; with fp16,
    one multiply for both (DeepSpeed's combined scale), unscaled by the loss scale of their backward (the
    scale before this step's update of it). ``loss_scaler``: None without fp16; ``clipping``: 0 for none.
    """
    factor = 1.0
    # 1. fp16: a step with an inf/NaN gradient on any rank is skipped and the scale lowered.
    if loss_scaler is not None:
        scale = loss_scaler.loss_scale
        overflow = loss_scaler.has_overflow(norms, group=group)
        loss_scaler.update(overflow)
        if overflow:
            return None
        factor = 1.0 / scale
    # 2. Clip by the global norm over all ranks' partitions.
    if clipping > 0:
        norm = total_norm(norms, group=group)
        factor *= clip_coefficient(norm * factor if factor != 1.0 else norm, clipping)
    return factor
