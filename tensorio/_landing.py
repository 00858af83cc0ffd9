"""`LandingHashes`: a request's chunk checksums, hashed piece by piece as its bytes land.

Each chunk of a `Checksums` layout (``chunk`` bytes from ``start``, ``nbytes`` in all) is hashed by a
streaming xxh3 (the same value as hashing the chunk at once) fed its bytes in order. A range that lands
ahead of its chunk's next unhashed byte waits in ``pending`` until the bytes before it have landed; the
thread that lands the range at a chunk's next byte feeds it, then whatever waited behind it. One thread
at a time feeds a chunk (``feeding``); the others leave their ranges behind for it.

Why as they land, not after the request's last byte: the request's future resolves once its last
piece has landed and been hashed, not after a hash of the whole of it (40 ms for a 617 MB partition),
so a disk-bound transfer with checksums takes the time it takes without (docs/benchmarks.md,
"Checksums"). The state lives under its request's lock: `land` and `take` are called holding it.
"""

from __future__ import annotations

import threading
import time
from typing import NamedTuple

import xxhash

from ._checksum import checksum

__all__ = ["ChecksumTotals", "LandingHashes", "checksum_totals"]


class ChecksumTotals(NamedTuple):
    """What tensorio's checksums have cost this process so far (`checksum_totals`)."""

    nbytes: int
    """Bytes hashed as they landed (written with ``checksum=``, read with ``verify=``)."""
    cpu_seconds: float
    """CPU time of the threads that hashed them, while they hashed."""


_totals = [0, 0]  # bytes, CPU nanoseconds
_totals_lock = threading.Lock()


def checksum_totals() -> ChecksumTotals:
    """The bytes tensorio has hashed in this process and the CPU seconds it took (differences of two
    calls measure a span: `benchmarks.engine_step` reports them a step)."""
    with _totals_lock:
        return ChecksumTotals(_totals[0], _totals[1] / 1e9)


class LandingHashes:
    """The chunk checksums of ``memory[start:start + nbytes]`` in chunks of ``chunk`` bytes, built as
    ranges of it land (`land`, `take`, `feed`); ``values[i]`` is chunk ``i``'s once all of it was fed."""

    __slots__ = ("memory", "start", "chunk", "nbytes", "values", "_next", "_pending", "_feeding", "_states")

    def __init__(self, memory: memoryview, chunk: int, nbytes: int, start: int = 0) -> None:
        self.memory = memory
        self.start, self.chunk, self.nbytes = start, chunk, nbytes
        count = -(-nbytes // chunk)
        self.values: list[int | None] = [None] * count
        self._next = [start + i * chunk for i in range(count)]  # each chunk's first byte not yet hashed
        self._pending: dict[int, dict[int, int]] = {}  # chunk -> {first byte: end} landed ahead of _next
        self._feeding: set[int] = set()  # chunks a thread is feeding
        self._states: dict[int, xxhash.xxh3_64] = {}  # chunks partly fed

    def land(self, first: int, end: int) -> list[int]:
        """Record that bytes [first, end) of the memory have landed; return the chunks the caller must now
        `feed` (their next byte is here and nobody feeds them). Call holding the request's lock."""
        first, end = max(first, self.start), min(end, self.start + self.nbytes)
        ready = []
        while first < end:
            index = (first - self.start) // self.chunk
            stop = min(end, self.start + (index + 1) * self.chunk)
            self._pending.setdefault(index, {})[first] = stop
            if index not in self._feeding and self._next[index] == first:
                self._feeding.add(index)
                ready.append(index)
            first = stop
        return ready

    def take(self, index: int) -> tuple[int, int] | None:
        """The next bytes of chunk ``index`` to feed, as one range of everything landed back to back from
        its next byte; None when nothing is (the caller stops feeding it). Call holding the request's lock."""
        pending = self._pending.get(index, {})
        first = self._next[index]
        end = pending.pop(first, None)
        if end is None:
            self._feeding.discard(index)
            return None
        while end in pending:
            end = pending.pop(end)
        self._next[index] = end
        return first, end

    def feed(self, index: int, first: int, end: int) -> None:
        """Hash bytes [first, end) of chunk ``index`` (a range from `take`; outside the lock: the hash
        releases the GIL on large ranges); the chunk's value is set with its last byte."""
        start = time.thread_time_ns()
        self._hash(index, first, end)
        spent = time.thread_time_ns() - start
        with _totals_lock:
            _totals[0] += end - first
            _totals[1] += spent

    def _hash(self, index: int, first: int, end: int) -> None:
        chunk_first = self.start + index * self.chunk
        chunk_end = min(chunk_first + self.chunk, self.start + self.nbytes)
        window = self.memory[first:end]
        if first == chunk_first and end == chunk_end:  # the whole chunk at once
            self.values[index] = checksum(window)
            return
        state = self._states.get(index)
        if state is None:
            state = self._states[index] = xxhash.xxh3_64()
        state.update(window)
        if end == chunk_end:
            self.values[index] = state.intdigest()
            del self._states[index]
