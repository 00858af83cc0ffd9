"""Safetensors checkpoints read in place, with O_DIRECT, through tensorio.

A checkpoint directory holds one ``model.safetensors`` or shards listed by
``model.safetensors.index.json``. Each file is an 8-byte little-endian header length, a JSON header
(name -> dtype, shape, ``data_offsets`` relative to the data section), then the tensors' bytes.

A tensor's bytes start 8-byte aligned in the file, not 4096-byte aligned as O_DIRECT needs, so we
read the page-aligned *window* around a group of tensors into a page-aligned buffer and view each
tensor inside it. Tensors whose windows touch (a decoder layer's tensors are usually back to back in
a shard) share one window: one read per layer per file. Nothing is mmapped and, apart from the last
partial page of a file, nothing goes through the page cache.

    checkpoint = SafetensorsCheckpoint(directory, handle)        # headers read, sizes checked
    windows = plan_windows([checkpoint.entries[n] for n in names], checkpoint.file_sizes)
    buffer = tensorio.locked_tensor(windows_nbytes(windows))
    for future in read_windows(handle, windows, buffer): future.result()
    views = tensor_views(windows, buffer)                        # name -> tensor inside buffer
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from tensorio import DIRECT_ALIGN, AioHandle, IOFuture, aligned_tensor

__all__ = [
    "INDEX_NAME",
    "SINGLE_NAME",
    "SafetensorsCheckpoint",
    "SafetensorsError",
    "TensorEntry",
    "Window",
    "plan_windows",
    "read_windows",
    "tensor_views",
    "windows_nbytes",
]

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"

#: safetensors dtype strings -> torch dtypes (those this torch build has).
DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, attr)
    for name, attr in (
        ("F64", "float64"), ("F32", "float32"), ("F16", "float16"), ("BF16", "bfloat16"),
        ("I64", "int64"), ("I32", "int32"), ("I16", "int16"), ("I8", "int8"), ("U8", "uint8"),
        ("U16", "uint16"), ("U32", "uint32"), ("U64", "uint64"), ("BOOL", "bool"),
        ("F8_E4M3", "float8_e4m3fn"), ("F8_E5M2", "float8_e5m2"),
    )
    if hasattr(torch, attr)
}

# A header larger than this is not a safetensors header (the format caps it at 100 MB).
_MAX_HEADER = 100_000_000


class SafetensorsError(ValueError):
    """A checkpoint file that is not valid safetensors: a bad header, a truncated file, a bad index."""


@dataclass(frozen=True, slots=True)
class TensorEntry:
    """Where one tensor's bytes are: file, absolute byte offset and length, with its dtype and shape."""

    name: str
    path: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    """Absolute offset of the first byte in ``path`` (header included)."""
    nbytes: int

    @property
    def end(self) -> int:
        return self.offset + self.nbytes


@dataclass(frozen=True, slots=True)
class Window:
    """One read: bytes [offset, offset + nbytes) of ``path`` into buffer bytes [buffer_offset, ...)."""

    path: str
    offset: int
    """Page-aligned file offset."""
    nbytes: int
    """Page-aligned length, except where the window ends at the end of the file."""
    buffer_offset: int
    """Page-aligned offset in the buffer."""
    entries: tuple[TensorEntry, ...]


def _align_down(value: int, align: int) -> int:
    return value // align * align


def _align_up(value: int, align: int) -> int:
    return -(-value // align) * align


def plan_windows(entries: Sequence[TensorEntry], file_sizes: Mapping[str, int], *,
                 align: int = DIRECT_ALIGN) -> list[Window]:
    """The aligned windows that cover ``entries``, packed one after another into one buffer.

    Each tensor needs the window from its first byte rounded down to ``align`` to its last byte
    rounded up (clipped at the end of its file, whose size ``file_sizes`` gives). Tensors of one file
    whose windows touch or overlap share one window, so contiguous tensors cost one read. Windows are
    ordered by file (first appearance in ``entries``) then offset. Pure: no I/O.
    """
    by_file: dict[str, list[TensorEntry]] = {}
    for entry in entries:
        by_file.setdefault(entry.path, []).append(entry)
    windows: list[Window] = []
    buffer_offset = 0
    for path, group in by_file.items():
        size = file_sizes[path]
        group.sort(key=lambda e: (e.offset, e.nbytes))
        start, end, members = None, 0, []
        for entry in group:
            lo, hi = _align_down(entry.offset, align), min(_align_up(entry.end, align), size)
            if start is not None and lo <= end:  # touches the open window: extend it
                end = max(end, hi)
                members.append(entry)
                continue
            if start is not None:
                windows.append(Window(path, start, end - start, buffer_offset, tuple(members)))
                buffer_offset += _align_up(end - start, align)
            start, end, members = lo, hi, [entry]
        if start is not None:
            windows.append(Window(path, start, end - start, buffer_offset, tuple(members)))
            buffer_offset += _align_up(end - start, align)
    return windows


def windows_nbytes(windows: Sequence[Window], *, align: int = DIRECT_ALIGN) -> int:
    """Buffer bytes ``windows`` need (each window starts page-aligned in the buffer)."""
    return max((w.buffer_offset + _align_up(w.nbytes, align) for w in windows), default=0)


def read_windows(handle: AioHandle, windows: Sequence[Window], buffer: torch.Tensor) -> list[IOFuture]:
    """Start reading each window into its place in ``buffer`` (a 1-D uint8 tensor, page-aligned for
    O_DIRECT, at least ``windows_nbytes(windows)`` long). Returns one future per window; do not touch
    ``buffer`` until all are done. Raises ValueError for a buffer too small; the futures raise
    TensorIOError (a short read names the file, offset and length)."""
    need = windows_nbytes(windows)
    if buffer.dtype != torch.uint8 or buffer.dim() != 1 or buffer.numel() < need:
        raise ValueError(f"buffer must be a 1-D uint8 tensor of at least {need} bytes, got "
                         f"{buffer.dtype} of shape {tuple(buffer.shape)}")
    return [handle.read(buffer[w.buffer_offset: w.buffer_offset + w.nbytes], w.path, w.offset) for w in windows]


def tensor_views(windows: Sequence[Window], buffer: torch.Tensor) -> dict[str, torch.Tensor]:
    """Each tensor of ``windows`` as a view into ``buffer`` (after `read_windows` has completed).

    A tensor whose bytes do not start at a multiple of its element size in the buffer (a file whose
    header was not padded to 8 bytes) cannot be viewed; it is copied into its own memory instead.
    """
    views: dict[str, torch.Tensor] = {}
    for window in windows:
        for entry in window.entries:
            start = window.buffer_offset + entry.offset - window.offset
            raw = buffer[start: start + entry.nbytes]
            itemsize = torch.empty((), dtype=entry.dtype).element_size()
            if start % itemsize:
                raw = raw.clone()  # a fresh allocation is aligned for any dtype
            views[entry.name] = raw.view(entry.dtype).view(entry.shape)
    return views


class SafetensorsCheckpoint:
    """The tensors of a checkpoint directory (or of one .safetensors file), with their places.

    Opening reads every file's header (through ``handle``, with O_DIRECT) and checks, before any
    tensor is read, that each listed file exists, that each header is valid and that each file is
    long enough for the tensors its header places in it.

    Raises FileNotFoundError naming the directory or the missing shard (and the index listing it),
    SafetensorsError naming the file for a bad header, a truncated file or an index that disagrees
    with a shard's header.
    """

    def __init__(self, path: str | os.PathLike, handle: AioHandle) -> None:
        path = os.path.abspath(os.fspath(path))
        self.index_path: str | None = None
        if os.path.isfile(path):
            self.directory, files = os.path.dirname(path), [path]
            index: dict[str, str] = {}
        elif os.path.isdir(path):
            self.directory = path
            files, index = self._list_files(path)
        else:
            raise FileNotFoundError(f"checkpoint {path}: no such file or directory")
        self.file_sizes: dict[str, int] = {}
        self.entries: dict[str, TensorEntry] = {}
        self.metadata: dict[str, dict[str, str]] = {}
        for file in files:
            self._read_file(file, handle)
        for name, file in index.items():
            entry = self.entries.get(name)
            if entry is None or entry.path != file:
                raise SafetensorsError(
                    f"{self.index_path}: lists tensor {name!r} in {os.path.basename(file)}, but that file's header "
                    f"does not hold it; the index and the shards are from different checkpoints")

    def _list_files(self, directory: str) -> tuple[list[str], dict[str, str]]:
        index_path = os.path.join(directory, INDEX_NAME)
        if os.path.isfile(index_path):
            self.index_path = index_path
            with open(index_path, encoding="utf-8") as f:
                try:
                    weight_map = json.load(f)["weight_map"]
                except (json.JSONDecodeError, KeyError, TypeError) as exc:
                    raise SafetensorsError(f"{index_path}: not a safetensors index (no weight_map: {exc})") from None
            index = {name: os.path.join(directory, file) for name, file in weight_map.items()}
            files = sorted(set(index.values()))
            for file in files:
                if not os.path.isfile(file):
                    raise FileNotFoundError(f"checkpoint shard {file} is missing; {index_path} lists it "
                                            f"(copy the whole checkpoint, or fix the index)")
            return files, index
        single = os.path.join(directory, SINGLE_NAME)
        if os.path.isfile(single):
            return [single], {}
        found = sorted(os.path.join(directory, f) for f in os.listdir(directory) if f.endswith(".safetensors"))
        if len(found) == 1:
            return found, {}
        pickled = sorted(f for f in os.listdir(directory) if f.endswith(".bin") and f.startswith("pytorch_model"))
        convert = (f"; it holds {', '.join(pickled)} (pickle, which is never loaded here: it could run code): convert "
                   f"it once with transformers.AutoModelForCausalLM.from_pretrained({directory!r})"
                   f".save_pretrained({directory!r}), which writes {SINGLE_NAME} beside it") if pickled else ""
        raise FileNotFoundError(
            f"checkpoint {directory}: no {SINGLE_NAME} and no {INDEX_NAME}"
            + (f" (and {len(found)} .safetensors files, so it is not clear which are the model)" if found else "")
            + convert)

    def _read_file(self, path: str, handle: AioHandle) -> None:
        size = os.stat(path).st_size
        if size < 8:
            raise SafetensorsError(f"{path}: {size} bytes, too short for a safetensors header (truncated?)")
        # 1. The header length and the header itself, read page-aligned (O_DIRECT; the page cache is left alone).
        head = _read_prefix(handle, path, min(size, DIRECT_ALIGN))
        (length,) = struct.unpack("<Q", head[:8].numpy().tobytes())
        if length > _MAX_HEADER or 8 + length > size:
            raise SafetensorsError(f"{path}: header length {length} does not fit in the file of {size} bytes; "
                                   f"not a safetensors file, or truncated")
        if 8 + length > head.numel():
            head = _read_prefix(handle, path, min(size, _align_up(8 + length, DIRECT_ALIGN)))
        try:
            header = json.loads(head[8: 8 + length].numpy().tobytes())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise SafetensorsError(f"{path}: the header is not valid JSON ({exc}); not a safetensors file") from None
        if not isinstance(header, dict):
            raise SafetensorsError(f"{path}: the header is not a JSON object")
        # 2. Every tensor's absolute place, checked against the file's size.
        self.metadata[path] = header.pop("__metadata__", None) or {}
        data = 8 + length
        for tensor, info in header.items():
            try:
                dtype = DTYPES[info["dtype"]]
                shape = tuple(int(s) for s in info["shape"])
                begin, end = (int(v) for v in info["data_offsets"])
            except (KeyError, TypeError, ValueError) as exc:
                raise SafetensorsError(f"{path}: tensor {tensor!r} has a bad header entry {info!r} ({exc!r})") from None
            numel = 1
            for s in shape:
                numel *= s
            if end - begin != numel * torch.empty((), dtype=dtype).element_size() or begin < 0:
                raise SafetensorsError(f"{path}: tensor {tensor!r} has data_offsets {begin}..{end}, which do not "
                                       f"match its shape {list(shape)} and dtype {info['dtype']}")
            if data + end > size:
                raise SafetensorsError(
                    f"{path} is truncated: it is {size} bytes long, but its header places tensor {tensor!r} up to "
                    f"byte {data + end}; copy the file again")
            if tensor in self.entries:
                raise SafetensorsError(f"{path}: tensor {tensor!r} is also in {self.entries[tensor].path}")
            self.entries[tensor] = TensorEntry(tensor, path, dtype, shape, data + begin, end - begin)
        self.file_sizes[path] = size

    @property
    def files(self) -> list[str]:
        """The checkpoint's safetensors files, sorted."""
        return sorted(self.file_sizes)

    def __contains__(self, name: str) -> bool:
        return name in self.entries

    def __getitem__(self, name: str) -> TensorEntry:
        return self.entries[name]

    def windows(self, names: Sequence[str]) -> list[Window]:
        """`plan_windows` for the named tensors. Raises KeyError for a name not in the checkpoint."""
        return plan_windows([self.entries[name] for name in names], self.file_sizes)

    def dominant_dtype(self) -> torch.dtype | None:
        """The floating dtype holding the most bytes (the checkpoint's dtype), or None if none is floating."""
        totals: dict[torch.dtype, int] = {}
        for entry in self.entries.values():
            if entry.dtype.is_floating_point:
                totals[entry.dtype] = totals.get(entry.dtype, 0) + entry.nbytes
        return max(totals, key=totals.__getitem__) if totals else None


def _read_prefix(handle: AioHandle, path: str, nbytes: int) -> torch.Tensor:
    buffer = aligned_tensor(nbytes, torch.uint8)
    handle.read(buffer, path, 0).result()
    return buffer
