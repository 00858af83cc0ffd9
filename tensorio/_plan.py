"""Splitting one request into pieces: pure arithmetic on offsets, lengths and addresses."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Mode(enum.Enum):
    """How a piece reaches the disk."""

    DIRECT = "direct"
    """O_DIRECT straight from/to the caller's memory (file offset, length and address aligned)."""
    STAGED = "staged"
    """O_DIRECT through an aligned staging buffer (file range aligned, the caller's memory is not)."""
    BUFFERED = "buffered"
    """Through the page cache (no O_DIRECT, or an unaligned head or tail of the request)."""


@dataclass(frozen=True, slots=True)
class Piece:
    """One system call's worth of a request: ``length`` bytes at ``file_offset`` in the file and at
    ``buf_offset`` in the caller's buffer."""

    file_offset: int
    buf_offset: int
    length: int
    mode: Mode


@dataclass(frozen=True, slots=True)
class Run:
    """Pieces back to back: ``length`` bytes from ``file_offset`` (at ``buf_offset`` in the caller's
    buffer), cut into ``piece_bytes`` pieces (the last one may be shorter), all moved one way."""

    file_offset: int
    buf_offset: int
    length: int
    piece_bytes: int
    mode: Mode

    @property
    def count(self) -> int:
        """Pieces in the run."""
        return -(-self.length // self.piece_bytes)

    def pieces(self) -> list[Piece]:
        """The run as one `Piece` per system call, in file order."""
        base = self.file_offset - self.buf_offset
        return _split(self.file_offset, self.file_offset + self.length, base, self.piece_bytes, self.mode)


def round_up(value: int, align: int) -> int:
    """Smallest multiple of ``align`` that is >= ``value``."""
    return -(-value // align) * align


def round_down(value: int, align: int) -> int:
    """Largest multiple of ``align`` that is <= ``value``."""
    return value // align * align


def piece_size(block_size: int, direct: bool, align: int) -> int:
    """Bytes per piece: ``block_size``, rounded up to ``align`` under O_DIRECT."""
    return round_up(block_size, align) if direct else block_size


def _split(start: int, end: int, base: int, size: int, mode: Mode) -> list[Piece]:
    return [Piece(off, off - base, min(size, end - off), mode) for off in range(start, end, size)]


def plan_pieces(*, offset: int, nbytes: int, buf_addr: int, block_size: int, direct: bool, align: int) -> list[Piece]:
    """Split the request [offset, offset + nbytes) into pieces that tile it exactly, in file order
    (`plan_runs`, one `Piece` per system call)."""
    runs = plan_runs(offset=offset, nbytes=nbytes, buf_addr=buf_addr, block_size=block_size, direct=direct,
                     align=align)
    return [piece for run in runs for piece in run.pieces()]


def plan_runs(*, offset: int, nbytes: int, buf_addr: int, block_size: int, direct: bool, align: int) -> list[Run]:
    """Split the request [offset, offset + nbytes) into runs of pieces that tile it exactly, in file order.

    Without O_DIRECT: ``block_size`` pieces through the page cache. With O_DIRECT: the part of the
    range that lies on ``align`` boundaries is cut into ``piece_size`` pieces, DIRECT when the
    caller's memory at ``buf_addr`` is aligned there too and STAGED otherwise; the unaligned head
    and tail (each shorter than ``align``) are BUFFERED.
    """
    end = offset + nbytes
    if not direct:
        return _runs([(offset, end, block_size, Mode.BUFFERED)], offset)
    body_start, body_end = round_up(offset, align), round_down(end, align)
    if body_start >= body_end:
        return _runs([(offset, end, piece_size(block_size, True, align), Mode.BUFFERED)], offset)
    body_mode = Mode.DIRECT if (buf_addr + body_start - offset) % align == 0 else Mode.STAGED
    return _runs([(offset, body_start, align, Mode.BUFFERED),
                  (body_start, body_end, piece_size(block_size, True, align), body_mode),
                  (body_end, end, align, Mode.BUFFERED)], offset)


def _runs(spans: list[tuple[int, int, int, Mode]], offset: int) -> list[Run]:
    return [Run(start, start - offset, stop - start, size, mode) for start, stop, size, mode in spans if stop > start]
