"""`StripedSwapFile`: one rank's swap file striped over several drives, so that they work at once.

Where a rank has several drives (``nvme_path`` lists more drives than the node has ranks: `rank_path`),
each of its swap files is a `StripedSwapFile`: one `SwapFile` per drive, each with its own tensorio
handle (its own I/O threads and queue), under one offset space laid out as RAID 0 does. The offset
space is cut into stripe units of ``stripe_bytes`` (1 MiB, a multiple of the page); unit ``u`` lives on
drive ``u % drives`` at byte ``(u // drives) * stripe_bytes`` of that drive's file. Every read and write
is split at the unit boundaries into one request per unit, all started at once, and answered by one
future (`tensorio.IOFuture.all_of`): a request of two units or more keeps two drives busy.

Everything a `SwapFile` guarantees holds per drive: the files are named, locked, removed and reclaimed
as `SwapFile`'s are; extents and the A/B slots are offsets in the striped space (`allocate`);
`preallocate` reserves each drive's share and names the drive's file on ENOSPC. Checksums are kept per
piece by the drive's file: a write is also split at its checksum chunks (a piece never spans two), so
that a read of the same chunks splits into the same pieces and each is verified against its write.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from tensorio import AioConfig, BufferPool, IOFuture

from offload.storage.swapfile import PAGE, PooledBuffers, SwapFile, aligned_size

__all__ = ["STRIPE_BYTES", "StripePiece", "StripedSwapFile", "drive_bytes", "open_swap_file", "stripe_pieces"]

STRIPE_BYTES = 1 << 20
"""The stripe unit: tensorio's default piece (``aio.block_size``), so that striping adds no smaller requests
than a single drive gets, while a request of 2 MiB or more already reaches two drives."""


@dataclass(frozen=True, slots=True)
class StripePiece:
    """One drive's part of a request: ``length`` bytes from byte ``start`` of the request, at byte
    ``file_offset`` of drive ``drive``'s file."""

    drive: int
    file_offset: int
    start: int
    length: int


def stripe_pieces(offset: int, nbytes: int, *, stripe: int, drives: int, chunk: int | None = None) -> list[StripePiece]:
    """The pieces of a request of ``nbytes`` at ``offset`` of the striped space, in order, cut at every
    stripe-unit boundary and (``chunk``) at every multiple of ``chunk`` from the request's start. Pure.

    Raises ValueError for a negative offset or size, or a stripe, drive count or chunk below 1."""
    if offset < 0 or nbytes < 0:
        raise ValueError(f"stripe_pieces: offset {offset} and size {nbytes} must be at least 0")
    if stripe < 1 or drives < 1 or (chunk is not None and chunk < 1):
        raise ValueError(f"stripe_pieces: stripe {stripe}, drives {drives} and chunk {chunk} must be at least 1")
    pieces = []
    start = 0
    while start < nbytes:
        at = offset + start
        unit = at // stripe
        end = min(nbytes, (unit + 1) * stripe - offset, (start // chunk + 1) * chunk if chunk else nbytes)
        pieces.append(StripePiece(drive=unit % drives, file_offset=(unit // drives) * stripe + at % stripe,
                                  start=start, length=end - start))
        start = end
    return pieces


def drive_bytes(end: int, *, stripe: int, drives: int, drive: int) -> int:
    """Bytes of drive ``drive``'s file that the striped space ``[0, end)`` covers (its file's size). Pure."""
    rows, rest = divmod(end, stripe * drives)
    return rows * stripe + min(stripe, max(0, rest - drive * stripe))


class StripedSwapFile(PooledBuffers):
    """A swap file striped over ``directories`` (one per drive), with `SwapFile`'s interface.

    Made whole or not at all: every drive's file is created here (a missing or unwritable directory
    raises as `SwapFile` does, naming ``key`` and the directory) and those made are removed on failure.
    Requests are split into stripe units (`stripe_pieces`) sent to the drives' files together.

    Raises ValueError for fewer than two directories, a directory listed twice or a ``stripe_bytes`` that
    is not a positive multiple of the page.
    """

    def __init__(self, directories: Sequence[str | os.PathLike], aio: AioConfig, *, kind: str,
                 key: str = "nvme_path", stripe_bytes: int = STRIPE_BYTES) -> None:
        paths = [os.path.abspath(os.fspath(d)) for d in directories]
        if len(paths) < 2 or len(set(paths)) != len(paths):
            raise ValueError(f"{key}: striping needs two or more distinct directories, got {list(directories)!r}")
        if stripe_bytes < PAGE or stripe_bytes % PAGE:
            raise ValueError(f"stripe_bytes: {stripe_bytes} is not a positive multiple of {PAGE} (O_DIRECT's alignment)")
        self.stripe_bytes = stripe_bytes
        self.files: list[SwapFile] = []
        """One per drive, in the order given."""
        try:
            for directory in directories:
                self.files.append(SwapFile(directory, aio, kind=kind, key=key))
        except BaseException:
            for file in self.files:
                file.close()
            raise
        self.pool: BufferPool | None = None
        """Where `buffer` takes buffers from; set by the owner, as `SwapFile.pool`."""
        self._end = 0

    @property
    def path(self) -> str:
        """The first drive's file (`paths` names them all)."""
        return self.files[0].path

    @property
    def paths(self) -> list[str]:
        """Every drive's file, in the order of the directories."""
        return [file.path for file in self.files]

    @property
    def verify(self) -> bool:
        """Whether writes are checksummed and reads verified (``aio.verify``), on every drive."""
        return self.files[0].verify

    @verify.setter
    def verify(self, value: bool) -> None:
        for file in self.files:
            file.verify = value

    @property
    def bytes_read(self) -> int:
        return sum(file.bytes_read for file in self.files)

    @property
    def bytes_written(self) -> int:
        return sum(file.bytes_written for file in self.files)

    @property
    def bytes_verified(self) -> int:
        return sum(file.bytes_verified for file in self.files)

    @property
    def allocated_bytes(self) -> int:
        """Bytes of the striped space reserved so far (the drives' files hold them between them)."""
        return self._end

    def allocate(self, nbytes: int, slots: int = 1) -> int:
        """Reserve ``slots`` page-aligned slots of ``nbytes`` at the end of the striped space; return the
        offset of the first (as `SwapFile.allocate`)."""
        offset = self._end
        self._end += slots * aligned_size(nbytes)
        return offset

    def preallocate(self) -> None:
        """Reserve each drive's share of every extent allocated so far (`SwapFile.preallocate` on each file),
        so that a full drive is named now. Raises OSError naming the drive's file, the bytes it needs and the
        bytes free."""
        for index, file in enumerate(self.files):
            share = drive_bytes(self._end, stripe=self.stripe_bytes, drives=len(self.files), drive=index)
            if share > file.allocated_bytes:
                file.allocate(share - file.allocated_bytes)
            file.preallocate()

    def read(self, buffer: torch.Tensor, offset: int, *, chunk: int | None = None, what: str = "") -> IOFuture:
        """Start filling ``buffer`` (contiguous, CPU) from ``offset`` of the striped space, every drive's part
        at once, each verified against its write (as `SwapFile.read`, ``chunk`` as the write's). Raises
        RuntimeError (at once) for a range not written in those chunks."""
        pieces = self._pieces(buffer, offset, chunk)  # checked first: a byte view of anything else would be a copy
        data = _bytes_of(buffer)
        return self._start(pieces, lambda p: self.files[p.drive].read(data[p.start:p.start + p.length], p.file_offset,
                                                                      what=what))

    def write(self, tensor: torch.Tensor, offset: int, *, chunk: int | None = None) -> IOFuture:
        """Start writing ``tensor`` (contiguous, CPU) at ``offset`` of the striped space, every drive's part at
        once; keep it unchanged until done. With `verify`, each piece's checksum is recorded by its drive's
        file (a piece never spans two ``chunk``s, so reads in the same chunks verify piece by piece)."""
        pieces = self._pieces(tensor, offset, chunk)
        data = _bytes_of(tensor)
        return self._start(pieces, lambda p: self.files[p.drive].write(data[p.start:p.start + p.length], p.file_offset))

    @staticmethod
    def _start(pieces: list[StripePiece], move: Callable[[StripePiece], IOFuture]) -> IOFuture:
        """Start every piece; one future for them all. Where starting one raises (a range with no write to
        verify against), the pieces already started are waited for first (sync point), so none is left
        using the buffer."""
        futures: list[IOFuture] = []
        try:
            for piece in pieces:
                futures.append(move(piece))
        except BaseException:
            for future in futures:
                future.exception()
            raise
        return IOFuture.all_of(futures)

    def _pieces(self, tensor: torch.Tensor, offset: int, chunk: int | None) -> list[StripePiece]:
        if not tensor.is_contiguous() or tensor.device.type != "cpu":
            raise ValueError(f"striped swap file {self.path}: the buffer must be a contiguous CPU tensor, got "
                             f"{'a non-contiguous' if not tensor.is_contiguous() else 'a ' + tensor.device.type} one")
        nbytes = tensor.nbytes
        pieces = stripe_pieces(offset, nbytes, stripe=self.stripe_bytes, drives=len(self.files),
                               chunk=chunk if self.verify else None)
        return pieces or [StripePiece(drive=0, file_offset=0, start=0, length=0)]  # nothing to move: one empty request

    @property
    def closed(self) -> bool:
        return all(file.closed for file in self.files)

    def close(self) -> None:
        """Close every drive's file (finish its I/O, remove it), all of them even if one fails (its error
        is raised once all are closed). Idempotent."""
        self.pool = None
        with contextlib.ExitStack() as stack:
            for file in reversed(self.files):
                stack.callback(file.close)


def open_swap_file(directories: str | os.PathLike | Sequence[str | os.PathLike], aio: AioConfig, *, kind: str,
                   key: str = "nvme_path") -> SwapFile | StripedSwapFile:
    """A swap file in ``directories``: a `SwapFile` for one directory, a `StripedSwapFile` over several.
    Raises as those do."""
    if isinstance(directories, (str, os.PathLike)):
        return SwapFile(directories, aio, kind=kind, key=key)
    if len(directories) == 1:
        return SwapFile(directories[0], aio, kind=kind, key=key)
    return StripedSwapFile(directories, aio, kind=kind, key=key)


def _bytes_of(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s bytes as a flat uint8 view of the same memory."""
    return tensor.reshape(-1).view(torch.uint8)
