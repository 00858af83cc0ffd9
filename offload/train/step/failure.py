"""After an error: whether training may go on, and what a failed step must put back.

A step that fails is in one of three conditions (docs/engine.md, "Failures"): it failed before changing
anything (only this accumulation's gradients are lost), it was rolled back entirely (the fast paths:
parameters and optimizer state commit together), or it changed some parameters and not others (the
chunked step after backward, or an in-memory partition beyond the rollback's copies). `FailureState`
is that condition, one enum with its reason and the checkpoint to resume from; `StepCounters` and
`CounterSnapshot` are what a rolled-back step puts back besides parameters and optimizer state.
"""

from __future__ import annotations

import copy
import enum
import os
from dataclasses import dataclass
from typing import Any

from tensorio import ChecksumError


class Failure(enum.Enum):
    """What the last error left behind (`FailureState.kind`)."""

    NONE = "none"
    """Nothing failed (or a load put everything back)."""
    GRADIENTS_LOST = "gradients lost"
    """This accumulation's gradients are incomplete: ``step()`` refuses until ``zero_grad()``."""
    ROLLED_BACK = "rolled back"
    """The last failed step was undone entirely; training goes on from the step before it."""
    PARTLY_UPDATED = "partly updated"
    """Some parameters carry a failed step's update and others not: step and save refuse until a load."""
    CORRUPT = "corrupt"
    """Bytes read back from a swap file failed their checksum: what is on disk cannot be trusted, so step
    and save refuse until a load."""
    ANOTHER_RANK = "another rank needs a load"
    """Another rank's step failed where it needs a load (corrupt bytes, or part way): every rank gave the
    step up, and step and save refuse until every rank loads a checkpoint (`RanksFailed`)."""
    STOPPED = "stopped"
    """A rank failed outside the ranks' agreement and every rank stopped (offload/train/step/stop.py): the
    engine's process group is closed, and every call that needs it refuses, a load included."""


class Refused(RuntimeError):
    """A call refused by the failure state, before it began anything: the same on every rank, whose
    states follow the same agreed failures (so a refusal needs no agreement of its own)."""


@dataclass(slots=True)
class FailureState:
    """The engine's failure state: its kind, why, and the checkpoint to resume from."""

    kind: Failure = Failure.NONE
    reason: str | None = None
    """The message for ``kind`` (None: NONE)."""
    resume_from: str | None = None
    """The checkpoint last saved or loaded (None: none yet)."""
    last_rollback: str | None = None
    """The last step rolled back entirely (what GRADIENTS_LOST falls back to once the gradients are cleared)."""

    def gradients_lost(self, reason: str) -> None:
        """This accumulation's gradients are incomplete (a backward or the validation of a step failed)."""
        if self.kind not in _NEEDS_LOAD:
            self.kind, self.reason = Failure.GRADIENTS_LOST, reason

    def rolled_back(self, reason: str, *, gradients_lost: bool) -> None:
        """A failed step was undone entirely; with ``gradients_lost`` this accumulation must run again."""
        self.last_rollback = reason
        if self.kind in _NEEDS_LOAD:
            return
        if gradients_lost:
            self.kind, self.reason = Failure.GRADIENTS_LOST, f"{reason}, and the gradients of this accumulation are lost"
        elif self.kind is not Failure.GRADIENTS_LOST:
            self.kind, self.reason = Failure.ROLLED_BACK, reason

    def partly_updated(self, reason: str) -> None:
        """A step failed after changing some parameters and not others."""
        if self.kind not in (Failure.CORRUPT, Failure.STOPPED):
            self.kind, self.reason = Failure.PARTLY_UPDATED, reason

    def corrupt(self, error: BaseException) -> None:
        """A read from a swap file failed its checksum (``error``, a tensorio.ChecksumError): the step it
        was part of is given up, and nothing on disk is trusted again until a load."""
        if self.kind is Failure.STOPPED:
            return
        self.kind = Failure.CORRUPT
        self.reason = (f"a swap file returned corrupt bytes ({describe(error)}); the step was given up, but "
                       f"the values kept on disk can no longer be trusted")

    def another_rank(self, reason: str) -> None:
        """Another rank needs a load after a step every rank gave up (``reason``: the agreed error)."""
        if self.kind not in _NEEDS_LOAD:
            self.kind, self.reason = Failure.ANOTHER_RANK, reason

    def stopped(self, reason: str) -> None:
        """Every rank stopped after a failure outside the ranks' agreement (``reason``: which, and what to do
        next; offload/train/step/stop.py): the process group is closed (over any other condition)."""
        self.kind, self.reason = Failure.STOPPED, reason

    def check_stopped(self, what: str) -> None:
        """Raise `Refused` when every rank stopped (``what``: "step", ...), with the reason and what to do."""
        if self.kind is Failure.STOPPED:
            raise Refused(f"cannot {what}: {self.reason}")

    def gradients_cleared(self) -> None:
        """``zero_grad()``: a new accumulation starts."""
        if self.kind is Failure.GRADIENTS_LOST:
            self.kind = Failure.ROLLED_BACK if self.last_rollback is not None else Failure.NONE
            self.reason = self.last_rollback

    def saved(self, path: str) -> None:
        """A checkpoint was saved at ``path``."""
        self.resume_from = path

    def loaded(self, path: str | None) -> None:
        """A checkpoint was loaded: every partition holds its values."""
        self.kind, self.reason, self.last_rollback, self.resume_from = Failure.NONE, None, None, path

    def check(self, what: str) -> None:
        """Raise `Refused` (a RuntimeError), saying how to resume, when the parameters may be partly updated
        or corrupt, or every rank stopped."""
        if self.kind not in _NEEDS_LOAD:
            return
        self.check_stopped(what)
        resume = (f"load_checkpoint({os.path.dirname(self.resume_from)!r}, "
                  f"tag={os.path.basename(self.resume_from)!r})" if self.resume_from else
                  "load_checkpoint(...) with your last checkpoint")
        if self.kind in (Failure.CORRUPT, Failure.ANOTHER_RANK):
            raise Refused(f"cannot {what}: {self.reason}. Resume with {resume}")
        raise Refused(f"cannot {what}: {self.reason}, so some parameters may carry its update and others "
                      f"not; {what} would go on from a mixed model. Resume with {resume}")

    def check_all_ranks(self, what: str, *, group: Any, world_size: int, rank: int) -> None:
        """`check` agreed by every rank of ``group`` (one all-reduce of a flag per rank): where any rank cannot
        ``what`` (its parameters partly updated or corrupt), every rank raises, the others naming it, so that
        none is left waiting in the collectives that ``what`` begins. Every rank must call it (after a stop,
        each refuses alone: the process group is closed)."""
        self.check_stopped(what)
        import torch
        import torch.distributed as dist

        from offload.device import collective_device

        blocked = self.kind in _NEEDS_LOAD
        if world_size > 1 and dist.is_available() and dist.is_initialized():
            flags = torch.zeros(world_size, dtype=torch.int32, device=collective_device(group))
            flags[rank] = int(blocked)
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
            others = [r for r, flag in enumerate(flags.tolist()) if flag and r != rank]
            if others and not blocked:
                raise Refused(f"cannot {what}: rank{'s' if len(others) > 1 else ''} "
                              f"{', '.join(map(str, others))} cannot (a step there failed part way or read corrupt "
                              f"bytes; its error says which), and every rank refuses with it; resume every rank "
                              f"with load_checkpoint(...)")
        self.check(what)

    def check_step(self) -> None:
        """Raise `Refused` when ``step()`` cannot run: partly updated parameters, lost gradients, a stop."""
        self.check("step")
        if self.kind is Failure.GRADIENTS_LOST:
            raise Refused(f"cannot step: {self.reason}; call zero_grad() and run the accumulation "
                          f"again, or load_checkpoint(...)")


_NEEDS_LOAD = (Failure.PARTLY_UPDATED, Failure.CORRUPT, Failure.ANOTHER_RANK, Failure.STOPPED)


def checksum_error_in(error: BaseException) -> BaseException | None:
    """The tensorio.ChecksumError that ``error`` is, or was raised from (its causes and contexts); None if none."""
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, ChecksumError):
            return error
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return None


def describe(error: BaseException) -> str:
    """``Type: message``, as failure reasons quote an error."""
    return f"{type(error).__name__}: {error}"


@dataclass(slots=True)
class StepCounters:
    """The engine's DeepSpeed counters."""

    global_steps: int = 0
    micro_steps: int = 0
    skipped_steps: int = 0


class CounterAttribute:
    """An attribute of an object with ``counters`` (`StepCounters`) that is that counter: ``engine.global_steps``
    reads and sets ``engine.counters.global_steps``, so that a failed step's rollback restores it."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        return self if obj is None else getattr(obj.counters, self.name)

    def __set__(self, obj: Any, value: int) -> None:
        setattr(obj.counters, self.name, value)


@dataclass(slots=True)
class CounterSnapshot:
    """What a step changes besides parameters and optimizer state, taken before it, to undo it."""

    counters: StepCounters
    lr: list[float]
    lr_scheduler: dict[str, Any] | None
    loss_scaler: dict[str, Any] | None

    @classmethod
    def take(cls, counters: StepCounters, optimizer: Any, lr_scheduler: Any, loss_scaler: Any,
             accumulation_steps: int) -> "CounterSnapshot":
        """Before a step at an accumulation boundary (its micro-batches are counted from their first)."""
        return cls(StepCounters(counters.global_steps, counters.micro_steps + 1 - accumulation_steps,
                                counters.skipped_steps),
                   [group["lr"] for group in optimizer.param_groups],
                   copy.deepcopy(lr_scheduler.state_dict()) if lr_scheduler is not None else None,
                   loss_scaler.state_dict() if loss_scaler is not None else None)

    def restore(self, counters: StepCounters, optimizer: Any, lr_scheduler: Any, loss_scaler: Any) -> None:
        counters.global_steps, counters.skipped_steps = self.counters.global_steps, self.counters.skipped_steps
        counters.micro_steps = self.counters.micro_steps
        for group, lr in zip(optimizer.param_groups, self.lr):
            group["lr"] = lr
        if self.lr_scheduler is not None:
            lr_scheduler.load_state_dict(self.lr_scheduler)
        if self.loss_scaler is not None:
            loss_scaler.load_state_dict(self.loss_scaler)
