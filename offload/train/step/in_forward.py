"""IN_FORWARD: the step is validated after backward and its updates run during the next forward.

Clipping needs the global norm and fp16 the overflow check over every gradient, so no partition can be
updated while backward produces its gradient. Instead:

1. ``before_backward``: the last step's updates finish (`DeferredStep.finish`: sync point); at an
   accumulation boundary the buffers backward reads of the partitions the next forward updates first are
   kept (`DeferredStep.prepare`), and late in backward the optimizer reads their state ahead;
2. ``step``: from each partition's gradient norm, taken as it was reduced, the overflow check and the
   clip coefficient (`step_factor`); the step is handed to `DeferredStep.begin` with that factor, and the
   schedule steps now (the update uses the hyperparameters of this moment);
3. the next forward: each gather waits for its partition's update and takes the updated values
   (`ParamStore.gather` -> `DeferredStep.values`), the updates running on the optimizer's thread in the
   forward's order; the optimizer commits the step once every write has landed.

A failure anywhere from the hand-over on gives the step up whole (`FastPath.give_up`). With several ranks,
the step commits in 3 only once every rank agreed, and a failure on one rank is given up on every rank
(`offload.train.step.agree`).
"""

from __future__ import annotations

import dataclasses

from offload.train.grads.clip import step_factor
from offload.train.step.agree import RanksFailed
from offload.train.step.deferred import DeferredStep
from offload.train.step.rollback import StepRollback
from offload.train.step.update_mode import FastPath, PathCounts, StepContext, UpdateMode
from offload.train.step.writeback import PartitionWriteBack


class UpdateInNextForward(FastPath):
    """The IN_FORWARD update path (see the module docstring)."""

    mode = UpdateMode.IN_FORWARD

    def __init__(self, ctx: StepContext, writeback: PartitionWriteBack | None, rollback: StepRollback,
                 deferred: DeferredStep) -> None:
        super().__init__(ctx, writeback, rollback)
        self.deferred = deferred

    def before_forward(self) -> None:
        pass  # the forward's gathers wait for their updates (`DeferredStep.values`)

    def forward_failed(self, error: BaseException) -> None:
        # The update of the last step failed here, or on another rank (every rank gives it up).
        if self.deferred.failed or (isinstance(error, RanksFailed) and self.changed_parameters()):
            self.give_up(error, gradients_lost=False)

    def before_backward(self, boundary: bool) -> None:
        self._finish_last_step(commit=True)
        if boundary:  # the next forward's first updates find their partitions
            self.deferred.prepare(self.ctx.store.budget.buffer_elements // 2)
        self.ctx.kept.begin_backward(for_update=False)

    def step(self) -> bool:
        ctx = self.ctx
        snapshot = self._snapshot()
        taken = [(rec.index, ctx.reducer.grads[rec.index]) for rec in ctx.trainable()]
        error, factor = None, None
        try:
            ctx.reducer.drain()  # sync point: every offloaded gradient is on disk
        except BaseException as failed:
            error = failed
        try:
            if error is None or ctx.agreement.active:  # every rank takes part in the norm's all-reduce
                factor = step_factor([grad.norm for _, grad in taken if grad.norm is not None],
                                     loss_scaler=ctx.loss_scaler, clipping=ctx.config.gradient_clipping, group=ctx.group)
            if factor is not None and error is None:
                grads = {index: grad.value for index, grad in taken if grad.value is not None}
                grads.update({index: None for index, grad in taken if grad.on_disk})  # read back in the forward
                self.rollback.begin_step()
                self.rollback.counted(snapshot)
                self.deferred.begin(grads, factor)  # prefetches the forward's first partitions
                del grads
        except BaseException as failed:
            error = error or failed
        # Several ranks: one all-reduce of a flag, so that every rank hands the step over, or none.
        error = ctx.agreement.agreed(error, f"step {ctx.counters.global_steps + 1}")
        if error is not None:
            if self.changed_parameters():  # this step's updates began, or the last step's writes failed and undid it
                self.give_up(error, gradients_lost=True)
            else:  # nothing is updated yet: the parameters are whole
                ctx.gradients_lost_before_update(error)
            raise error
        if factor is None:  # fp16 overflow: the step is skipped
            ctx.kept.next = set()  # the buffers kept for its updates are prefetched ones now
            return False
        return True

    def after_step(self) -> None:
        pass  # `DeferredStep.begin` started the next forward's reads

    def settle(self) -> None:
        self._finish_last_step()
        if self.writeback is not None:
            self.writeback.settle()

    def counts(self) -> PathCounts:
        return dataclasses.replace(super().counts(), steps_in_forward=self.deferred.steps)

    def _finish_last_step(self, *, commit: bool = False) -> None:
        """Let the step handed to the next forward finish and, with ``commit``, wait until the last step has
        committed (`_wait_for_commit`); give the step up if it failed (sync points). With several ranks the
        step always lands here and commits only once every rank agreed (one all-reduce of a flag)."""
        agreement, error = self.ctx.agreement, None
        try:
            self.deferred.finish()
            if agreement.active:
                self.ctx.optimizer.synchronize()  # every write landed; the step is held (`hold_commits`)
            elif commit:
                self._wait_for_commit()
        except BaseException as failed:
            error = failed
        error = agreement.agreed(error, f"the update of step {self.ctx.counters.global_steps}")
        if error is not None:
            self.give_up(error, gradients_lost=False)
            raise error
        if agreement.active:
            self.ctx.optimizer.commit_held()

    def _abandon_updates(self) -> None:
        super()._abandon_updates()
        self.deferred.abandon()
