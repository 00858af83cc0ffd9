"""`StagedWrites`: bytes put at any offsets of one file, written with O_DIRECT through a tensorio handle
from a few page-aligned chunks, the page cache left alone.

Why chunks: a checkpoint's tensors sit back to back after a page-aligned header, so most of them start
at an offset that is not a multiple of the page; O_DIRECT moves whole pages from page-aligned memory.
`put` copies the caller's bytes into a chunk at the same offset within a page as they have in the file
(one copy, which also frees the caller's buffer at once: a swap buffer the optimizer reuses, a partition
read ahead), so that tensorio writes every whole page of the chunk straight from it with O_DIRECT and
only a run's first and last partial page through the page cache (`tensorio._plan.plan_runs`). Runs that
follow each other in the file share a chunk, so a file written front to back goes out in whole chunks.

The rules every user keeps (the writer of `offload.storage.safetensors_writer` does):

- each byte of the file is put at most once: two writes of one byte in flight at once land in either order;
- alignment: a page either lies wholly inside one write (O_DIRECT) or is shared by two writes, each of
  which writes its part of it through the page cache, so no page is written both ways;
- the file already has its final size (the last partial page is then written through the page cache
  without growing the file).

At most ``chunks`` chunks exist; while one fills, the others are being written (the caller waits only
when all are in flight: a sync point in `put`).
"""

from __future__ import annotations

import collections
import errno
import os

import torch

from offload.storage.host_copy import host_copy
from tensorio import DIRECT_ALIGN, AioHandle, BufferPool, IOFuture, TensorIOError, aligned_tensor

__all__ = ["CHUNK_BYTES", "CHUNKS", "StagedWrites", "open_direct"]

CHUNK_BYTES = 8 << 20
"""Bytes per chunk: eight of tensorio's 1 MiB pieces in flight per chunk."""

CHUNKS = 4
"""Chunks per file being written: one filling, three being written."""

_REFUSED = (errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP)
"""Errors of an O_DIRECT open that mean "this file system has no direct I/O" (not a broken file)."""


def open_direct(path: str) -> tuple[int | None, str]:
    """Open the existing file ``path`` for writing with O_DIRECT: (the descriptor, "") or, where the file
    system refuses O_DIRECT (EINVAL, EOPNOTSUPP), (None, the reason). Raises other OSErrors."""
    try:
        return os.open(path, os.O_WRONLY | os.O_DIRECT | os.O_CLOEXEC), ""
    except OSError as error:
        if error.errno in _REFUSED:
            return None, f"the file system refuses O_DIRECT opens ({errno.errorcode.get(error.errno)}: {error.strerror})"
        raise


class StagedWrites:
    """Writes of one file through ``handle`` from at most ``chunks`` page-aligned chunks of ``chunk_bytes``
    (see the module docstring). ``fd``: the file opened with O_DIRECT (`open_direct`), owned from now on and
    closed by `finish` or `abandon`; ``path`` names the file in errors. ``pool``: where chunks are taken from
    (the engine's I/O buffers, faulted in once), else `aligned_tensor`.

    Raises TensorIOError naming ``path``, the offset and the length for a write that failed (from `put`, once
    its chunk is needed again, or from `finish`).
    """

    def __init__(self, handle: AioHandle, fd: int, path: str, *, chunk_bytes: int = CHUNK_BYTES,
                 chunks: int = CHUNKS, pool: BufferPool | None = None) -> None:
        if chunk_bytes < DIRECT_ALIGN or chunk_bytes % DIRECT_ALIGN or chunks < 2:
            raise ValueError(f"StagedWrites: chunk_bytes must be a multiple of {DIRECT_ALIGN} and chunks at least 2, "
                             f"got {chunk_bytes} and {chunks}")
        self.handle, self.fd, self.path = handle, fd, path
        self._chunk_bytes, self._most, self._pool = chunk_bytes, chunks, pool
        self._made = 0
        self._free: list[torch.Tensor] = []
        self._busy: collections.deque[tuple[IOFuture, torch.Tensor]] = collections.deque()
        self._chunk: torch.Tensor | None = None
        self._base = self._begin = self._fill = 0  # the chunk's byte 0 in the file (page-aligned); its first and end bytes
        self.requests = 0
        """Writes handed to tensorio so far."""
        self.most_in_flight = 0
        """The most writes in flight at once so far (at most ``chunks``)."""

    def put(self, raw: torch.Tensor, offset: int) -> None:
        """Copy ``raw`` (uint8, contiguous) for the file's bytes ``[offset, offset + len)``; it may be reused once
        this returns. Sync point only when every chunk is in flight."""
        if self.fd < 0:
            raise RuntimeError(f"internal error: {self.path}: write after the file was finished")
        while raw.numel():
            if self._chunk is not None and offset != self._base + self._fill:  # not the next bytes: a new run
                self._flush()
            if self._chunk is None:
                self._chunk = self._take()
                self._base = offset // DIRECT_ALIGN * DIRECT_ALIGN  # alignment: same offset within a page as in the file
                self._begin = self._fill = offset - self._base
            take = min(raw.numel(), self._chunk.numel() - self._fill)
            host_copy(self._chunk[self._fill:self._fill + take], raw[:take])  # one thread's memcpy, not torch's team
            self._fill += take
            offset += take
            raw = raw[take:]
            if self._fill == self._chunk.numel():
                self._flush()

    def finish(self) -> None:
        """Write what is left and wait for every write (sync point); close the descriptor. Raises the first
        failed write's TensorIOError (after waiting for the others)."""
        try:
            self._flush()
            error = None
            while self._busy:
                error = error or self._wait_oldest(raise_error=False)
            if error is not None:
                raise error
        finally:
            self.abandon()

    def abandon(self) -> None:
        """Wait for the writes in flight without raising (after an error; the kernel may still read the chunks);
        drop the chunks and close the descriptor. Idempotent."""
        while self._busy:
            self._wait_oldest(raise_error=False)
        self._chunk, self._free = None, []
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def _take(self) -> torch.Tensor:
        """A free chunk: one made, or the oldest write's once it has landed (sync point)."""
        if self._free:
            return self._free.pop()
        if self._made < self._most:
            self._made += 1
            if self._pool is not None:
                return self._pool.take(self._chunk_bytes, torch.uint8)
            return aligned_tensor(self._chunk_bytes, torch.uint8)
        self._wait_oldest(raise_error=True)
        return self._free.pop()

    def _flush(self) -> None:
        """Start writing the current chunk's bytes ``[begin, fill)`` at their place in the file."""
        chunk, self._chunk = self._chunk, None
        if chunk is None:
            return
        if self._fill == self._begin:
            self._free.append(chunk)
            return
        future = self.handle.write(chunk[self._begin:self._fill], self.fd, self._base + self._begin)
        self._busy.append((future, chunk))
        self.requests += 1
        self.most_in_flight = max(self.most_in_flight, len(self._busy))

    def _wait_oldest(self, *, raise_error: bool) -> TensorIOError | None:
        """Wait for the oldest write (sync point); its chunk is free again. Its error, naming the file, is
        raised (``raise_error``) or returned."""
        future, chunk = self._busy.popleft()
        failure = future.exception()
        self._free.append(chunk)
        if failure is None:
            return None
        error = TensorIOError(getattr(failure, "errno", None) or errno.EIO, "write of checkpoint data failed",
                              path=self.path, offset=getattr(failure, "offset", 0), length=getattr(failure, "length", 0),
                              hint=_hint(failure))
        error.__cause__ = failure
        if raise_error:
            raise error
        return error


def _hint(failure: BaseException) -> str:
    code = getattr(failure, "errno", None)
    if code in (errno.ENOSPC, errno.EDQUOT):
        return "the disk is full: free space or save to another directory"
    return str(failure)
