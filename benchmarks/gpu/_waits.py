"""How long threads were blocked on NVMe: the seconds spent in a tensorio future's ``result()`` or
``exception()`` before its read or write had finished, by direction, for the thread that opened the
count (the training loop) and for every other thread together (the optimizer's, a checkpoint's).

    with NvmeWaits() as waits:
        ...train...
    waits.seconds   # {"read": s, "write": s} on this thread; waits.other: on other threads

A measuring aid of the benchmarks: while it is open, ``AioHandle._start`` tags each future with its
direction and ``IOFuture.result`` / ``exception`` time the calls that find it unfinished (a finished
future costs one clock read). Nothing else changes, and both are put back on exit. One at a time.
"""

from __future__ import annotations

import threading
import time

from tensorio import AioHandle, IOFuture

_active: list["NvmeWaits"] = []


class NvmeWaits:
    """The count (see the module docstring). Raises RuntimeError when one is open already."""

    def __init__(self) -> None:
        self.seconds = {"read": 0.0, "write": 0.0}
        """Seconds the opening thread waited, by direction."""
        self.other = {"read": 0.0, "write": 0.0}
        """Seconds every other thread waited, by direction."""
        self._kinds: dict[int, str] = {}
        self._lock = threading.Lock()
        self._thread = threading.get_ident()
        self._saved: tuple | None = None

    def __enter__(self) -> "NvmeWaits":
        if _active:
            raise RuntimeError("NvmeWaits: one count at a time (another is open)")
        _active.append(self)
        start, result, exception = AioHandle._start, IOFuture.result, IOFuture.exception
        self._saved = (start, result, exception)
        kinds, lock = self._kinds, self._lock

        def tagged_start(handle, write, *args, **kwargs):
            future = start(handle, write, *args, **kwargs)
            key = id(future)
            with lock:
                kinds[key] = "write" if write else "read"
            future.add_done_callback(lambda f, key=key: kinds.pop(key, None))  # done: no wait left to time
            return future

        def timed(method):
            def wrapper(future, *args, **kwargs):
                kind = kinds.get(id(future)) if not future.done() else None
                if kind is None:
                    return method(future, *args, **kwargs)
                began = time.perf_counter()
                try:
                    return method(future, *args, **kwargs)
                finally:
                    self._add(kind, time.perf_counter() - began)
            return wrapper

        AioHandle._start = tagged_start
        IOFuture.result, IOFuture.exception = timed(result), timed(exception)
        return self

    def _add(self, kind: str, seconds: float) -> None:
        with self._lock:
            (self.seconds if threading.get_ident() == self._thread else self.other)[kind] += seconds

    def snapshot(self) -> dict[str, float]:
        """{"read", "write", "other_read", "other_write"} seconds so far."""
        with self._lock:
            return {**self.seconds, "other_read": self.other["read"], "other_write": self.other["write"]}

    def __exit__(self, *exc: object) -> None:
        AioHandle._start, IOFuture.result, IOFuture.exception = self._saved
        _active.remove(self)
