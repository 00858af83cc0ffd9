"""Gradients on a compute device with its own memory (a GPU, or the simulated one): reduced on the
device in buckets and copied to page-locked host buffers for the CPU optimizer.

As autograd produces each gradient (on the device), in order:

1. pack: it is copied (cast to fp32) into the current device bucket of ``bucket_elements``, padded to
   its partitions; a gradient larger than a bucket gets a bucket of its own;
2. reduce: a full bucket is all-reduced over the ranks on the device (`Device.check_collective`);
3. copy out: the side stream "grad-copy" waits for the compute that filled the bucket, then copies it
   into the bucket's page-locked host twin (`Device.to_host`);
4. hand over: once the host has seen a copy done (the oldest of ``in_flight``, or at `flush`), each
   member's partition (averaged over the ranks) goes to `GradReducer._take`, as on the CPU.

Two bucket pairs are reused in turn, so device memory does not grow with the model: before compute
refills a device bucket it waits for the copy that read it, and the host has taken everything from
its host twin.
"""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from offload.device import Device, Event
from offload.params.store import ParamRecord

if TYPE_CHECKING:
    from offload.train.grads import GradReducer

_IN_FLIGHT = 2
"""Bucket copies in flight at once before backward waits for the oldest."""


@dataclass(slots=True, eq=False)
class _Bucket:
    device: torch.Tensor
    host: torch.Tensor
    copied: Event | None = None
    """The copy out of ``device`` last issued (compute waits for it before refilling)."""
    members: list[tuple[ParamRecord, int]] = field(default_factory=list)
    used: int = 0
    spare: bool = True
    """One of the reused pair (False: a one-off bucket for a gradient larger than a bucket)."""


class DeviceGradBuckets:
    """Steps 1 to 4 of the module docstring for one `GradReducer`."""

    def __init__(self, reducer: "GradReducer", device: Device, elements: int) -> None:
        self._reducer, self._device, self._elements = reducer, device, max(elements, 1)
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
        size = rec.partition_numel * self._reducer.world_size
        if size > self._elements:  # larger than a bucket: alone, in a bucket of its own
            self._launch()
            bucket = self._new_bucket(size, spare=False, name=f"gradient bucket of {rec.name}")
        else:
            if self._current is not None and self._current.used + size > self._elements:
                self._launch()
            if self._current is None:
                self._current = self._next_bucket()
            bucket = self._current
        view = bucket.device[bucket.used:bucket.used + size]
        view[:rec.numel].copy_(flat)  # on the compute stream, fp32
        view[rec.numel:].zero_()
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
            self._device.free(bucket.device)
        self._pair.clear()
        self._made = 0

    # ---- internals -------------------------------------------------------------------------------

    def _next_bucket(self) -> _Bucket:
        if not self._pair and self._made < 2:
            self._made += 1
            return self._new_bucket(self._elements, spare=True, name=f"gradient bucket {self._made}")
        while not self._pair:
            self._finish_oldest()  # sync point: a bucket comes back
        bucket = self._pair.popleft()
        if bucket.copied is not None:  # compute refills it only after its last copy out has read it
            self._device.compute_stream.wait_event(bucket.copied)
        return bucket

    def _new_bucket(self, elements: int, *, spare: bool, name: str) -> _Bucket:
        return _Bucket(self._device.empty(elements, torch.float32, name=name),
                       self._device.pinned_empty(elements, torch.float32), spare=spare)

    def _launch(self) -> None:
        if self._current is not None:
            bucket, self._current = self._current, None
            self._start(bucket)

    def _start(self, bucket: _Bucket) -> None:
        """Steps 2 and 3 for a filled bucket."""
        reducer, device = self._reducer, self._device
        flat = bucket.device[:bucket.used]
        if reducer.world_size > 1:
            device.check_collective(flat, op="gradient all_reduce")
            start = time.perf_counter()
            dist.all_reduce(flat, group=reducer.group)
            reducer.comm_seconds += time.perf_counter() - start
        self._side.wait_event(device.compute_stream.record())
        bucket.copied = device.to_host(bucket.host[:bucket.used], flat, stream=self._side)
        self.bytes_to_host += flat.numel() * flat.element_size()
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
        world = reducer.world_size
        for rec, offset in bucket.members:
            first = offset + reducer.rank * rec.partition_numel
            part = host[first:first + rec.partition_numel]
            reducer._take(rec, part.div(world) if world > 1 else part.clone())  # copies: the bucket is reused
        self._recycle(bucket)

    def _recycle(self, bucket: _Bucket) -> None:
        bucket.members, bucket.used = [], 0
        if bucket.spare:
            self._pair.append(bucket)
        else:
            self._device.free(bucket.device)
