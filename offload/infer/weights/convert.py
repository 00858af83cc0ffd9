"""A converted copy of a checkpoint (another dtype), written once under ``nvme_path`` and reused.

Only needed when weights are streamed in a dtype other than the checkpoint's: streaming reads tensors
in place, so they must be on the disk in the dtype they compute in. The copy keeps the shard layout
and tensor names; it is written one tensor at a time (memory: the largest tensor, twice), each file
atomically, with ``converted.json`` (the source files' names, sizes and times, and the dtype) written
last: a copy with a matching ``converted.json`` is complete and is reused, once every file matches the
checksums ``converted.json`` records (read whole when reused; a corrupt copy is written again).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os

import torch

from offload.storage.safetensors_reader import (
    INDEX_NAME,
    SafetensorsCheckpoint,
    plan_windows,
    read_windows,
    tensor_views,
    windows_nbytes,
)
from offload.storage.file_checksums import FileChecksums, verify_file
from offload.storage.safetensors_writer import atomic_safetensors
from tensorio import AioHandle, aligned_tensor

__all__ = ["converted_copy", "drop_page_cache", "verified_cache"]

log = logging.getLogger("offload.infer")

MARKER = "converted.json"


def drop_page_cache(path: str | os.PathLike) -> None:
    """Ask the kernel to drop ``path``'s pages from the page cache (after it is written and synced)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def converted_copy(checkpoint: SafetensorsCheckpoint, dtype: torch.dtype, nvme_path: str | os.PathLike,
                   handle: AioHandle) -> str:
    """The directory of ``checkpoint`` with its floating tensors in ``dtype``, under ``nvme_path``.

    Written the first time (with a log line), reused afterwards. Raises FileNotFoundError when
    ``nvme_path`` does not exist, OSError (ENOSPC, ...) from the writes.
    """
    nvme_path = os.fspath(nvme_path)
    if not os.path.isdir(nvme_path):
        raise FileNotFoundError(f"zero_optimization.offload_param.nvme_path: {nvme_path!r} does not exist; create the "
                                f"directory (on the NVMe drive) for the converted copy of the checkpoint")
    source = {
        "dtype": str(dtype).removeprefix("torch."),
        "files": [[os.path.basename(f), os.stat(f).st_size, os.stat(f).st_mtime_ns] for f in checkpoint.files],
        "directory": checkpoint.directory,
    }
    key = hashlib.sha256(json.dumps(source, sort_keys=True).encode()).hexdigest()[:16]
    target = os.path.join(nvme_path, f"converted-{source['dtype']}-{key}")
    marker = os.path.join(target, MARKER)
    if os.path.isfile(marker):
        with open(marker, encoding="utf-8") as f:
            recorded = json.load(f)
        checksums = recorded.pop("checksums", None) if isinstance(recorded, dict) else None
        if recorded == source and verified_cache(target, checksums):
            return target
    log.warning("offload.infer: writing a %s copy of %s to %s (once; later runs reuse it)",
                source["dtype"], checkpoint.directory, target)
    os.makedirs(target, exist_ok=True)
    weight_map = {}
    checksums = {}
    for file in checkpoint.files:
        entries = sorted((e for e in checkpoint.entries.values() if e.path == file), key=lambda e: e.offset)
        layout = {e.name: (dtype if e.dtype.is_floating_point else e.dtype, e.shape) for e in entries}
        out_path = os.path.join(target, os.path.basename(file))
        with atomic_safetensors(out_path, layout, checkpoint.metadata.get(file) or None, checksums=True) as out:
            for entry in entries:  # one tensor in memory at a time
                windows = plan_windows([entry], checkpoint.file_sizes)
                buffer = aligned_tensor(windows_nbytes(windows), torch.uint8)
                for future in read_windows(handle, windows, buffer):
                    future.result()
                out.write(entry.name, tensor_views(windows, buffer)[entry.name].to(layout[entry.name][0]))
        checksums[os.path.basename(file)] = out.checksums.to_json()
        drop_page_cache(out_path)
        weight_map.update({e.name: os.path.basename(file) for e in entries})
    if checkpoint.index_path is not None:
        with open(os.path.join(target, INDEX_NAME), "w", encoding="utf-8") as f:
            json.dump({"metadata": {}, "weight_map": weight_map}, f, indent=1)
    with open(marker, "w", encoding="utf-8") as f:
        json.dump({**source, "checksums": checksums}, f)
    return target


def checkpoint_in_dtype(checkpoint: SafetensorsCheckpoint, dtype: torch.dtype, nvme_path: str | os.PathLike | None,
                        handle: AioHandle, *, units: list[str], to_device: bool) -> SafetensorsCheckpoint:
    """The checkpoint's converted copy in ``dtype`` under ``nvme_path`` (`converted_copy`), for ``units`` that are
    streamed (or copied to a device, ``to_device``) as read. Raises ValueError naming ``nvme_path`` without one."""
    if nvme_path is None:
        raise ValueError(
            f"zero_optimization.offload_param.nvme_path: dtype {dtype} differs from the checkpoint's "
            f"({checkpoint.dominant_dtype()}) and {len(units)} units are "
            f"{'copied to the device' if to_device else 'streamed'} as read ({units[0]}, ...), "
            f"so they must be on the disk in {dtype}; set nvme_path to a directory for a "
            f"converted copy (written once), or use the checkpoint's dtype, or a budget that holds them")
    return SafetensorsCheckpoint(converted_copy(checkpoint, dtype, nvme_path, handle), handle)


def verified_cache(directory: str, checksums: dict | None) -> bool:
    """Whether every file of the cache in ``directory`` matches the ``checksums`` its marker recorded (each
    read whole, once, when the cache is reused): False, with a warning naming the corrupt file and tensor
    (the cache is then written again), or for a cache of an earlier version that recorded none."""
    if not checksums:
        log.warning("offload.infer: %s records no checksums (written by an earlier version): writing it again",
                    directory)
        return False
    try:
        for name, record in checksums.items():
            verify_file(os.path.join(directory, name), FileChecksums.from_json(record, f"{directory}: {name}"))
    except (OSError, ValueError) as error:  # a ChecksumError, a missing or truncated file, a damaged record
        log.warning("offload.infer: the cache %s is corrupt (%s): writing it again", directory, error)
        return False
    return True
