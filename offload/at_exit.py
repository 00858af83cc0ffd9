"""Background threads ended before the interpreter's shutdown, for scripts that exit without closing.

A daemon thread still running at exit is stopped by the interpreter wherever it next takes the GIL;
inside a torch call that unwinds C++ frames that may not be unwound, and the process aborts
("terminate called without an active exception", status 134), after a script's own traceback where
it raised. It happened with an engine's background load and a simulated device's copy streams left
open (in half to three quarters of such runs) and with the optimizer's worker mid-update (every
time). Their owners register here; at exit each is ended, the newest first (a load before the
device it copies to), by the callable it gave.
"""

from __future__ import annotations

import atexit
import weakref
from collections.abc import Callable
from typing import Any

__all__ = ["end_at_exit"]

_owners: weakref.WeakKeyDictionary[Any, Callable[[Any], None]] = weakref.WeakKeyDictionary()


def end_at_exit(owner: Any, end: Callable[[Any], None]) -> None:
    """Call ``end(owner)`` at interpreter exit, where ``owner`` is still alive then (it is held weakly).
    ``end`` must let the owner's threads finish what they are in and return once they have."""
    _owners[owner] = end


@atexit.register
def _end_all() -> None:
    for owner, end in reversed(list(_owners.items())):
        end(owner)
