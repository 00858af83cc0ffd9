"""What reading on-disk partitions ahead of use obeys: the budget, and the recorded order.

`SwapBudget` is the buffer budget (``buffer_count x buffer_size`` elements) that reads of on-disk
partitions stay within; `Prefetcher` replays the order in which parameters were gathered during the
first step, so that the store (`ParamStore.prefetch`) can read the next ones ahead of use.

Buffers are page-aligned tensors (``tensorio.aligned_tensor``) allocated per read and freed by
reference counting when the last view of them dies. That is what makes the budget safe: a buffer
is never handed to a second parameter while autograd may still read it. Prefetching waits for room
in the budget (it simply stops and resumes at the next gather); a read on demand never waits for
and never fails for lack of a buffer, so the peak is the budget plus the parameters in use.
"""

from __future__ import annotations

from dataclasses import dataclass, field


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
    """stage3_prefetch_bucket_size: reads ahead of use start while fewer elements than this are in flight
    (the one crossing it included, as DeepSpeed's); 0 turns prefetching off."""
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
