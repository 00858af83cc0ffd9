"""`HashLoad`: a thread that hashes memory at a set pace, the checksums' CPU work with no tie to the I/O.

``benchmarks.engine_step --modes ...,nvme-unverified+hash`` (and `benchmarks.verify_cost`'s "floor"
side, through ``train_large --hash-cpu-rate``) runs the engine without checksums while this thread
spends, each step, the CPU time the engine with checksums spent hashing (the same xxh3-64, 4 MiB at a
time from a buffer larger than the CPU's caches, as swapped bytes come from memory), spread evenly over
the step. What that costs the step is what that hashing costs on this CPU wherever it is done: the
floor under the checksums' cost, beside which `tensorio`'s own hashing (in the I/O threads, as pieces
land) is measured.

``HashLoad(bytes_per_s=...)`` paces the hashing by bytes instead: ``bytes_per_s`` bytes hashed a second,
wall time (`benchmarks.striped_swap`'s "fio at once + hashing" side hashes, while fio runs, as many bytes
a second as fio moves).
"""

from __future__ import annotations

import threading
import time

import numpy as np
import xxhash

__all__ = ["HashLoad"]

_SLICE = 4 << 20  # a reaped batch's size; ~0.2 ms of hashing, so the thread wakes a few hundred times a second


class HashLoad:
    """While open, a daemon thread hashes (4 MiB slices of a ``buffer_bytes`` buffer, round and round) for
    ``cpu_rate`` CPU seconds a second, sleeping when ahead of the pace; ``hashed`` and ``cpu_seconds`` (the
    hashing's, its loop's not counted) say what it did, over every time it was open (it can be reopened).
    With ``bytes_per_s`` instead of ``cpu_rate`` the pace is that many bytes hashed a second (wall time;
    behind it, the thread hashes without pause until back on it); it may be changed between openings."""

    def __init__(self, cpu_rate: float | None = None, *, bytes_per_s: float | None = None,
                 buffer_bytes: int = 128 << 20) -> None:
        if (cpu_rate is None) == (bytes_per_s is None):
            raise ValueError("HashLoad: give either cpu_rate or bytes_per_s, not both or neither")
        if cpu_rate is not None and not 0 < cpu_rate < 1:
            raise ValueError(f"cpu_rate: {cpu_rate!r} is not allowed; use CPU seconds a second in (0, 1)")
        if bytes_per_s is not None and not bytes_per_s > 0:
            raise ValueError(f"bytes_per_s: {bytes_per_s!r} is not allowed; use bytes a second > 0")
        self.cpu_rate = cpu_rate
        self.bytes_per_s = bytes_per_s
        self.hashed = 0
        self.cpu_seconds = 0.0
        self._buffer = memoryview(np.random.default_rng(0).integers(0, 256, buffer_bytes, dtype=np.uint8))
        self._offset = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> "HashLoad":
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="hash-load", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        start, spent, done, size = time.perf_counter(), 0.0, 0, len(self._buffer)
        while not self._stop.is_set():
            due = done / self.bytes_per_s if self.bytes_per_s else spent / self.cpu_rate  # seconds of pace done
            ahead = due - (time.perf_counter() - start)
            if ahead > 0:  # seconds until the hashing is back on the pace
                self._stop.wait(ahead)
                continue
            began = time.thread_time()  # the hash alone, as `tensorio.checksum_totals` counts it
            xxhash.xxh3_64_intdigest(self._buffer[self._offset:self._offset + _SLICE])
            spent += time.thread_time() - began
            self.hashed += _SLICE
            done += _SLICE
            self._offset = (self._offset + _SLICE) % size
        self.cpu_seconds += spent
