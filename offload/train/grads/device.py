"""Gradients on a compute device with its own memory (a GPU, or the simulated one): reduced on the
device in buckets and copied to page-locked host buffers for the CPU optimizer.

A bucket is ``world_size`` rows of ``row`` elements: row ``r`` holds rank ``r``'s partitions of its
members, each at the same column. As autograd produces each gradient (on the device), in order:

1. pack: it is copied (cast to the reducer's ``comm_dtype``, ``communication_data_type``) into the current bucket, partition ``r`` of it into row ``r``
   (padded with zeros); a gradient whose partition is longer than a row gets a bucket of its own;
2. reduce: across ranks, a full bucket is reduce-scattered on the device (`Device.check_collective`):
   this rank's row of the sum lands in the bucket's ``reduced`` buffer;
3. copy out: the side stream "grad-copy" waits for the compute that filled it, then copies this
   rank's row (only: 1 / world_size of the bucket) into the bucket's page-locked host twin
   (`Device.to_host`);
4. hand over: once the host has seen a copy done (the oldest of ``_IN_FLIGHT``, or at `flush`), each
   member's partition (averaged over the ranks) goes to `GradReducer._take`, as on the CPU.

Two buckets are reused in turn, so device memory does not grow with the model: before compute
refills a bucket it waits for the copy that read it, and the host has taken everything from its
host twin.
"""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.distributed as dist

from offload.device import Device, Event
from offload.params.record import ParamRecord


def _reduce_scatter(output: torch.Tensor, input: torch.Tensor, *, group: object) -> None:
    """torch.distributed's reduce-scatter of one flat tensor (its newer name where torch has it; looked up
    at each call, so that a test may count the calls)."""
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    scatter(output, input, group=group)


_IN_FLIGHT = 2
"""Bucket copies in flight at once before backward waits for the oldest."""


def fp32_mean(summed: torch.Tensor, world_size: int) -> torch.Tensor:
    """A partition of a gradient summed over ``world_size`` ranks (in the communication dtype), as a new
    fp32 tensor divided by ``world_size``: never a view of the bucket it came from, which goes or is reused."""
    if summed.dtype == torch.float32:
        return summed.div(world_size) if world_size > 1 else summed.clone()
    return summed.float().div_(world_size)


@dataclass(slots=True, eq=False)
class _Bucket:
    device: torch.Tensor
    """``world_size`` rows of ``row`` elements, flat."""
    reduced: torch.Tensor
    """This rank's row of the sum over ranks (the row itself at world size 1)."""
    host: torch.Tensor
    """The page-locked twin of ``reduced``."""
    row: int
    copied: Event | None = None
    """The copy out of ``reduced`` last issued (compute waits for it before refilling)."""
    members: list[tuple[ParamRecord, int]] = field(default_factory=list)
    """(record, column) of each gradient packed."""
    used: int = 0
    """Columns filled."""
    spare: bool = True
    """One of the reused pair (False: a one-off bucket for a gradient larger than a bucket)."""


class GradTaker(Protocol):
    """What the buckets read of and hand to their owner (the host's `GradReducer`)."""

    world_size: int
    group: object
    comm_seconds: float
    comm_dtype: torch.dtype
    """The buckets' dtype: what gradients are reduced and copied to the host in."""

    def _take(self, rec: ParamRecord, part: torch.Tensor) -> None:
        """Take ``rec``'s reduced partition (averaged over the ranks), as from the CPU's reduction."""


class DeviceGradBuckets:
    """Steps 1 to 4 of the module docstring for one `GradReducer`, which hands itself in."""

    def __init__(self, reducer: GradTaker, device: Device, elements: int) -> None:
        self._reducer, self._device = reducer, device
        self._row = max(-(-elements // reducer.world_size), 1)
        """Elements per rank's row of a bucket (``elements`` over the ranks)."""
        self._side = device.new_stream("grad-copy")
        self._pair: collections.deque[_Bucket] = collections.deque()
        """The reused buckets not in flight, next first (made on first use)."""
        self._made = 0
        self._current: _Bucket | None = None
        self._in_flight: collections.deque[_Bucket] = collections.deque()
        self.bytes_to_host = 0
        """Bytes copied device -> host so far."""

    def add(self, rec: ParamRecord, flat: torch.Tensor) -> None:
        """Step 1 for one gradient (a flat device tensor of ``rec.numel`` elements)."""
        size = rec.partition_numel
        if size > self._row:  # a partition longer than a row: alone, in a bucket of its own
            self._launch()
            bucket = self._new_bucket(size, spare=False, name=f"gradient bucket of {rec.name}")
        else:
            if self._current is not None and self._current.used + size > self._row:
                self._launch()
            if self._current is None:
                self._current = self._next_bucket()
            bucket = self._current
        # On the compute stream, fp32: partition r of the gradient into row r, zero padded.
        rows = bucket.device.view(-1, bucket.row)[:, bucket.used:bucket.used + size]
        whole, rest = divmod(rec.numel, size)
        rows[:whole].copy_(flat[:whole * size].view(whole, size))
        if whole < rows.shape[0]:
            rows[whole, :rest].copy_(flat[whole * size:])
            rows[whole, rest:].zero_()
            rows[whole + 1:].zero_()
        bucket.members.append((rec, bucket.used))
        bucket.used += size
        if not bucket.spare:
            self._start(bucket)

    def flush(self) -> None:
        """End of a backward: reduce and copy out the last bucket; hand every copied gradient over (sync point)."""
        self._launch()
        while self._in_flight:
            self._finish_oldest()

    def abandon(self) -> None:
        """After a failed backward: wait for the copies in flight and drop what the buckets hold."""
        for bucket in self._in_flight:
            bucket.copied.synchronize()
            self._recycle(bucket)
        self._in_flight.clear()
        if self._current is not None:
            self._recycle(self._current)
            self._current = None

    def close(self) -> None:
        """Give the buckets' device memory back (after `flush` or `abandon`)."""
        self.abandon()
        for bucket in self._pair:  # the host twins are unlocked when their memory goes
            self._free(bucket)
        self._pair.clear()
        self._made = 0

    # ---- internals -------------------------------------------------------------------------------

    def _next_bucket(self) -> _Bucket:
        if not self._pair and self._made < 2:
            self._made += 1
            return self._new_bucket(self._row, spare=True, name=f"gradient bucket {self._made}")
        while not self._pair:
            self._finish_oldest()  # sync point: a bucket comes back
        bucket = self._pair.popleft()
        if bucket.copied is not None:  # compute refills it only after its last copy out has read it
            self._device.compute_stream.wait_event(bucket.copied)
        return bucket

    def _new_bucket(self, row: int, *, spare: bool, name: str) -> _Bucket:
        device, world = self._device, self._reducer.world_size
        dtype = self._reducer.comm_dtype
        flat = device.empty(row * world, dtype, name=name)
        reduced = device.empty(row, dtype, name=f"{name}, reduced") if world > 1 else flat
        return _Bucket(flat, reduced, device.pinned_empty(row, dtype), row, spare=spare)

    def _free(self, bucket: _Bucket) -> None:
        self._device.free(bucket.device)
        if bucket.reduced is not bucket.device:
            self._device.free(bucket.reduced)

    def _launch(self) -> None:
        if self._current is not None:
            bucket, self._current = self._current, None
            self._start(bucket)

    def _start(self, bucket: _Bucket) -> None:
        """Steps 2 and 3 for a filled bucket."""
        reducer, device = self._reducer, self._device
        if reducer.world_size > 1:
            device.check_collective(bucket.reduced, bucket.device, op="gradient reduce_scatter")
            start = time.perf_counter()
            _reduce_scatter(bucket.reduced, bucket.device, group=reducer.group)
            reducer.comm_seconds += time.perf_counter() - start
        out = bucket.reduced[:bucket.used]
        self._side.wait_event(device.compute_stream.record())
        bucket.copied = device.to_host(bucket.host[:bucket.used], out, stream=self._side)
        self.bytes_to_host += out.numel() * out.element_size()
        self._in_flight.append(bucket)
        while len(self._in_flight) > _IN_FLIGHT:
            self._finish_oldest()

    def _finish_oldest(self) -> None:
        """Step 4 for the oldest bucket in flight."""
        bucket = self._in_flight.popleft()
        reducer = self._reducer
        start = time.perf_counter()
        bucket.copied.synchronize()  # sync point
        reducer.comm_seconds += time.perf_counter() - start
        host = bucket.host[:bucket.used]
        self._device.check_ready(host)
        for rec, column in bucket.members:  # fp32 copies: the bucket is reused
            reducer._take(rec, fp32_mean(host[column:column + rec.partition_numel], reducer.world_size))
        self._recycle(bucket)

    def _recycle(self, bucket: _Bucket) -> None:
        bucket.members, bucket.used = [], 0
        if bucket.spare:
            self._pair.append(bucket)
        else:
            self._free(bucket)
