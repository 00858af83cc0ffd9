"""Parameter records and the hooks that gather a module's parameters around its use.

One `ParamRecord` per distinct ``nn.Parameter`` (tied parameters share one) holds everything about
it: its rank's partition (the tensor the optimizer steps), where that partition lives (memory or
NVMe, and whether a read is in flight), the gathered full tensor while in use, and its accumulated
gradient partition. Nothing is glued onto the parameter: between uses its ``.data`` is an empty
placeholder and the record is the only place that knows where its values are.

Gathering happens at three points:
1. a module's forward pre-hook gathers the module's own parameters; its forward post-hook releases
   them (unless kept: persistent, or the partition is the whole parameter);
2. autograd's saved-tensor hooks replace a saved gathered parameter (or a view of it) by a token
   during forward, and gather it again when backward unpacks the token: so backward needs neither
   module backward hooks nor the forward's buffers to survive;
3. the engine's step loads NVMe partitions for the optimizer (see engine.py).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from tensorio import IOFuture, aligned_tensor

from ._param_swap import ParamSwapFile, Prefetcher, SwapBudget, start_prefetch
from .partition import partition_bounds, partition_numel


class Where(enum.Enum):
    """Where a record's partition is."""

    RESIDENT = "resident"
    """In host (or accelerator) memory: ``partition`` holds it."""
    ON_DISK = "on disk"
    """In the parameter swap file at ``offset``."""
    IN_FLIGHT = "in flight"
    """On disk, with a read into ``buffer`` in flight."""


@dataclass(slots=True, eq=False)
class ParamRecord:
    """Everything about one (possibly tied) parameter."""

    index: int
    names: list[str]
    param: nn.Parameter
    shape: torch.Size
    numel: int
    partition: nn.Parameter
    """This rank's flat partition, ``partition_numel`` elements; an empty placeholder while on disk."""
    partition_numel: int
    where: Where
    keep_full: bool
    """Never released: persistent (small) parameters, and at world size 1 those in memory (the
    partition is then a view of the parameter itself)."""
    offset: int = -1
    """Byte offset of the partition in the parameter swap file (NVMe records only)."""
    buffer: torch.Tensor | None = None
    """The page-aligned buffer a read fills, counted in the swap budget until dropped."""
    read: IOFuture | None = None
    full: torch.Tensor | None = None
    """The gathered flat parameter (``numel`` elements) while in use."""
    users: int = 0
    """Modules whose forward is using the gathered parameter now."""
    saved: int = 0
    """Tokens saved for backward and not yet unpacked."""
    grad: torch.Tensor | None = None
    """Accumulated gradient partition (float32, ``partition_numel`` elements) when kept in memory."""
    grad_offset: int = -1
    """Byte offset of the gradient partition in the gradient swap file (gradients offloaded to NVMe)."""
    grad_on_disk: bool = False
    """The gradient swap file holds this step's accumulated gradient partition."""
    grad_norm: torch.Tensor | None = None
    """L2 norm of the offloaded accumulated gradient (float32, inf/nan if any element is): for clipping
    and the fp16 overflow check."""
    accumulator: object = None
    """The parameter's AccumulateGrad node, held so that its hooks stay registered."""

    @property
    def name(self) -> str:
        return self.names[0]

    @property
    def on_disk(self) -> bool:
        return self.offset >= 0


@dataclass(slots=True, eq=False)
class _Saved:
    """A token autograd keeps instead of a gathered parameter (or a view of it)."""

    rec: ParamRecord
    offset: int
    size: torch.Size
    stride: tuple[int, ...]


@dataclass(slots=True, eq=False)
class ParamStore:
    """The records, the swap file, the budget and the prefetcher: gather and release."""

    records: list[ParamRecord]
    world_size: int
    rank: int
    swap: ParamSwapFile | None
    budget: SwapBudget
    prefetcher: Prefetcher
    group: object = None
    demand_reads: int = 0
    """Reads started when a parameter was needed (not prefetched)."""
    prefetch_reads: int = 0
    """Reads started ahead of use by the prefetcher."""
    reuse_distance: int = 0
    """stage3_max_reuse_distance: a parameter read from NVMe stays gathered after a module's forward
    when the recorded order uses it again within this many elements of reads (see `reused_soon`)."""
    keep_for_update: bool = False
    """Set by the engine during a backward whose updates run as gradients arrive: an on-disk trainable
    partition's buffer is kept when its parameter is released, for the update to use (see `take_buffer`)."""
    _live: dict[int, ParamRecord] = field(default_factory=dict)
    """Storage address of each gathered, releasable parameter -> its record (for the pack hook)."""
    _placeholders: dict[torch.dtype, torch.Tensor] = field(default_factory=dict)
    _hooks: list = field(default_factory=list)

    # ---- gather / release ---------------------------------------------------------------------

    def gather(self, rec: ParamRecord) -> torch.Tensor:
        """Make ``rec.param`` the full tensor; return the flat full tensor."""
        if rec.full is not None:
            return rec.full
        # 1. The partition's data: in memory, or read from NVMe (prefetched, on demand, or kept from
        #    an earlier gather in this backward).
        if rec.on_disk:
            self.prefetcher.observe(rec.index)
            self._arrive(rec)
            local = rec.buffer
        else:
            local = rec.partition.data
        # 2. All-gather the partitions (at world size 1 the partition is the parameter).
        if self.world_size == 1:
            full = local[:rec.numel]
        else:
            full = torch.empty(rec.partition_numel * self.world_size, dtype=local.dtype)
            chunks = list(full.chunk(self.world_size))
            dist.all_gather(chunks, local.contiguous(), group=self.group)
            full = full[:rec.numel]
            if not self._keeps(rec):
                self._drop_buffer(rec)
        rec.full = full
        rec.param.data = full.view(rec.shape)
        if not rec.keep_full:
            self._live[full.untyped_storage().data_ptr()] = rec
        return full

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
        rec.param.data = self.placeholder(rec.param.dtype)
        if not self._keeps(rec):
            self._drop_buffer(rec)

    def _keeps(self, rec: ParamRecord) -> bool:
        return self.keep_for_update and rec.on_disk and rec.param.requires_grad

    def take_buffer(self, rec: ParamRecord) -> torch.Tensor:
        """The page-aligned buffer holding an on-disk partition's values, for its update: the one kept
        from this backward's gather, else one read now (sync point). The caller owns it from here and
        gives its elements back to the budget with `return_buffer`."""
        if rec.full is not None:
            self.release(rec)  # the gradient is final: no backward node reads the parameter any more
        if rec.buffer is None or rec.read is not None:
            # Not gathered in this backward (a bias, an embedding): part of the recorded order, so
            # that from the next step on it is read ahead like any gather.
            self.prefetcher.observe(rec.index)
            self._arrive(rec)
        buffer, rec.buffer = rec.buffer, None
        return buffer

    def _arrive(self, rec: ParamRecord) -> None:
        """Make an on-disk partition's values be in ``rec.buffer``: read on demand unless prefetched or
        kept, prefetch what comes next, and wait for the read (sync point)."""
        if rec.buffer is None:
            self.start_read(rec)
            self.demand_reads += 1
        start_prefetch(self.prefetcher, self.budget, self.records, self._prefetch_read)
        if rec.read is not None:
            rec.read.result()
        rec.read, rec.where = None, Where.ON_DISK

    def return_buffer(self, rec: ParamRecord) -> None:
        """A buffer from `take_buffer` is no longer used: its elements leave the budget."""
        self.budget.held -= rec.partition_numel

    def start_read(self, rec: ParamRecord) -> None:
        """Start reading an on-disk partition into a fresh buffer (counted in the budget)."""
        assert rec.on_disk and rec.read is None and rec.buffer is None, rec.name
        rec.buffer, rec.read = self.swap.read(rec.partition_numel, rec.partition.dtype, rec.offset)
        rec.where = Where.IN_FLIGHT
        self.budget.held += rec.partition_numel

    def prefetch_from_start(self) -> None:
        """Start reading the first partitions of the recorded order (the next forward's), within the
        budget: after a step, when every partition's last write has landed."""
        self.prefetcher.cursor = 0
        start_prefetch(self.prefetcher, self.budget, self.records, self._prefetch_read)

    def _prefetch_read(self, rec: ParamRecord) -> None:
        self.start_read(rec)
        self.prefetch_reads += 1

    def _drop_buffer(self, rec: ParamRecord) -> None:
        if rec.buffer is not None:
            if rec.read is not None:  # never free memory the kernel may still write to
                rec.read.exception()  # waits; a failed read was raised where it was needed
                rec.read = None
            rec.buffer = None
            rec.where = Where.ON_DISK
            self.budget.held -= rec.partition_numel

    def placeholder(self, dtype: torch.dtype) -> torch.Tensor:
        if dtype not in self._placeholders:
            self._placeholders[dtype] = torch.empty(0, dtype=dtype)
        return self._placeholders[dtype]

    def release_all(self) -> None:
        """End of a backward or step: release everything not kept and drop unused prefetches."""
        self.keep_for_update = False
        for rec in self.records:
            rec.users = rec.saved = 0
            self.release(rec)
            self._drop_buffer(rec)

    # ---- the optimizer's view of NVMe partitions ------------------------------------------------

    def start_loads(self, recs: list[ParamRecord]) -> None:
        """Start reading the on-disk partitions of ``recs`` for the optimizer step (counted in the budget)."""
        for rec in recs:
            if rec.on_disk and rec.read is None and rec.buffer is None:
                self.start_read(rec)

    def finish_loads(self, recs: list[ParamRecord]) -> None:
        """Wait for ``start_loads``'s reads (sync point); the partitions then hold their values."""
        for rec in recs:
            if rec.on_disk:
                if rec.read is not None:
                    rec.read.result()
                    rec.read = None
                rec.partition.data = rec.buffer

    def start_stores(self, recs: list[ParamRecord]) -> list:
        """Start writing the updated on-disk partitions of ``recs``; return the futures."""
        return [self.swap.write(rec.partition.data, rec.offset) for rec in recs if rec.on_disk]

    def finish_stores(self, recs: list[ParamRecord], writes: list) -> None:
        """Wait for ``start_stores``'s writes (sync point: a partition is dropped only once on disk)."""
        for future in writes:
            future.result()
        for rec in recs:
            if rec.on_disk:
                rec.partition.data = self.placeholder(rec.partition.dtype)
                self._drop_buffer(rec)

    def refresh(self, rec: ParamRecord) -> None:
        """After an update: regather a kept parameter whose partition is not a view of it."""
        if rec.keep_full and self.world_size > 1:
            rec.full = None
            self.gather(rec)

    # ---- hooks ---------------------------------------------------------------------------------

    def install(self, model: nn.Module) -> None:
        """Register the forward pre/post hooks on every module that owns parameters."""
        by_param = {id(rec.param): rec for rec in self.records}
        for module in model.modules():
            recs = [by_param[id(p)] for p in module.parameters(recurse=False) if id(p) in by_param]
            if any(not rec.keep_full for rec in recs):
                self._hooks.append(module.register_forward_pre_hook(_PreForward(self, recs)))
                self._hooks.append(module.register_forward_hook(_PostForward(self, recs), always_call=True))

    def pack(self, tensor: torch.Tensor) -> object:
        """Saved-tensor pack hook: a gathered parameter (or a view of it) becomes a token."""
        if tensor.device.type != "cpu" or tensor.numel() == 0:
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
        full = self.gather(rec)
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


class _PreForward:
    def __init__(self, store: ParamStore, recs: list[ParamRecord]) -> None:
        self.store, self.recs = store, recs

    def __call__(self, module: nn.Module, args: object) -> None:
        for rec in self.recs:
            rec.users += 1
            self.store.gather(rec)


class _PostForward:
    def __init__(self, store: ParamStore, recs: list[ParamRecord]) -> None:
        self.store, self.recs = store, recs

    def __call__(self, module: nn.Module, args: object, output: object) -> None:
        for rec in self.recs:
            rec.users = max(0, rec.users - 1)
            if rec.users == 0 and not self.store.reused_soon(rec):
                self.store.release(rec)  # saved tokens gather it again in backward


def build_records(model: nn.Module, *, world_size: int, rank: int, nvme: bool, max_in_cpu: int,
                  persistence_threshold: int, swap: ParamSwapFile | None) -> list[ParamRecord]:
    """Partition every distinct parameter of ``model`` and place this rank's partitions.

    With ``nvme``, partitions go to the swap file in order once ``max_in_cpu`` elements are kept in
    memory; parameters of at most ``persistence_threshold`` elements stay whole in memory.
    Raises ValueError for a parameter that is not a floating-point CPU tensor.
    """
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    records: list[ParamRecord] = []
    in_cpu = 0
    writes = []
    for name, p in model.named_parameters():
        if not p.is_floating_point() or p.device.type != "cpu":
            raise ValueError(f"parameter {name!r} is {p.dtype} on {p.device}; the engine partitions floating-point "
                             f"CPU parameters: build the model on the CPU (model.to('cpu'))")
        numel = p.numel()
        part = partition_numel(numel, world_size)
        start, end = partition_bounds(numel, world_size, rank)
        persistent = numel <= persistence_threshold
        to_disk = nvme and not persistent and in_cpu + part > max_in_cpu
        keep_full = persistent or (world_size == 1 and not to_disk)
        flat = p.data.reshape(-1)
        if world_size == 1 and not to_disk:
            local = flat  # the partition is the parameter itself
        else:  # page-aligned when bound for the disk: O_DIRECT from it, no staging copy
            local = aligned_tensor(part, p.dtype) if to_disk else torch.zeros(part, dtype=p.dtype)
            local[:max(0, min(end, numel) - start)] = flat[start:min(end, numel)]
        if not to_disk:
            in_cpu += part if nvme and not persistent else 0
        rec = ParamRecord(index=len(records), names=names[id(p)], param=p, shape=p.shape, numel=numel,
                          partition=nn.Parameter(local, requires_grad=p.requires_grad), partition_numel=part,
                          where=Where.RESIDENT, keep_full=keep_full)
        if p.requires_grad:  # created while the parameter has its full shape: autograd checks it
            with torch.enable_grad():
                rec.accumulator = p.view_as(p).grad_fn.next_functions[0][0]
        if to_disk:
            rec.offset = swap.allocate(local.nbytes)
            writes.append((swap.write(local, rec.offset), local))
            rec.partition.data = torch.empty(0, dtype=p.dtype)
            rec.where = Where.ON_DISK
        if keep_full:
            rec.full = flat
        else:
            p.data = torch.empty(0, dtype=p.dtype)
        records.append(rec)
        if len(writes) >= 8:  # sync point: bound the memory of initial writes in flight
            for future, _ in writes:
                future.result()
            writes = []
    for future, _ in writes:
        future.result()
    return records
