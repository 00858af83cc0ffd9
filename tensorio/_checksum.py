"""Checksums of byte ranges: computed as a write completes, verified as a read completes.

Both run piece by piece as the request's bytes land, in the I/O threads that moved them
(tensorio/_landing.py; the hash releases the GIL on large ranges, so the caller's Python code runs
beside it), and are complete before the request's future resolves: ``write(...,
checksum=chunk)`` gives the written bytes' `Checksums` in ``future.checksums``; ``read(...,
verify=checksums)`` fails with `ChecksumError` when the bytes read differ, after reading the
mismatched chunks once more (a transient error in the transfer is not an error on the disk).

The hash is xxh3-64 (the ``xxhash`` package): several times the speed of any disk here, see
docs/benchmarks.md, "Checksums".
"""

from __future__ import annotations

import errno
from dataclasses import dataclass

import xxhash

from ._errors import TensorIOError

__all__ = ["ALGORITHM", "ChecksumError", "Checksums", "checksum", "checksum_chunks"]

ALGORITHM = "xxh3_64"
"""The hash, as checkpoints record it."""

checksum = xxhash.xxh3_64_intdigest
"""``checksum(buffer) -> int``: the 64-bit hash of a bytes-like object's bytes (releases the GIL above
about 100 kB)."""


@dataclass(frozen=True, slots=True)
class Checksums:
    """The checksums of ``nbytes`` consecutive bytes cut into chunks of ``chunk`` bytes (the last one may
    be shorter): chunk ``i`` covers bytes ``[start + i * chunk, min(start + (i + 1) * chunk, start + nbytes))``
    of a buffer. ``start`` places them inside a larger read (the checksummed range of a page-aligned window)."""

    values: tuple[int, ...]
    chunk: int
    nbytes: int
    start: int = 0

    def __post_init__(self) -> None:
        if self.chunk < 1 or self.nbytes < 0 or self.start < 0:
            raise ValueError(f"Checksums: chunk {self.chunk} must be >= 1, nbytes {self.nbytes} and start "
                             f"{self.start} >= 0")
        if len(self.values) != -(-self.nbytes // self.chunk):
            raise ValueError(f"Checksums: {len(self.values)} values for {self.nbytes} bytes in chunks of "
                             f"{self.chunk} (expected {-(-self.nbytes // self.chunk)})")

    def span(self, i: int) -> tuple[int, int]:
        """(first byte in the buffer, length) of chunk ``i``."""
        first = self.start + i * self.chunk
        return first, min(self.chunk, self.start + self.nbytes - first)


def checksum_chunks(memory: memoryview, chunk: int, start: int = 0, nbytes: int | None = None) -> Checksums:
    """The `Checksums` of ``memory[start:start + nbytes]`` (default: to the end) in chunks of ``chunk`` bytes."""
    nbytes = len(memory) - start if nbytes is None else nbytes
    values = tuple(checksum(memory[first:first + chunk]) for first in range(start, start + nbytes, chunk))
    return Checksums(values, chunk, nbytes, start)


class ChecksumError(TensorIOError):
    """Bytes read do not hash to what was recorded when they were written (read twice, both times wrong).

    ``offset`` and ``length`` are the mismatched chunk's place in the file; ``expected`` and ``actual`` its
    checksums; ``what`` the caller's name for the range (a partition, an optimizer state), or "".
    """

    def __init__(self, *, path: str, offset: int, length: int, expected: int, actual: int, what: str = "") -> None:
        self.expected, self.actual, self.what = expected, actual, what
        named = f" ({what})" if what else ""
        super().__init__(errno.EIO, f"checksum mismatch{named}", path=path, offset=offset, length=length,
                         name_errno=False,
                         hint=f"{ALGORITHM} expected {expected:016x}, read {actual:016x} twice; the bytes on the "
                              f"disk (or the memory they passed through) are corrupt")

    def __reduce__(self):
        return (_rebuild, (self.path, self.offset, self.length, self.expected, self.actual, self.what))


def _rebuild(path: str, offset: int, length: int, expected: int, actual: int, what: str) -> ChecksumError:
    return ChecksumError(path=path, offset=offset, length=length, expected=expected, actual=actual, what=what)
