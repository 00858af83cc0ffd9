"""Spare memory: gradients the optimizer has applied, lent back to hold optimizer state read ahead.

With ``overlap_backward`` a gradient is useless once its sub-groups are updated, yet a plain training
loop would hold it until ``zero_grad()``. `SparePool` cuts page-aligned regions out of such memory,
so that state read ahead costs no new allocation: host memory never exceeds what training without
offload holds at the same moment.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from offload.storage.swapfile import PAGE



@dataclass(slots=True, eq=False)
class _Chunk:
    raw: torch.Tensor
    """The lent memory's page-aligned part, as bytes."""
    cursor: int = 0
    """First byte not cut yet."""
    users: int = 0
    """Regions cut from it and not given back; the chunk is cut from the start again at 0."""


class SparePool:
    """Bump allocator over lent tensors: regions of whole pages, each chunk reused once all of its
    regions are given back.

    ``limit``: most bytes held at once until `clear` (None: no limit); memory lent beyond it is let go.
    """

    def __init__(self, limit: int | None = None) -> None:
        self._chunks: list[_Chunk] = []
        self.limit = limit
        self._held = 0

    def lend(self, tensor: torch.Tensor, smallest: int) -> None:
        """Add the memory of a contiguous CPU ``tensor`` the caller no longer needs, if at least
        ``smallest`` bytes of it are page-aligned (else it could hold no region and is let go), and
        if it fits under ``limit``."""
        raw = tensor.detach().reshape(-1).view(torch.uint8)
        first = -raw.data_ptr() % PAGE
        if raw.numel() - first < smallest:
            return
        if self.limit is not None and self._held + raw.numel() > self.limit:
            return
        self._held += raw.numel()
        self._chunks.append(_Chunk(raw[first:]))

    def cut(self, count: int, nbytes: int, *, take: bool = True) -> list[tuple[torch.Tensor, _Chunk]] | None:
        """``count`` regions of ``nbytes`` (a multiple of PAGE) as fp32 tensors with their chunks, first
        fit, or None if the pool has no room for all of them. ``take=False`` only checks (returns [])."""
        cuts: list[tuple[_Chunk, int]] = []
        for chunk in self._chunks:
            cursor = chunk.cursor
            while len(cuts) < count and cursor + nbytes <= chunk.raw.numel():
                cuts.append((chunk, cursor))
                cursor += nbytes
            if len(cuts) == count:
                break
        if len(cuts) < count:
            return None
        if not take:
            return []
        regions = []
        for chunk, start in cuts:
            regions.append((chunk.raw[start:start + nbytes].view(torch.float32), chunk))
            chunk.cursor, chunk.users = start + nbytes, chunk.users + 1
        return regions

    def give_back(self, chunks: list[_Chunk]) -> None:
        """Return regions cut from ``chunks`` (one entry per region)."""
        for chunk in chunks:
            chunk.users -= 1
            if chunk.users == 0:
                chunk.cursor = 0

    def clear(self) -> None:
        """Stop lending: regions still in use keep their memory until they are dropped."""
        self._chunks.clear()
        self._held = 0

    @property
    def lending(self) -> bool:
        """Whether any memory is lent."""
        return bool(self._chunks)
