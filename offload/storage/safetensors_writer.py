"""Safetensors files written piece by piece (a checkpoint larger than RAM), and atomically.

The format (https://github.com/huggingface/safetensors, "Format"): an 8-byte little-endian header
length, a JSON header mapping each tensor name to its dtype, shape and ``data_offsets`` relative to
the data section, then the tensors' bytes back to back.
"""

from __future__ import annotations

import collections
import errno
import json
import logging
import os
import shutil
import struct
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Mapping, Sequence

import torch

from tensorio import DIRECT_ALIGN, AioHandle, BufferPool, IOFuture, aligned_tensor

from offload.storage.checkpoint_dir import fsync_dir
from offload.storage.direct_writes import StagedWrites, open_direct
from offload.storage.file_checksums import FileChecksums, TensorHasher

__all__ = ["SAFETENSORS_DTYPES", "DirectSafetensorsWriter", "SafetensorsWriter", "atomic_safetensors",
           "save_tensors_safetensors"]

log = logging.getLogger("offload")


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
                       metadata: Mapping[str, str] | None = None, *, data_align: int = 8,
                       checksums: bool = False) -> Iterator["SafetensorsWriter"]:
    """A `SafetensorsWriter` on a hidden temporary file beside ``path``, fsynced and renamed over
    ``path`` when the block ends without an error; on an error the temporary file is removed and
    ``path`` is untouched (``checksums``: the writer's `SafetensorsWriter.checksums` are set once the
    block has ended). Raises FileNotFoundError if the parent directory is missing."""
    path = Path(path)
    if not path.parent.is_dir():
        raise FileNotFoundError(f"{path}: directory {path.parent} does not exist; create it first")
    descriptor, temporary = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(descriptor)
    try:
        with SafetensorsWriter(temporary, layout, metadata, data_align=data_align, checksums=checksums) as out:
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

    Two ways to the disk, the same bytes:

    - buffered (the default): each run is written with pwrite where it belongs, and every 64 MiB the kernel is
      asked to write back what was written and drop it from the page cache;
    - ``handle`` given (a tensorio `AioHandle`): the tensors' bytes go out with O_DIRECT from a few page-aligned
      chunks (`offload.storage.direct_writes`, taken from ``pool`` when given), the page cache left alone; the
      caller's buffer is free again when `write` returns. Each element must then be written once. Where the
      file system refuses O_DIRECT, the writer falls back to the buffered way: `direct` is False and
      `buffered_reason` says why (also logged at debug level).

    ``preallocate``: reserve the file's blocks when it is opened (``posix_fallocate``; skipped where the file
    system cannot), so that a full disk is named before anything is written.

    Raises TypeError for a dtype safetensors cannot store, ValueError for a write outside a tensor or
    of another dtype (naming the tensor), OSError from the file system (ENOSPC from the preallocation
    names the file and the bytes it needs), TensorIOError naming the file for a failed O_DIRECT write.
    """

    def __init__(self, path: str | os.PathLike, layout: Mapping[str, tuple[torch.dtype, Sequence[int]]],
                 metadata: Mapping[str, str] | None = None, *, data_align: int = 8, checksums: bool = False,
                 handle: AioHandle | None = None, pool: BufferPool | None = None, preallocate: bool = False) -> None:
        head, self._places, end = _header(layout, metadata, data_align)
        self._data = len(head)
        self.path = os.fspath(path)
        self._hasher = TensorHasher({name: (self._data + start, numel * _itemsize(dtype))
                                     for name, (dtype, start, numel) in self._places.items()}, head) if checksums else None
        self.checksums: FileChecksums | None = None
        """With ``checksums``: the header's and each tensor's chunk checksums, once closed
        (`offload.storage.file_checksums`); tensors written front to back are hashed as they are written."""
        self.buffered_reason: str | None = None if handle is not None else "no I/O handle given"
        """Why the data is written through the page cache rather than with O_DIRECT; None when it is not."""
        self._direct: StagedWrites | None = None
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        self._unflushed = 0
        try:
            _pwrite_all(self._fd, head, 0)  # whole pages (data_align 4096) or the page cache's: never written with O_DIRECT
            if preallocate:
                _preallocate(self._fd, self._data + end, self.path)
            os.ftruncate(self._fd, self._data + end)  # the final size: the last partial page is written in place
            if handle is not None:
                fd, reason = open_direct(self.path)
                if fd is None:
                    self.buffered_reason = reason
                    log.debug("%s: written through the page cache: %s", self.path, reason)
                else:
                    self._direct = StagedWrites(handle, fd, self.path, pool=pool)
        except BaseException:
            os.close(self._fd)
            raise

    @property
    def direct(self) -> bool:
        """Whether the tensors' bytes are written with O_DIRECT (see `buffered_reason` when not)."""
        return self._direct is not None

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
        contiguous = flat.contiguous().view(torch.uint8)
        raw = contiguous.numpy()
        if self._hasher is not None:  # the bytes in flight, hashed once, on this thread
            self._hasher.feed(name, first * flat.element_size(), memoryview(raw).cast("B"))
        offset = self._data + start + first * flat.element_size()
        if self._direct is not None:
            self._direct.put(contiguous, offset)
            return
        _pwrite_all(self._fd, raw, offset)
        self._unflushed += raw.nbytes
        if self._unflushed >= _WRITE_BEHIND_BYTES:  # the disk writes the last bytes while the caller reads the next
            self._unflushed = 0
            _drop_cached(self._fd)

    def close(self) -> None:
        """Wait for the O_DIRECT writes, flush the file to the disk (fsync: this file only) and close it (with
        ``checksums``: finish them first). Raises TensorIOError for a failed write, OSError from fsync."""
        if self._fd >= 0:
            try:
                if self._direct is not None:
                    self._direct.finish()  # sync point: every write landed (or the first error raised)
                if self._hasher is not None:
                    self.checksums = self._hasher.finish(self._fd)
                os.fsync(self._fd)
                _drop_cached(self._fd)  # written and on the disk: its pages need not stay in the page cache
            finally:
                self._abandon()

    def _abandon(self) -> None:
        """After an error: wait for the writes in flight (never raises), close the descriptors."""
        if self._direct is not None:
            self._direct.abandon()
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> "SafetensorsWriter":
        return self

    def __exit__(self, *exc: object) -> None:
        if exc[0] is None:
            self.close()
        else:  # the file is given up (its directory or temporary name is removed): no fsync
            self._abandon()


class DirectSafetensorsWriter:
    """Write a safetensors file front to back with O_DIRECT through a tensorio handle: the header, then
    each tensor of ``layout`` in order, whole or in consecutive runs (`write`). The page cache is
    left alone (buffered writes of a large file ran at a tenth of the disk's speed on this
    project's disk), and writing overlaps what the caller does next:

    - A run that starts page-aligned in memory where the file is page-aligned (``data_align`` 4096
      and tensor sizes that are multiples of 4096 bytes keep it so) is written straight from the
      caller's tensor, with no copy; the writer holds a reference to it until its write is done
      (at most ``in_flight`` such writes at a time), so a pooled buffer is not handed out again
      while the disk still reads it.
    - Anything else goes through two page-aligned chunks of ``chunk_bytes``: one fills while the
      other is written. Values of another floating dtype than the tensor's are converted as they
      are copied into the chunk (one pass, no temporary).

    `close` waits for the writes, cuts the file to its size and fsyncs it. The file is what
    `SafetensorsWriter` writes with the same ``data_align``.

    Raises TypeError for a dtype safetensors cannot store, ValueError naming the tensor for a write
    out of order, of a dtype that cannot be converted or past its end, and for `close` before every
    tensor is whole; TensorIOError from the writes.
    """

    def __init__(self, path: str | os.PathLike, layout: Mapping[str, tuple[torch.dtype, Sequence[int]]],
                 metadata: Mapping[str, str] | None, handle: AioHandle, chunk_bytes: int = 64 << 20, *,
                 data_align: int = 8, in_flight: int = 4) -> None:
        head, places, end = _header(layout, metadata, data_align)
        self.path, self._handle = os.fspath(path), handle
        self._size = len(head) + end
        self._order = [(name, dtype, numel) for name, (dtype, _, numel) in places.items()]
        self._next, self._done = 0, 0  # the tensor being written, and its elements written
        chunk_bytes = max(DIRECT_ALIGN, chunk_bytes // DIRECT_ALIGN * DIRECT_ALIGN)
        self._chunks = [aligned_tensor(chunk_bytes, torch.uint8) for _ in range(2)]
        self._pending: list[IOFuture | None] = [None, None]
        self._current, self._fill, self._offset = 0, 0, 0  # chunk filling, its bytes, its file offset
        self._direct: collections.deque[tuple[IOFuture, torch.Tensor]] = collections.deque()
        self._in_flight = max(1, in_flight)
        open(self.path, "wb").close()
        self._put(torch.frombuffer(bytearray(head), dtype=torch.uint8))

    def write(self, name: str, values: torch.Tensor) -> None:
        """Append ``values`` (flattened; converted if of another floating dtype) to tensor ``name``, the
        one being written (or the next one). Do not modify ``values`` until `close`: it may be
        written from where it is."""
        if self._next < len(self._order) and self._done == self._order[self._next][2] and \
                name != self._order[self._next][0]:
            self._next, self._done = self._next + 1, 0
        if self._next >= len(self._order) or name != self._order[self._next][0]:
            expected = self._order[self._next][0] if self._next < len(self._order) else "nothing (all written)"
            raise ValueError(f"{self.path}: tensor {name!r} written out of order; next is {expected}")
        _, dtype, numel = self._order[self._next]
        flat = values.detach().reshape(-1)
        if flat.dtype != dtype and not (flat.dtype.is_floating_point and dtype.is_floating_point):
            raise ValueError(f"{self.path}: tensor {name!r} is {dtype}, got {flat.dtype} values")
        if self._done + flat.numel() > numel:
            raise ValueError(f"{self.path}: {flat.numel()} more elements overrun tensor {name!r} of {numel}")
        if flat.dtype != dtype:
            self._put_converted(flat, dtype)
        else:
            self._put(self._write_direct(flat.contiguous().view(torch.uint8)))
        self._done += flat.numel()
        if self._done == numel:
            self._next, self._done = self._next + 1, 0

    def _write_direct(self, raw: torch.Tensor) -> torch.Tensor:
        """Start writing the page-aligned head of ``raw`` from where it is, when memory and file are
        both page-aligned there; return the bytes left to copy."""
        whole = raw.numel() // DIRECT_ALIGN * DIRECT_ALIGN
        if not whole or raw.data_ptr() % DIRECT_ALIGN or (self._offset + self._fill) % DIRECT_ALIGN:
            return raw
        if self._fill:
            self._flush(self._fill)
        while len(self._direct) >= self._in_flight:  # sync point: bound the caller's buffers held
            self._direct.popleft()[0].result()
        self._direct.append((self._handle.write(raw[:whole], self.path, self._offset), raw))
        self._offset += whole
        return raw[whole:]

    def _put(self, raw: torch.Tensor) -> None:
        while raw.numel():
            chunk = self._chunks[self._current]
            take = min(raw.numel(), chunk.numel() - self._fill)
            chunk[self._fill:self._fill + take] = raw[:take]
            self._fill += take
            raw = raw[take:]
            if self._fill == chunk.numel():
                self._flush(chunk.numel())

    def _put_converted(self, flat: torch.Tensor, dtype: torch.dtype) -> None:
        """Copy ``flat`` into the chunks as ``dtype``, converting on the way."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        while flat.numel():
            chunk = self._chunks[self._current]
            take = (chunk.numel() - self._fill) // itemsize
            if self._fill % itemsize or take == 0:  # an element across the chunk's end: one at a time
                self._put(flat[:1].to(dtype).view(torch.uint8))
                flat = flat[1:]
                continue
            take = min(take, flat.numel())
            chunk[self._fill:self._fill + take * itemsize].view(dtype).copy_(flat[:take])
            self._fill += take * itemsize
            flat = flat[take:]
            if self._fill == chunk.numel():
                self._flush(chunk.numel())

    def _flush(self, nbytes: int) -> None:
        """Start writing the current chunk's first ``nbytes`` (a multiple of the alignment); switch chunks."""
        self._pending[self._current] = self._handle.write(self._chunks[self._current][:nbytes], self.path, self._offset)
        self._offset += nbytes
        self._current, self._fill = 1 - self._current, 0
        waiting = self._pending[self._current]
        if waiting is not None:  # sync point: the other chunk's write must be done before it is refilled
            self._pending[self._current] = None
            waiting.result()

    def close(self) -> None:
        """Write what is left, cut the file to its size, fsync it. Raises ValueError if a tensor is
        not whole, TensorIOError from the writes."""
        if self._chunks is None:
            return
        try:
            written = sum(numel for _, _, numel in self._order[:self._next]) + self._done
            if written != sum(numel for _, _, numel in self._order):
                missing = self._order[self._next][0]
                raise ValueError(f"{self.path}: closed before tensor {missing!r} was written whole")
            if self._fill:
                self._flush(-(-self._fill // DIRECT_ALIGN) * DIRECT_ALIGN)
            for future in self._in_flight_writes():
                future.result()
        finally:
            self._abandon()
        os.truncate(self.path, self._size)
        descriptor = os.open(self.path, os.O_RDONLY)
        try:
            os.fsync(descriptor)
        finally:
            os.close(descriptor)

    def _in_flight_writes(self) -> Iterator[IOFuture]:
        """Every write still in flight, each taken off its list as it is handed out."""
        for i, future in enumerate(self._pending):
            if future is not None:
                self._pending[i] = None
                yield future
        while self._direct:
            yield self._direct.popleft()[0]

    def _abandon(self) -> None:
        """Wait for whatever is still in flight without raising (after an error); drop the chunks."""
        for future in self._in_flight_writes():
            future.exception()
        self._chunks = None

    def __enter__(self) -> "DirectSafetensorsWriter":
        return self

    def __exit__(self, *exc: object) -> None:
        if exc[0] is None:
            self.close()
        else:
            self._abandon()


def _header(layout: Mapping[str, tuple[torch.dtype, Sequence[int]]], metadata: Mapping[str, str] | None,
            data_align: int = 8) -> tuple[bytes, dict[str, tuple[torch.dtype, int, int]], int]:
    """The safetensors header bytes (length prefix included, padded so the data starts at a multiple
    of ``data_align``, 8 as safetensors writes it, or a multiple of 8), each tensor's (dtype, byte
    offset in the data, elements), and the data's size.
    Raises TypeError for metadata that is not str to str or a dtype safetensors cannot store."""
    header: dict[str, object] = {}
    for key, value in (metadata or {}).items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise TypeError(f"metadata[{key!r}]: safetensors metadata maps str to str, got {type(value).__name__}")
    if metadata:
        header["__metadata__"] = dict(metadata)
    places: dict[str, tuple[torch.dtype, int, int]] = {}
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
        places[name] = (dtype, end, numel)
        end += nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-(8 + len(encoded)) % data_align)
    return struct.pack("<Q", len(encoded)) + encoded, places, end


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


_WRITE_BEHIND_BYTES = 64 << 20
"""Bytes a `SafetensorsWriter` writes before it asks the kernel to write its dirty pages back and drop the
clean ones (`_drop_cached`): the disk writes while the caller goes on (reading the next partition), and the
page cache holds at most about this much of the file, not a second copy of the whole checkpoint."""


def _drop_cached(fd: int) -> None:
    """``posix_fadvise(DONTNEED)`` on the whole file: Linux starts writing its dirty pages back (without
    waiting) and drops its clean ones from the page cache. Best effort: a system without it keeps them."""
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    except (AttributeError, OSError):
        pass


def _preallocate(fd: int, size: int, path: str) -> None:
    """Reserve the blocks of the file's ``size`` bytes. Where the file system cannot (EOPNOTSUPP, EINVAL,
    ENOSYS), nothing is reserved and the writes allocate as they go. Raises OSError (ENOSPC, EDQUOT) naming
    ``path``, the bytes needed and the bytes free."""
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as error:
        if error.errno in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            return
        free = shutil.disk_usage(os.path.dirname(os.path.abspath(path))).free
        raise OSError(error.errno, f"cannot reserve the file's {size:,} bytes ({error.strerror}); the file system "
                                   f"has {free:,} bytes free: free space or save to another directory",
                      path) from error


def _pwrite_all(fd: int, data, offset: int) -> None:
    view = memoryview(data).cast("B")
    while view:
        written = os.pwrite(fd, view, offset)
        view, offset = view[written:], offset + written
