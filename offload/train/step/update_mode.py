"""Where a step's update runs: the three update modes, the protocol each implements, and what they share.

The mode is chosen once, at `initialize` (`choose_update_mode`), and the engine delegates every
mode-dependent moment of a step to one object (`UpdatePath`):

- `offload.train.step.in_backward`: IN_BACKWARD, each partition updated as soon as its gradient is final;
- `offload.train.step.in_forward`: IN_FORWARD, the step validated after backward, its updates run in
  the next forward's order;
- `offload.train.step.after_backward`: AFTER_BACKWARD, the chunked step in ``step()``.

The two fast paths (the first two) run the updates on the optimizer's thread and commit the
parameters with the optimizer state (`StepRollback`): `FastPath` is what they share, giving a failed
step up.
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from offload.config import EngineConfig
from offload.params import ParamRecord, ParamStore
from offload.train.grads.reduce import GradReducer
from offload.train.step.agree import StepAgreement
from offload.train.step.failure import CounterSnapshot, FailureState, StepCounters, describe
from offload.train.step.kept_buffers import KeptBuffers
from offload.train.step.rollback import StepRollback
from offload.train.step.writeback import PartitionWriteBack

log = logging.getLogger("offload")


class UpdateMode(enum.Enum):
    """Where each step's update runs (docs/engine.md)."""

    IN_BACKWARD = "during backward"
    IN_FORWARD = "in the next forward"
    AFTER_BACKWARD = "after backward"


def fast_optimizer(cfg: EngineConfig, client: Any) -> bool:
    """Whether the optimizer is ours (`OffloadAdam`, built or taking over a torch Adam/AdamW) with
    state on NVMe: the fast paths' first condition (`choose_update_mode`)."""
    offload_opt = cfg.zero_optimization.offload_optimizer
    return (offload_opt.device == "nvme" and offload_opt.ratio > 0
            and (client is None or isinstance(client, (torch.optim.Adam, torch.optim.AdamW))))


def choose_update_mode(cfg: EngineConfig, client: Any, trainable: list[ParamRecord]) -> UpdateMode:
    """Where each step's update runs, so that the optimizer state's NVMe traffic overlaps compute.

    The fast paths need the optimizer we build (OffloadAdam) with its state on NVMe, and, for on-disk
    partitions (updated from the buffer a pass read and written back by `PartitionWriteBack`), all of
    that state (``ratio`` 1.0):

    - IN_BACKWARD: each partition is updated as soon as its gradient is final, when nothing has to see
      every gradient first: no clipping, no fp16 overflow check. With accumulation, the earlier
      micro-batches' gradient partitions are kept and added to the last one's as it arrives.
    - IN_FORWARD: with gradient clipping or fp16, the step validates (global norm, overflow) after
      backward and the updates run during the next forward, in its order (`DeferredStep`); this needs
      the whole state offloaded.
    - AFTER_BACKWARD otherwise: the chunked step.
    """
    offload_opt = cfg.zero_optimization.offload_optimizer
    if not fast_optimizer(cfg, client) or (offload_opt.ratio < 1.0 and any(rec.on_disk for rec in trainable)):
        return UpdateMode.AFTER_BACKWARD
    if cfg.gradient_clipping == 0 and not cfg.fp16.enabled:
        return UpdateMode.IN_BACKWARD
    return UpdateMode.IN_FORWARD if offload_opt.ratio == 1.0 else UpdateMode.AFTER_BACKWARD


@dataclass(eq=False)
class StepContext:
    """What the engine and its update path both work on."""

    config: EngineConfig
    store: ParamStore
    reducer: GradReducer
    optimizer: Any
    lr_scheduler: Any
    loss_scaler: Any
    group: Any
    counters: StepCounters
    failure: FailureState
    kept: KeptBuffers
    """The read buffers kept for the step's updates (the store's `BufferKeeper`)."""
    agreement: StepAgreement = field(default_factory=StepAgreement)
    """Failures shared by every rank (world size > 1): absorbed in the passes, agreed before a step commits."""

    def trainable(self) -> list[ParamRecord]:
        """The records the optimizer steps, in order."""
        return [rec for rec in self.store.records if rec.param.requires_grad]

    def close(self) -> None:
        """Remove the gradient hooks, then the optimizer's and the parameters' swap files (and hooks)."""
        self.reducer.remove()
        if hasattr(self.optimizer, "close"):
            self.optimizer.close()
        self.store.close()

    def gradients_lost_before_update(self, error: BaseException) -> None:
        """A step failed before changing anything: the parameters are whole, its gradients lost."""
        self.failure.gradients_lost(f"step {self.counters.global_steps + 1} failed before its update "
                                    f"({describe(error)}): its gradients are lost, the parameters are whole")


    def gradients_lost_in_backward(self, error: BaseException) -> None:
        """A backward failed: this accumulation's gradients are incomplete."""
        self.failure.gradients_lost(f"the backward of step {self.counters.global_steps + 1} failed "
                                    f"({describe(error)}), so the accumulated gradients are incomplete")


@dataclass(frozen=True, slots=True)
class PathCounts:
    """What an update path holds now (`UpdatePath.counts`)."""

    handed_over: int = 0
    """On-disk partitions handed to the optimizer with their buffer, not let go yet."""
    writes_in_flight: int = 0
    """Their write-backs started and not reaped yet."""
    uncommitted: bool = False
    """A step has begun to change parameters and is not committed yet."""
    steps_in_forward: int = 0
    """Steps whose update ran (or runs) in the next forward."""


class UpdatePath(Protocol):
    """The mode-dependent moments of a step, in the order a training loop reaches them."""

    mode: UpdateMode

    def before_forward(self) -> None:
        """A forward begins."""

    def forward_failed(self, error: BaseException) -> None:
        """The forward raised ``error`` (the path gives its step up if the error was the step's)."""

    def before_backward(self, boundary: bool) -> None:
        """A backward begins; ``boundary``: it ends a gradient accumulation. Raises the last step's error."""

    def backward_failed(self, error: BaseException, boundary: bool) -> None:
        """The backward raised ``error``: record what it lost (the reductions are abandoned already)."""

    def step(self) -> bool:
        """Update the parameters (or hand the update over); False when fp16 overflowed and the step is skipped."""

    def after_step(self) -> None:
        """The step is counted and its gradients dropped: start what the next forward needs."""

    def settle(self) -> None:
        """Before partitions are read outside the passes: every update handed over has run and landed."""

    def abandon(self) -> None:
        """Before a load: forget every update not committed yet."""

    def counts(self) -> PathCounts:
        """What the path holds now (for `Engine.stats`)."""


class FastPath:
    """What the two fast paths share: updates on the optimizer's thread, committed with its state, and
    a failed step given up as a whole (`give_up`)."""

    def __init__(self, ctx: StepContext, writeback: PartitionWriteBack | None, rollback: StepRollback) -> None:
        self.ctx, self.writeback, self.rollback = ctx, writeback, rollback

    def _snapshot(self) -> CounterSnapshot:
        ctx = self.ctx
        return CounterSnapshot.take(ctx.counters, ctx.optimizer, ctx.lr_scheduler, ctx.loss_scaler,
                                    ctx.config.gradient_accumulation_steps)

    def backward_failed(self, error: BaseException, boundary: bool) -> None:
        self.ctx.gradients_lost_in_backward(error)

    def _wait_for_commit(self) -> None:
        """Before a backward whose gradients go to the partitions' free slots: the last step has committed,
        so that they overwrite nothing a rollback needs (sync point)."""
        if self.ctx.reducer.param_slots and self.rollback.uncommitted:
            self.ctx.optimizer.synchronize()

    def counts(self) -> PathCounts:
        handed, writes = self.writeback.counts() if self.writeback is not None else (0, 0)
        return PathCounts(handed_over=handed, writes_in_flight=writes, uncommitted=self.rollback.uncommitted)

    def abandon(self) -> None:
        self._abandon_updates()
        self.rollback.take_aborts()

    def _abandon_updates(self) -> None:
        """The optimizer's thread is joined and its uncommitted steps forgotten first (nothing commits; the
        parameters roll back with them), then every partition handed over is let go."""
        self.ctx.optimizer.abandon_step()
        if self.writeback is not None:
            self.writeback.abort()

    def changed_parameters(self) -> bool:
        """Whether a step not committed has changed parameters, or one was undone that the engine has not
        accounted for yet: a failure now must `give_up` (else nothing changed, the parameters are whole)."""
        return self.rollback.uncommitted or self.rollback.aborted_untaken

    def give_up(self, error: BaseException, *, gradients_lost: bool) -> None:
        """A step failed: join the optimizer's thread and give up every uncommitted step (`StepRollback`).
        When that undid everything, the counters, schedule and loss scale go back to the last committed
        step and training may go on (with ``gradients_lost``, from a new backward); otherwise step and
        save refuse until a load."""
        ctx = self.ctx
        self._abandon_updates()
        ctx.store.release_all()  # reads in flight or failed (a failed prefetch would fail its next gather)
        total, snapshot, uncopied = self.rollback.take_aborts()
        failed_step = ctx.counters.global_steps + 1
        if not total:
            ctx.failure.partly_updated(
                f"step {failed_step} failed part way ({describe(error)}); the in-memory partitions "
                f"{', '.join(uncopied[:3])}{' ...' if len(uncopied) > 3 else ''} were updated without a copy to "
                f"undo it (beyond offload_param.buffer_size elements)")
            return
        if snapshot is not None:
            snapshot.restore(ctx.counters, ctx.optimizer, ctx.lr_scheduler, ctx.loss_scaler)
            failed_step = ctx.counters.global_steps + 1
        reason = (f"step {failed_step} failed ({describe(error)}) and was rolled back entirely: parameters and "
                  f"optimizer state are those after step {ctx.counters.global_steps}")
        log.warning("%s", reason)
        ctx.failure.rolled_back(reason, gradients_lost=gradients_lost)
