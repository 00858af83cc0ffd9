"""Failures outside the engine's calls: the user's code stopping every rank with its error (`Engine.stop`,
``with engine.stop_on_error():``), and an uncaught exception doing so before its process ends.

An error of the user's own code on one rank between the engine's calls (its data loader, its loss, its
logging) leaves that rank out of the next collective while the others wait in it: until gloo's timeout
(30 minutes) where the rank carries on or waits (a notebook, an ``except`` that logs, a ``finally`` that
waits), or, where its process ends, until its connections close, the others then raising a socket error
that does not say why. Stopping records it and closes the engine's process group exactly as a failure
inside forward, backward or step does (`offload.train.step.stop.RankStop.after`): ``rank 1 failed in the
training loop at step 3: ValueError: bad batch``, which every other rank's `RanksStopped` names.

What stops the ranks: any exception (``KeyboardInterrupt`` included: the rank leaves its loop as for any
error) but those the ranks raise alike (`RanksFailed`, `RanksStopped`, a refusal, `CheckpointSaveError`),
one the ranks were stopped for already (an engine call's own, leaving the block afterwards: recorded
once), ``GeneratorExit`` and a clean ``SystemExit`` (code 0 or None: every rank may end so).

Threads are not hooked (``threading.excepthook``): a thread's error ends that thread only, while the main
thread may be inside an engine call, whose collectives a stop would close under it. A loader's workers
hand their errors to the main thread (torch's DataLoader re-raises them at ``next``), where the block or
the hook sees them.
"""

from __future__ import annotations

import logging
import sys
import weakref
from typing import Any, Callable

from offload.train.step.failure import describe

__all__ = ["UNCAUGHT", "StopOnError", "hook_uncaught", "stops_ranks"]

log = logging.getLogger("offload")

UNCAUGHT = "its main thread (uncaught)"
"""Where an uncaught exception failed, as its record says: "rank 1 failed in its main thread (uncaught) ..."."""

Stop = Callable[[BaseException, str], BaseException]
"""`Engine.stop`: ``stop(error, where)`` returns the exception to raise."""


def stops_ranks(error: BaseException) -> bool:
    """Whether ``error`` leaving the user's code is a failure that stops every rank: not ``GeneratorExit`` nor
    a clean ``SystemExit`` (the agreed errors are told apart by `RankStop.after`)."""
    if isinstance(error, GeneratorExit):
        return False
    return not (isinstance(error, SystemExit) and error.code in (0, None))


class StopOnError:
    """`Engine.stop_on_error`'s context manager: an exception leaving the block stops every rank (``stop``),
    then goes on as it is, or as `RanksStopped` where another rank failed first."""

    def __init__(self, stop: Stop, where: str) -> None:
        self._stop, self.where = stop, where

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: Any, error: BaseException | None, traceback: Any) -> bool:
        if error is None:
            return False
        raised = self._stop(error, self.where)
        if raised is not error:
            raise raised from error
        return False  # ``error`` goes on, with a note where it stopped the ranks


def hook_uncaught(stop: Stop) -> Callable[[], None]:
    """Chain a ``sys.excepthook`` that stops every rank (``stop(error, UNCAUGHT)``, held weakly: a method of
    an engine that may be collected) before the hook it replaces prints the error; return what takes it out
    again (the previous hook put back where ours is still the current one, else ours left inert)."""
    method = weakref.WeakMethod(stop)  # type: ignore[arg-type]
    previous = sys.excepthook
    active = True

    def excepthook(kind: type[BaseException], error: BaseException, traceback: Any) -> None:
        live = method() if active else None
        if live is not None:
            try:
                live(error, UNCAUGHT)  # adds its note to the error before it is printed
            except BaseException as failed:  # noqa: BLE001 - the error itself must still be printed
                log.warning(f"offload: stopping the other ranks after an uncaught exception: {describe(failed)}")
        previous(kind, error, traceback)

    def unhook() -> None:
        nonlocal active
        active = False
        if sys.excepthook is excepthook:
            sys.excepthook = previous

    sys.excepthook = excepthook
    return unhook
