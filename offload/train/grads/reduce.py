"""Gradients: taken from autograd as each parameter's gradient is final, reduced to the owning rank's
partition (averaged over ranks), and accumulated in float32 in the reducer's `GradPartition` of the
record: in memory, or, when the optimizer state is on NVMe, in a gradient swap file (so host memory does
not grow with the model), or in the free slot of the partition's own `SlotPair`.

Per parameter and backward, in order:
1. the parameter's gradient hook (``param.register_hook``: autograd has summed every use of a tied
   parameter into the gradient it gets): if the parameter was released, give it a full-shaped
   zero-stride stand-in on the gradient's device, so that autograd's accumulation sees a parameter of
   the gradient's shape (one element of memory) rather than the empty placeholder;
2. the post-accumulate-grad hook: take ``param.grad``, clear it, put the placeholder back, reduce the
   gradient to this rank's partition and accumulate it.

Both hooks are the parameter's own, never hooks on its AccumulateGrad node: autograd replaces that node
whenever ``param.data`` changes device type or dtype (a gathered GPU tensor, then the host placeholder
again), and a hook on the old node would no longer run (on a GPU, the accumulation then met the empty
placeholder: "The size of tensor a (0) must match the size of tensor b (N)"; docs/device.md).
"""

from __future__ import annotations

import collections
import functools
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from offload.params.record import FaultSink, ParamRecord
from offload.params.store import ParamStore
from offload.storage.swapfile import SwapFile
from offload.storage.write_queue import WriteQueue
from offload.train.grads.device import DeviceGradBuckets, fp32_mean

@dataclass(slots=True, eq=False)
class GradPartition:
    """One record's gradient partition accumulated for this step (float32, ``partition_numel`` elements)."""

    value: torch.Tensor | None = None
    """Kept in memory."""
    offset: int = -1
    """Byte offset in the gradient swap file (gradients offloaded to NVMe, not in the partition's free slot)."""
    on_disk: bool = False
    """Offloaded: the gradient swap file (or the partition's free slot) holds it."""
    norm: torch.Tensor | None = None
    """Its L2 norm (float32, inf/nan if any element is), taken as it was reduced: for clipping and the
    fp16 overflow check."""


_WRITES_IN_FLIGHT = 2
"""Offloaded gradient writes in flight at once before backward waits for the oldest."""


class GradReducer:
    """Installs the two gradient hooks on every trainable parameter and reduces into its record."""

    def __init__(self, store: ParamStore, *, world_size: int, rank: int, group: object = None,
                 swap: SwapFile | None = None,
                 consumer: Callable[[ParamRecord, torch.Tensor], None] | None = None, norms: bool = False,
                 bucket_elements: int = 0, overlap: bool = True, param_slots: bool = False,
                 comm_dtype: torch.dtype = torch.float32) -> None:
        self.store, self.world_size, self.rank, self.group = store, world_size, rank, group
        self.comm_dtype = comm_dtype
        """The dtype gradients are reduced in (``communication_data_type``); the partitions taken are fp32."""
        self.grads = [GradPartition() for _ in store.records]
        """This step's gradient partition of each record, by record index."""
        self.swap = swap
        self.param_slots = param_slots and swap is not None
        """Offloaded gradients of on-disk fp32 partitions go to the partition's free slot in the parameter
        swap file, not to ``swap``: valid where a step's partitions commit with the optimizer state (the
        fast paths), since between a commit and the next step's first update the slot that is not the
        committed one holds nothing (`_location`)."""
        self.consumer = consumer
        self.faults: FaultSink | None = None
        """Several ranks (set by the engine): where `_take`'s errors go (`ParamStore.faults`)."""
        """Takes each reduced gradient partition of the accumulation's last micro-batch, with the earlier
        ones added, instead of accumulating it (updates during backward)."""
        self.norms = norms
        """Take each accumulated partition's norm (`GradPartition.norm`) in the last micro-batch, as it is
        reduced (the step in the next forward validates with them)."""
        self.boundary = True
        """This backward ends a gradient accumulation (`start_backward`)."""
        self.on_half: Callable[[], None] | None = None
        """Called once in each backward that ends an accumulation, when half of the trainable elements'
        gradients have been taken (most activations are freed by then)."""
        self._taken = 0
        self._half = sum(rec.partition_numel for rec in store.records if rec.accumulator is not None) / 2
        self.comm_seconds = 0.0
        """Seconds backward spent blocked in gradient reductions (a call, or the wait for a bucket's)."""
        self.device = store.device
        self.device_buckets: DeviceGradBuckets | None = None
        """On a device with its own memory: gradients reduced there in buckets and copied to the host
        (`offload.train.grads.device`), at any world size; the buckets are at most the model's size."""
        if self.device.separate_memory:
            needed = sum(rec.partition_numel * world_size for rec in store.records if rec.accumulator is not None)
            self.device_buckets = DeviceGradBuckets(self, self.device, min(bucket_elements or needed, needed))
        self._buckets = (_Buckets(self, bucket_elements, overlap=overlap)
                         if world_size > 1 and self.device_buckets is None and bucket_elements > 0 else None)
        """Gradients packed and all-reduced per bucket, asynchronously (gloo); None: one call per gradient."""
        self._writes = WriteQueue()
        """Offloaded gradient writes in flight, each with its buffer."""
        self._hooks = []
        for rec in store.records:
            if rec.accumulator is None:
                continue
            if swap is not None and not self._in_param_slot(rec):
                self.grads[rec.index].offset = swap.allocate(rec.partition_numel * 4)
            before, after = functools.partial(self._before_accumulate, rec), functools.partial(self._after_accumulate, rec)
            self._hooks.append(rec.param.register_hook(before))
            self._hooks.append(rec.param.register_post_accumulate_grad_hook(after))

    @property
    def has_buckets(self) -> bool:
        """Whether gradients are all-reduced in buckets (more than one rank: over gloo, or on the device)."""
        return self._buckets is not None or (self.device_buckets is not None and self.world_size > 1)

    def _before_accumulate(self, rec: ParamRecord, grad: torch.Tensor) -> None:
        if rec.full is None:  # released: a stand-in of the full shape, zero strides, one element
            rec.param.data = torch.zeros((), dtype=rec.param.dtype, device=grad.device).expand(rec.shape)

    def _after_accumulate(self, rec: ParamRecord, param: torch.Tensor) -> None:
        grad, param.grad = param.grad, None
        if rec.full is None:
            param.data = self.store.placeholder_of(rec)
        self.reduce(rec, grad)

    def reduce(self, rec: ParamRecord, grad: torch.Tensor) -> None:
        """Reduce a full gradient to this rank's partition (mean over ranks) and accumulate it in fp32.

        Across ranks over gloo, gradients are packed into buckets of ``bucket_elements`` and each full
        bucket is all-reduced asynchronously while backward goes on (`flush` ends the last one); a
        gradient larger than a bucket is all-reduced alone."""
        flat = grad.reshape(-1)
        if self.device_buckets is not None:
            self.device_buckets.add(rec, flat)
            return
        if self.world_size == 1:
            self._take(rec, flat.float())  # no copy for fp32: autograd handed this tensor over
            return
        if self._buckets is not None:
            self._buckets.add(rec, flat)
            return
        padded = torch.zeros(rec.partition_numel * self.world_size, dtype=self.comm_dtype)
        padded[:rec.numel] = flat
        start = time.perf_counter()
        # gloo's reduce-scatter is slower than its all-reduce: all-reduce, keep this rank's slice
        self.device.check_collective(padded, op=f"gradient all_reduce of {rec.name!r}")
        dist.all_reduce(padded, group=self.group)
        self.comm_seconds += time.perf_counter() - start
        self._take(rec, fp32_mean(padded.chunk(self.world_size)[self.rank], self.world_size))

    def flush(self) -> None:
        """End of a backward: reduce what the last bucket holds and wait for every reduction in flight
        (sync point); every gradient partition of this backward is then taken."""
        if self._buckets is not None:
            self._buckets.flush()
        if self.device_buckets is not None:
            self.device_buckets.flush()

    def abandon(self) -> None:
        """After a failed backward: wait for the reductions in flight and drop what the buckets hold."""
        if self._buckets is not None:
            self._buckets.abandon()
        if self.device_buckets is not None:
            self.device_buckets.abandon()

    def start_backward(self, boundary: bool) -> None:
        """A backward begins; ``boundary``: it ends a gradient accumulation."""
        self.boundary, self._taken = boundary, 0

    def _take(self, rec: ParamRecord, part: torch.Tensor) -> None:
        """``rec``'s reduced gradient partition (fp32, averaged over ranks): hand it over or accumulate it.
        Several ranks: an error is handed to ``faults`` (the step is given up on every rank) rather than
        raised in the middle of the backward's collectives."""
        try:
            self._take_now(rec, part)
        except Exception as error:
            if self.faults is None or not self.faults.absorb(error, f"taking the gradient of {rec.name!r}"):
                raise

    def _take_now(self, rec: ParamRecord, part: torch.Tensor) -> None:
        if self.boundary and self.on_half is not None:
            before, self._taken = self._taken, self._taken + rec.partition_numel
            if before < self._half <= self._taken:
                self.on_half()
        grad = self.grads[rec.index]
        if self.consumer is not None and self.boundary:
            if grad.value is not None:  # the earlier micro-batches', kept: added as autograd accumulates
                part, grad.value = grad.value.add_(part), None
            elif grad.on_disk:  # kept in the swap file (sync points: its last write, then the read)
                self.drain()
                part, grad.on_disk = self.read(rec).add_(part), False
            grad.norm = torch.linalg.vector_norm(part)
            self.consumer(rec, part)
            return
        if self.swap is None:
            if grad.value is None:
                grad.value = part if part.is_contiguous() else part.contiguous()
            else:
                grad.value.add_(part)
            if self.norms and self.boundary:  # one pass, while the gradient is in cache
                grad.norm = torch.linalg.vector_norm(grad.value)
            return
        # Offloaded: read-add-write when accumulating, then write behind (bounded writes in flight),
        # always from a page-aligned buffer so that the write goes straight to the disk (O_DIRECT).
        swap, offset = self._location(rec)
        if grad.on_disk:
            self.drain()  # sync point: this record's previous write must have landed
            buffer = self.read(rec)
            buffer.add_(part)
        else:
            buffer = swap.buffer(rec.partition_numel, torch.float32)
            buffer.copy_(part)
        del part
        grad.norm = torch.linalg.vector_norm(buffer)  # one pass, while the buffer is in cache
        self._writes.push(swap.write(buffer, offset), buffer)
        grad.on_disk = True
        self._writes.trim(_WRITES_IN_FLIGHT)

    def read(self, rec: ParamRecord) -> torch.Tensor:
        """This step's offloaded gradient partition of ``rec`` (float32), read now."""
        buffer, future = self.start_read(rec)
        future.result()
        return buffer

    def start_read(self, rec: ParamRecord):
        """Start reading this step's offloaded gradient partition: (buffer, future)."""
        swap, offset = self._location(rec)
        return swap.read_new(rec.partition_numel, torch.float32, offset,
                             what=f"gradient of {self.store.describe(rec)}")

    def offloaded_places(self) -> dict[str, int]:
        """Trainable records by where their offloaded gradient goes: "param_slot", "swap_file" (empty: none offloaded)."""
        if self.swap is None:
            return {}
        trainable = [rec for rec in self.store.records if rec.accumulator is not None]
        in_slots = sum(self._in_param_slot(rec) for rec in trainable)
        return {"param_slot": in_slots, "swap_file": len(trainable) - in_slots}

    def _in_param_slot(self, rec: ParamRecord) -> bool:
        return self.param_slots and rec.on_disk and rec.partition.dtype.itemsize >= 4

    def _location(self, rec: ParamRecord) -> tuple[SwapFile, int]:
        """The swap file and byte offset of ``rec``'s offloaded gradient partition."""
        if not self._in_param_slot(rec):
            return self.swap, self.grads[rec.index].offset
        if rec.slots.staged:
            raise RuntimeError(f"internal error: the gradient of {rec.name!r} would overwrite the update of a step "
                               f"not committed yet (the engine waits for the commit before backward)")
        return self.store.swap, rec.slots.spare_offset()

    def global_norm(self) -> float:
        """The L2 norm of this step's accumulated gradient partitions over all ranks (every rank calls it;
        sync point: waits for the offloaded writes, raising their error), from each partition's norm
        taken as it was reduced where there is one."""
        total = torch.zeros((), dtype=torch.float64)
        self.drain()
        for grad in self.grads:
            if grad.norm is not None:  # taken as it was reduced (offloaded, applied during backward, or kept)
                total += grad.norm.double() ** 2
            elif grad.value is not None:
                total += torch.linalg.vector_norm(grad.value).double() ** 2
        if self.world_size > 1:
            total = self.device.collective_tensor(total)
            self.device.check_collective(total, op="gradient norm all_reduce")
            dist.all_reduce(total, group=self.group)
        return float(total.sqrt())

    def drain(self) -> None:
        """Wait for every gradient write in flight (sync point). Raises the first failure's TensorIOError."""
        self._writes.drain()

    def clear(self) -> None:
        """Forget this step's gradients (after the step, or when it is skipped)."""
        self.drain()
        for grad in self.grads:
            grad.value, grad.on_disk, grad.norm = None, False, None

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        self.drain()
        if self.device_buckets is not None:
            self.device_buckets.close()
        if self.swap is not None:
            self.swap.close()


_BUCKETS_IN_FLIGHT = 2
"""Bucket reductions in flight at once before backward waits for the oldest."""


class _Buckets:
    """Gradients packed into flat buckets (of ``communication_data_type``) (each padded to its partitions), all-reduced asynchronously
    as each bucket fills, in the order backward produces them: the same on every rank, since every rank
    runs the same graph. Each finished bucket's partitions go to `GradReducer._take`."""

    def __init__(self, reducer: GradReducer, elements: int, *, overlap: bool) -> None:
        self._reducer, self._elements, self._overlap = reducer, elements, overlap
        self._buffer: torch.Tensor | None = None
        self._members: list[tuple[ParamRecord, int]] = []
        self._used = 0
        self._in_flight: collections.deque = collections.deque()

    def add(self, rec: ParamRecord, flat: torch.Tensor) -> None:
        size = rec.partition_numel * self._reducer.world_size
        if size > self._elements:  # larger than a bucket: alone, from its own padded copy
            self._launch()
            padded = torch.zeros(size, dtype=self._reducer.comm_dtype)
            padded[:rec.numel] = flat
            self._start(padded, [(rec, 0)])
            return
        if self._used + size > self._elements:
            self._launch()
        if self._buffer is None:
            self._buffer = torch.empty(self._elements, dtype=self._reducer.comm_dtype)
        view = self._buffer[self._used:self._used + size]
        view[:rec.numel].copy_(flat)
        view[rec.numel:].zero_()
        self._members.append((rec, self._used))
        self._used += size

    def flush(self) -> None:
        self._launch()
        while self._in_flight:
            self._finish_oldest()

    def abandon(self) -> None:
        in_flight, self._in_flight = self._in_flight, collections.deque()
        for work, _, _ in in_flight:
            work.wait()  # never drop memory a reduction may still write to
        self._buffer, self._members, self._used = None, [], 0

    def _launch(self) -> None:
        if self._members:
            self._start(self._buffer[:self._used], self._members)
            self._buffer, self._members, self._used = None, [], 0

    def _start(self, flat: torch.Tensor, members: list[tuple[ParamRecord, int]]) -> None:
        self._reducer.device.check_collective(flat, op="gradient bucket all_reduce")
        work = dist.all_reduce(flat, group=self._reducer.group, async_op=True)
        self._in_flight.append((work, flat, members))
        while len(self._in_flight) > (_BUCKETS_IN_FLIGHT if self._overlap else 0):
            self._finish_oldest()

    def _finish_oldest(self) -> None:
        work, flat, members = self._in_flight.popleft()
        reducer = self._reducer
        start = time.perf_counter()
        work.wait()  # sync point
        reducer.comm_seconds += time.perf_counter() - start
        for rec, offset in members:
            first = offset + reducer.rank * rec.partition_numel
            reducer._take(rec, fp32_mean(flat[first:first + rec.partition_numel], reducer.world_size))
