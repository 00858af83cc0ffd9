"""Placement: partition parameters and put this rank's partitions in memory or on NVMe.

`Placement` decides and places one parameter at a time (so that `offload.zero.Init` can place each
module's parameters as soon as the module is built); `build_records` places a whole model.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

from tensorio import aligned_tensor

from offload.params.partition import partition_bounds, partition_numel
from offload.params.record import ParamRecord
from offload.storage.slotted import allocate_pair
from offload.storage.swapfile import SwapFile
from offload.storage.write_queue import WriteQueue

_WRITES_IN_FLIGHT = 8
"""Initial writes in flight at most: bounds the memory of partitions on their way to the disk."""


@dataclass(slots=True)
class Placement:
    """Where each partition goes: with ``swap``, partitions go to the swap file in order once
    ``max_in_cpu`` elements are kept in memory; parameters of at most ``persistence_threshold``
    elements stay whole in memory."""

    world_size: int
    rank: int
    swap: SwapFile | None
    max_in_cpu: int = 0
    persistence_threshold: int = 0
    accumulators: bool = True
    """Attach each parameter's AccumulateGrad node (see `attach_accumulator`); False under
    `offload.zero.Init`, which may place from inside a dispatch mode, below autograd: `initialize`
    attaches them then."""
    pinned: Callable[[int, torch.dtype], torch.Tensor] | None = None
    """For compute on a device with its own memory (`offload.device.Device.pinned_empty`): in-memory
    partitions go into page-locked buffers it makes, which the gathers copy to the device from, and only
    persistent parameters are kept whole (the store keeps them gathered on the device; the others are
    gathered there around each use). None: the CPU."""
    in_cpu: int = 0
    """Elements of non-persistent partitions kept in memory so far."""
    _writes: WriteQueue = field(default_factory=WriteQueue)

    def place(self, p: nn.Parameter, names: list[str], index: int) -> ParamRecord:
        """Partition ``p``, keep this rank's partition in memory or start writing it to the swap file;
        ``p.data`` becomes an empty placeholder unless the partition is kept whole. Waits for earlier
        writes when too many are in flight (`finish` waits for the rest).

        Raises ValueError (naming the parameter) for one that is not a floating-point CPU tensor,
        TensorIOError for a failed write.
        """
        name = names[0]
        if not p.is_floating_point() or p.device.type != "cpu":
            raise ValueError(f"parameter {name!r} is {p.dtype} on {p.device}; the engine partitions floating-point "
                             f"CPU parameters: build the model on the CPU (model.to('cpu'))")
        world_size, rank = self.world_size, self.rank
        numel = p.numel()
        part = partition_numel(numel, world_size)
        start, end = partition_bounds(numel, world_size, rank)
        persistent = numel <= self.persistence_threshold
        to_disk = self.swap is not None and not persistent and self.in_cpu + part > self.max_in_cpu
        # With a device of its own memory only persistent parameters stay whole (gathered there by the store).
        keep_full = persistent or (world_size == 1 and not to_disk and self.pinned is None)
        flat = p.data.reshape(-1)
        if world_size == 1 and not to_disk and self.pinned is None:
            local = flat  # the partition is the parameter itself
        else:  # page-aligned when bound for the disk: O_DIRECT from it, no staging copy
            local = (aligned_tensor(part, p.dtype) if to_disk else
                     self.pinned(part, p.dtype) if self.pinned is not None else torch.zeros(part, dtype=p.dtype))
            local[max(0, min(end, numel) - start):].zero_()
            local[:max(0, min(end, numel) - start)] = flat[start:min(end, numel)]
        if not to_disk and self.swap is not None and not persistent:
            self.in_cpu += part
        rec = ParamRecord(index=index, names=list(names), param=p, shape=p.shape, numel=numel,
                          partition=nn.Parameter(local, requires_grad=p.requires_grad), partition_numel=part,
                          keep_full=keep_full)
        if self.accumulators:
            attach_accumulator(rec)
        if to_disk:
            rec.slots = allocate_pair(self.swap, local.nbytes)  # a step's commit rule: `offload.storage.slotted`
            rec.slots.filled = True
            self._writes.push(self.swap.write(local, rec.slots.newest_offset), local)
            rec.partition.data = torch.empty(0, dtype=p.dtype)
        if keep_full:
            rec.full = flat
        else:
            p.data = torch.empty(0, dtype=p.dtype)
        if len(self._writes) >= _WRITES_IN_FLIGHT:
            self.finish()
        return rec

    def finish(self) -> None:
        """Wait for every write `place` started (sync point). Raises the first failure's TensorIOError."""
        self._writes.drain()  # waits for all before raising: never leaves a write behind


def pin_partition(rec: ParamRecord, pinned: Callable[[int, torch.dtype], torch.Tensor], *, persistent: bool) -> None:
    """Move ``rec``'s in-memory partition (placed for the CPU, as `offload.zero.Init` does) into a page-locked
    buffer made by ``pinned``, as `Placement.place` does for a device with its own memory: only a
    ``persistent`` parameter stays whole (the store keeps it gathered on the device); another one's
    ``param.data`` becomes an empty placeholder. The old host memory goes before this returns (where
    nothing else refers to it), so moving a model's records one by one holds one extra partition at most.
    An on-disk record is left as it is (NVMe reads fill page-locked pool buffers)."""
    if rec.on_disk:
        return
    local = pinned(rec.partition_numel, rec.partition.dtype)
    local.copy_(rec.partition.data)
    rec.partition.data = local
    rec.keep_full = persistent
    if not persistent:
        rec.full = None
        rec.param.data = torch.empty(0, dtype=rec.param.dtype)


def attach_accumulator(rec: ParamRecord) -> None:
    """Hold the parameter's AccumulateGrad node, made while the parameter has its full shape, which autograd
    checks each gradient against: a zero-stride stand-in gives it that shape for free. The gradient hooks
    are registered on the parameter itself (`offload.train.grads.reduce`), which outlives a replaced node."""
    p = rec.param
    if not p.requires_grad:
        rec.accumulator = None
        return
    data = p.data
    if tuple(data.shape) != tuple(rec.shape):
        p.data = torch.zeros((), dtype=p.dtype).expand(rec.shape)
    try:
        with torch.enable_grad():
            rec.accumulator = p.view_as(p).grad_fn.next_functions[0][0]
    finally:
        p.data = data


def parameter_names(model: nn.Module) -> dict[int, list[str]]:
    """Every name of each distinct parameter of ``model`` (tied ones have several), by ``id``."""
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return names


def build_records(model: nn.Module, placement: Placement) -> list[ParamRecord]:
    """Partition every distinct parameter of ``model`` and place this rank's partitions (see `Placement`).

    Raises ValueError for a parameter that is not a floating-point CPU tensor, TensorIOError.
    """
    names = parameter_names(model)
    records = [placement.place(p, names[id(p)], index) for index, (_, p) in enumerate(model.named_parameters())]
    placement.finish()
    return records
