"""Failures outside the agreement: a rank whose forward, backward or step raises where the others cannot
know it stops every rank at once, each naming the rank that failed first.

The agreement (`offload.train.step.agree`) covers the engine's own I/O inside the passes: such an error
is kept and shared at the next all-reduce of a flag. An error that leaves the engine's call on one rank
only (the user's model raising on a bad batch, an assertion, an out-of-memory) cannot be: that rank
leaves its forward, backward or step while the others go on to their next collective, which waits for it
until the process group's timeout (gloo's default: 30 minutes). So, with several ranks:

1. The rank that failed records ``rank R failed in <call> at step N: <its error>`` in its process group's
   store (a side channel the collectives do not need), the first rank to record winning (compare-and-set).
2. It closes the engine's process group, so that every other rank's pending collective in it, and its
   next one, fails at once. Over gloo that takes destroying the group: its connections close once nothing
   holds it, and only then (``abort()`` and ``shutdown()`` leave them open, and a peer waits on; measured
   with torch 2.13). So the engine runs its collectives in a gloo group of its own (`offload.train.setup.
   engine_group`), and here waits for its collectives in flight (each was issued by every rank, the
   failure coming after it), drops their handles and its parts' references to the group (``let_go``),
   then destroys it. Over NCCL the default group is aborted.
3. It re-raises its own error, with a note saying every rank stopped.
4. A rank whose call then fails (its collective did) finds the record and raises `RanksStopped` naming
   the rank, its call, the step and its error, and closes its group too (a third rank waiting on it is
   freed in turn). Where there is no record before its own (another rank's process ended without one),
   its failed collective is raised with a note saying another rank probably ended.

5. An error of the user's own code between the engine's calls (its data loader, its loss) stops every rank
   the same way where it leaves ``with engine.stop_on_error():`` or the process uncaught (`offload.train.
   step.outside`): recorded as ``rank R failed in the training loop at step N: ...``.

Afterwards every engine call refuses with the same reason on every rank (`FailureState`'s STOPPED); a new
engine resumes from the last checkpoint. No rank commits anything the failed rank did not: a step
commits only after an all-reduce every rank joins, and the failed rank joins none after its failure.
Errors that every rank raises alike (`RanksFailed`, the failure state's `Refused`, an asynchronous save's
`CheckpointSaveError`) stop nothing.
"""

from __future__ import annotations

import gc
import json
import logging
import os
from dataclasses import dataclass
from typing import Any, Callable

import torch.distributed as dist

from offload.train.checkpoint.background import CheckpointSaveError
from offload.train.step.agree import RanksFailed
from offload.train.step.failure import Failure, FailureState, Refused, describe

__all__ = ["RankStop", "RanksStopped", "StopRecord", "communication_error", "destroy_group"]

log = logging.getLogger("offload")

_AGREED = (RanksFailed, Refused, CheckpointSaveError)
"""Errors every rank raises alike: an agreed failure, a refusal of the failure state, an asynchronous save's
failure (agreed by the save's own collectives, raised at each rank's next forward)."""
_KEY = "offload/train/stopped"
"""The store key of the first failure's record (the store is the engine's group's own)."""


@dataclass(frozen=True, slots=True)
class StopRecord:
    """The failure that stopped every rank, as recorded in the process group's store."""

    rank: int
    where: str
    """The engine's call it left: "forward", "backward" or "step"; or where the user's code failed outside
    them ("the training loop", `offload.train.step.outside`)."""
    step: int
    """The step under way (``global_steps + 1``)."""
    error: str
    """``Type: message``."""

    def __str__(self) -> str:
        return f"rank {self.rank} failed in {self.where} at step {self.step}: {self.error}"

    def dumps(self) -> str:
        return json.dumps({"rank": self.rank, "where": self.where, "step": self.step, "error": self.error})

    @classmethod
    def loads(cls, text: str | bytes) -> "StopRecord":
        return cls(**json.loads(text))


class RanksStopped(RanksFailed):
    """Raised on every rank but the one that failed first outside the ranks' agreement (in its forward,
    backward or step, or in the user's code between them: `Engine.stop`), naming it (``first``, a
    `StopRecord`); this rank's call stopped because its collective failed (``__cause__``). The engine's
    process group is closed: resume every rank from the last checkpoint in a new engine."""

    def __init__(self, first: StopRecord, *, rank: int, where: str, local: BaseException, then: str) -> None:
        why = describe(local)
        why = why if len(why) <= 160 else why[:159] + "…"  # gloo's are long; the whole is ``__cause__``
        RuntimeError.__init__(self, f"{first}; this rank ({rank}) stopped in {_its(where)} ({why}). {then}")
        self.what, self.reasons = f"step {first.step}", {first.rank: first.error}
        self.rank, self.needs_load = rank, True
        self.first = first


class RankStop:
    """This rank's side of stopping every rank (module docstring): on an error leaving forward, backward or
    step that the ranks did not agree, record it or read the record, and close the engine's process group.
    ``let_go`` waits for the engine's collectives in flight and drops them and its parts' references to
    the group."""

    def __init__(self, *, world_size: int, rank: int, group: Any, failure: FailureState,
                 let_go: Callable[[], None]) -> None:
        self.world_size, self.rank, self.group, self.failure = world_size, rank, group, failure
        self._own_group = group is not None
        """The engine's own group (gloo), destroyed; else the default one (NCCL), aborted."""
        self._let_go = let_go
        self._store: Any = None
        """The group's store, kept from the first failure: on the rank that hosts it (rank 0 under torchrun)
        the others read the record from it after the group is gone."""

    def after(self, error: BaseException, *, where: str, step: int) -> BaseException:
        """The error to raise for ``error``, which left ``where`` ("forward", ...) of step ``step``: ``error``
        itself where nothing stops (world size 1, an agreed error) or on the rank that failed first (with a
        note); `RanksStopped` on the others. Closes the process group otherwise. Nothing twice: once the ranks
        stopped (or the engine's own group was let go: closed) ``error`` is returned as it is."""
        if self.world_size <= 1 or isinstance(error, _AGREED) or self.failure.kind is Failure.STOPPED or (
                self._own_group and self.group is None):
            return error
        first, unread = self._record(StopRecord(self.rank, where, step, describe(error)))
        self._close()
        then = self._then()
        if first is None:
            self.failure.stopped(f"rank {self.rank} stopped in {where} at step {step} ({describe(error)}). {then}")
            error.add_note(f"offload: this rank ({self.rank}) stopped in {where} at step {step}; no other rank's "
                           f"failure could be read ({unread}): if this is a communication error, another rank may "
                           f"have ended. {then}")
            return error
        self.failure.stopped(f"{first}. {then}")
        if first.rank == self.rank and communication_error(error):  # a rank ended before it could record
            error.add_note(f"offload: a collective of this rank ({self.rank}) failed in {where} at step {step} and no "
                           f"rank recorded a failure first: another rank probably ended (its process exited or "
                           f"was killed: see its log); every rank is stopped. {then}")
            return error
        if first.rank == self.rank:
            error.add_note(f"offload: {first}, outside the ranks' agreement, so every rank was stopped: the other "
                           f"ranks' collectives fail at once and they raise RanksStopped naming this rank. {then}")
            return error
        stopped = RanksStopped(first, rank=self.rank, where=where, local=error, then=then)
        stopped.__cause__ = error
        return stopped

    def _then(self) -> str:
        """What every rank does next."""
        path = self.failure.resume_from
        resume = (f"load_checkpoint({os.path.dirname(path)!r}, tag={os.path.basename(path)!r})" if path else
                  "load_checkpoint(...) from the last checkpoint")
        anew = "make a new engine on every rank" if self._own_group else \
            "re-create the process group (it was aborted), make a new engine on every rank"
        return (f"No rank committed anything the failed rank did not (a step commits only once every rank "
                f"agreed), and the engine closed its process group: {anew} and resume it with {resume}")

    def _record(self, mine: StopRecord) -> tuple[StopRecord | None, str]:
        """The first failure recorded in the group's store (``mine`` unless another rank's came first), or
        None and why none could be read."""
        try:
            if self._store is None:
                self._store = (dist.distributed_c10d._get_default_store() if self.group is None else
                               dist.distributed_c10d._get_process_group_store(self.group))
            return StopRecord.loads(self._store.compare_set(_KEY, "", mine.dumps())), ""
        except Exception as failed:  # noqa: BLE001 - the store is gone (its host ended), or the group
            return None, describe(failed)

    def _close(self) -> None:
        """Make every other rank's pending and next collective in the group fail now (module docstring)."""
        group = self.group
        try:
            self._let_go()  # a work handle or a reference held keeps a gloo group's connections open
        except Exception as failed:  # noqa: BLE001 - on a rank stopped by another, they failed with the group
            log.debug(f"offload: collectives in flight after a failure: {describe(failed)}")
        try:
            if group is None and dist.is_available() and dist.is_initialized():
                dist.distributed_c10d._abort_process_group()  # NCCL: the default group
            else:
                destroy_group(group)
            gc.collect()  # a handle in a reference cycle
        except Exception as failed:  # noqa: BLE001 - the error raised says what happened
            log.warning(f"offload: closing the process group after a failure: {describe(failed)}")


def _its(where: str) -> str:
    """``where`` a rank stopped, as a clause: "its forward" for an engine's call, "the training loop" as it is."""
    return f"its {where}" if where in ("forward", "backward", "step") else where


def communication_error(error: BaseException) -> bool:
    """Whether ``error`` is a failed collective (torch.distributed's errors, gloo's or NCCL's RuntimeErrors),
    as a rank's is when another rank closed the group or ended."""
    text = str(error)
    return isinstance(error, dist.DistError) or isinstance(error, RuntimeError) and (
        "gloo" in text or "NCCL" in text or "Connection closed by peer" in text or "Connection reset by peer" in text)


def destroy_group(group: Any) -> None:
    """Destroy the engine's own process group (`offload.train.setup.engine_group`; None: nothing), where
    torch still has it (``destroy_process_group()`` destroys every group). Local: no collective."""
    if group is None or not (dist.is_available() and dist.is_initialized()):
        return
    if group in dist.distributed_c10d._world.pg_map:
        dist.destroy_process_group(group)
