"""The parameter store: records and the hooks that gather a module's parameters around its use.

One `ParamRecord` (offload/params/record.py) per distinct ``nn.Parameter`` (tied parameters share
one) holds everything about it: its rank's partition (the tensor the optimizer steps), where that partition lives (memory or
NVMe, and whether a read is in flight) and the gathered full tensor while in use. Nothing is glued onto the parameter: between uses its ``.data`` is an empty
placeholder and the record is the only place that knows where its values are.

Gathering happens at three points:
1. a module's forward pre-hook gathers the module's own parameters (across ranks in one all-gather, issued
   ahead: `gather_together`); its post-hook releases them (unless kept: persistent, or the partition is the whole parameter);
2. autograd's saved-tensor hooks replace a saved gathered parameter (or a view of it) by a token
   during forward, and gather it again when backward unpacks the token: so backward needs neither
   module backward hooks nor the forward's buffers to survive;
3. outside the passes, for a whole partition (`read_partition`, `write_back`).

Nothing here is training-specific: gradients, the buffers a step keeps for its updates and the step's
commit rule belong to `offload.train`, which plugs in through two small protocols (`PendingUpdates`,
`BufferKeeper`). Every buffer a read fills is counted in the swap budget.
"""

from __future__ import annotations

import functools
import itertools
import weakref
from dataclasses import dataclass, field

import torch
from torch import nn

from tensorio import IOFuture

from offload.device import CpuDevice, Device
from offload.params.coalesce import HostGather
from offload.params.device_gather import DeviceGathers
from offload.params.gather_ahead import GatherAhead
from offload.params.hooks import ForwardEntry, ForwardExit, PostForward, PreForward
from offload.params.partition import partition_bounds
from offload.params.prefetch import Prefetcher, SwapBudget
from offload.params.record import BufferKeeper, FaultSink, ParamRecord, PendingUpdates
from offload.storage.slotted import SlottedRegion
from offload.storage.swapfile import SwapFile


@dataclass(slots=True, eq=False)
class _Saved:
    """A token autograd keeps instead of a gathered parameter (or a view of it)."""

    rec: ParamRecord
    offset: int
    size: torch.Size
    stride: tuple[int, ...]


@dataclass(eq=False)
class ParamStore:
    """The records, the swap file, the budget and the prefetcher: gather and release."""

    records: list[ParamRecord]
    world_size: int
    rank: int
    swap: SwapFile | None
    budget: SwapBudget
    prefetcher: Prefetcher
    group: object = None
    demand_reads: int = 0
    """Reads started when a parameter was needed (not prefetched)."""
    prefetch_reads: int = 0
    """Reads started ahead of use by the prefetcher."""
    skipped_reads: int = 0
    """Of those, the ones not issued: the partition's pending update overwrites it whole (``updates``)."""
    reuse_distance: int = 0
    """stage3_max_reuse_distance: a parameter read from NVMe stays gathered after a module's forward
    when the recorded order uses it again within this many elements of reads (see `reused_soon`)."""
    keeper: BufferKeeper | None = None
    """Which read buffers stay in memory (in the budget) when their parameter is released (`BufferKeeper`):
    a training step's, for the updates that use them; None: none."""
    updates: PendingUpdates | None = None
    """A step whose updates run during the passes (`PendingUpdates`): `gather` first calls
    its ``values(rec)``, which waits for ``rec``'s update and returns the updated partition when the step
    holds it (None: gather as usual); prefetch skips partitions its ``holds(rec)``, and gives those its
    ``overwrites(rec)`` a buffer without reading it (the update writes every element). With it, every
    module using a trainable parameter gets the gather hooks, so that no forward uses a parameter before
    its update."""
    _live: dict[int, ParamRecord] = field(default_factory=dict)
    """Storage address of each gathered, releasable parameter -> its record (for the pack hook)."""
    shaped_placeholders: bool = False
    """Released parameters get a zero-stride placeholder of their full shape, one per record (while a
    model is built under `offload.zero.Init`, whose code reads shapes), rather than an empty one."""
    _placeholders: dict[object, torch.Tensor] = field(default_factory=dict)
    _shaped: dict[int, torch.Tensor] = field(default_factory=dict)
    _by_param: dict[int, ParamRecord] = field(default_factory=dict)
    forwards: list[nn.Module] = field(default_factory=list)
    """The modules whose forward is under way, innermost last (`ForwardEntry`, `ForwardExit`)."""
    _detected: dict[int, set[int]] = field(default_factory=dict)
    """Module id -> indices of the records found to be its external parameters (`ForwardExit`)."""
    _modules: dict[int, list[ParamRecord]] = field(default_factory=dict)
    """Record index -> the records of the first module whose hooks gather it: backward gathers them together (`unpack`)."""
    device: Device = field(default_factory=CpuDevice)
    """Where compute runs. With memory of its own (a GPU), gathers copy partitions onto it (``gathers``)."""
    collectives: Device | None = None
    """Where gathers of host partitions (no ``gathers``) run their collectives, by its backend: the
    compute device for `offload.zero.Init`'s build (NCCL takes GPU tensors only); None: ``device``."""
    gathers: DeviceGathers | None = None
    """The device side of gather and release where the device's memory is separate; None on the CPU."""
    resident: bool = False
    """On a device with its own memory: every parameter stays gathered there (``offload_param.device``
    "none"), as persistent ones (``keep_full``) always do, its host partition the optimizer's; `refresh`
    copies each update to the device."""
    _in_pass: bool = False
    """Between a forward's start and the release at the end of its backward (`begin_forward`, `release_all`)."""
    faults: FaultSink | None = None
    """Several ranks (set by the engine): a gather that fails inside a pass hands its error to
    ``faults.absorb`` and, where that takes it, gathers zeros in its place, so that this rank goes on taking
    part in the pass's collectives; the step is then given up on every rank (offload/train/step/agree.py)."""
    ahead: GatherAhead = field(default_factory=GatherAhead)
    """Several ranks: the order of the coalesced gathers, and the all-gather issued ahead of its module."""
    _hooks: list = field(default_factory=list)
    _serial: int = 0

    def __post_init__(self) -> None:
        if self.device.separate_memory and self.gathers is None:
            self.gathers = DeviceGathers(self.device, world_size=self.world_size, rank=self.rank, group=self.group,
                                         ahead_elements=self.prefetcher.bucket_elements)
            for rec in self.records:  # kept whole: on the device, for good
                if self.resident and rec.on_disk:
                    raise RuntimeError(f"internal error: parameter {rec.name!r} is on NVMe in a resident store")
                rec.keep_full = rec.keep_full or self.resident
            self._set_resident([rec for rec in self.records if rec.keep_full])
        self._by_param = {id(rec.param): rec for rec in self.records}
        self.region: SlottedRegion | None = (
            SlottedRegion(self.swap, [rec.slots for rec in self.records if rec.on_disk]) if self.swap is not None else None)
        """The on-disk partitions' slots (`offload.storage.slotted`): a training step commits or rolls them back."""
        self._serial = next(_SERIALS)
        _STORES.add(self)

    # ---- records ---------------------------------------------------------------------------------

    def add(self, rec: ParamRecord) -> None:
        """Append a record placed after the store was made (``rec.index`` must be its position)."""
        if rec.index != len(self.records):
            raise RuntimeError(f"internal error: record {rec.name!r} has index {rec.index}, expected {len(self.records)}")
        self.records.append(rec)
        self._by_param[id(rec.param)] = rec
        if rec.on_disk:
            self.region.adopt(rec.slots)

    def record_of(self, param: torch.Tensor) -> ParamRecord | None:
        """The record of ``param`` in this store, or None."""
        rec = self._by_param.get(id(param))
        return rec if rec is not None and rec.param is param else None

    # ---- gather / release ---------------------------------------------------------------------

    def gather(self, rec: ParamRecord) -> torch.Tensor:
        """Make ``rec.param`` the full tensor; return the flat full tensor."""
        self.gather_together([rec])
        return rec.full

    def gather_together(self, recs: list[ParamRecord]) -> None:
        """Make each ``rec.param`` of ``recs`` (a module's) the full tensor: across ranks, those not gathered
        yet in one all-gather (per dtype; `offload.params.coalesce`), in the order of ``recs``, taken from
        the one issued ahead where it is this group's (`offload.params.gather_ahead`); then issue the next."""
        recs = list(dict.fromkeys(recs))  # a module's own parameter may be registered as its external one too
        key = tuple(rec.index for rec in recs)
        if self._in_pass:
            self.ahead.order.observe(key)
        # 2. All-gather the partitions (at world size 1 the partition is the parameter); on a device
        #    with its own memory, copy them there first (`DeviceGathers`) and the next ones ahead.
        taken = self.ahead.take(key)  # sync point: the all-gather issued ahead, where it is this group's
        members = taken[0] if taken is not None else self._members(recs)
        if taken is not None:
            fulls = taken[1]
        elif self.gathers is not None:
            fulls = self.gathers.gather_many(members) if members else []
        elif self.world_size == 1 or not members:
            fulls = [local[:rec.numel] for rec, local in members]
        else:  # host memory, gathered where the collectives' backend needs it
            fulls = HostGather(members, collectives=self.collectives or self.device, world_size=self.world_size,
                               group=self.group).wait()
        for (rec, _), full in zip(members, fulls):
            if rec.full is not None:
                continue  # a member of an all-gather issued ahead, gathered meanwhile by another module
            if (self.world_size > 1 or rec.on_disk and self.gathers is not None) and not self._keeps(rec):
                self.drop_buffer(rec)  # on a device, once its copies are done
            rec.full = full
            rec.param.data = full.view(rec.shape)
            if not rec.keep_full:
                self._live[full.untyped_storage().data_ptr()] = rec
        if self._in_pass:  # outside the passes (a save, full_parameters) an update may come first
            self._gather_ahead()
            if self.gathers is not None:
                self.gathers.copy_ahead(self, self.prefetcher.upcoming())

    def _members(self, recs: list[ParamRecord]) -> list[tuple[ParamRecord, torch.Tensor]]:
        """(record, its partition to gather) for each of ``recs`` not gathered (`_local`)."""
        members = []
        for rec in recs:
            try:
                local = self._local(rec)
            except Exception as error:  # several ranks: this one goes on with zeros (`faults`), or raises
                if self.faults is None or not self.faults.absorb(error, f"gathering {rec.name!r}"):
                    raise
                local = None if rec.full is not None else torch.zeros(rec.partition_numel, dtype=rec.partition.dtype)
            if local is not None:
                members.append((rec, local))
        return members

    def _gather_ahead(self) -> None:
        """Several ranks, prefetch on: issue the all-gather of the group expected next, not waited for."""
        key = self.ahead.wanted() if self.world_size > 1 and self.prefetcher.bucket_elements > 0 else None
        if key is None or all(self.records[index].full is not None for index in key):
            return
        self.ahead.busy = True
        try:
            members = self._members([self.records[index] for index in key])
        finally:
            self.ahead.busy = False
        if not members:
            return
        if self.gathers is not None:
            flight = self.gathers.start(members)
            self.ahead.hold(key, members, functools.partial(self.gathers.finish, flight),
                            functools.partial(self.gathers.abandon, flight))
        else:
            flight = HostGather(members, collectives=self.collectives or self.device, world_size=self.world_size,
                                group=self.group, async_op=True)
            self.ahead.hold(key, members, flight.wait, flight.wait)

    def _local(self, rec: ParamRecord) -> torch.Tensor | None:
        """This rank's partition of ``rec`` for its gather (None: ``rec.full`` is kept gathered)."""
        # 0. A step whose update runs now (``updates``) first makes sure this partition's has run.
        held = self.updates.values(rec) if self.updates is not None else None
        if rec.full is not None:
            return None
        # 1. The partition's data: in memory, or read from NVMe (prefetched, on demand, or kept from
        #    an earlier gather in this backward), or the updated buffer the step holds.
        if held is not None:
            self.prefetcher.observe(rec.index)
            self._prefetch()
            return held
        if rec.on_disk:
            self.prefetcher.observe(rec.index)
            self.arrive(rec)
            return rec.buffer
        if self.gathers is not None:  # copies ahead follow every record, in memory too
            self.prefetcher.observe(rec.index)
        return rec.partition.data

    def reused_soon(self, rec: ParamRecord) -> bool:
        """Whether the gathered ``rec`` (read from NVMe into a budgeted buffer) is used again, in the
        recorded order, before ``reuse_distance`` elements of other on-disk partitions are gathered,
        and before those would fill the rest of the budget: then releasing it would only read it
        again (GPT-2's tied embedding is the last parameter of forward and the first of backward)."""
        if rec.buffer is None or self.prefetcher.recording or self.reuse_distance <= 0:
            return False
        room = min(self.reuse_distance, self.budget.buffer_elements - self.budget.held)
        between = 0
        for index in self.prefetcher.trace[self.prefetcher.cursor:]:
            if index == rec.index:
                return True
            other = self.records[index]
            if other.on_disk:
                between += other.partition_numel
                if between > room:
                    return False
        return False

    def release(self, rec: ParamRecord) -> None:
        """Drop the gathered tensor (unless kept); the param's data becomes an empty placeholder."""
        if rec.keep_full or rec.full is None:
            return
        self._live.pop(rec.full.untyped_storage().data_ptr(), None)
        rec.full = None
        rec.param.data = self.placeholder_of(rec)
        if self.gathers is not None:
            self.gathers.release(rec)
        if not self._keeps(rec):
            self.drop_buffer(rec)

    def before_host_write(self, rec: ParamRecord) -> None:
        """Before the host updates ``rec``'s partition in place (in memory, or the read buffer a step
        keeps): wait for the copies to the device that read it (sync point; nothing on the CPU)."""
        if self.gathers is not None:
            self.gathers.host_released(rec, rec.buffer if rec.on_disk else rec.partition.data)

    def host_partition(self, rec: ParamRecord) -> torch.Tensor | None:
        """``rec``'s partition in host memory when it is there without waiting and final (in memory, or
        its read done; with a step whose updates run during the passes, ``updates``, its update run,
        in the buffer the step holds); None while a read is in flight or not started, or an update pending."""
        if self.updates is not None:
            if not self.updates.settled(rec):
                return None
            if self.updates.holds(rec):
                return rec.partition.data  # the updated buffer the step holds
        if not rec.on_disk:
            return rec.partition.data
        if rec.buffer is None or (rec.read is not None and not rec.read.done()):
            return None
        return rec.buffer

    def _keeps(self, rec: ParamRecord) -> bool:
        return self.keeper is not None and self.keeper.keeps(rec)

    def arrive(self, rec: ParamRecord) -> None:
        """Make an on-disk partition's values be in ``rec.buffer``: read on demand unless prefetched or
        kept, prefetch what comes next, and wait for the read (sync point)."""
        if rec.buffer is None:
            self.start_read(rec)
            self.demand_reads += 1
        self._prefetch()
        if rec.read is not None:
            try:
                rec.read.result()
            except BaseException:
                self.drop_buffer(rec)  # a failed read is not kept: the next gather reads again
                raise
        rec.read = None

    def start_read(self, rec: ParamRecord) -> None:
        """Start reading an on-disk partition into a fresh buffer (counted in the budget); a partition the
        pending update overwrites whole (``updates.overwrites``) gets the buffer unread."""
        if not rec.on_disk or rec.read is not None or rec.buffer is not None:
            raise RuntimeError(f"internal error: parameter {rec.name!r} cannot be read (on disk: {rec.on_disk}, "
                               f"read in flight: {rec.read is not None}, buffered: {rec.buffer is not None})")
        if self.updates is not None and self.updates.overwrites(rec):
            rec.buffer = self.swap.buffer(rec.partition_numel, rec.partition.dtype)
            self.skipped_reads += 1
        else:
            rec.buffer, rec.read = self.region.read_new(rec.slots, rec.partition_numel, rec.partition.dtype,
                                                        what=self.describe(rec))
        self.budget.held += rec.partition_numel

    def prefetch_from_start(self) -> None:
        """Start reading the first partitions of the recorded order (the next forward's), within the
        budget: after a step, when every partition's last write has landed."""
        self.prefetcher.cursor = 0
        self._prefetch()

    def _prefetch(self) -> None:
        """Start reads of upcoming on-disk records while fewer than the bucket's elements are read ahead
        (as DeepSpeed's coordinator: the read that crosses it starts too, so a bucket smaller than one
        partition still reads the next one ahead) and while they fit in the budget."""
        if self.gathers is not None:
            self.gathers.reap_host()  # read buffers whose copies to the device are done count no more
        ahead = 0
        for index in self.prefetcher.upcoming():
            rec = self.records[index]
            if rec.buffer is not None or rec.full is not None or (self.updates is not None and self.updates.holds(rec)):
                # in flight, gathered, kept for its update, or held by the step updating it
                ahead += rec.partition_numel if rec.read is not None else 0
                continue
            if not rec.on_disk:
                continue
            if ahead >= self.prefetcher.bucket_elements or not self.budget.fits(rec.partition_numel):
                return  # wait for room: the next gather tries again
            self.start_read(rec)
            self.prefetch_reads += 1
            ahead += rec.partition_numel

    def drop_buffer(self, rec: ParamRecord) -> None:
        """Let go of ``rec``'s read buffer (after its read, if one is in flight): its elements leave the budget
        (on a device with its own memory, once the copies that read it are done, without waiting for them)."""
        if rec.buffer is not None:
            if rec.read is not None:  # never free memory the kernel may still write to
                rec.read.exception()  # waits; a failed read was raised where it was needed
                rec.read = None
            buffer, rec.buffer = rec.buffer, None
            if self.gathers is None:
                self.budget.held -= rec.partition_numel
            else:  # nor memory a copy to the device still reads: given back once its copies are done
                self.gathers.give_back_host(rec, buffer, functools.partial(self._unbudget, rec.partition_numel))

    def _unbudget(self, numel: int) -> None:
        self.budget.held -= numel

    def placeholder(self, dtype: torch.dtype) -> torch.Tensor:
        """The empty tensor that stands in for released parameters and on-disk partitions of ``dtype``."""
        if dtype not in self._placeholders:
            self._placeholders[dtype] = torch.empty(0, dtype=dtype)
        return self._placeholders[dtype]

    def placeholder_of(self, rec: ParamRecord) -> torch.Tensor:
        """What ``rec.param.data`` is while released (see ``shaped_placeholders``): an empty tensor on the
        compute device, so that the parameter's device type never changes between its gathers and
        releases. Autograd replaces a parameter's AccumulateGrad node when ``.data`` changes device type
        or dtype; a tied parameter released and gathered again between its two uses in a forward would
        then get two nodes, and two gradients in one backward."""
        if not self.shaped_placeholders:
            if not self.device.separate_memory:
                return self.placeholder(rec.param.dtype)
            key = (rec.param.dtype, "device")
            if key not in self._placeholders:
                self._placeholders[key] = torch.empty(0, dtype=rec.param.dtype, device=self.device.torch_device)
            return self._placeholders[key]
        if rec.index not in self._shaped:  # one element of memory, its own storage
            self._shaped[rec.index] = torch.zeros((), dtype=rec.param.dtype).expand(rec.shape)
        return self._shaped[rec.index]

    def release_all(self, *, end_of_backward: bool = False) -> None:
        """End of a backward or step (or before a load): release everything and drop unused prefetches;
        the `keeper` says which buffers stay after its `BufferKeeper.reset`."""
        self.ahead.abandon()  # before the buffers its all-gather reads go
        if self.keeper is not None:
            self.keeper.reset(end_of_backward=end_of_backward)
        for rec in self.records:
            rec.users = rec.saved = 0
            self.release(rec)
            if not self._keeps(rec):
                self.drop_buffer(rec)
        if self.gathers is not None:
            self.gathers.drop_all()
        self._in_pass = False

    # ---- the passes ----------------------------------------------------------------------------

    def begin_forward(self) -> None:
        """A forward pass starts: the recorded order is replayed from its start."""
        self.ahead.abandon()  # one issued for a backward that did not come (an evaluation forward)
        self.prefetcher.cursor = self.ahead.order.cursor = 0
        self._in_pass = True

    def end_backward(self) -> None:
        """A backward pass ended (or failed): release everything but what the `keeper` keeps past it (sync
        point); the first step's order is final."""
        self.release_all(end_of_backward=True)
        self.prefetcher.end_step()
        self.ahead.order.end_step()

    # ---- partitions read or written outside the passes ----------------------------------------------

    def read_partition(self, rec: ParamRecord) -> torch.Tensor:
        """A copy of ``rec``'s partition (read from NVMe when it is there: sync point)."""
        if not rec.on_disk:
            return rec.partition.detach().clone()
        buffer, future = self.start_read_partition(rec)
        future.result()
        return buffer

    def start_read_partition(self, rec: ParamRecord) -> tuple[torch.Tensor, IOFuture]:
        """Start reading ``rec``'s on-disk partition (its newest slot, verified) into a new page-aligned
        buffer; (the buffer, the read: ``result()`` waits)."""
        return self.region.read_new(rec.slots, rec.partition_numel, rec.partition.dtype, what=self.describe(rec))

    def describe(self, rec: ParamRecord) -> str:
        """How errors name ``rec``'s partition on disk."""
        return f"parameter {rec.name!r}, partition of rank {self.rank}"

    def write_partition(self, rec: ParamRecord, values: torch.Tensor) -> IOFuture:
        """Start writing ``values`` (``partition_numel`` elements, page-aligned, kept unchanged until the
        future is done) over ``rec``'s on-disk partition, in place (its newest slot): for writes outside a
        step, such as loading weights. A step's update goes to the other slot instead (`SlottedRegion.stage`)."""
        if not rec.on_disk:
            raise RuntimeError(f"internal error: parameter {rec.name!r} has no on-disk partition to write")
        return self.region.write_in_place(rec.slots, values)

    def write_back(self, rec: ParamRecord) -> None:
        """The gathered full tensor of ``rec`` was changed in place: put this rank's slice into its partition,
        in memory or on NVMe (sync point: waits for the write). Raises TensorIOError."""
        if rec.full is None:
            raise RuntimeError(f"internal error: parameter {rec.name!r} is not gathered")
        if rec.keep_full and self.world_size == 1 and self.gathers is None:
            return  # the partition is the parameter itself
        start, end = partition_bounds(rec.numel, self.world_size, self.rank)
        values = rec.full[start:min(end, rec.numel)]
        if not rec.on_disk:
            rec.partition.data[:values.numel()].copy_(values)
            return
        if self.world_size == 1 and rec.buffer is not None and rec.full.data_ptr() == rec.buffer.data_ptr():
            staged = rec.buffer  # the buffer the gather read: page-aligned, the whole partition
        else:
            staged = self.swap.buffer(rec.partition_numel, rec.partition.dtype)
            staged.zero_()
            staged[:values.numel()].copy_(values)
        self.write_partition(rec, staged).result()

    def _set_resident(self, recs: list[ParamRecord]) -> None:
        if recs:
            for rec, full in zip(recs, self.gathers.refresh_resident([(rec, rec.partition.data) for rec in recs])):
                rec.full = full
                rec.param.data = full.view(rec.shape)

    def kept_elsewhere(self, rec: ParamRecord) -> bool:
        """Whether ``rec`` is kept gathered in memory apart from its partition (gathered across ranks, or
        on a device with its own memory): an update of the partition then needs a `refresh`."""
        return rec.keep_full and (self.world_size > 1 or self.gathers is not None)

    def refresh(self, rec: ParamRecord) -> None:
        """After ``rec``'s partition changed: regather a kept parameter whose partition is not a view of it
        (on a device with its own memory, every kept one: its gathered copy lives there)."""
        self.refresh_many([rec])

    def refresh_many(self, recs: list[ParamRecord]) -> None:
        """`refresh` for each of ``recs``; across ranks in host memory, one all-gather (per dtype) for them all."""
        if self.gathers is not None:
            self._set_resident([rec for rec in recs if rec.keep_full])
            return
        regather = [rec for rec in recs if rec.keep_full and self.world_size > 1]
        for rec in regather:
            rec.full = None
        if regather:
            self.gather_together(regather)

    def io_bytes(self) -> dict[str, int]:
        """Bytes read from and written to the parameter swap file so far."""
        return SwapFile.io_bytes_of(self.swap)

    def close(self) -> None:
        """Remove the hooks and the swap file; give the device buffers back."""
        self.remove_hooks()
        if self.gathers is not None:
            self.gathers.close()
        if self.swap is not None:
            self.swap.close()

    # ---- hooks ---------------------------------------------------------------------------------

    def install(self, model: nn.Module) -> None:
        """Register the forward pre/post hooks on every module that owns parameters, or uses parameters
        of another module (`register_external`), and on every module the hooks that keep the stack of
        forwards under way, which detect a parameter a module's forward returns (see `ForwardExit`)."""
        by_param = {id(rec.param): rec for rec in self.records}
        for module in model.modules():
            # First, so that a returned parameter is detected before its owner's hook releases it.
            self._hooks.append(module.register_forward_pre_hook(ForwardEntry(self)))
            self._hooks.append(module.register_forward_hook(ForwardExit(self), always_call=True))
            recs = [by_param[id(p)] for p in module.parameters(recurse=False) if id(p) in by_param]
            recs += [by_param[id(p)] for p in EXTERNAL.get(module, ()) if id(p) in by_param]
            self._hook(module, recs)

    def register_external(self, module: nn.Module, rec: ParamRecord) -> None:
        """Gather ``rec`` around ``module``'s forward too (a parameter it uses but does not own); takes
        effect at once when the hooks are installed already."""
        if self._hooks:
            self._hook(module, [rec])

    def _hook(self, module: nn.Module, recs: list[ParamRecord]) -> None:
        for rec in recs:
            self._modules.setdefault(rec.index, recs)
        if any(not rec.keep_full or (self.updates is not None and rec.param.requires_grad) for rec in recs):
            self._hooks.append(module.register_forward_pre_hook(PreForward(self, recs)))
            self._hooks.append(module.register_forward_hook(PostForward(self, recs), always_call=True))

    def pack(self, tensor: torch.Tensor) -> object:
        """Saved-tensor pack hook: a gathered parameter (or a view of it) becomes a token."""
        if tensor.numel() == 0:
            return tensor
        rec = self._live.get(tensor.untyped_storage().data_ptr())
        if rec is None:
            return tensor
        rec.saved += 1
        return _Saved(rec, tensor.storage_offset() - rec.full.storage_offset(), tensor.size(), tensor.stride())

    def unpack(self, saved: object) -> torch.Tensor:
        """Saved-tensor unpack hook: gather the parameter again and rebuild the saved view."""
        if not isinstance(saved, _Saved):
            return saved
        rec = saved.rec
        # With it, its module's other parameters that backward will unpack and that are released (one all-gather).
        self.gather_together([other for other in self._modules.get(rec.index, [rec])
                              if other is rec or (other.saved > 0 and other.full is None)])
        full = rec.full
        view = full.as_strided(saved.size, saved.stride, full.storage_offset() + saved.offset)
        rec.saved = max(0, rec.saved - 1)
        if rec.saved == 0 and rec.users == 0:
            self.release(rec)  # the view keeps the memory alive while the backward node runs
        return view

    def saved_tensor_hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        """The pack/unpack hooks as a context manager, for the forward and backward passes."""
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    def remove_hooks(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        self.forwards.clear()
        self._detected.clear()
        self._modules.clear()


EXTERNAL: "weakref.WeakKeyDictionary[nn.Module, list[nn.Parameter]]" = weakref.WeakKeyDictionary()
"""Module -> parameters its forward uses beyond its own (`offload.zero.register_external_parameter`)."""

_SERIALS = itertools.count()
_STORES: "weakref.WeakSet[ParamStore]" = weakref.WeakSet()
"""Every live store: `find_record` looks a parameter up in them."""


def find_record(param: torch.Tensor) -> tuple[ParamStore, ParamRecord] | None:
    """The store and record of a partitioned parameter (built under `offload.zero.Init` or handed to
    an engine), or None for a parameter no store holds. The newest store wins (an engine over Init's)."""
    found = None
    for store in list(_STORES):
        rec = store.record_of(param)
        if rec is not None and (found is None or store._serial > found[0]._serial):
            found = (store, rec)
    return found
