"""A thread that runs work handed over by backward hooks, one call at a time, in order.

`OffloadAdam(overlap_backward=True)` updates each sub-group as soon as its gradients are final. Doing
that inside the hook would stop the backward pass whenever a sub-group's state is still being read;
handing it to this thread lets backward go on while the state streams in.
"""

from __future__ import annotations

import queue
import threading
from typing import Any, Callable

import torch


class BackgroundWorker:
    """Runs submitted calls on one daemon thread, in submission order, under ``torch.no_grad()``.

    Once a call raises, the calls after it are skipped until `join` has reported the error.
    """

    def __init__(self, name: str) -> None:
        self._name = name
        self._queue: queue.SimpleQueue[tuple[Callable[..., Any], tuple[Any, ...]] | None] = queue.SimpleQueue()
        self._done = threading.Condition()
        self._pending = 0
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None

    def submit(self, fn: Callable[..., Any], *args: Any) -> None:
        """Queue ``fn(*args)``; it runs after every call submitted before it."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name=self._name, daemon=True)
            self._thread.start()
        with self._done:
            self._pending += 1
        self._queue.put((fn, args))

    @property
    def has_backlog(self) -> bool:
        """Whether calls are queued behind the one running (approximate, as seen from any thread)."""
        return not self._queue.empty()

    @property
    def failed(self) -> bool:
        """Whether a call raised and `join` has not reported it yet."""
        return self._error is not None

    def join(self) -> None:
        """Wait until every submitted call has run; re-raise the first error of those calls, if any."""
        with self._done:
            self._done.wait_for(lambda: self._pending == 0)
            error, self._error = self._error, None
        if error is not None:
            raise error

    def wait_until(self, done: Callable[[], bool]) -> None:
        """Wait until ``done()`` is true or no call is left to run; checked after each call ends.

        Unlike `join`, never raises: an error stays for `join` to report.
        """
        with self._done:
            self._done.wait_for(lambda: self._pending == 0 or done())

    def wake(self) -> None:
        """Let `wait_until` check its condition again now, not only when the running call ends."""
        with self._done:
            self._done.notify_all()

    def close(self) -> None:
        """Let the queued calls run, then stop the thread (errors left unreported are dropped)."""
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None
        self._error = None

    def _loop(self) -> None:
        while (item := self._queue.get()) is not None:
            fn, args = item
            try:
                if self._error is None:
                    with torch.no_grad():
                        fn(*args)
            except BaseException as error:  # reported by join(), on the caller's thread
                self._error = error
            finally:
                del item, fn, args  # drop references to the caller's objects before waiting again
                with self._done:
                    self._pending -= 1
                    self._done.notify_all()
