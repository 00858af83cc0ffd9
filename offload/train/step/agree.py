"""Failures agreed by every rank: a rank that fails inside a step goes on taking part in its collectives,
and the ranks agree before anything commits.

At world size > 1 every rank makes a step's collectives (the gathers of forward and backward, the
gradients' reductions, the norm) in the same order. A rank that raised in the middle of a pass would
leave the others waiting in their next collective for ever. So, inside the passes, a failure is not
raised where it happens: `StepAgreement.absorb` keeps this rank's first error, and the caller goes on
with stand-in data (a gather takes a partition of zeros, a gradient is not handed over), which feeds only
a step that every rank will give up. Then, at the end of each of the engine's calls (forward, backward,
step) and before a step commits, `StepAgreement.agreed` all-reduces one flag per rank: where any rank
failed, every rank gets a `RanksFailed` naming the ranks and their errors, gives up the same step (the
fast paths roll it back whole) and raises it.

Why not agree before each collective: a failure inside a phase (a read in backward) comes between its
collectives, so the others would already be waiting in the next one; and one flag per collective would
double their number. Carrying on with stand-ins costs nothing while nothing fails, and one tiny
all-reduce per call is noise beside a pass's gathers.

At world size 1 nothing is absorbed and `agreed` hands the local error back: errors raise where they happen.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
import torch.distributed as dist

from offload.train.step.failure import checksum_error_in, describe

__all__ = ["RanksFailed", "StepAgreement"]


class RanksFailed(RuntimeError):
    """A step failed on one rank or more; every rank gave it up and raises this. On a rank that failed
    itself, ``__cause__`` is its own error (a TensorIOError or ChecksumError)."""

    def __init__(self, what: str, reasons: dict[int, str], *, rank: int, needs_load: bool) -> None:
        self.what, self.reasons, self.rank, self.needs_load = what, dict(reasons), rank, needs_load
        failed = "; ".join(f"rank {r}: {reason}" for r, reason in sorted(reasons.items()))
        ranks = ", ".join(map(str, sorted(reasons)))
        then = ("a rank needs a load (corrupt bytes, or a step changed part way there): resume every rank with "
                "load_checkpoint(...)" if needs_load else
                "call zero_grad() and run the step again on every rank, or load_checkpoint(...)")
        super().__init__(f"{what} failed on rank{'s' if len(reasons) > 1 else ''} {ranks} ({failed}); every rank "
                         f"gave it up (this is rank {rank}); {then}")


class StepAgreement:
    """This rank's first failure inside the passes, and the all-reduce that shares it (module docstring)."""

    def __init__(self, *, world_size: int = 1, rank: int = 0, group: Any = None) -> None:
        self.world_size, self.rank, self.group = world_size, rank, group
        self._open = 0
        self._error: BaseException | None = None
        self._where = ""
        self.agreements = 0
        """Flags all-reduced so far (for tests)."""

    @property
    def active(self) -> bool:
        """Whether there are other ranks to agree with."""
        return self.world_size > 1

    @contextlib.contextmanager
    def absorbing(self) -> Iterator[None]:
        """Inside this, a pass's failures may be absorbed (the engine's forward and backward passes only:
        outside them, a save or ``full_parameters`` must never see stand-in data)."""
        self._open += 1
        try:
            yield
        finally:
            self._open -= 1

    def absorb(self, error: BaseException, where: str) -> bool:
        """Keep ``error`` (the first one of the step) in place of raising it, and return True, when this rank
        must go on taking part in the pass's collectives: world size > 1, inside `absorbing`, an Exception.
        The caller then goes on with stand-in data. False: the caller raises as usual."""
        if not (self.active and self._open and isinstance(error, Exception)):
            return False
        if self._error is None:
            self._error, self._where = error, where
        return True

    def keep(self, error: BaseException, where: str) -> None:
        """Keep ``error`` for the next `agreed` (world size > 1), outside the passes: for a failure before a
        collective every rank must still make (the wait for the gradients' writes before the norm's all-reduce)."""
        if self._error is None:
            self._error, self._where = error, where

    @property
    def pending(self) -> BaseException | None:
        """The absorbed error not agreed yet."""
        return self._error

    def agreed(self, local: BaseException | None, what: str, *, needs_load: bool = False) -> BaseException | None:
        """The error every rank raises for ``what`` ("the backward of step 3", ...), or None when no rank failed.

        ``local``: this rank's own error at this point (besides one absorbed earlier); ``needs_load``: a
        local error leaves this rank needing a load (its step changed part way). World size 1: returns
        ``local`` itself. Otherwise every rank must call it at the same point (one all-reduce of a flag per
        rank, then, only where one failed, one all-gather of the reasons), and it returns a `RanksFailed`,
        the same on every rank, or None. Sync point.
        """
        if not self.active:
            return local
        error, where = (self._error, self._where) if self._error is not None else (local, "")
        self._error, self._where = None, ""
        flag = 0 if error is None else 2 if (needs_load and local is not None) or checksum_error_in(error) else 1
        from offload.device import collective_device

        flags = torch.zeros(self.world_size, dtype=torch.int32, device=collective_device(self.group))
        flags[self.rank] = flag
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.group)  # sync point
        self.agreements += 1
        flags = flags.tolist()
        if not any(flags):
            return None
        mine = None if error is None else describe(error) + (f" ({where})" if where else "")
        reasons: list[str | None] = [None] * self.world_size
        dist.all_gather_object(reasons, mine, group=self.group)
        failed = RanksFailed(what, {r: reasons[r] or "failed" for r, f in enumerate(flags) if f},
                             rank=self.rank, needs_load=max(flags) == 2)
        failed.__cause__ = error
        return failed
