"""Gathering parameters onto a compute device with its own memory (a GPU, or the simulated one).

A partition at rest is host memory: a page-locked buffer (``offload_param`` "none" or "cpu") or the
page-locked buffer an NVMe read filled. Per gathered parameter, in order:

1. copy: a device buffer, allocated for the side stream "param-copy" (`Device.empty`), is filled from
   the host partition by `Device.to_device` on that stream. It waits for no compute: a GPU's caching
   allocator reuses that stream's memory in its order, after the other streams that used a buffer
   (each named to `Device.record_stream` when it takes one);
2. the stream that reads the copy waits for its event (`Stream.wait_event`), never the host: at world
   size 1 the compute stream (the copy is the parameter), across ranks the side stream "param-gather";
3. across ranks, on "param-gather", a module's partitions are packed into one flat input, all-gathered in
   one call into one flat output (`Device.collective_on`, `offload.params.coalesce`) and unpacked into a
   buffer per parameter (`Device.device_copy`), all allocated for that stream; so a gather issued ahead
   runs beside the compute queued before it, and the compute stream waits for the gather's event only
   when the module takes it (`finish`);
4. release: the buffer goes back to the budget (`Device.free`) once no view of it is left: backward's
   autograd node holds the view a saved-tensor unpack returned until it has run, after the store has
   released the parameter (`_sweep`); its memory waits for the compute that read it (`record_stream`).

While a module computes, the next partitions of the recorded order are copied ahead (step 1 for them,
``ahead_elements`` at most, whatever host data is there without waiting for a read). A host buffer
an NVMe read filled goes back to the pool and the budget once every copy from it is done, without the
host waiting for them (`give_back_host`: it is held until the copies' events answer done, polled before
the next reads start); a host partition about to be written in place first waits for them
(`host_released`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import ClassVar, Protocol

import torch
from tensorio import storage_references

from offload.device import Device, Event
from offload.params.coalesce import all_gather_flat, by_dtype, columns
from offload.params.record import ParamRecord


class HostPartitions(Protocol):
    """What `DeviceGathers.copy_ahead` reads of its owner (the `ParamStore`)."""

    records: list[ParamRecord]

    def host_partition(self, rec: ParamRecord) -> torch.Tensor | None:
        """``rec``'s partition in host memory now, or None where it is not there."""


@dataclass(slots=True, eq=False)
class _Copy:
    """A partition copied to the device: its buffer and the copy's event."""

    buffer: torch.Tensor
    event: Event | None
    """The copy into ``buffer``; None for a buffer the gather stream filled (an all-gather's)."""
    source: torch.Tensor
    references: int | None = None
    """The buffer's storage references while only the buffer itself refers to it (see `_sweep`; None:
    torch cannot count them, and the buffer is freed at the end of the pass)."""


@dataclass(slots=True, eq=False)
class _Call:
    """One all-gather of `DeviceGathers._issue` (partitions of one dtype), on the gather stream."""

    recs: list[ParamRecord]
    fulls: list[_Copy]
    """Each record's full buffer."""
    event: Event
    """After the last unpack: what compute waits for."""
    spent: list[_Copy]
    """The partitions' buffers and the flat ones: given back when the gather is taken or dropped (their
    memory waits for the gather stream's work), counted in the budget until then."""


@dataclass(slots=True, eq=False)
class InFlight:
    """A coalesced all-gather of `DeviceGathers.start`, not yet waited for (`DeviceGathers.finish`)."""

    members: list[tuple[ParamRecord, torch.Tensor]]
    copies: list[_Copy] | None
    """World size 1: each member's copy, its full parameter itself; else None."""
    calls: list[_Call] = field(default_factory=list)
    """Per dtype, its all-gather."""


class DeviceGathers:
    """The device side of `ParamStore.gather` and `ParamStore.release` where memory is separate."""

    side_stream_gathers: ClassVar[bool] = True
    """Across ranks, all-gather on the side stream "param-gather" (False: on the compute stream, which
    the tests compare it with)."""

    def __init__(self, device: Device, *, world_size: int, rank: int, group: object,
                 ahead_elements: int) -> None:
        self.device, self.world_size, self.rank, self.group = device, world_size, rank, group
        self.ahead_elements = ahead_elements
        self.side = device.new_stream("param-copy")
        self.gather_stream = (device.new_stream("param-gather") if world_size > 1 and self.side_stream_gathers
                              else device.compute_stream)
        self._ahead: dict[int, _Copy] = {}
        """Record index -> its partition copied ahead of its gather."""
        self._gathered: dict[int, _Copy] = {}
        """Record index -> the device buffer its full parameter lives in, while gathered."""
        self._starting: set[int] = set()
        """Record indices whose all-gather is issued and not finished (`start`)."""
        self._resident: dict[int, _Copy] = {}
        """Record index -> the device buffer its full parameter stays in (``offload_param.device`` "none")."""
        self._retired: list[_Copy] = []
        """Buffers of released parameters that views may still refer to (freed by `_sweep`)."""
        self._from_host: dict[int, list[Event]] = {}
        """Record index -> copies that read its host buffer and that the host has not yet seen done."""
        self._returning: list[tuple[list[Event], torch.Tensor, Callable[[], None]]] = []
        """Host buffers given back while copies may still read them: (those copies' events, the buffer,
        what gives it back), until the events are done."""
        self.bytes_to_device = 0
        """Bytes copied host -> device so far."""
        self.copied_ahead = 0
        """Partitions copied ahead of their gather so far."""

    @property
    def waiting_ahead_elements(self) -> int:
        """Elements copied ahead of their gather and not gathered yet (at most ``ahead_elements`` plus one partition)."""
        return sum(copy.buffer.numel() for copy in self._ahead.values())

    @property
    def returning_buffers(self) -> int:
        """Host buffers given back while copies to the device may still read them (0 once those are seen done)."""
        return len(self._returning)

    # ---- gather / release ---------------------------------------------------------------------

    def gather(self, rec: ParamRecord, local: torch.Tensor) -> torch.Tensor:
        """``rec``'s full flat parameter on the device, from its host partition ``local``."""
        return self.gather_many([(rec, local)])[0]

    def gather_many(self, members: Sequence[tuple[ParamRecord, torch.Tensor]]) -> list[torch.Tensor]:
        """Each member's full flat parameter on the device, from its host partition: across ranks one
        all-gather for all of them (per dtype; `offload.params.coalesce`)."""
        return self.finish(self.start(members))

    def start(self, members: Sequence[tuple[ParamRecord, torch.Tensor]]) -> InFlight:
        """Steps 1 to 3 of `gather_many` up to the all-gathers, issued on the gather stream without the host
        or compute waiting for them; `finish` makes compute wait for them, `abandon` drops them."""
        self._sweep()
        copies = []
        for rec, local in members:
            copy = self._ahead.pop(rec.index, None)
            if copy is not None and copy.source.data_ptr() != local.data_ptr():
                self._discard(copy)  # copied from a buffer the partition no longer lives in
                copy = None
            if copy is None:
                copy = self._copy(rec, local)
            # 2. The stream that reads the copy waits for it (the host goes on).
            (self.device.compute_stream if self.world_size == 1 else self.gather_stream).wait_event(copy.event)
            copies.append(copy)
        flight = InFlight(list(members), copies if self.world_size == 1 else None)
        if self.world_size > 1:  # 3. all-gather on device tensors, one call per dtype
            for batch in by_dtype(members):
                flight.calls.append(self._issue([(rec, local, copies[at]) for at, (rec, local) in batch]))
        self._starting.update(rec.index for rec, _ in members)
        return flight

    def _issue(self, batch: list[tuple[ParamRecord, torch.Tensor, _Copy]]) -> _Call:
        """Step 3 for partitions of one dtype copied to the device, on the gather stream, each into a full
        buffer of its own."""
        world, dtype, stream = self.world_size, batch[0][0].partition.dtype, self.gather_stream
        recs = [rec for rec, _, _ in batch]
        fulls = []
        for rec, local, copy in batch:
            full = self.device.empty(rec.partition_numel * world, dtype, name=f"gathered {rec.name}", stream=stream)
            fulls.append(_Copy(full, None, local, storage_references(full)))  # before any view of it exists
            self.device.record_stream(copy.buffer, stream)  # allocated for "param-copy", read here

        def issue(output: torch.Tensor, input: torch.Tensor) -> object:
            return all_gather_flat(output, input, group=self.group, async_op=True)

        spent = [copy for _, _, copy in batch]
        if len(batch) == 1:  # straight into its full buffer
            event = self.device.collective_on(stream, issue, fulls[0].buffer, spent[0].buffer,
                                              op=f"all_gather of {recs[0].name!r}")
            return _Call(recs, fulls, event, spent)
        # pack, gather into one flat buffer, unpack (offload/params/coalesce.py)
        starts, total = columns(recs)
        what = f"{len(recs)} parameters from {recs[0].name}"
        flat = self.device.empty(total, dtype, name=f"all_gather input of {what}", stream=stream)
        for (rec, _, copy), start in zip(batch, starts):
            self.device.device_copy(flat[start:start + rec.partition_numel], copy.buffer, stream=stream)
        rows = self.device.empty(total * world, dtype, name=f"all_gather output of {what}", stream=stream)
        self.device.collective_on(stream, issue, rows, flat, op=f"all_gather of {what}")
        by_rank = rows.view(world, total)
        for rec, start, full in zip(recs, starts, fulls):
            part = rec.partition_numel
            event = self.device.device_copy(full.buffer.view(world, part), by_rank[:, start:start + part],
                                            stream=stream)
        return _Call(recs, fulls, event, spent + [_Copy(flat, None, flat), _Copy(rows, None, rows)])

    def finish(self, flight: InFlight) -> list[torch.Tensor]:
        """Make the compute stream wait for ``flight``'s all-gathers (the host does not wait) and take each
        member's full flat parameter (a member gathered meanwhile keeps its buffer); its memory waits
        for the compute that reads it (`Device.record_stream`)."""
        compute = self.device.compute_stream
        if flight.copies is not None:  # world size 1: the copies are the parameters
            for (rec, _), copy in zip(flight.members, flight.copies):
                self.device.check_ready(copy.buffer)
                self.device.record_stream(copy.buffer, compute)
                self._keep(rec, copy)
        for call in flight.calls:
            compute.wait_event(call.event)  # 2. compute waits for the gather (the host goes on)
            for rec, full in zip(call.recs, call.fulls):
                self.device.check_ready(full.buffer)
                self.device.record_stream(full.buffer, compute)
                self._keep(rec, full)
            for copy in call.spent:
                self._discard(copy)
        flight.calls = []
        self._starting.difference_update(rec.index for rec, _ in flight.members)
        return [self._gathered[rec.index].buffer[:rec.numel] for rec, _ in flight.members]

    def abandon(self, flight: InFlight) -> None:
        """Drop ``flight`` unused (end of a pass): give its buffers back (their memory waits for the gather)."""
        for call in flight.calls:
            for copy in [*call.fulls, *call.spent]:
                self._discard(copy)
        for copy in flight.copies or ():
            self._discard(copy)
        flight.calls, flight.copies = [], None
        self._starting.difference_update(rec.index for rec, _ in flight.members)

    def _keep(self, rec: ParamRecord, gathered: _Copy) -> None:
        if rec.index in self._gathered:  # gathered meanwhile (not by this flight): that one stays
            self._discard(gathered)
        else:
            self._gathered[rec.index] = gathered

    def release(self, rec: ParamRecord) -> None:
        """``rec``'s gathered buffer goes back to the budget once no view of it is left (compute issued
        so far may still read it: its memory waits for that compute, `finish` named it to `record_stream`)."""
        gathered = self._gathered.pop(rec.index, None)
        if gathered is not None:
            self._retired.append(gathered)
            self._sweep()

    def _sweep(self) -> None:
        """Free the retired buffers no view refers to any more."""
        if self._retired:
            kept = [copy for copy in self._retired
                    if copy.references is None or storage_references(copy.buffer) > copy.references]
            for copy in self._retired:
                if not any(copy is other for other in kept):
                    self._discard(copy)
            self._retired = kept

    def refresh_resident(self, members: Sequence[tuple[ParamRecord, torch.Tensor]]) -> list[torch.Tensor]:
        """Gather each member onto the device for good (until the next `refresh_resident` or `close`), from
        its host partition, after it changed (an update, a load) or first: across ranks in one all-gather
        (per dtype, and per run of ``ahead_elements`` partition elements, which bounds the flat buffers);
        each one's old buffer goes once no view of it is left. Their full flat tensors."""
        fulls, run, elements = [], [], 0
        for position, (rec, local) in enumerate(members):
            old = self._resident.pop(rec.index, None)
            if old is not None:
                self._retired.append(old)
            run.append((rec, local))
            elements += rec.partition_numel
            if elements >= self.ahead_elements or position == len(members) - 1:
                fulls += self.gather_many(run)
                for done, _ in run:
                    self._resident[done.index] = self._gathered.pop(done.index)
                run, elements = [], 0
        return fulls

    def close(self) -> None:
        """Give every device buffer back, resident ones included (sync point)."""
        self._retired.extend(self._resident.values())
        self._resident.clear()
        self.drop_all()

    def copy_ahead(self, store: HostPartitions, upcoming: list[int]) -> None:
        """Start copying the partitions of ``upcoming`` (record indices, next first) that are not on the
        device yet, up to ``ahead_elements``, where their host data is there without waiting."""
        ahead = self.waiting_ahead_elements
        for index in upcoming:
            if ahead >= self.ahead_elements:
                return
            if index in self._ahead or index in self._gathered or index in self._resident or index in self._starting:
                continue
            rec = store.records[index]
            local = store.host_partition(rec)
            if local is None:
                continue  # its read is in flight or not started: the gather copies it
            self._ahead[index] = self._copy(rec, local)
            self.copied_ahead += 1
            ahead += rec.partition_numel

    def host_released(self, rec: ParamRecord, host: torch.Tensor | None) -> None:
        """Before the host writes ``rec``'s host partition ``host`` in place (an update): wait for the
        copies that read it (sync point)."""
        for event in self._from_host.pop(rec.index, ()):
            event.synchronize()
        if host is not None:
            self.device.check_writable(host)

    def give_back_host(self, rec: ParamRecord, host: torch.Tensor, on_free: Callable[[], None]) -> None:
        """``rec``'s NVMe read buffer ``host`` is no longer needed: ``on_free()`` (its elements back to the
        budget) and the last reference to it (back to the pool) once the copies that read it are done,
        at once where they are; never waits (see `reap_host`)."""
        self._returning.append((self._from_host.pop(rec.index, []), host, on_free))
        self.reap_host()

    def reap_host(self) -> None:
        """Give back the host buffers whose copies' events are done (never waits)."""
        self._settle_host(wait=False)

    def _settle_host(self, *, wait: bool) -> None:
        """Give back the host buffers of `give_back_host` whose copies are done (``wait``: all, sync point)."""
        kept = []
        for entry in self._returning:
            events, host, on_free = entry
            if wait:
                for event in events:
                    event.synchronize()
            elif not all(event.query() for event in events):
                kept.append(entry)
                continue
            self.device.check_writable(host)  # the pool may refill it from here on
            on_free()
        self._returning = kept

    def drop_all(self) -> None:
        """End of a pass (or an error): every copy ahead and gathered buffer goes (sync point: the copies
        that read host partitions)."""
        for copy in [*self._ahead.values(), *self._gathered.values(), *self._retired]:
            self._discard(copy)
        self._ahead.clear()
        self._gathered.clear()
        self._retired.clear()
        for events in self._from_host.values():
            for event in events:
                event.synchronize()
        self._from_host.clear()
        self._settle_host(wait=True)

    # ---- internals -------------------------------------------------------------------------------

    def _copy(self, rec: ParamRecord, local: torch.Tensor) -> _Copy:
        """1. Copy ``rec``'s host partition into a new device buffer on the side stream, allocated for it: its
        memory was last used by that stream, or by streams named to `record_stream` that the allocator
        waits for, so the copy waits for no compute."""
        buffer = self.device.empty(rec.partition_numel, rec.partition.dtype, name=f"partition {rec.name}",
                                   stream=self.side)
        references = storage_references(buffer)  # before any view of it exists
        source = local[:rec.partition_numel]
        event = self.device.to_device(buffer, source, stream=self.side)
        self.bytes_to_device += buffer.numel() * buffer.element_size()
        self._from_host.setdefault(rec.index, []).append(event)
        return _Copy(buffer, event, source, references)

    def _discard(self, copy: _Copy) -> None:
        # No wait: the buffer was allocated for the stream that fills it, and the other streams that use it
        # were named to record_stream; its memory is reused only after their work.
        self.device.free(copy.buffer)
