"""`StripedSwapFile`: one rank's swap file striped over several drives, so that they work at once.

Where a rank has several drives (``nvme_path`` lists more drives than the node has ranks: `rank_path`),
each of its swap files is a `StripedSwapFile`: one `SwapFile` per drive, each with its own tensorio
handle (its own I/O threads and queue), under one offset space laid out as RAID 0 does, with stripes
in proportion to each drive's speed (`StripeLayout`). The offset space is cut into stripe units of
``stripe_bytes`` (1 MiB, a multiple of the page) and the units into cycles of ``sum(weights)`` units;
drive ``i`` holds ``weights[i]`` consecutive units of each cycle (after drives ``0 .. i-1``'s), back to
back in its file. Equal weights are RAID 0's layout: unit ``u`` on drive ``u % drives``. The weights are
measured when the file is made (`offload.storage.drive_speed`), or stated (``stripe_weights``). Every read
and write is split where the drive changes into one request per drive's run of units, all started at
once, and answered by one future (`tensorio.IOFuture.all_of`): a request longer than a run keeps two
drives busy, and a fast drive gets its share of a request as one large piece.

Everything a `SwapFile` guarantees holds per drive: the files are named, locked, removed and reclaimed
as `SwapFile`'s are; extents and the A/B slots are offsets in the striped space (`allocate`);
`preallocate` reserves each drive's share and names the drive's file on ENOSPC. Checksums are kept by
the drive's file, in the request's checksum chunks: a piece that starts inside a chunk is cut at that
chunk's end, so that every other piece starts at a chunk's start, and a read of the same chunks (all of
them or some) splits into pieces whose chunks its drive's file checksummed at the write. A drive's run
of units stays one piece whatever the chunks: one handle request per run, not one per chunk.
"""

from __future__ import annotations

import bisect
import contextlib
import math
import os
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from tensorio import AioConfig, BufferPool, IOFuture

from offload.storage.drive_speed import measured_weights
from offload.storage.swapfile import PAGE, PooledBuffers, SwapFile, aligned_size

__all__ = ["STRIPE_BYTES", "StripeLayout", "StripePiece", "StripedSwapFile", "open_swap_file"]

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


@dataclass(frozen=True, slots=True)
class StripeLayout:
    """Where each byte of a striped space lives (pure). The space is cut into units of ``stripe`` bytes and
    the units into cycles of ``sum(weights)``; drive ``i`` holds ``weights[i]`` consecutive units of each
    cycle, after those of drives ``0 .. i-1``, back to back in its file (cycle ``c``'s at unit ``c *
    weights[i]`` of it). The weights are ratios, kept reduced by their common divisor: ``(2, 2)`` is ``(1, 1)``,
    RAID 0's layout (unit ``u`` on drive ``u % drives``).

    Raises ValueError for a stripe below 1 or weights that are not one or more integers of at least 1."""

    stripe: int
    weights: tuple[int, ...]
    starts: tuple[int, ...] = field(init=False, repr=False)
    """The first unit of each drive's run within a cycle."""

    def __post_init__(self) -> None:
        weights = tuple(self.weights)
        if not weights or not all(isinstance(w, int) and not isinstance(w, bool) and w >= 1 for w in weights):
            raise ValueError(f"stripe weights: {self.weights!r} is not allowed; give one integer of at least 1 "
                             f"per drive")
        if self.stripe < 1:
            raise ValueError(f"stripe_bytes: {self.stripe} must be at least 1")
        common = math.gcd(*weights)
        weights = tuple(w // common for w in weights)
        object.__setattr__(self, "weights", weights)
        object.__setattr__(self, "starts", tuple(sum(weights[:i]) for i in range(len(weights))))

    @classmethod
    def even(cls, stripe: int, drives: int) -> "StripeLayout":
        """RAID 0 over ``drives`` drives of one speed."""
        return cls(stripe, (1,) * drives)

    @property
    def drives(self) -> int:
        return len(self.weights)

    @property
    def cycle(self) -> int:
        """Stripe units per cycle: each drive's run once."""
        return sum(self.weights)

    def pieces(self, offset: int, nbytes: int, chunk: int | None = None) -> list[StripePiece]:
        """The pieces of a request of ``nbytes`` at ``offset``, in order, cut where the drive changes (at the
        end of each drive's run of units) and (``chunk``) where a piece that starts inside a checksum chunk
        (counted in ``chunk`` bytes from the request's start) reaches that chunk's end: every piece lies in one
        chunk or starts at a chunk's start, so that its drive's file, given the same ``chunk``, checksums the
        request's chunks (or the parts of them on that drive) and not others. Raises ValueError for a negative
        offset or size, or a chunk below 1."""
        if offset < 0 or nbytes < 0:
            raise ValueError(f"StripeLayout.pieces: offset {offset} and size {nbytes} must be at least 0")
        if chunk is not None and chunk < 1:
            raise ValueError(f"StripeLayout.pieces: chunk {chunk} must be at least 1")
        stripe, weights, starts = self.stripe, self.weights, self.starts
        pieces = []
        start = 0
        while start < nbytes:
            at = offset + start
            cycle, unit = divmod(at // stripe, self.cycle)
            drive = bisect.bisect_right(starts, unit) - 1
            run_end = (cycle * self.cycle + starts[drive] + weights[drive]) * stripe  # the drive's run ends here
            end = min(nbytes, run_end - offset, (start // chunk + 1) * chunk if chunk and start % chunk else nbytes)
            file_offset = (cycle * weights[drive] + unit - starts[drive]) * stripe + at % stripe
            pieces.append(StripePiece(drive=drive, file_offset=file_offset, start=start, length=end - start))
            start = end
        return pieces

    def drive_bytes(self, end: int, drive: int) -> int:
        """Bytes of drive ``drive``'s file that the space ``[0, end)`` covers (its file's size)."""
        cycles, rest = divmod(end, self.stripe * self.cycle)
        run = self.weights[drive] * self.stripe
        return cycles * run + min(run, max(0, rest - self.starts[drive] * self.stripe))


class StripedSwapFile(PooledBuffers):
    """A swap file striped over ``directories`` (one per drive), with `SwapFile`'s interface.

    Made whole or not at all: every drive's file is created here (a missing or unwritable directory
    raises as `SwapFile` does, naming ``key`` and the directory) and those made are removed on failure.
    ``weights`` are the drives' relative speeds, one integer each (`StripeLayout`); None: measured now, once
    per file system and process (`offload.storage.drive_speed.measured_weights`, well under a second).
    Requests are split into runs of stripe units (`StripeLayout.pieces`) sent to the drives' files together.

    Raises ValueError for fewer than two directories, a directory listed twice, a ``stripe_bytes`` that
    is not a positive multiple of the page, or ``weights`` that are not one integer of at least 1 per
    directory.
    """

    def __init__(self, directories: Sequence[str | os.PathLike], aio: AioConfig, *, kind: str,
                 key: str = "nvme_path", stripe_bytes: int = STRIPE_BYTES,
                 weights: Sequence[int] | None = None) -> None:
        paths = [os.path.abspath(os.fspath(d)) for d in directories]
        if len(paths) < 2 or len(set(paths)) != len(paths):
            raise ValueError(f"{key}: striping needs two or more distinct directories, got {list(directories)!r}")
        if stripe_bytes < PAGE or stripe_bytes % PAGE:
            raise ValueError(f"stripe_bytes: {stripe_bytes} is not a positive multiple of {PAGE} (O_DIRECT's alignment)")
        if weights is not None:  # checked before any file is made
            if len(weights) != len(paths):
                raise ValueError(f"{key}: {len(weights)} stripe weights {list(weights)!r} for {len(paths)} "
                                 f"directories; give one per directory")
            StripeLayout(stripe_bytes, tuple(weights))
        self.stripe_bytes = stripe_bytes
        self.files: list[SwapFile] = []
        """One per drive, in the order given."""
        try:
            for directory in directories:
                self.files.append(SwapFile(directory, aio, kind=kind, key=key))
            if weights is None:  # the directories are known good now: measure them
                weights = measured_weights(paths, aio, key=key)
        except BaseException:
            for file in self.files:
                file.close()
            raise
        self.layout = StripeLayout(stripe_bytes, tuple(weights))
        """Where each byte of the striped space lives."""
        self.pool: BufferPool | None = None
        """Where `buffer` takes buffers from; set by the owner, as `SwapFile.pool`."""
        self._end = 0

    @property
    def weights(self) -> tuple[int, ...]:
        """Each drive's stripe units per cycle (reduced: equal drives have 1 each)."""
        return self.layout.weights

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
            share = self.layout.drive_bytes(self._end, index)
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
                                                                      chunk=chunk, what=what))

    def write(self, tensor: torch.Tensor, offset: int, *, chunk: int | None = None) -> IOFuture:
        """Start writing ``tensor`` (contiguous, CPU) at ``offset`` of the striped space, every drive's part at
        once; keep it unchanged until done. With `verify`, each piece's checksums are recorded by its drive's
        file in the request's ``chunk``s (`StripeLayout.pieces`: a piece starts at a chunk's start or stays in
        one chunk), so reads in the same chunks, of the whole or of some chunks, verify piece by piece."""
        pieces = self._pieces(tensor, offset, chunk)
        data = _bytes_of(tensor)
        return self._start(pieces, lambda p: self.files[p.drive].write(data[p.start:p.start + p.length], p.file_offset,
                                                                       chunk=chunk))

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
        pieces = self.layout.pieces(offset, nbytes, chunk if self.verify else None)
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
                   key: str = "nvme_path", weights: Sequence[int] | None = None) -> SwapFile | StripedSwapFile:
    """A swap file in ``directories``: a `SwapFile` for one directory, a `StripedSwapFile` over several
    (``weights``: each drive's stripe units per cycle; None: measured). Raises as those do."""
    if isinstance(directories, (str, os.PathLike)):
        return SwapFile(directories, aio, kind=kind, key=key)
    if len(directories) == 1:
        return SwapFile(directories[0], aio, kind=kind, key=key)
    return StripedSwapFile(directories, aio, kind=kind, key=key, weights=weights)


def _bytes_of(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s bytes as a flat uint8 view of the same memory."""
    return tensor.reshape(-1).view(torch.uint8)
