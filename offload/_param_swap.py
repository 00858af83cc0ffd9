"""The NVMe parameter swapper: partitions in one swap file, read into memory under a byte budget.

`ParamSwapFile` owns the file and the I/O; `SwapBudget` is the buffer budget (``buffer_count x
buffer_size`` elements) that prefetching must stay within; `Prefetcher` replays the order in which
parameters were gathered during the first step and reads the next ones ahead of use.

Buffers are page-aligned tensors (``tensorio.aligned_tensor``) allocated per read and freed by
reference counting when the last view of them dies. That is what makes the budget safe: a buffer
is never handed to a second parameter while autograd may still read it. Prefetching waits for room
in the budget (it simply stops and resumes at the next gather); a read on demand never waits for
and never fails for lack of a buffer, so the peak is the budget plus the parameters in use.
"""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

import torch

from tensorio import AioConfig, AioHandle, IOFuture, aligned_tensor

if TYPE_CHECKING:
    from ._params import ParamRecord

PAGE = 4096


class ParamSwapFile:
    """One swap file holding NVMe-resident partitions (parameters, or gradients with ``kind="grads"``),
    each at a page-aligned offset."""

    def __init__(self, directory: str, aio: AioConfig, kind: str = "params") -> None:
        self.path = os.path.join(directory, f"offload-{kind}-{os.getpid()}-{uuid.uuid4().hex[:8]}.swp")
        self._handle = AioHandle.from_config(aio)
        self._end = 0
        self.bytes_read = 0
        self.bytes_written = 0

    def allocate(self, nbytes: int) -> int:
        """Reserve ``nbytes`` at the end of the file; return the page-aligned offset."""
        offset = self._end
        self._end += -(-nbytes // PAGE) * PAGE
        return offset

    def read(self, numel: int, dtype: torch.dtype, offset: int) -> tuple[torch.Tensor, IOFuture]:
        """Start reading ``numel`` elements at ``offset`` into a fresh page-aligned buffer."""
        buffer = aligned_tensor(numel, dtype)
        self.bytes_read += buffer.nbytes
        return buffer, self._handle.read(buffer, self.path, offset)

    def write(self, tensor: torch.Tensor, offset: int) -> IOFuture:
        """Start writing ``tensor`` (contiguous) at ``offset``; keep it unchanged until done."""
        self.bytes_written += tensor.nbytes
        return self._handle.write(tensor, self.path, offset)

    def close(self) -> None:
        """Close the handle and remove the file."""
        self._handle.close()
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


@dataclass(slots=True)
class SwapBudget:
    """Elements of NVMe-read parameter buffers held at once, and the limits prefetching obeys."""

    buffer_elements: int
    """buffer_count x buffer_size: the swap buffer budget."""
    max_live: int
    """stage3_max_live_parameters."""
    held: int = 0
    """Elements of buffers now held (in flight or gathered from disk)."""

    def fits(self, numel: int) -> bool:
        return self.held + numel <= min(self.buffer_elements, self.max_live)


@dataclass(slots=True)
class Prefetcher:
    """Follows the gather order recorded in the first step and starts reads of what comes next.

    A step whose order differs is still correct: an unexpected gather re-synchronises the cursor
    (or reads on demand), and reads started for parameters not used are dropped at the step's end.
    """

    bucket_elements: int
    """stage3_prefetch_bucket_size: elements read ahead of use at most; 0 turns prefetching off."""
    trace: list[int] = field(default_factory=list)
    recording: bool = True
    cursor: int = 0

    def observe(self, index: int) -> None:
        """Note that record ``index`` is being gathered: record it, or advance the cursor past it."""
        if self.recording:
            self.trace.append(index)
            return
        if self.cursor < len(self.trace) and self.trace[self.cursor] == index:
            self.cursor += 1
            return
        # Out of order: find the next occurrence; if there is none, stop prefetching this step.
        try:
            self.cursor = self.trace.index(index, self.cursor) + 1
        except ValueError:
            self.cursor = len(self.trace)

    def upcoming(self) -> list[int]:
        """Record indices expected next, in order (bounded by the caller's budget)."""
        if self.recording or self.bucket_elements == 0:
            return []
        return self.trace[self.cursor:]

    def end_step(self) -> None:
        """The first step's trace is final; every later step replays it from the start."""
        if self.trace:
            self.recording = False
        self.cursor = 0


def start_prefetch(prefetcher: Prefetcher, budget: SwapBudget, records: list["ParamRecord"],
                   start_read: Callable[["ParamRecord"], None]) -> None:
    """Start reads of upcoming on-disk records while they fit in the bucket and the budget."""
    ahead = 0
    for index in prefetcher.upcoming():
        rec = records[index]
        if rec.buffer is not None or rec.full is not None:  # in flight, gathered, or kept for its update
            ahead += rec.partition_numel if rec.read is not None else 0
            continue
        if not rec.on_disk:
            continue
        if ahead + rec.partition_numel > prefetcher.bucket_elements or not budget.fits(rec.partition_numel):
            return  # wait for room: the next gather tries again
        start_read(rec)
        ahead += rec.partition_numel
