"""`OffloadAdam.step`'s run: the sub-groups not updated during backward, then the commit.

1. offloaded sub-groups whose gradients are in, pipelined in plan order (`SwapSchedule.update_offloaded`:
   read ahead, update, write behind);
2. buffers read ahead for sub-groups that got no gradient this step are given back;
3. with overlap_backward, the callbacks of parameters updated here rather than during backward run;
4. every write has landed before resident state changes (sync point), then resident sub-groups are
   updated (no I/O: cannot fail);
5. the step's state is committed (`StepTransaction`), or, while writes are still in flight with
   overlap_backward, committed when they land (write-behind into the next forward).

A failure anywhere in 1-5 aborts the step's transaction (the previous state stays) and propagates.
"""

from __future__ import annotations

import threading

import torch

from offload.optim.kernel import ParamState, StepInputs, adam_update, check_grads
from offload.optim.overlap import BackwardUpdates
from offload.optim.schedule import SwapSchedule
from offload.optim.subgroups import SubGroupPlan
from offload.optim.swapper import StateSwapper, Where
from offload.optim.transaction import StepTransaction


class StepRun:
    """Runs the kernel on sub-groups with the step's inputs (`update`) and the whole step (`run`)."""

    def __init__(self, owner: torch.optim.Optimizer, params: list[ParamState], plans: list[SubGroupPlan],
                 resident: dict[int, list[torch.Tensor]], swapper: StateSwapper, schedule: SwapSchedule,
                 transaction: StepTransaction, inputs: StepInputs, *, adamw_mode: bool) -> None:
        self._owner, self._params, self._plans, self._resident = owner, params, plans, resident
        self._swapper, self._schedule, self._transaction, self._inputs = swapper, schedule, transaction, inputs
        self._adamw_mode = adamw_mode
        self.background: BackwardUpdates | None = None
        """The overlap_backward worker's side of the step, when there is one."""
        self._scratches = threading.local()  # each updating thread's `adam_update` scratch

    def begin(self, grad_scale: float) -> None:
        """Read the hyperparameters the step will use (see `OffloadAdam.start_step`)."""
        self._inputs.begin(self._owner.param_groups, grad_scale)

    def grad_of(self, index: int) -> torch.Tensor | None:
        """The gradient parameter ``index`` is updated with: the one passed to `grad_ready`, else ``.grad``."""
        return self._inputs.grad_of(index, self._params)

    def update(self, plan: SubGroupPlan, regions: list[torch.Tensor]) -> None:
        """Run the kernel on one sub-group with this step's hyperparameters and gradient scale."""
        inputs = self._inputs
        group = inputs.groups[plan.group] if inputs.groups is not None else self._owner.param_groups[plan.group]
        adam_update(plan, regions, self._params, self.grad_of, group, inputs.grad_scale, self._adamw_mode,
                    self._scratch(plan))

    def _scratch(self, plan: SubGroupPlan) -> torch.Tensor:
        """fp32 scratch of at least ``plan.region`` elements: for an offloaded sub-group, this thread's,
        kept for the next updates (updates run on the optimizer's worker and, after joining it, on the
        caller's thread: one each; a sub-group's size is capped by its swap buffer); for a resident one,
        new memory, touched only if used (resident sub-groups may be as large as the config says)."""
        numel = plan.region
        if not plan.offloaded:
            return torch.empty(numel, dtype=torch.float32)
        scratch = getattr(self._scratches, "tensor", None)
        if scratch is None or scratch.numel() < numel:
            scratch = self._scratches.tensor = torch.empty(numel, dtype=torch.float32)
        return scratch

    def run(self) -> None:
        """The step (see the module docstring). Raises TensorIOError for the swap file and ValueError for a
        bad gradient, after aborting."""
        background, swapper, schedule, transaction = self.background, self._swapper, self._schedule, self._transaction
        if self._inputs.groups is None:
            self.begin(1.0)
        if background is not None:
            background.in_backward = False
        transaction.sync()  # the updates handed over in backward, and the write-behind of the previous step
        swapper.drop_spares()  # gradient memory not used for read-ahead goes back now
        todo = [p for p in self._plans if p.index not in schedule.done and self._has_grads(p)]
        for plan in todo:
            check_grads(plan, self._params, self.grad_of)
        offloaded = [p.index for p in todo if p.offloaded]
        resident = [p for p in todo if not p.offloaded]
        try:
            if offloaded:  # 1.
                schedule.prefetch(offloaded)
            for index in offloaded:
                schedule.update_offloaded(index, offloaded, self.update)
            for rec in swapper.records.values():  # 2.
                if rec.where in (Where.READING, Where.RESIDENT):
                    swapper.evict(rec)
            if background is not None:  # 3.
                background.run_callbacks()
            if resident or background is None:  # 4. sync point
                swapper.drain()
                transaction.wait_dependents()
                swapper.commit()  # the step counts are committed below, with the resident state
        except BaseException:
            transaction.abort()
            raise
        for plan in resident:  # 4. no I/O, cannot fail
            self.update(plan, self._resident[plan.index])
        try:  # 5.
            if swapper.idle and (background is None or background.dependents_done()):
                transaction.commit()  # never waits; raises a failed callback write
            else:
                transaction.uncommitted = True  # write-behind: committed at the next sync point
        except BaseException:
            transaction.abort()
            raise
        schedule.end_step()
        self._inputs.clear()
        if transaction.uncommitted and background is not None:
            # Finish the writes during the next forward, freeing their memory as each one lands.
            background.worker.submit(background.in_worker, transaction.finish_write_behind)

    def _has_grads(self, plan: SubGroupPlan) -> bool:
        return any(self.grad_of(m.param) is not None for m in plan.members)
