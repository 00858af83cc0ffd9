"""`BufferPool`: page-aligned buffers handed out again once nothing refers to them.

A loop that reads into a fresh buffer on every pass (a training step reading each parameter
partition, writing each gradient) maps new memory every time, and the kernel faults every page of
it in again, on the thread that first writes it, at a cost comparable to the I/O itself and more on
a virtual machine whose host takes freed memory back (docs/tensorio.md, "Buffers", has the figures).
The pool keeps the buffers it made and gives one back out when no tensor (the buffer, or any view of
it) still refers to its memory, so each byte is faulted in once. It never hands out memory in use:
a buffer is free only when the pool holds the last reference to its storage.
"""

from __future__ import annotations

import mmap
import threading
from typing import Callable

import torch

from ._buffers import aligned_tensor

_PAGE = mmap.PAGESIZE
_use_count = getattr(torch._C, "_storage_Use_Count", None)  # private: a torch without it gets no reuse


def storage_references(tensor: torch.Tensor) -> int | None:
    """How many tensors (``tensor`` and its views, any device) refer to ``tensor``'s storage now; None
    where torch cannot count them (a private call). Compare with the count taken when only ``tensor``
    referred to it to learn whether a view is still alive."""
    return _references(tensor) if _use_count else None


def _references(buffer: torch.Tensor) -> int:
    """How many tensors refer to ``buffer``'s storage (the pool's own included)."""
    return _use_count(buffer.untyped_storage()._cdata)


class BufferPool:
    """Page-aligned CPU buffers for reuse, at most ``max_bytes`` of them kept (in use or idle).

    ``take(num_elem, dtype)`` returns a 1-D tensor of ``num_elem`` elements starting on a page
    boundary, like ``aligned_tensor`` but **with unspecified contents**: a buffer taken from the
    pool holds what its last user left in it. A buffer goes back to the pool by itself once the
    last tensor referring to it is dropped. Buffers are matched by size (whole pages); when a new
    one would pass ``max_bytes``, idle buffers of other sizes are freed first, and if that is not
    enough the buffer is made outside the pool (freed as usual when dropped). Thread-safe. Where
    torch cannot count a storage's references (a private call), every buffer is made outside the
    pool. ``make(nbytes)`` makes each buffer: `aligned_tensor` (the default), or `locked_tensor` for
    buffers an asynchronous copy to a GPU reads. Raises ValueError for a negative ``max_bytes``.
    """

    def __init__(self, max_bytes: int, make: Callable[[int], torch.Tensor] = aligned_tensor) -> None:
        if max_bytes < 0:
            raise ValueError(f"BufferPool: max_bytes must be >= 0, got {max_bytes}")
        self.max_bytes = max_bytes
        self._make = make
        self._buffers: dict[int, list[torch.Tensor]] = {}  # whole-page size -> the uint8 buffers made
        self._held = 0
        self._lock = threading.Lock()
        self._baseline = _references(make(1)) if _use_count else None  # of a buffer nobody else holds
        self.reused = 0  # buffers handed out again: each is memory not faulted in anew

    @property
    def held_bytes(self) -> int:
        """Bytes of the buffers the pool keeps, in use or idle."""
        return self._held

    def take(self, num_elem: int, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
        """A page-aligned 1-D tensor of ``num_elem`` ``dtype`` elements; contents unspecified.

        Raises ValueError for a negative ``num_elem``.
        """
        if num_elem < 0:
            raise ValueError(f"num_elem must be >= 0, got {num_elem}")
        if self._baseline is None:
            return self._outside(num_elem, dtype)
        nbytes = num_elem * torch.empty((), dtype=dtype).element_size()
        size = max(-(-nbytes // _PAGE), 1) * _PAGE
        with self._lock:
            buffer = self._idle(size)
            if buffer is None:
                buffer = self._made(size)
        if buffer is None:
            return self._outside(num_elem, dtype)
        return buffer[:nbytes].view(dtype)

    def _outside(self, num_elem: int, dtype: torch.dtype) -> torch.Tensor:
        """A buffer made outside the pool (freed as usual when dropped)."""
        nbytes = num_elem * torch.empty((), dtype=dtype).element_size()
        return self._make(max(nbytes, 1))[:nbytes].view(dtype)

    def _idle(self, size: int) -> torch.Tensor | None:
        for buffer in self._buffers.get(size, ()):
            if _references(buffer) == self._baseline:
                self.reused += 1
                return buffer
        return None

    def _made(self, size: int) -> torch.Tensor | None:
        if self._held + size > self.max_bytes:
            self._free_idle(self._held + size - self.max_bytes)
            if self._held + size > self.max_bytes:
                return None
        buffer = self._make(size)
        self._buffers.setdefault(size, []).append(buffer)
        self._held += size
        return buffer

    def _free_idle(self, nbytes: int) -> None:
        """Drop idle buffers, largest first, until ``nbytes`` are freed or none is idle."""
        idle = sorted(((size, buffer) for size, buffers in self._buffers.items() for buffer in buffers
                       if _references(buffer) == self._baseline), key=lambda entry: -entry[0])
        for size, buffer in idle:
            if nbytes <= 0:
                break
            self._buffers[size] = [kept for kept in self._buffers[size] if kept is not buffer]
            self._held -= size
            nbytes -= size
