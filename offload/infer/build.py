"""Building an inference engine: the compute device and its budget, the model's skeleton on the meta
device, its units matched to the checkpoint's tensors, the buffers, and the disk's measured speed."""

from __future__ import annotations

import math
import os
import re
import time
from typing import Any

import torch
from torch import nn

from offload.device import Device, device_for
from offload.infer.config import InferenceConfig
from offload.infer.plan.units import format_bytes
from offload.infer.stream.unit import ParamRef, Unit
from offload.infer.weights.names import CheckpointNames, ParamSource
from offload.infer.weights.qcache import PAD_PREFIX
from offload.storage.safetensors_reader import SafetensorsCheckpoint, read_windows, tensor_views, windows_nbytes
from tensorio import AioHandle, aligned_tensor

__all__ = ["CheckpointMismatchError", "build_units", "checkpoint_directory", "compute_device_for", "contiguous_head_input",
           "decoder_blocks", "device_budget", "materialize_buffers", "measure_disk", "meta_skeleton", "refuse_prequantized"]

# Modules outside the repeated blocks that may be streamed (the output head); the rest stays resident.
_STREAMABLE_OUTSIDE = (nn.Linear,)
_STREAMABLE_OUTSIDE_NAMES = ("Conv1D",)
_DISK_PROBE_BYTES = 256 << 20


class CheckpointMismatchError(ValueError):
    """The checkpoint and the model disagree: a missing or unexpected tensor, or a shape; names it."""


def compute_device_for(settings: InferenceConfig) -> Device:
    """The device ``compute_device`` names, on ``max_memory``'s device index (``{1: "6GiB"}``: GPU 1; without
    one the current device, or the rank's under a launcher) with its budget (checked against its free memory).
    Raises ValueError naming the setting; RuntimeError for an index the machine does not have."""
    tiers = settings.max_memory
    index = tiers.device_index if tiers is not None else None  # max_memory={1: ...}: compute on device 1
    device = device_for(settings.compute_device, index=index)
    if tiers is None or tiers.device_bytes in (None, "auto") or not device.separate_memory:
        return device  # a device budget with compute on the CPU is refused by `device_budget`, naming it
    device.close()
    return device_for(settings.compute_device, budget_bytes=tiers.device_bytes, budget_setting=tiers.device_key,
                      index=index)


def device_budget(compute: Device, settings: InferenceConfig) -> tuple[int, str] | None:
    """(bytes, setting) of the device tier where ``compute`` has memory of its own: its budget, else
    90% of its free memory (Accelerate's headroom); None on the CPU, whose device tier is the host.
    Raises ValueError naming ``max_memory[i]`` where it cannot apply."""
    tiers = settings.max_memory
    given = tiers.device_bytes if tiers is not None else None
    auto = given == "auto"
    given = None if auto else given
    if not compute.separate_memory:
        if given is not None or auto:
            raise ValueError(f"{tiers.device_key}: a device budget, but compute is on the {compute.name} device, whose "
                             f"memory is the host's; leave {tiers.device_key} out (max_memory['cpu'] or max_in_cpu is the "
                             f"budget), or compute on a GPU (compute_device)")
        return None
    if given is not None and compute.budget_bytes != given:
        raise ValueError(f"{tiers.device_key}: {given} bytes, but the device passed as compute_device has a budget of "
                         f"{compute.budget_bytes} bytes; give the budget once (to the device, or as {tiers.device_key})")
    if compute.budget_bytes is not None:
        return compute.budget_bytes, compute.budget_setting
    free, _ = compute.memory_info()
    key = tiers.device_key if tiers is not None and tiers.device_index is not None else "max_memory[0]"
    return int(free * 0.9), (f"{key} \"auto\": 90% of the {compute.name} device's free {format_bytes(free)}, 10% "
                             f"kept for the device runtime and its allocator")


def checkpoint_directory(model: Any, checkpoint: Any) -> str:
    if isinstance(model, (str, os.PathLike)):
        if checkpoint is not None:
            raise ValueError("checkpoint: give the checkpoint either as `model` or as `checkpoint=`, not both")
        return os.fspath(model)
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a checkpoint directory or a transformers model on the meta device, "
                        f"got {type(model).__name__}")
    if checkpoint is not None:
        return os.fspath(checkpoint)
    name = getattr(getattr(model, "config", None), "_name_or_path", "") or ""
    if name and os.path.isdir(name):
        return name
    raise ValueError("checkpoint: the model does not say where its checkpoint is (config._name_or_path is "
                     f"{name!r}); pass checkpoint=DIRECTORY")


def meta_skeleton(model: Any, directory: str, dtype: torch.dtype) -> nn.Module:
    """The transformers model on the meta device (no memory), its parameters in ``dtype``."""
    import transformers

    if isinstance(model, nn.Module):
        refuse_prequantized(getattr(model, "config", None), directory)
        real = [name for name, p in model.named_parameters() if p.device.type != "meta"]
        if real:
            raise ValueError(f"model: parameter {real[0]!r} is on {model.get_parameter(real[0]).device}, not on the "
                             f"meta device; build the model under `with torch.device('meta'):` so that no weight is "
                             f"in memory before the engine reads it")
        for module in model.modules():  # parameters only: buffers (rotary frequencies) keep their dtype
            for attr, param in list(module._parameters.items()):
                if param is not None and param.is_floating_point() and param.dtype != dtype:
                    module._parameters[attr] = nn.Parameter(param.to(dtype), requires_grad=False)
        return model.eval()
    if not os.path.isfile(os.path.join(directory, "config.json")):
        raise FileNotFoundError(f"checkpoint {directory}: no config.json, so the model's architecture is unknown")
    config = transformers.AutoConfig.from_pretrained(directory)
    refuse_prequantized(config, directory)
    with torch.device("meta"):
        module = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    if os.path.isfile(os.path.join(directory, "generation_config.json")):
        module.generation_config = transformers.GenerationConfig.from_pretrained(directory)
    module.config._name_or_path = directory
    return module.eval()


def refuse_prequantized(config: Any, directory: str) -> None:
    """Raise ValueError, in one line naming the method, for a checkpoint whose config.json carries a
    ``quantization_config`` (GPTQ, AWQ, FP8, bitsandbytes, ...): its tensors are packed by that method, not
    weights this engine can compute with, and reading them as weights would give garbage."""
    quantization = getattr(config, "quantization_config", None)
    if quantization is None:
        return
    method = quantization.get("quant_method") if isinstance(quantization, dict) else getattr(quantization, "quant_method", None)
    method = str(getattr(method, "value", method) or "unknown")
    raise ValueError(f"checkpoint {directory}: a {method.upper()}-quantized checkpoint (config.json's quantization_config); "
                     f"pre-quantized checkpoints are not supported yet: use the model's bf16 or fp16 checkpoint with "
                     f"weight_quantization \"int4\" or \"int8\" (--quantize int4), which quantizes it once into a cache")


def contiguous_head_input(module: nn.Module) -> None:
    """Give the output head its input contiguous (a forward pre-hook; a copy of batch x hidden values).

    ``generate`` hands it the last position's hidden states, a slice ``hidden[:, -1:, :]`` of the
    prompt's. torch.matmul multiplies such an input by a weight that does not require grad (ours never
    do: they are views into our buffers) with bmm on the weight expanded to the batch and made
    contiguous: a copy of batch x the head (5 GB for Llama-13B's 32000 x 5120 head at batch 16, 0.16 GB
    for a 32000 x 2560 one at batch 1) at every prefill, and at every chunk of a chunked one. An input
    with row-major strides is folded into one mm. ``Tensor.contiguous`` is not enough: a slice of one
    position of one sequence counts as contiguous (its size-1 dimensions' strides are ignored) while
    matmul's folding checks them, so the input is copied wherever its strides are not row-major.
    """
    head = module.get_output_embeddings() if hasattr(module, "get_output_embeddings") else None
    if isinstance(head, nn.Linear):
        head.register_forward_pre_hook(lambda _, args: (_row_major(args[0]), *args[1:]) if args else None)


def _row_major(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``, or a copy of it where its strides are not exactly row-major (size-1 dimensions included)."""
    stride, strides = 1, []
    for size in reversed(tensor.shape):
        strides.append(stride)
        stride *= size
    if tuple(tensor.stride()) == tuple(reversed(strides)):
        return tensor
    return tensor.clone(memory_format=torch.contiguous_format)


def decoder_blocks(module: nn.Module) -> str | None:
    """The path of the ModuleList holding the most parameters: the decoder layers."""
    best, most = None, 0
    for name, child in module.named_modules():
        if isinstance(child, nn.ModuleList):
            count = sum(p.numel() for p in child.parameters())
            if count > most:
                best, most = name, count
    return best


def build_units(module: nn.Module, checkpoint: SafetensorsCheckpoint) -> list[Unit]:
    """One `Unit` per decoder layer and per other module with parameters, in forward order, each
    parameter matched to its checkpoint tensors by transformers' own conversion of names and layouts
    (offload/infer/weights/names.py). Raises CheckpointMismatchError naming the first tensor or
    parameter it cannot place, before anything is read."""
    blocks = decoder_blocks(module)
    names = CheckpointNames(module, {key: entry.shape for key, entry in checkpoint.entries.items()})
    aliases: dict[int, list[str]] = {}
    params: dict[int, nn.Parameter] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(param), []).append(name)
        params[id(param)] = param
    where = checkpoint.index_path or checkpoint.directory
    consumed: set[str] = set()
    members: dict[str, list[ParamRef]] = {}
    kinds: dict[str, tuple[nn.Module, bool]] = {}
    for pid, param_names in aliases.items():
        param = params[pid]
        source = next((found for found in map(names.source, param_names) if found is not None), None)
        if source is None:
            raise CheckpointMismatchError(
                f"parameter {param_names[0]!r} of {type(module).__name__} ({_family(module)}) is not in the "
                f"checkpoint ({where}), under its own name or any name transformers converts to it; the checkpoint "
                f"is for another model, or incomplete")
        consumed.update(source.tensors)
        _check_shape(source, param, param_names[0], module, checkpoint)
        owners = tuple((module.get_submodule(n.rpartition(".")[0]), n.rpartition(".")[2]) for n in param_names)
        placeholder = nn.Parameter(torch.empty(param.shape, dtype=param.dtype, device="meta"), requires_grad=False)
        owner_path = param_names[0].rpartition(".")[0]
        match = re.match(rf"{re.escape(blocks)}\.\d+(?=\.)", param_names[0]) if blocks else None
        unit = match.group(0) if match and len(param_names) == 1 else owner_path
        streamable = len(param_names) == 1 and (match is not None or (
            isinstance(owners[0][0], _STREAMABLE_OUTSIDE) or type(owners[0][0]).__name__ in _STREAMABLE_OUTSIDE_NAMES))
        members.setdefault(unit, []).append(ParamRef(owners, source.tensor, placeholder, source.conversion))
        old = kinds.get(unit)
        kinds[unit] = (module.get_submodule(unit), streamable and (old is None or old[1]))
        for ref_owner, attr in owners:  # meta placeholder until the plan decides
            ref_owner._parameters[attr] = placeholder
    _check_unexpected(module, checkpoint, consumed, names)
    units = []
    for name, refs in members.items():
        unit_module, streamable = kinds[name]
        nbytes = sum(ref.placeholder.numel() * ref.placeholder.element_size() for ref in refs)
        tensors = [key for ref in refs for key in ref.tensors]
        units.append(Unit(name, unit_module, tuple(refs), checkpoint.windows(tensors), nbytes, streamable))
    return units


def _family(module: nn.Module) -> str:
    return f"model_type {getattr(getattr(module, 'config', None), 'model_type', None)!r}"


def _check_shape(source: ParamSource, param: nn.Parameter, name: str, module: nn.Module,
                 checkpoint: SafetensorsCheckpoint) -> None:
    """The checkpoint's tensors make ``param``'s shape (a conversion is run on meta tensors: nothing read).
    Raises CheckpointMismatchError naming the tensor."""
    if source.conversion is None:
        entry = checkpoint[source.tensor]
        if tuple(entry.shape) != tuple(param.shape):
            raise CheckpointMismatchError(
                f"tensor {entry.name!r} in {entry.path} has shape {list(entry.shape)}, but parameter {name!r} of "
                f"{type(module).__name__} has shape {list(param.shape)}; the checkpoint and config.json disagree")
        return
    meta = {key: torch.empty(tuple(checkpoint[key].shape), dtype=checkpoint[key].dtype, device="meta")
            for key in source.tensors}
    try:
        made = source.conversion.run(meta, module)[source.tensor]
    except (RuntimeError, ValueError, KeyError, IndexError) as error:
        raise CheckpointMismatchError(
            f"tensors {source.tensors[0]!r} ... ({len(source.tensors)}) in {checkpoint[source.tensors[0]].path} do not "
            f"make parameter {name!r} of {type(module).__name__} as transformers converts them ({error}); the "
            f"checkpoint and config.json disagree") from None
    if tuple(made.shape) != tuple(param.shape):
        raise CheckpointMismatchError(
            f"tensors {source.tensors[0]!r} ... ({len(source.tensors)}) in {checkpoint[source.tensors[0]].path} make "
            f"shape {list(made.shape)}, but parameter {name!r} of {type(module).__name__} has shape "
            f"{list(param.shape)}; the checkpoint and config.json disagree")


def _check_unexpected(module: nn.Module, checkpoint: SafetensorsCheckpoint, consumed: set[str],
                      names: CheckpointNames) -> None:
    buffers = {key for name, _ in module.named_buffers() if (key := names.buffer_key(name)) is not None}
    ignore = [re.compile(p) for p in (getattr(module, "_keys_to_ignore_on_load_unexpected", None) or [])]
    ignore.append(re.compile(r"rotary_emb\.inv_freq"))
    ignore.append(re.compile(rf"^{re.escape(PAD_PREFIX)}"))  # the quantized cache's alignment padding
    extra = [name for name in checkpoint.entries
             if name not in consumed and name not in buffers and not any(p.search(name) for p in ignore)]
    if extra:
        entry = checkpoint[extra[0]]
        more = f" (and {len(extra) - 1} more: {', '.join(extra[1:4])}{', ...' if len(extra) > 4 else ''})" if len(extra) > 1 else ""
        raise CheckpointMismatchError(
            f"tensor {entry.name!r} in {entry.path} has no parameter or buffer in {type(module).__name__} "
            f"({_family(module)}){more}, under its own name or the one transformers converts it to; the checkpoint "
            f"is for another model or config.json is wrong")


def materialize_buffers(module: nn.Module, checkpoint: SafetensorsCheckpoint, handle: AioHandle,
                         device: torch.device) -> int:
    """Give every meta buffer real memory: persistent ones from the checkpoint, the others (rotary
    frequencies) computed by transformers' own initialisation. Returns bytes read."""
    names = CheckpointNames(module, {key: entry.shape for key, entry in checkpoint.entries.items()})
    nbytes = 0
    to_init = []
    for name, buffer in list(module.named_buffers()):
        if buffer.device.type != "meta":
            continue
        owner_path, _, attr = name.rpartition(".")
        owner = module.get_submodule(owner_path)
        key = names.buffer_key(name)
        if key is not None:
            windows = checkpoint.windows([key])
            raw = aligned_tensor(windows_nbytes(windows), torch.uint8)
            nbytes += sum(f.result() for f in read_windows(handle, windows, raw))
            owner._buffers[attr] = tensor_views(windows, raw)[key].to(device=device, dtype=buffer.dtype).clone()
        else:  # NaN until computed: a buffer no initialisation writes is found, not used as garbage
            owner._buffers[attr] = torch.full_like(buffer, math.nan, device=device) if buffer.is_floating_point() \
                else torch.empty_like(buffer, device=device)
            to_init.append((name, owner))
    init = getattr(module, "_init_weights", None)
    for owner in dict.fromkeys(owner for _, owner in to_init):
        # transformers' initialisation computes the buffers (rotary frequencies, Gemma's embedding scale); the
        # owner's parameters are meta placeholders here, which it leaves as they are (nothing to write to)
        if init is None or any(p.device.type != "meta" for p in owner.parameters(recurse=False)):
            raise ValueError(f"buffer of {type(owner).__name__} is neither in the checkpoint nor computable here")
        init(owner)
    _init_from_ancestors(module, [name for name, _ in to_init], init)
    return nbytes


def _init_from_ancestors(module: nn.Module, names: list[str], init) -> None:
    """Buffers still NaN after their owner's initialisation are computed by an ancestor's (Falcon-H1's
    ``mup_vector``: by the model's), nearest first; one that none computes is refused, naming it. Every
    parameter is still a meta placeholder here, which initialisation leaves as it is."""
    def unset(name: str) -> bool:
        buffer = module.get_buffer(name)
        return buffer.is_floating_point() and bool(buffer.isnan().any())

    for name in names:
        path = name.rpartition(".")[0]  # the owner's, already initialised
        while unset(name) and path:
            path = path.rpartition(".")[0]
            init(module.get_submodule(path))
        if unset(name):
            raise ValueError(f"buffer {name!r} of {type(module).__name__} is neither in the checkpoint nor computed by "
                             f"transformers' initialisation (of its module or of any module above it)")


def measure_disk(handle: AioHandle, checkpoint: SafetensorsCheckpoint) -> tuple[float, str]:
    """Read up to 256 MiB of the checkpoint's largest files with O_DIRECT, 64 MiB per request;
    (bytes per second, description)."""
    files = sorted(checkpoint.files, key=checkpoint.file_sizes.__getitem__, reverse=True)
    chunk = min(64 << 20, _DISK_PROBE_BYTES)
    buffer = aligned_tensor(min(chunk, checkpoint.file_sizes[files[0]]) // 4096 * 4096, torch.uint8)
    if buffer.numel() == 0:
        return 0.0, "not measured: the checkpoint is smaller than a page"
    moved, used = 0, []
    start = time.perf_counter()
    for path in files:
        size = checkpoint.file_sizes[path] // 4096 * 4096  # whole pages: every read is O_DIRECT
        for offset in range(0, size, buffer.numel()):
            if moved >= _DISK_PROBE_BYTES:
                break
            moved += handle.read(buffer[: min(buffer.numel(), size - offset)], path, offset).result()
        used.append(os.path.basename(path))
        if moved >= _DISK_PROBE_BYTES:
            break
    seconds = time.perf_counter() - start
    where = used[0] if len(used) == 1 else f"{len(used)} files"
    return moved / seconds, f"measured: {format_bytes(moved)} of {where} read with O_DIRECT"
