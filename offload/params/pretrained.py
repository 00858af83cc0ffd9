"""Pretrained weights read from a Hugging Face checkpoint straight into the partitions.

Tensor by tensor, through tensorio (O_DIRECT, the page-aligned window around each tensor): the
checkpoint is never whole in memory, nor in the page cache; each rank keeps its slice, in memory or
in the swap file. One tensor (the largest) and a few partition writes are in memory at a time.
"""

from __future__ import annotations

import torch
from torch import nn

from tensorio import AioConfig, AioHandle, aligned_tensor, locked_tensor

from offload.params.partition import partition_bounds
from offload.params.placement import parameter_names
from offload.params.record import ParamRecord
from offload.params.store import ParamStore
from offload.storage.safetensors_reader import SafetensorsCheckpoint, read_windows, tensor_views, windows_nbytes

__all__ = ["load_pretrained"]

_WRITES_IN_FLIGHT = 2


def load_pretrained(model: nn.Module, store: ParamStore, checkpoint: str, aio: AioConfig) -> list[str]:
    """Load ``checkpoint`` (a directory with model.safetensors or shards and their index, or one
    .safetensors file) into ``model``'s partitions (``store``) and its floating-point buffers, casting to
    each parameter's dtype. A tied parameter takes the first of its names the checkpoint holds.

    Returns the checkpoint's tensors the model has no place for (such as buffers it recomputes).
    Raises FileNotFoundError / SafetensorsError (naming the file) for a missing or broken checkpoint,
    ValueError naming the parameters the checkpoint lacks, or a tensor whose shape differs from the
    parameter's, before any partition changes; TensorIOError for the swap file.
    """
    with AioHandle.from_config(aio) as handle:
        ckpt = SafetensorsCheckpoint(checkpoint, handle)
        # 1. Match every record to a tensor, and check shapes, before anything changes.
        sources: list[tuple[ParamRecord, str]] = []
        missing = []
        names = parameter_names(model)
        for first, param in model.named_parameters():
            rec = store.record_of(param)
            if rec is None:
                raise ValueError(f"parameter {first!r} is not partitioned by this engine or zero.Init build")
            name = next((n for n in names[id(param)] if n in ckpt), None)
            if name is None:
                missing.append(first)
                continue
            if tuple(ckpt[name].shape) != tuple(rec.shape):
                raise ValueError(f"{ckpt[name].path}: tensor {name!r} has shape {list(ckpt[name].shape)}, the model's "
                                 f"parameter {list(rec.shape)}; the checkpoint is for another model configuration")
            sources.append((rec, name))
        if missing:
            raise ValueError(f"checkpoint {checkpoint} has no tensor for parameters {missing[:5]}"
                             f"{' and %d more' % (len(missing) - 5) if len(missing) > 5 else ''}; it is for another "
                             f"model")
        buffers = {name: buf for name, buf in model.named_buffers() if buf is not None and name in ckpt}
        used = {name for _, name in sources} | set(buffers)
        # 2. One tensor at a time: read its window, keep this rank's slice.
        largest = max((windows_nbytes(ckpt.windows([name])) for _, name in sources), default=0)
        staging = locked_tensor(max(largest, 1), torch.uint8)
        writes: list = []
        for rec, name in sources:
            values = _read(ckpt, handle, name, staging).to(rec.param.dtype).reshape(-1)
            writes += _store_slice(store, rec, values)
            while len(writes) > _WRITES_IN_FLIGHT:
                writes.pop(0).result()  # sync point: bounds the memory in flight
        for future in writes:
            future.result()
        for name, buffer in buffers.items():
            buffer.copy_(_read(ckpt, handle, name, staging).reshape(buffer.shape))
        return sorted(set(ckpt.entries) - used)


def _read(ckpt: SafetensorsCheckpoint, handle: AioHandle, name: str, staging: torch.Tensor) -> torch.Tensor:
    """Tensor ``name``, read into ``staging`` (sync point); a view of it, valid until the next read."""
    windows = ckpt.windows([name])
    for future in read_windows(handle, windows, staging):
        future.result()
    return tensor_views(windows, staging)[name]


def _store_slice(store: ParamStore, rec: ParamRecord, values: torch.Tensor) -> list:
    """Put this rank's slice of the full flat ``values`` into ``rec``'s partition; the writes started."""
    start, end = partition_bounds(rec.numel, store.world_size, store.rank)
    part = values[start:min(end, rec.numel)]
    if rec.on_disk:
        staged = aligned_tensor(rec.partition_numel, rec.partition.dtype)
        staged[part.numel():].zero_()
        staged[:part.numel()].copy_(part)
        return [store.write_partition(rec, staged)]  # the request keeps ``staged`` alive
    rec.partition.data[:part.numel()].copy_(part)
    store.refresh(rec)
    return []
