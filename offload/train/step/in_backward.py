"""IN_BACKWARD: each partition is updated during backward, as soon as its gradient is final.

Nothing has to see every gradient first (no clipping, no fp16 overflow check), so:

1. ``before_backward``: at an accumulation boundary the step begins (`StepRollback.begin_step`), and the
   store keeps the buffer each on-disk trainable partition's gather read (`KeptBuffers.begin_backward`);
   a second boundary backward before ``step()`` is refused (it would update the parameters twice);
2. ``gradient_final`` (the reducer's consumer, with the earlier micro-batches' gradients added): the
   partition and its gradient go to the optimizer's thread, an in-memory one directly, an on-disk one
   through `PartitionWriteBack`, which writes it to its uncommitted slot once updated;
3. ``step``: waits for those updates and writes (sync point); the optimizer commits the step, and the
   parameters with it, once every write has landed (with several ranks: and every rank agreed,
   `offload.train.step.agree`).

A failure anywhere gives the step up whole (`FastPath.give_up`), on every rank.
"""

from __future__ import annotations

import torch

from offload.params import ParamRecord
from offload.train.step.rollback import StepRollback
from offload.train.step.update_mode import FastPath, StepContext, UpdateMode
from offload.train.step.writeback import PartitionWriteBack


class UpdateDuringBackward(FastPath):
    """The IN_BACKWARD update path (see the module docstring)."""

    mode = UpdateMode.IN_BACKWARD

    def __init__(self, ctx: StepContext, writeback: PartitionWriteBack | None, rollback: StepRollback) -> None:
        super().__init__(ctx, writeback, rollback)
        self._updated_since_step = False
        """A backward at an accumulation boundary ran (its updates with it) and ``step()`` has not yet."""

    def before_forward(self) -> None:
        self.settle()

    def forward_failed(self, error: BaseException) -> None:
        pass  # the forward runs no update

    def before_backward(self, boundary: bool) -> None:
        if boundary and self._updated_since_step:
            raise RuntimeError(
                "engine.backward() was called twice without engine.step() in between: with the optimizer state on "
                "NVMe and no gradient_clipping, the engine updates each parameter during backward, so the first "
                "backward already updated them and a second one would update them twice. Nothing was changed: call "
                "engine.step() after each engine.backward(); to accumulate gradients over several backwards, set "
                "gradient_accumulation_steps in the config (still calling step() after each backward) or call "
                "set_gradient_accumulation_boundary(False) before the backwards that do not end a step")
        try:
            self._wait_for_commit()
        except BaseException as error:
            self.give_up(error, gradients_lost=False)
            raise
        # On-disk partitions updated during backward keep the buffer their backward read (writeback.py).
        self.ctx.kept.begin_backward(for_update=boundary and self.writeback is not None)
        if boundary:
            self.rollback.begin_step()
            self._updated_since_step = True

    def gradient_final(self, rec: ParamRecord, grad: torch.Tensor) -> None:
        """Give a reduced gradient partition to the optimizer, which updates it in the background."""
        self.rollback.before_update(rec)
        self.ctx.store.before_host_write(rec)  # no copy to the device may still read it
        if rec.on_disk:
            self.writeback.hand_over(rec, grad)
            return
        self.ctx.optimizer.grad_ready(rec.partition, grad=grad.view(rec.partition.shape))

    def backward_failed(self, error: BaseException, boundary: bool) -> None:
        self._updated_since_step = False  # a new backward redoes it
        if boundary:  # this backward's updates are given up (the last step committed before they began)
            self.give_up(error, gradients_lost=True)
        else:
            super().backward_failed(error, boundary)

    def step(self) -> bool:
        ctx = self.ctx
        self._updated_since_step = False
        self.rollback.counted(self._snapshot())
        error = None
        try:
            ctx.optimizer.step()  # sync point: waits for those updates; steps any partition left
            if self.writeback is not None:
                self.writeback.finish()  # sync point: on-disk partitions written back
            if ctx.agreement.active:
                ctx.optimizer.synchronize()  # sync point: every write landed; the step is held (`hold_commits`)
        except BaseException as failed:
            error = failed
        # Several ranks: the step commits only where every rank's is whole (one all-reduce of a flag).
        error = ctx.agreement.agreed(error, f"step {ctx.counters.global_steps + 1}")
        if error is not None:
            self.give_up(error, gradients_lost=True)
            raise error
        if ctx.agreement.active:
            ctx.optimizer.commit_held()
        ctx.store.refresh_many(ctx.trainable())  # kept whole parameters whose partition is not the parameter itself
        return True

    def after_step(self) -> None:
        self.ctx.store.prefetch_from_start()

    def abandon(self) -> None:
        super().abandon()
        self._updated_since_step = False

    def settle(self) -> None:
        if self.writeback is not None:
            self.writeback.settle()
