"""The update kernel: torch's fused Adam/AdamW on one sub-group, and the checks of what it is given.

Pure functions of the parameters, their gradients and a sub-group's state regions: no I/O, no threads.
The fused CPU kernel (``torch._fused_adamw_`` / ``torch._fused_adam_``) is called once per sub-group, so
fp32 parameters match ``torch.optim.AdamW(fused=True)`` bit for bit; a 16-bit parameter is updated
through its fp32 master copy (the third state region) and copied back.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch

from offload.optim.subgroups import Member, SubGroupPlan

SIXTEEN_BIT = (torch.float16, torch.bfloat16)
_DTYPES = (torch.float32, *SIXTEEN_BIT)

GradOf = Callable[[int], "torch.Tensor | None"]
"""Parameter index -> the gradient it is updated with (None: no gradient this step)."""


@dataclass(slots=True, eq=False)
class ParamState:
    """One parameter: its tensor, step count and where its elements sit in the sub-groups."""

    param: torch.Tensor
    group: int
    index: int
    step: torch.Tensor | None = None
    """Committed step count (a float32 0-d tensor, as torch keeps it); None: no state yet."""
    new_step: torch.Tensor | None = None
    """This step's count, committed together with the state."""
    runs: list[tuple[int, Member]] = field(default_factory=list)
    """(sub-group index, run of elements) for each part of the parameter."""

    @property
    def master(self) -> bool:
        return self.param.dtype in SIXTEEN_BIT

    def name(self) -> str:
        return f"parameter {self.index} (param group {self.group}, shape {tuple(self.param.shape)})"


def check_hyperparameters(*, lr: float, betas: tuple[float, float], eps: float, weight_decay: float,
                          amsgrad: bool) -> None:
    """Raise ValueError, naming the argument and what is allowed, for a hyperparameter the kernel cannot take."""
    if amsgrad:
        raise ValueError("amsgrad=True is not supported by OffloadAdam; use amsgrad=False")
    if not 0.0 <= lr:
        raise ValueError(f"lr: {lr!r} is not allowed; use a number >= 0")
    if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
        raise ValueError(f"betas: {betas!r} is not allowed; use two numbers in [0, 1)")
    if not 0.0 <= eps:
        raise ValueError(f"eps: {eps!r} is not allowed; use a number >= 0")
    if not 0.0 <= weight_decay:
        raise ValueError(f"weight_decay: {weight_decay!r} is not allowed; use a number >= 0")


class StepInputs:
    """What one step's updates take besides the state: the hyperparameters read when it began, the gradient
    scale, and gradients handed over in place of ``.grad`` (`OffloadAdam.grad_ready`; any thread, under a lock)."""

    def __init__(self) -> None:
        self.groups: list[dict[str, Any]] | None = None
        """The param groups' hyperparameters read at the step's start (None: read them at each update)."""
        self.grad_scale = 1.0
        self._given: dict[int, torch.Tensor] = {}
        self._lock = threading.Lock()

    def begin(self, param_groups: list[dict[str, Any]], grad_scale: float) -> None:
        """Read the hyperparameters the step will use (see `OffloadAdam.start_step`)."""
        self.groups = [{k: v for k, v in group.items() if k != "params"} for group in param_groups]
        self.grad_scale = grad_scale

    def give(self, index: int, grad: torch.Tensor) -> None:
        """Parameter ``index`` is updated with ``grad`` instead of its ``.grad``."""
        with self._lock:
            self._given[index] = grad

    def take_given(self, index: int) -> torch.Tensor | None:
        """The gradient given for parameter ``index`` (None: none), no longer held here."""
        with self._lock:
            return self._given.pop(index, None)

    def grad_of(self, index: int, states: list[ParamState]) -> torch.Tensor | None:
        """The gradient parameter ``index`` is updated with: the one given, else ``.grad``."""
        if self._given:
            with self._lock:
                given = self._given.get(index)
            if given is not None:
                return given
        return states[index].param.grad

    def clear(self) -> None:
        """The step is over (or given up)."""
        self.groups, self.grad_scale = None, 1.0
        with self._lock:
            self._given = {}


def check_grads(plan: SubGroupPlan, params: list[ParamState], grad_of: GradOf) -> None:
    """Raise ValueError, naming the parameter, for a gradient of ``plan`` the kernel cannot take."""
    for member in plan.members:
        rec = params[member.param]
        grad = grad_of(member.param)
        if grad is None:
            continue
        if grad.is_sparse:
            raise ValueError(f"{rec.name()} has a sparse gradient; OffloadAdam needs dense gradients")
        dtype_ok = grad.dtype == rec.param.dtype or (rec.master and grad.dtype == torch.float32)
        if grad.device != rec.param.device or not dtype_ok or grad.shape != rec.param.shape:
            raise ValueError(f"{rec.name()} has a gradient of {grad.dtype} {tuple(grad.shape)} on {grad.device}; "
                             f"it must match the parameter ({rec.param.dtype} on {rec.param.device}; a 16-bit "
                             f"parameter may have a float32 gradient)")


def adam_update(plan: SubGroupPlan, regions: list[torch.Tensor], states: list[ParamState], grad_of: GradOf,
                group: Mapping[str, Any], scale: float, adamw_mode: bool, scratch: torch.Tensor) -> None:
    """Run the fused Adam/AdamW kernel on one sub-group whose state regions are ``regions`` (exp_avg,
    exp_avg_sq and, for 16-bit parameters, the fp32 master), with ``group``'s hyperparameters, every
    gradient multiplied by ``scale``. Each parameter's ``new_step`` counts this step. ``scratch``, fp32 of
    at least ``plan.region`` elements, holds the gradients scaled or made fp32 (the caller's are left
    as they are): memory a caller can reuse in every update, whose pages are then faulted in once
    rather than per update (docs/engine.md, "Memory bound")."""
    exp_avg, exp_avg_sq = regions[0], regions[1]
    master = regions[2] if plan.master else None
    params, grads, exp_avgs, exp_avg_sqs, steps, copy_back = [], [], [], [], [], []
    for member in plan.members:
        rec = states[member.param]
        grad = grad_of(member.param)  # read once: with overlap_backward this runs beside the caller's thread
        if grad is None:
            continue
        run = slice(member.offset, member.offset + member.numel)
        elements = slice(member.start, member.start + member.numel)
        flat_param = rec.param.detach().view(-1)[elements]
        flat_grad = grad.reshape(-1)[elements]
        if rec.step is None:  # first update of this parameter: fresh state, as torch makes it
            exp_avg[run].zero_()
            exp_avg_sq[run].zero_()
            if master is not None:
                master[run].copy_(flat_param)
        if rec.new_step is None:
            rec.new_step = (rec.step.clone() if rec.step is not None else torch.zeros((), dtype=torch.float32)) + 1
        # clip_grad_norm_'s multiply (times the inverse loss scale), in fp32 for masters
        if master is not None and flat_grad.dtype != torch.float32:
            flat_grad = scratch[run].copy_(flat_grad)
            if scale != 1.0:
                flat_grad.mul_(scale)
        elif scale != 1.0:
            flat_grad = torch.mul(flat_grad, scale, out=scratch[run])
        if master is not None:
            params.append(master[run])
            copy_back.append((flat_param, master[run]))
        else:
            params.append(flat_param)
        grads.append(flat_grad)
        exp_avgs.append(exp_avg[run])
        exp_avg_sqs.append(exp_avg_sq[run])
        steps.append(rec.new_step)
    if not params:
        return
    decoupled = group.get("decoupled_weight_decay", adamw_mode)
    kernel = torch._fused_adamw_ if decoupled else torch._fused_adam_
    beta1, beta2 = group["betas"]
    kernel(params, grads, exp_avgs, exp_avg_sqs, [], steps, amsgrad=False, lr=group["lr"], beta1=beta1,
           beta2=beta2, weight_decay=group["weight_decay"], eps=group["eps"], maximize=group["maximize"],
           grad_scale=None, found_inf=None)
    for param_run, master_run in copy_back:
        param_run.copy_(master_run)


def check_params(records: list[ParamState]) -> None:
    """Raise ValueError, naming the parameter, for one the kernel cannot update."""
    devices = {rec.param.device for rec in records}
    for rec in records:
        if not isinstance(rec.param, torch.Tensor):
            raise ValueError(f"parameter {rec.index} is a {type(rec.param).__name__}, not a tensor")
        if rec.param.device.type != "cpu":
            mixed = f" (the parameters are on {len(devices)} devices: {sorted(map(str, devices))})" if len(devices) > 1 else ""
            raise ValueError(f"{rec.name()} is on {rec.param.device}{mixed}; OffloadAdam updates CPU parameters: "
                             "move the model to the CPU first")
        if rec.param.dtype not in _DTYPES:
            raise ValueError(f"{rec.name()} is {rec.param.dtype}; OffloadAdam supports float32, float16 and bfloat16")
        if not rec.param.is_contiguous():
            raise ValueError(f"{rec.name()} is not contiguous; OffloadAdam updates parameters in place as flat views")
