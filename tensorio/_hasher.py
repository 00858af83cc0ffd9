"""`Hasher`: threads that hash a checksummed write's bytes, or verify a read's, once its transfer is done.

A request's checksum work used to run in the I/O thread that moved its last piece. With io_uring that
is the one thread that also reaps completions and submits the next pieces, so while it hashed (a
partition of 150 MB: 10 ms at the 15 GB/s the hash reaches on memory fresh from a transfer) the disk
waited: `benchmarks.train_large --layers 4` stepped 4-16% slower with checksums than without. Here the
I/O threads hand that work over and go on moving bytes; the request's future resolves once it is done,
as before.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

__all__ = ["Hasher"]

_PREFIX = "tensorio-hash"


class Hasher:
    """Runs checksum work (`run`) on ``threads`` threads of its own, made at the first call. `close`
    waits for the work handed over; work handed over after it runs in the caller's thread."""

    def __init__(self, threads: int = 2) -> None:
        self.threads = threads
        self._pool: ThreadPoolExecutor | None = None
        self._closed = False
        self._lock = threading.Lock()

    def run(self, work: Callable[[], None]) -> None:
        """Run ``work`` on one of the threads (in this thread once closed). ``work`` reports its own
        errors (through the request's future)."""
        with self._lock:
            if not self._closed and self._pool is None:
                self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix=_PREFIX)
            pool = None if self._closed else self._pool
        if pool is None:
            work()
        else:
            pool.submit(work)

    def close(self) -> None:
        """Wait for the work handed over (not when called from one of the threads: a future's callback
        closing its handle; the work still runs), then let the threads go."""
        with self._lock:
            pool, self._pool, self._closed = self._pool, None, True
        if pool is not None:
            pool.shutdown(wait=not threading.current_thread().name.startswith(_PREFIX))
