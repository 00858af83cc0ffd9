"""A scratch directory for benchmark files that is removed on every exit, Ctrl-C included."""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

PREFIX = "tensorio-bench-"


@contextmanager
def scratch_dir(directory: str | os.PathLike) -> Iterator[Path]:
    """Create ``directory/tensorio-bench-XXXX/``, yield it, and remove it with all it holds on exit.

    SIGTERM is turned into KeyboardInterrupt meanwhile, so that ``kill`` cleans up like Ctrl-C.
    Raises OSError (naming the directory) when it cannot be created.
    """
    path = Path(tempfile.mkdtemp(prefix=PREFIX, dir=directory))
    with sigterm_as_interrupt():
        try:
            yield path
        finally:
            shutil.rmtree(path, ignore_errors=True)


@contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """Turn SIGTERM into KeyboardInterrupt while the body runs, so that ``kill`` cleans up like Ctrl-C.

    Only the main thread can handle signals: elsewhere this does nothing (the main thread, waiting for
    the others, is the one to use it).
    """
    previous = signal.getsignal(signal.SIGTERM) or signal.SIG_DFL  # None: set outside Python
    in_main_thread = _set_sigterm(_raise_interrupt)
    try:
        yield
    finally:
        if in_main_thread:
            _set_sigterm(previous)


def _raise_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def _set_sigterm(handler: object) -> bool:
    try:
        signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread: signals cannot be handled here
        return False
    return True
