"""A streamed decode step's floor, measured side by side in the engine's own process: the ring's reads
alone (no compute) and the compute alone (no reads), beside the steps that do both.

A step cannot beat ``max(reads alone, compute alone)``; what it takes beyond that is the cost of doing
both at once (the I/O thread and the disk's transfers beside the matmuls on the same cores and memory)
or reads the ring does not overlap with compute. fio or an in-memory model of fewer layers measure each
half elsewhere, on other bytes and another code path; these measure the engine's own.

- **Reads alone** (`ring_reads_alone`): the streamed units' windows read into the ring's own buffers,
  in forward order, as many in flight as the ring has buffers, through the engine's handle.
- **Compute alone** (`reads_skipped`): decode steps whose streamed reads complete at once without
  reading; each streamed layer computes on what its ring buffer already holds (another layer's weights
  of the same shapes), so the step runs every kernel it runs when streaming, on the same memory.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Iterator

import numpy as np
import torch


__all__ = ["reads_skipped", "ring_reads_alone", "side_by_side"]


class _Skipped:
    """A read that was not made: done at once, 0 bytes moved."""

    def result(self, timeout: float | None = None) -> int:
        return 0

    def done(self) -> bool:
        return True

    def exception(self, timeout: float | None = None) -> None:
        return None

    def add_done_callback(self, fn) -> None:
        fn(self)


def _streamed(engine) -> list:
    """The units the engine streams through its ring now, in forward order, its ring drained first (the
    reads a finished forward left in flight for the next one). Not within a forward. Raises RuntimeError
    where a load is still under way (`engine.wait_loaded()` first) or nothing is streamed."""
    streamer = engine.streamer
    streamer.reset()
    if any(unit.state == "loading" for unit in streamer.units):
        raise RuntimeError("a unit is still loading: call engine.wait_loaded() before measuring the floor")
    units = [unit for unit in streamer.units if unit.state == "on disk"]
    if not units or not streamer.buffers:
        raise RuntimeError("the engine streams nothing (every unit is resident): there is no read to measure")
    return units


def ring_reads_alone(engine, *, forwards: int = 2) -> tuple[int, float]:
    """Read ``forwards`` forwards' worth of the engine's streamed units into its ring buffers, in forward
    order with ``buffer_count`` reads in flight, no compute; (bytes read, seconds). Raises RuntimeError
    (see `_streamed`) and the reads' TensorIOError."""
    units = _streamed(engine) * forwards
    buffers = engine.streamer.buffers
    inflight: list[list] = []
    total, start = 0, time.perf_counter()
    for i, unit in enumerate(units):
        if len(inflight) == len(buffers):  # the oldest read's buffer is the next one free
            total += sum(future.result() for future in inflight.pop(0))
        inflight.append(engine.streamer.read_into(unit.windows, buffers[i % len(buffers)]))
    for futures in inflight:
        total += sum(future.result() for future in futures)
    return total, time.perf_counter() - start


@contextmanager
def reads_skipped(engine) -> Iterator[None]:
    """Within: the engine's streamed reads are not made (each completes at once, 0 bytes), so a forward
    is its compute alone on the ring's stale bytes; its outputs mean nothing. Raises RuntimeError (see
    `_streamed`)."""
    _streamed(engine)
    streamer = engine.streamer
    streamer.read_into = lambda windows, buffer: [_Skipped() for _ in windows]  # shadows the method
    try:
        yield
    finally:
        del streamer.read_into  # the method again
        streamer.reset()  # nothing skipped stays bound: the next forward reads its layers again


class _TokenClock:
    """A transformers streamer that notes when each new token arrives (the first `put` is the prompt)."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._prompt = True

    def put(self, value) -> None:
        if not self._prompt:
            self.times.append(time.perf_counter())
        self._prompt = False

    def end(self) -> None:
        pass


def side_by_side(engine, ids: torch.Tensor, new_tokens: int) -> dict:
    """``engine``'s floor, measured now (its loads done, no forward running): the ring's reads of one
    forward alone, and the compute alone of a greedy generation of ``new_tokens`` (>= 2) from ``ids``
    (the median of its decode steps, reads skipped). Give the batch and length of the run measured, so
    that the plan stays that run's. Raises RuntimeError (see `_streamed`; or where the generation's KV
    cache changed the plan)."""
    nbytes, seconds = ring_reads_alone(engine)
    clock, resident = _TokenClock(), set(engine.plan.resident)
    with reads_skipped(engine):
        engine.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False,
                        pad_token_id=0, streamer=clock)
    if set(engine.plan.resident) != resident:
        raise RuntimeError("the compute alone ran with another plan than the run's (its KV cache changed what is "
                           "resident): give side_by_side the run's batch and length")
    compute = np.diff(np.array(clock.times))
    return {"reads_alone_bps": nbytes / seconds, "reads_alone_s": engine.plan.read_bytes_per_forward * seconds / nbytes,
            "compute_alone_steps": [float(s) for s in compute], "compute_alone_s": float(np.median(compute))}
