"""Safetensors files written piece by piece (a checkpoint larger than RAM), and atomically.

The format (https://github.com/huggingface/safetensors, "Format"): an 8-byte little-endian header
length, a JSON header mapping each tensor name to its dtype, shape and ``data_offsets`` relative to
the data section, then the tensors' bytes back to back.
"""

from __future__ import annotations

import json
import os
import struct
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Mapping, Sequence

import torch

from offload.storage.checkpoint_dir import fsync_dir

__all__ = ["SAFETENSORS_DTYPES", "SafetensorsWriter", "atomic_safetensors", "save_tensors_safetensors"]


def save_tensors_safetensors(
    path: str | os.PathLike, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None
) -> None:
    """Write ``tensors`` to ``path`` in the safetensors format, atomically (see `atomic_safetensors`):
    readers see the old file or the new one, never a partial one. Any layout works (views, shared
    memory).

    Raises FileNotFoundError if the parent directory is missing, TypeError naming a key whose value is
    not a tensor or a metadata entry that is not str to str; the temporary file is removed on any error.
    """
    for name, tensor in tensors.items():
        if not isinstance(name, str) or not isinstance(tensor, torch.Tensor):
            raise TypeError(f"tensors[{name!r}]: expected a str key and a torch.Tensor, got {type(tensor).__name__}")
    with atomic_safetensors(path, {name: (t.dtype, t.shape) for name, t in tensors.items()}, metadata) as out:
        for name, tensor in tensors.items():
            out.write(name, tensor)


@contextmanager
def atomic_safetensors(path: str | os.PathLike, layout: Mapping[str, tuple[torch.dtype, Sequence[int]]],
                       metadata: Mapping[str, str] | None = None, *, data_align: int = 8) -> Iterator["SafetensorsWriter"]:
    """A `SafetensorsWriter` on a hidden temporary file beside ``path``, fsynced and renamed over
    ``path`` when the block ends without an error; on an error the temporary file is removed and
    ``path`` is untouched. Raises FileNotFoundError if the parent directory is missing."""
    path = Path(path)
    if not path.parent.is_dir():
        raise FileNotFoundError(f"{path}: directory {path.parent} does not exist; create it first")
    descriptor, temporary = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(descriptor)
    try:
        with SafetensorsWriter(temporary, layout, metadata, data_align=data_align) as out:
            yield out
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


SAFETENSORS_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
                       torch.int64: "I64", torch.int32: "I32", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL"}


class SafetensorsWriter:
    """Write a safetensors file piece by piece, so that a checkpoint larger than RAM can be saved.

    The header (each tensor's dtype, shape and place, and ``metadata``) is written when the file is
    opened, from ``layout`` (name -> (dtype, shape)), tensors back to back in that order; `write` then puts any
    run of a tensor's elements in place, in any order, so that only that run has to be in memory.
    Every element must be written before `close` (unwritten ones read as zeros). The file is what
    ``safetensors.torch.save_file`` would make of the same tensors, up to their order, and loads with
    ``safetensors.torch.load_file`` or ``safe_open``. ``data_align`` (a multiple of 8) pads the
    header so that the tensors' data starts at a multiple of it in the file. Not atomic by itself: write it inside
    `atomic_checkpoint`'s directory, or to a temporary name that you rename.

    Raises TypeError for a dtype safetensors cannot store, ValueError for a write outside a tensor or
    of another dtype (naming the tensor), OSError from the file system.
    """

    def __init__(self, path: str | os.PathLike, layout: Mapping[str, tuple[torch.dtype, Sequence[int]]],
                 metadata: Mapping[str, str] | None = None, *, data_align: int = 8) -> None:
        header: dict[str, object] = {}
        for key, value in (metadata or {}).items():
            if not isinstance(key, str) or not isinstance(value, str):
                raise TypeError(f"metadata[{key!r}]: safetensors metadata maps str to str, got {type(value).__name__}")
        if metadata:
            header["__metadata__"] = dict(metadata)
        self._places: dict[str, tuple[torch.dtype, int, int]] = {}
        end = 0
        for name, (dtype, shape) in layout.items():
            if dtype not in SAFETENSORS_DTYPES:
                raise TypeError(f"tensor {name!r}: dtype {dtype} cannot be stored in safetensors")
            numel = 1
            for size in shape:
                numel *= int(size)
            nbytes = numel * torch.empty((), dtype=dtype).element_size()
            header[name] = {"dtype": SAFETENSORS_DTYPES[dtype], "shape": [int(s) for s in shape],
                            "data_offsets": [end, end + nbytes]}
            self._places[name] = (dtype, end, numel)
            end += nbytes
        encoded = json.dumps(header, separators=(",", ":")).encode()
        # The data starts 8-byte aligned, as safetensors writes it, or ``data_align``-aligned (a multiple of 8).
        encoded += b" " * (-(8 + len(encoded)) % data_align)
        self._data = 8 + len(encoded)
        self.path = os.fspath(path)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            _pwrite_all(self._fd, struct.pack("<Q", len(encoded)) + encoded, 0)
            os.ftruncate(self._fd, self._data + end)
        except BaseException:
            os.close(self._fd)
            raise

    def write(self, name: str, values: torch.Tensor, first: int = 0) -> None:
        """Put ``values`` (flattened) into tensor ``name`` from its element ``first`` on."""
        if name not in self._places:
            raise ValueError(f"{self.path}: no tensor {name!r} in the layout")
        dtype, start, numel = self._places[name]
        flat = values.detach().reshape(-1)
        if flat.dtype != dtype:
            raise ValueError(f"{self.path}: tensor {name!r} is {dtype}, got {flat.dtype} values")
        if first < 0 or first + flat.numel() > numel:
            raise ValueError(f"{self.path}: elements {first}..{first + flat.numel()} are outside tensor {name!r} "
                             f"of {numel} elements")
        raw = flat.contiguous().view(torch.uint8).numpy()
        _pwrite_all(self._fd, raw, self._data + start + first * flat.element_size())

    def close(self) -> None:
        """Flush the file to the disk (fsync) and close it."""
        if self._fd >= 0:
            try:
                os.fsync(self._fd)
            finally:
                os.close(self._fd)
                self._fd = -1

    def __enter__(self) -> "SafetensorsWriter":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _pwrite_all(fd: int, data, offset: int) -> None:
    view = memoryview(data).cast("B")
    while view:
        written = os.pwrite(fd, view, offset)
        view, offset = view[written:], offset + written
