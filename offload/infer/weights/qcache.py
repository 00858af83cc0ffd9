"""The quantized cache: a checkpoint's weights with the decoder layers' linear weights quantized, written
once to one safetensors file on NVMe and streamed from there.

Laid out for the layer streamer: the units in forward order, all in one file, each unit starting on
a page boundary with its tensors back to back (each on a multiple of 64 bytes), so that a layer is
one aligned O_DIRECT read from its first byte (see docs/inference.md, "Quantized weights"). A mixture of
experts' experts are written expert by expert, each expert's packed tensors together from a page boundary
(offload/infer/weights/quant_experts.py), so that one expert is one aligned read too. The tensors that are not
quantized (embeddings, norms, the head) are stored in the compute dtype. int4 weights are packed in
the layout of the compute device's kernel (``Device.packed_kernels``): a device whose packing is not
the CPU's has a cache of its own (tagged with the layout), so the bytes streamed and copied to it are
the ones it computes on. Nothing in it executes code:
safetensors, plus ``quantized.json``, written last, which records what it was made from: the source
files' names, sizes and modification times, a hash of their headers, the quantization, the compute
dtype and the int4 packing of this torch and device (``PackedKernels.int4_fingerprint``), and the file's
checksums. A cache whose record matches, and whose file matches its checksums (read whole once when
reused), is reused; a corrupt one, or one whose record does not match (a changed checkpoint, another
setting), is written again, and the caches
of older versions of the same checkpoint with the same settings are removed.

Written unit by unit (memory: one unit's read buffer plus a few copies of its largest tensor in fp32),
with a progress bar on stderr; the file is atomic (a temporary name renamed when complete).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import sys
from collections.abc import Mapping, Sequence

import torch

from offload.device import CPU_KERNELS, PackedKernels
from offload.infer.config import WeightQuantization
from offload.infer.plan.host import format_bytes
from offload.infer.stream.unit import ParamRef, Unit
from offload.infer.weights.convert import drop_page_cache, verified_cache
from offload.infer.weights.quant_experts import expert_layout, expert_tensors
from offload.infer.weights.quantize import quantize_weight, quantized_layout
from offload.storage.safetensors_reader import SafetensorsCheckpoint, read_windows, tensor_views
from offload.storage.safetensors_writer import atomic_safetensors
from tensorio import AioHandle, aligned_tensor

__all__ = ["PAD_PREFIX", "quantized_cache"]

log = logging.getLogger("offload.infer")

MARKER = "quantized.json"
FILE = "model.safetensors"
_FORMAT = 1
PAGE = 4096
_TENSOR_ALIGN = 64
PAD_PREFIX = "__pad__."


def _record(checkpoint: SafetensorsCheckpoint, spec: WeightQuantization, dtype: torch.dtype,
            targets: Mapping[str, object], kernels: PackedKernels) -> dict:
    """What a cache is made from; equal records mean the cache can be reused. int8 weights are laid
    out alike for every device, so their record (and cache) is the same on all of them."""
    header = hashlib.sha256()
    for name in sorted(checkpoint.entries):
        e = checkpoint.entries[name]
        header.update(f"{name}|{os.path.basename(e.path)}|{e.dtype}|{list(e.shape)}|{e.offset}|{e.nbytes}\n".encode())
    return {
        "format": _FORMAT,
        "directory": os.path.abspath(checkpoint.directory),
        "files": [[os.path.basename(f), os.stat(f).st_size, os.stat(f).st_mtime_ns] for f in checkpoint.files],
        "headers_sha256": header.hexdigest(),
        "quantization": {"num_bits": spec.num_bits, "group_size": spec.group_size, "symmetric": spec.symmetric},
        "dtype": str(dtype).removeprefix("torch."),
        "packing": (kernels if spec.num_bits == 4 else CPU_KERNELS).int4_fingerprint(),
        "quantized": sorted(targets),
    }


def _read_record(directory: str) -> dict | None:
    try:
        with open(os.path.join(directory, MARKER), encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def quantized_cache(checkpoint: SafetensorsCheckpoint, units: Sequence[Unit], targets: Mapping[str, object],
                    spec: WeightQuantization, dtype: torch.dtype, root: str | os.PathLike, handle: AioHandle,
                    *, kernels: PackedKernels = CPU_KERNELS, progress: bool = True) -> str:
    """The directory of the quantized cache of ``checkpoint`` under ``root``: written the first time
    (a log line and a progress bar), reused while the checkpoint and the settings are unchanged.

    ``units`` are the model's units (forward order) matched to ``checkpoint``; ``targets`` are the
    linear modules to quantize (path -> module); ``spec`` how; ``dtype`` the compute dtype; ``kernels``
    the compute device's (int4 is packed in their layout).

    Raises FileNotFoundError when ``root`` does not exist, PermissionError naming it when it cannot be
    written, OSError (ENOSPC: the sizes named) from the writes; a failed write leaves no cache that
    could be taken for complete.
    """
    root = os.fspath(root)
    if not os.path.isdir(root):
        raise FileNotFoundError(f"zero_optimization.offload_param.nvme_path: {root!r} does not exist; create the "
                                f"directory (on the NVMe drive) for the quantized cache of the checkpoint")
    record = _record(checkpoint, spec, dtype, targets, kernels)
    tag = f"int{spec.num_bits}-{'channel' if spec.group_size is None else f'g{spec.group_size}'}-" \
          f"{'sym' if spec.symmetric else 'asym'}-{str(dtype).removeprefix('torch.')}"
    if spec.num_bits == 4 and kernels.int4_layout != CPU_KERNELS.int4_layout:
        tag += f"-{kernels.int4_layout}"  # another device's packing: a cache beside the CPU's, not in its place
    key = hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()[:16]
    target = os.path.join(root, f"quantized-{tag}-{key}")
    recorded = _read_record(target)
    checksums = recorded.pop("checksums", None) if isinstance(recorded, dict) else None
    if recorded == record and verified_cache(target, checksums):
        return target
    if not os.access(root, os.W_OK):
        raise PermissionError(f"zero_optimization.offload_param.nvme_path: {root!r} is not writable; the quantized "
                              f"cache of the checkpoint is written there (set nvme_path to a writable directory)")
    layout, sources = _layout(units, targets, spec, dtype, kernels)
    total = sum(torch.empty((), dtype=d).element_size() * _numel(s) for d, s in layout.values())
    free = shutil.disk_usage(root).free
    if total > free:
        raise OSError(f"zero_optimization.offload_param.nvme_path: the quantized cache needs {total / 1e9:.2f} GB "
                      f"and {root!r} has {free / 1e9:.2f} GB free")
    log.warning("offload.infer: writing the %s cache of %s to %s (%s, once; later runs reuse it)",
                spec.name, checkpoint.directory, target, format_bytes(total))
    _remove_stale(root, tag, record["directory"])
    os.makedirs(target, exist_ok=True)
    path = os.path.join(target, FILE)
    from tqdm import tqdm

    with atomic_safetensors(path, layout, {"format": "pt"}, data_align=PAGE, checksums=True) as out, \
            tqdm(total=sum(u.read_nbytes for u in units), unit="B", unit_scale=True, file=sys.stderr,
                 desc=f"quantizing to {spec.name}", disable=not progress) as bar:
        for unit in units:  # one unit in memory at a time
            buffer = aligned_tensor(unit.buffer_nbytes, torch.uint8)
            for future in read_windows(handle, unit.windows, buffer):
                future.result()
            views = tensor_views(unit.windows, buffer)
            for ref in unit.params:
                for name, value in _converted(sources[id(ref)], ref, views, spec, dtype, kernels):
                    out.write(name, value)
            del views, buffer
            bar.update(unit.read_nbytes)
    drop_page_cache(path)
    with open(os.path.join(target, MARKER), "w", encoding="utf-8") as f:
        json.dump({**record, "checksums": {FILE: out.checksums.to_json()}}, f, indent=1)
    return target


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for size in shape:
        n *= int(size)
    return n


def _layout(units: Sequence[Unit], targets: Mapping[str, object], spec: WeightQuantization, dtype: torch.dtype,
            kernels: PackedKernels):
    """The cache's tensors in write order (name -> (dtype, shape)), and per parameter (by id of its
    `ParamRef`) how it is written: ("quantize", module path), ("copy", name, dtype), or for an experts module
    (offload/infer/weights/quant_experts.py) ("experts", path, module, its parameters) on its first parameter and
    ("with",) on the others; each expert's tensors start on a page boundary (one aligned read per expert).

    Padding tensors (``__pad__.N``, uint8) put every unit's first tensor on a page boundary and every
    tensor on a multiple of 64 bytes (the file's data starts page-aligned): a layer is read from its
    first byte, and each tensor lands in the read buffer aligned as the kernels' vector loads need
    (``torch._weight_int8pack_mm`` crashes on an int8 weight at an address that is 8 mod 16)."""
    by_module = {id(module): path for path, module in targets.items() if isinstance(module, torch.nn.Linear)}
    experts = {id(module): path for path, module in targets.items() if not isinstance(module, torch.nn.Linear)}
    layout: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
    sources: dict[int, tuple] = {}
    end = 0

    def place(name: str, tensor_dtype: torch.dtype, shape: tuple[int, ...], align: int) -> None:
        nonlocal end
        if end % align:
            layout[f"{PAD_PREFIX}{len(layout)}"] = (torch.uint8, (align - end % align,))
            end += align - end % align
        layout[name] = (tensor_dtype, shape)
        end += _numel(shape) * torch.empty((), dtype=tensor_dtype).element_size()

    for unit in units:
        align = PAGE
        for ref in unit.params:
            module, attr = ref.owners[0]
            if id(module) in experts:  # an experts module: each expert's tensors together, from a page boundary
                group = tuple(r for r in unit.params if r.owners[0][0] is module)
                if ref is group[0]:
                    for tensors in expert_layout(experts[id(module)], module, spec, dtype, kernels):
                        align = PAGE
                        for name, (tensor_dtype, tensor_shape) in tensors.items():
                            place(name, tensor_dtype, tensor_shape, align)
                            align = _TENSOR_ALIGN
                sources[id(ref)] = ("experts", experts[id(module)], module, group) if ref is group[0] else ("with",)
                align = _TENSOR_ALIGN
                continue
            path = by_module.get(id(module))
            shape = tuple(ref.placeholder.shape)
            if path is not None and attr == "weight":
                for name, (tensor_dtype, tensor_shape) in quantized_layout(shape[0], shape[1], spec, dtype,
                                                                           kernels).items():
                    place(f"{path}.{name}", tensor_dtype, tensor_shape, align)
                    align = _TENSOR_ALIGN
                sources[id(ref)] = ("quantize", path)
            else:
                name = f"{path}.{attr}" if path is not None else ref.tensor
                out_dtype = dtype if ref.placeholder.is_floating_point() else ref.placeholder.dtype
                place(name, out_dtype, shape, align)
                sources[id(ref)] = ("copy", name, out_dtype)
            align = _TENSOR_ALIGN
    return layout, sources


def _converted(source: tuple, ref: ParamRef, views: Mapping[str, torch.Tensor], spec: WeightQuantization,
               dtype: torch.dtype, kernels: PackedKernels):
    """The (name, tensor) pairs one parameter (``ref``, its checkpoint tensors ``views``) becomes in the cache:
    an experts module's first parameter, its experts' (the others: nothing of their own)."""
    if source[0] == "quantize":
        for name, tensor in quantize_weight(ref.value(views), spec, dtype, kernels).items():
            yield f"{source[1]}.{name}", tensor
    elif source[0] == "experts":
        _, path, module, group = source
        yield from expert_tensors(path, module, {r.owners[0][1]: r.value(views) for r in group}, spec, dtype, kernels)
    elif source[0] == "copy":
        yield source[1], ref.value(views).to(source[2])


def _remove_stale(root: str, tag: str, directory: str) -> None:
    """Remove the caches under ``root`` with the same settings (``tag``) made from an older version of
    the checkpoint in ``directory`` (their record names it)."""
    for name in os.listdir(root):
        path = os.path.join(root, name)
        if not name.startswith(f"quantized-{tag}-") or not os.path.isdir(path):
            continue
        record = _read_record(path)
        if record is not None and record.get("directory") == directory:
            log.warning("offload.infer: removing the stale quantized cache %s", path)
            shutil.rmtree(path, ignore_errors=True)
