"""Checksums of a safetensors file's header and of each tensor's bytes in chunks, and their JSON record.

A record (``FileChecksums.to_json``), kept in the checkpoint's JSON beside the file it describes::

    {"algorithm": "xxh3_64", "chunk": 8388608, "header": "<16 hex digits>",
     "tensors": {"<name>": ["<16 hex digits>", ...], ...}}

``header`` hashes the file's first ``8 + header length`` bytes (the length prefix and the JSON header);
tensor ``name``'s chunk ``k`` hashes its bytes ``[k * chunk, min((k + 1) * chunk, nbytes))`` counted from
the tensor's first byte. Chunked per tensor so that a reader of any element range (another world size,
the offline consolidation) verifies it by reading at most one chunk more on each side.

`TensorHasher` computes the chunks while a writer streams each tensor front to back (the saving
thread hashes what it writes, no second pass); a tensor written out of order, or not whole, is hashed
from the file when the writer closes.
"""

from __future__ import annotations

import errno
import os
from collections import deque
from dataclasses import dataclass

import torch
import xxhash

from tensorio import CHECKSUM_ALGORITHM, AioHandle, ChecksumError, aligned_tensor, checksum

__all__ = ["CHUNK", "FileChecksums", "TensorHasher", "header_checksum", "verify_file"]

CHUNK = 8 << 20
"""Bytes per tensor chunk checksum."""


@dataclass(frozen=True, slots=True)
class FileChecksums:
    """The checksums of one safetensors file (see the module docstring)."""

    header: int
    tensors: dict[str, tuple[int, ...]]
    chunk: int = CHUNK

    def to_json(self) -> dict:
        """The JSON record."""
        return {"algorithm": CHECKSUM_ALGORITHM, "chunk": self.chunk, "header": f"{self.header:016x}",
                "tensors": {name: [f"{value:016x}" for value in values] for name, values in self.tensors.items()}}

    @classmethod
    def from_json(cls, record: object, where: str) -> "FileChecksums":
        """Read a record back. Raises ValueError naming ``where`` for one that is not a record of this format."""
        try:
            if record["algorithm"] != CHECKSUM_ALGORITHM:  # type: ignore[index]
                raise ValueError(f"algorithm {record['algorithm']!r} is not {CHECKSUM_ALGORITHM}")  # type: ignore[index]
            chunk = int(record["chunk"])  # type: ignore[index]
            if chunk < 1:
                raise ValueError(f"chunk {chunk} < 1")
            return cls(header=int(record["header"], 16),  # type: ignore[index]
                       tensors={str(name): tuple(int(v, 16) for v in values)
                                for name, values in record["tensors"].items()},  # type: ignore[index]
                       chunk=chunk)
        except (KeyError, TypeError, ValueError, AttributeError) as error:
            raise ValueError(f"{where}: not a checksum record of this version ({error}); the checkpoint's JSON is "
                             f"damaged") from None

    def chunks(self, name: str, first: int, stop: int, nbytes: int) -> tuple[int, int, tuple[int, ...]]:
        """For bytes ``[first, stop)`` of tensor ``name`` of ``nbytes`` bytes (counted from its first byte):
        the chunks covering them, as (first byte of the first chunk, end of the last, their checksums)."""
        lo, hi = first // self.chunk, -(-stop // self.chunk)
        return lo * self.chunk, min(hi * self.chunk, nbytes), self.tensors[name][lo:hi]


class TensorHasher:
    """Chunk checksums of the tensors of one file, fed front to back (`feed`), finished from the file for
    any tensor that was not (`finish`)."""

    def __init__(self, places: dict[str, tuple[int, int]], header: bytes, chunk: int | None = None) -> None:
        """``places``: tensor name -> (absolute byte offset in the file, bytes); ``chunk``: bytes per checksum,
        default `CHUNK` as it is when the hasher is made (tests make it small)."""
        chunk = CHUNK if chunk is None else chunk
        self.places, self.chunk = places, chunk
        self.header = checksum(header)
        self._fed: dict[str, int] = {name: 0 for name in places}  # bytes hashed in order so far; -1: out of order
        self._state = {name: xxhash.xxh3_64() for name in places}
        self._values: dict[str, list[int]] = {name: [] for name in places}

    def feed(self, name: str, first: int, data: memoryview) -> None:
        """Bytes ``data`` of tensor ``name`` from its byte ``first`` on, as they are written."""
        fed = self._fed[name]
        if fed != first:  # not the next bytes: hashed from the file at the end instead
            self._fed[name] = -1
            return
        state, nbytes, values = self._state[name], self.places[name][1], self._values[name]
        while len(data):
            take = min(len(data), self.chunk - fed % self.chunk)
            state.update(data[:take])
            fed += take
            data = data[take:]
            if fed % self.chunk == 0 or fed == nbytes:
                values.append(state.intdigest())
                state.reset()
        self._fed[name] = fed

    def finish(self, fd: int) -> FileChecksums:
        """The file's checksums, reading from ``fd`` the tensors not fed whole and in order."""
        tensors = {}
        for name, (offset, nbytes) in self.places.items():
            if self._fed[name] == nbytes:
                tensors[name] = tuple(self._values[name])
                continue
            tensors[name] = tuple(checksum(_pread_all(fd, min(self.chunk, nbytes - first), offset + first, ""))
                                  for first in range(0, nbytes, self.chunk))
        return FileChecksums(self.header, tensors, self.chunk)


def _pread_all(fd: int, length: int, offset: int, path: str) -> bytes:
    parts, done = [], 0
    while done < length:
        part = os.pread(fd, length - done, offset + done)
        if not part:  # a sparse tail never written reads as zeros; a file cut short does not
            raise OSError(errno.EIO, f"{path or f'fd {fd}'}: ends at byte {offset + done}, before the {length} bytes at "
                                     f"offset {offset} its header places there; the file is truncated")
        parts.append(part)
        done += len(part)
    return b"".join(parts)


def header_checksum(path: str) -> tuple[int, int]:
    """(checksum, bytes) of the safetensors header of the file at ``path`` (length prefix included)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        prefix = _pread_all(fd, 8, 0, path)
        header = prefix + _pread_all(fd, int.from_bytes(prefix, "little"), 8, path)
    finally:
        os.close(fd)
    return checksum(header), len(header)


VERIFY_AHEAD = 4
"""Chunks `verify_file` reads ahead of the one it hashes (each a buffer of the file's largest chunk and two
pages: 32 MiB at the default chunk)."""


def verify_file(path: str, record: FileChecksums) -> int:
    """Read the safetensors file at ``path`` front to back, a chunk at a time, and check its header and every
    tensor against ``record``; return the bytes checked. The chunks are read through tensorio (O_DIRECT where
    the file system has it: the page cache is not filled with a file read once), `VERIFY_AHEAD` of them in
    flight while this thread hashes the one before. Raises tensorio.ChecksumError naming the file, the tensor
    (or the header), the offset and both checksums; ValueError for a file whose header does not list the
    tensors the record has; OSError for a file that cannot be read (tensorio's error names a short one)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        prefix = _pread_all(fd, 8, 0, path)
        length = int.from_bytes(prefix, "little")
        header = prefix + _pread_all(fd, length, 8, path)
        size = os.fstat(fd).st_size
    finally:
        os.close(fd)
    if checksum(header) != record.header:
        raise ChecksumError(path=path, offset=0, length=len(header), expected=record.header,
                            actual=checksum(header), what="the safetensors header")
    places = _places(header, path)
    if set(places) != set(record.tensors):
        raise ValueError(f"{path}: holds tensors {sorted(places)[:5]}..., its checksums are for "
                         f"{sorted(record.tensors)[:5]}...; the file and the checkpoint's JSON do not belong together")
    short = next(((name, offset, nbytes) for name, (offset, nbytes) in places.items() if offset + nbytes > size), None)
    if short is not None:
        raise OSError(errno.EIO, f"{path}: ends at byte {size}, before the {short[2]} bytes of tensor {short[0]!r} at "
                                 f"offset {short[1]} its header places there; the file is truncated")
    chunks = sorted((offset + first, min(record.chunk, nbytes - first), name, index)
                    for name, (offset, nbytes) in places.items()
                    for index, first in enumerate(range(0, nbytes, record.chunk)))
    return len(header) + _verify_chunks(path, size, chunks, record)


def _verify_chunks(path: str, size: int, chunks: list[tuple[int, int, str, int]], record: FileChecksums) -> int:
    """Read and check ``chunks`` (file offset, bytes, tensor, chunk index; in file order) of ``path``
    (``size`` bytes long); the bytes checked. Each is read from the page boundary below it, so that the
    read is O_DIRECT's, into one of `VERIFY_AHEAD` buffers; every read in flight is waited for before an
    error is raised (no buffer is dropped under a read)."""
    page = 4096
    pending: deque = deque()
    upcoming = iter(chunks)
    checked = 0
    with AioHandle(block_size=1 << 20, queue_depth=16) as handle:

        def read_next(buffer) -> None:
            chunk = next(upcoming, None)
            if chunk is not None:
                start = chunk[0] // page * page
                end = min(size, -(-(chunk[0] + chunk[1]) // page) * page)
                pending.append((handle.read(buffer[:end - start], path, start), buffer, chunk[0] - start, chunk))

        try:
            largest = max((nbytes for _, nbytes, _, _ in chunks), default=0)  # a small file: small buffers
            for _ in range(min(VERIFY_AHEAD, len(chunks))):
                read_next(aligned_tensor(largest + 2 * page, torch.uint8))
            while pending:
                future, buffer, skip, (offset, nbytes, name, index) = pending.popleft()
                future.result()
                actual = checksum(memoryview(buffer[skip:skip + nbytes].numpy()))
                values = record.tensors[name]
                if index >= len(values) or actual != values[index]:
                    raise ChecksumError(path=path, offset=offset, length=nbytes,
                                        expected=values[index] if index < len(values) else 0, actual=actual,
                                        what=f"tensor {name!r}")
                checked += nbytes
                read_next(buffer)
        finally:
            for future, *_ in pending:  # an error raised: the reads still in flight land first
                future.exception()
    return checked


def _places(header: bytes, path: str) -> dict[str, tuple[int, int]]:
    """Tensor name -> (absolute offset, bytes), from a safetensors header (length prefix included)."""
    import json

    try:
        entries = json.loads(header[8:])
        return {name: (len(header) + int(e["data_offsets"][0]), int(e["data_offsets"][1]) - int(e["data_offsets"][0]))
                for name, e in entries.items() if name != "__metadata__"}
    except (ValueError, KeyError, TypeError, IndexError, AttributeError) as error:
        raise ValueError(f"{path}: not a safetensors header ({error})") from None
