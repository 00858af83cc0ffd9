"""`Engine.stats()`: what the engine is doing and holds, for users, tests and benchmarks.

    stats = engine.stats()
    stats.mode                      # UpdateMode.IN_FORWARD: where each step's update runs
    stats.io["params"]["read"]      # bytes read from the parameter swap file so far
    stats.buffers_held              # elements of on-disk partitions held in memory now
    stats.failure                   # Failure.NONE, or what the last error left behind
    stats.device_bytes["to_device"] # bytes copied to the GPU so far (parameter gathers)
"""

from __future__ import annotations

from dataclasses import dataclass

from offload.storage import SwapFile
from offload.train.step.failure import Failure
from offload.train.step.update_mode import StepContext, UpdateMode, UpdatePath


@dataclass(frozen=True, slots=True)
class EngineStats:
    """A snapshot of the engine's state (`Engine.stats`)."""

    mode: UpdateMode
    """Where each step's update runs (chosen at initialize; docs/engine.md)."""
    failure: Failure
    """What the last error left behind (NONE: nothing failed)."""
    failure_reason: str | None
    """Why (the message ``step()`` raises or the warning logged), or None."""
    resume_from: str | None
    """The checkpoint last saved or loaded, or None."""
    io: dict[str, dict[str, int]]
    """Swap file -> ``{"read": bytes, "written": bytes}`` so far: "params" (the parameter partitions),
    "grads" (the gradient swap file), "optimizer" (OffloadAdam's state); a file the run has not is absent."""
    records: dict[str, int]
    """Parameter records (one per distinct, possibly tied, parameter) by place: "memory", "nvme"."""
    reads: dict[str, int]
    """Partition reads started: "demand" (needed now), "prefetch" (ahead of use), "skipped" (not issued: the
    pending update overwrites the partition whole)."""
    recorded_order: int
    """Gathers in the order recorded in the first step (prefetch follows it)."""
    buffers_held: int
    """Elements of on-disk partitions held in memory now (read, being read, kept for an update)."""
    buffer_budget: int
    """The most elements the swap budget lets reads ahead take (``offload_param.buffer_count x buffer_size``)."""
    kept_for_next_forward: frozenset[int]
    """Records (indices into ``engine.records``) whose on-disk partition is kept in memory after backward
    for the next forward's updates (the first ones that forward updates); empty otherwise."""
    io_buffers: dict[str, int]
    """The I/O buffer pool: "held_bytes", "max_bytes", "reused" (buffers taken from it rather than mapped)."""
    handed_over: int
    """On-disk partitions handed to the optimizer with their buffer, not let go yet."""
    writes_in_flight: int
    """Their write-backs started and not reaped yet."""
    uncommitted: bool
    """A step has begun to change parameters and is not committed yet (fast paths)."""
    steps_in_forward: int
    """Steps whose update ran (or runs) in the next forward."""
    grads_in_param_slots: bool
    """Offloaded gradients of on-disk fp32 partitions go to the partition's free slot, not the gradient swap file."""
    offloaded_grads: dict[str, int]
    """Trainable records whose gradient is offloaded, by where it waits for the step: "param_slot" (the
    partition's free slot) and "swap_file" (the gradient swap file); empty when gradients stay in memory."""
    reduction_buckets: bool
    """Gradients are all-reduced in buckets (gloo, more than one rank) rather than one call per gradient."""
    comm_seconds: float
    """Seconds backward was blocked in gradient reductions so far."""
    forwards_under_way: int
    """Module forwards begun and not ended (0 between passes)."""
    device_bytes: dict[str, int]
    """Bytes copied between host memory and a compute device with memory of its own (a GPU) so far:
    "to_device" (parameter gathers), "to_host" (gradients); both 0 where compute runs on the host."""


def collect_stats(ctx: StepContext, path: UpdatePath) -> EngineStats:
    """The `EngineStats` of the engine made of ``ctx`` and ``path``."""
    store, reducer, optimizer = ctx.store, ctx.reducer, ctx.optimizer
    io = {"params": SwapFile.io_bytes_of(store.swap)} if store.swap is not None else {}
    if reducer.swap is not None:
        io["grads"] = SwapFile.io_bytes_of(reducer.swap)
    if getattr(optimizer, "swap_path", None) is not None:  # OffloadAdam with state on NVMe
        io["optimizer"] = optimizer.io_bytes()
    on_disk = sum(rec.on_disk for rec in store.records)
    pool = store.swap.pool if store.swap is not None else None
    counts = path.counts()
    return EngineStats(
        mode=path.mode, failure=ctx.failure.kind, failure_reason=ctx.failure.reason,
        resume_from=ctx.failure.resume_from, io=io,
        records={"memory": len(store.records) - on_disk, "nvme": on_disk},
        reads={"demand": store.demand_reads, "prefetch": store.prefetch_reads, "skipped": store.skipped_reads},
        recorded_order=len(store.prefetcher.trace), buffers_held=store.budget.held,
        buffer_budget=store.budget.buffer_elements, kept_for_next_forward=frozenset(ctx.kept.next),
        io_buffers={"held_bytes": pool.held_bytes if pool else 0, "max_bytes": pool.max_bytes if pool else 0,
                    "reused": pool.reused if pool else 0},
        handed_over=counts.handed_over, writes_in_flight=counts.writes_in_flight, uncommitted=counts.uncommitted,
        steps_in_forward=counts.steps_in_forward, grads_in_param_slots=reducer.param_slots,
        offloaded_grads=reducer.offloaded_places(), reduction_buckets=reducer.has_buckets, comm_seconds=reducer.comm_seconds,
        forwards_under_way=len(store.forwards),
        device_bytes={"to_device": store.gathers.bytes_to_device if store.gathers is not None else 0,
                      "to_host": reducer.device_buckets.bytes_to_host if reducer.device_buckets is not None else 0})
