"""`WriteQueue`: the writes a writer has in flight, oldest first, with the first error kept.

Every writer of the swap files (partition placement, gradient offload, the partition write-back of
the fast paths, the optimizer state's swapper) starts writes that must land before their memory is
reused and before the step that made them may commit. The queue holds each write's future with what must stay alive until it lands (its buffer,
or the record that owns it), and keeps the rule every writer needs:

- `push` never waits; `trim` bounds the writes in flight by waiting for the oldest, and raises an error
  as soon as it sees one;
- `reap` takes the writes that have landed, never waiting;
- `drain` waits for every write and raises the first error seen since the last drain or abort;
- `abort` waits for every write (never free memory the kernel may still read) and forgets the errors.

A failed write is always waited for with the others, so nothing is left half-written in flight when
an error is raised. Thread-safe: a writer may push from one thread and reap or drain from another.
"""

from __future__ import annotations

import collections
import threading
from typing import Any, Protocol, Sequence

__all__ = ["WriteQueue"]


class Write(Protocol):
    """What the queue needs of a write's future (`tensorio.IOFuture`, `concurrent.futures.Future`)."""

    def done(self) -> bool: ...

    def exception(self) -> BaseException | None: ...


class _AllOf:
    """Several requests written as one (a sub-group's state regions): done when all are; waiting for it
    waits for every one of them and gives the first one's error."""

    def __init__(self, futures: Sequence[Write]) -> None:
        self._futures = list(futures)

    def done(self) -> bool:
        return all(future.done() for future in self._futures)

    def exception(self) -> BaseException | None:
        errors = [future.exception() for future in self._futures]  # waits for every request
        return next((error for error in errors if error is not None), None)


class WriteQueue:
    """Writes in flight, oldest first (see the module docstring)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._writes: collections.deque[tuple[Write, Any]] = collections.deque()
        self._error: BaseException | None = None

    def __len__(self) -> int:
        with self._lock:
            return len(self._writes)

    def push(self, future: Write | Sequence[Write], item: Any = None) -> None:
        """Add a started write (or several requests that land as one) and ``item``, kept until it lands (its
        buffer, its record). Never waits."""
        if not hasattr(future, "done"):
            future = _AllOf(future)
        with self._lock:
            self._writes.append((future, item))

    def remove(self, item: Any) -> None:
        """Take ``item``'s write out of the queue without waiting for it (its owner waits for it itself).
        Raises ValueError when no write of ``item`` is in flight."""
        with self._lock:
            for write in self._writes:
                if write[1] is item:
                    self._writes.remove(write)
                    return
        raise ValueError("internal error: no write of this item is in flight")

    def reap(self) -> list[tuple[Any, BaseException | None]]:
        """The writes that have landed, removed from the queue: ``(item, error or None)`` each, oldest first
        (errors are kept for `drain` too). Never waits."""
        with self._lock:
            done = [write for write in self._writes if write[0].done()]
            for write in done:
                self._writes.remove(write)
        return [(item, self._keep(future.exception())) for future, item in done]

    def wait_oldest(self) -> tuple[Any, BaseException | None]:
        """Wait for the oldest write (sync point) and remove it: ``(item, error or None)`` (the error is kept
        for `drain` too). Raises IndexError when nothing is in flight."""
        with self._lock:
            future, item = self._writes.popleft()
        return item, self._keep(future.exception())

    def trim(self, limit: int) -> None:
        """Wait for the oldest writes until at most ``limit`` are in flight (sync point); then raise the first
        error kept, if any, and forget it (the writes still in flight are left to `drain` or `abort`)."""
        while len(self) > limit:
            self.wait_oldest()
        error = self.take_error()
        if error is not None:
            raise error

    def drain(self) -> list[Any]:
        """Wait for every write (sync point); return their items, oldest first. Raises the first error kept
        since the last `drain` or `abort` (TensorIOError, ...), once every write is done, and forgets it."""
        items = []
        while len(self):
            items.append(self.wait_oldest()[0])
        error = self.take_error()
        if error is not None:
            raise error
        return items

    def abort(self) -> list[Any]:
        """After a failure: wait for every write, errors dropped (sync point); return their items."""
        items = []
        while len(self):
            items.append(self.wait_oldest()[0])
        self.take_error()
        return items

    def take_error(self) -> BaseException | None:
        """The first error kept since the last `drain`, `abort` or `take_error`, now forgotten; None if none."""
        with self._lock:
            error, self._error = self._error, None
        return error

    def _keep(self, error: BaseException | None) -> BaseException | None:
        if error is not None:
            with self._lock:
                if self._error is None:
                    self._error = error
        return error
