"""Placement: partition every parameter of a model and put this rank's partitions in memory or on NVMe."""

from __future__ import annotations

import torch
from torch import nn

from tensorio import aligned_tensor

from offload.params.partition import partition_bounds, partition_numel
from offload.params.store import ParamRecord
from offload.storage.swapfile import SwapFile

_WRITES_IN_FLIGHT = 8
"""Initial writes in flight at most: bounds the memory of partitions on their way to the disk."""


def build_records(model: nn.Module, *, world_size: int, rank: int, nvme: bool, max_in_cpu: int,
                  persistence_threshold: int, swap: SwapFile | None) -> list[ParamRecord]:
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
                          keep_full=keep_full)
        if p.requires_grad:  # created while the parameter has its full shape: autograd checks it
            with torch.enable_grad():
                rec.accumulator = p.view_as(p).grad_fn.next_functions[0][0]
        if to_disk:
            rec.offset = swap.allocate(local.nbytes)
            writes.append((swap.write(local, rec.offset), local))
            rec.partition.data = torch.empty(0, dtype=p.dtype)
        if keep_full:
            rec.full = flat
        else:
            p.data = torch.empty(0, dtype=p.dtype)
        records.append(rec)
        if len(writes) >= _WRITES_IN_FLIGHT:  # sync point
            for future, _ in writes:
                future.result()
            writes = []
    for future, _ in writes:
        future.result()
    return records
