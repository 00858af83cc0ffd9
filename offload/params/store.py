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
3. a training engine's step loads NVMe partitions for the optimizer (`start_loads`, `finish_loads`).

Reads of on-disk partitions, and the writes of updated ones, go through the store, so that every
buffer is counted in the swap budget.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from tensorio import IOFuture

from offload.params.prefetch import Prefetcher, SwapBudget
from offload.storage.swapfile import SwapFile


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
    swap: SwapFile | None
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
    """Set by `begin_backward` for a backward whose updates run as gradients arrive: an on-disk trainable
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
        self._prefetch()
        if rec.read is not None:
            rec.read.result()
        rec.read = None

    def return_buffer(self, rec: ParamRecord) -> None:
        """A buffer from `take_buffer` is no longer used: its elements leave the budget."""
        self.budget.held -= rec.partition_numel

    def start_read(self, rec: ParamRecord) -> None:
        """Start reading an on-disk partition into a fresh buffer (counted in the budget)."""
        if not rec.on_disk or rec.read is not None or rec.buffer is not None:
            raise RuntimeError(f"internal error: parameter {rec.name!r} cannot be read (on disk: {rec.on_disk}, "
                               f"read in flight: {rec.read is not None}, buffered: {rec.buffer is not None})")
        rec.buffer, rec.read = self.swap.read_new(rec.partition_numel, rec.partition.dtype, rec.offset)
        self.budget.held += rec.partition_numel

    def prefetch_from_start(self) -> None:
        """Start reading the first partitions of the recorded order (the next forward's), within the
        budget: after a step, when every partition's last write has landed."""
        self.prefetcher.cursor = 0
        self._prefetch()

    def _prefetch(self) -> None:
        """Start reads of upcoming on-disk records while they fit in the bucket and the budget."""
        ahead = 0
        for index in self.prefetcher.upcoming():
            rec = self.records[index]
            if rec.buffer is not None or rec.full is not None:  # in flight, gathered, or kept for its update
                ahead += rec.partition_numel if rec.read is not None else 0
                continue
            if not rec.on_disk:
                continue
            if ahead + rec.partition_numel > self.prefetcher.bucket_elements or not self.budget.fits(rec.partition_numel):
                return  # wait for room: the next gather tries again
            self.start_read(rec)
            self.prefetch_reads += 1
            ahead += rec.partition_numel

    def _drop_buffer(self, rec: ParamRecord) -> None:
        if rec.buffer is not None:
            if rec.read is not None:  # never free memory the kernel may still write to
                rec.read.exception()  # waits; a failed read was raised where it was needed
                rec.read = None
            rec.buffer = None
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

    # ---- the passes ----------------------------------------------------------------------------

    def begin_forward(self) -> None:
        """A forward pass starts: the recorded order is replayed from its start."""
        self.prefetcher.cursor = 0

    def begin_backward(self, *, keep_for_update: bool) -> None:
        """A backward pass starts; with ``keep_for_update`` the buffers of on-disk trainable partitions
        are kept when released, for updates that run during backward (see `take_buffer`)."""
        self.keep_for_update = keep_for_update

    def end_backward(self) -> None:
        """A backward pass ended (or failed): release everything (sync point); the first step's order is final."""
        self.release_all()
        self.prefetcher.end_step()

    # ---- partitions read or written outside the passes ----------------------------------------------

    def read_partition(self, rec: ParamRecord) -> torch.Tensor:
        """A copy of ``rec``'s partition (read from NVMe when it is there: sync point)."""
        if not rec.on_disk:
            return rec.partition.detach().clone()
        buffer, future = self.swap.read_new(rec.partition_numel, rec.partition.dtype, rec.offset)
        future.result()
        return buffer

    def write_partition(self, rec: ParamRecord, values: torch.Tensor) -> IOFuture:
        """Start writing ``values`` (``partition_numel`` elements, page-aligned, kept unchanged until the
        future is done) over ``rec``'s on-disk partition."""
        if not rec.on_disk:
            raise RuntimeError(f"internal error: parameter {rec.name!r} has no on-disk partition to write")
        return self.swap.write(values, rec.offset)

    def io_bytes(self) -> dict[str, int]:
        """Bytes read from and written to the parameter swap file so far."""
        swap = self.swap
        return {"read": swap.bytes_read if swap else 0, "written": swap.bytes_written if swap else 0}

    def close(self) -> None:
        """Remove the hooks and the swap file."""
        self.remove_hooks()
        if self.swap is not None:
            self.swap.close()

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
