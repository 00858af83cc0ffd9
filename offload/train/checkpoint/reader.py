"""A checkpoint of `offload.train.checkpoint.rank_state` read at any world size, element range by element range.

Every rank file holds, per tensor, that rank's flat partition of the tensor padded at its end to
``world_size x partition`` elements (`offload.params.partition`, alignment 1). Element ``g`` of a
flat tensor saved by ``W`` ranks with partitions of ``P`` elements lives in rank ``g // P``'s file at
``g % P``. So any range of the flat tensor, and so any rank's partition at another world size, reads
from at most a few files: the loader repartitions on load (2 -> 1, 1 -> 3, ...) and the offline
consolidation (`offload.train.checkpoint.consolidate`) reads whole tensors the same way.

Reads go through tensorio with O_DIRECT (a page-aligned window around the range), never through a
memory map: reading a checkpoint larger than memory grows neither the process (mapped pages count
as its memory) nor the page cache. Opening checks every file's header, and that each file is long
enough for the tensors it lists, before anything is read: a truncated or empty file is an error
naming it.

Checksums (`offload.storage.file_checksums`, recorded in each rank's state file by file name, the state
files checked against their own: `offload.train.checkpoint.states_file`): opening checks every rank's state
file, the files written beside them and each tensor file's header against its record; every read is widened
to whole checksum chunks of its tensor and verified in tensorio's I/O threads as it completes, so a flipped
bit is a `tensorio.ChecksumError` naming the file, the tensor, the offset and both checksums. The tag's path
is made absolute once, here, and files are looked up by their name in it: relative, absolute or moved, the
same checks. A checkpoint saved before checksums were recorded is read unverified, with one warning.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Sequence

import torch

from tensorio import DIRECT_ALIGN, AioHandle, BufferPool, ChecksumError, Checksums, IOFuture

from offload.storage.file_checksums import FileChecksums, header_checksum
from offload.storage.host_copy import host_copy
from offload.storage.safetensors_reader import SafetensorsCheckpoint, TensorEntry
from offload.train.checkpoint.files import optimizer_file, params_file, require_file
from offload.train.checkpoint.states_file import decoded_state, read_states, read_states_file, verify_side_files

log = logging.getLogger("offload")

__all__ = ["READ_AHEAD_BYTES", "READ_BUFFER_BYTES", "CheckpointReader", "PendingRead", "ReadAhead"]

_BLOCK = 8 << 20
"""Bytes per read request: large sequential reads, 8 in flight."""

_POOL_BYTES = 512 << 20
"""Read buffers kept for reuse at most (`CheckpointReader.pool`)."""

READ_BUFFER_BYTES = (64 << 20) + 2 * DIRECT_ALIGN
"""Read buffers above it are taken in multiples of this size (64 MiB and the window's alignment slack), so
that the reads of a streamed copy, 64 MiB runs whatever their tensor, all share them; smaller reads take the
smallest of 1, 2, 4, ... 32 MiB (with the same slack) that holds them (`buffer_bytes`)."""


def buffer_bytes(nbytes: int) -> int:
    """The size of read buffer a read of ``nbytes`` (its aligned window) takes from the pool: a few size classes,
    so that reads of nearby sizes share buffers, while the pool's budget holds many small ones (the load keeps
    several reads and writes in flight, most of a few MiB: in 64 MiB buffers they would overflow it)."""
    size = 1 << 20
    while size + 2 * DIRECT_ALIGN < nbytes and size + 2 * DIRECT_ALIGN < READ_BUFFER_BYTES:
        size *= 2
    if nbytes <= size + 2 * DIRECT_ALIGN:
        return size + 2 * DIRECT_ALIGN
    return -(-nbytes // READ_BUFFER_BYTES) * READ_BUFFER_BYTES


@dataclass
class PendingRead:
    """Elements being read; `result` waits for them (sync point) and returns the tensor."""

    out: torch.Tensor | None
    """The result's storage when it is assembled from several pieces (else None: ``pieces[0]`` is it)."""
    pieces: list[tuple[int, IOFuture, torch.Tensor, int, int, torch.dtype, int, int]]
    """(first element in the result, the read, its buffer, first byte in it, bytes, dtype, tensor bytes read,
    of them bytes compared with their checksums) per piece."""
    count: int
    dtype: torch.dtype
    reader: "CheckpointReader"

    def result(self) -> torch.Tensor:
        """Wait for the reads; return the elements (a tensor of ``count`` elements). Raises TensorIOError."""
        single = None
        for first, future, buffer, skip, nbytes, dtype, read, verified in self.pieces:
            future.result()
            self.reader.bytes_read += read
            self.reader.bytes_verified += verified
            values = _view(buffer, skip, nbytes, dtype)
            if self.out is None:
                single = values
            else:
                host_copy(self.out[first:first + values.numel()], values)
        if self.out is None:
            return single if single is not None else torch.zeros(self.count, dtype=self.dtype)
        return self.out

    def wait(self) -> None:
        """Wait for the reads without raising or counting them (a read given up: its buffers may then be reused)."""
        for piece in self.pieces:
            piece[1].exception()


READ_AHEAD_BYTES = 64 << 20
"""Bytes a `ReadAhead` keeps in flight beyond the read being handed over, at most (the engine passes less:
one optimizer sub-group's state where that is smaller)."""


class ReadAhead:
    """Reads started ahead of their use, in the order they will be asked for, so that checking and staging
    one range overlaps reading the next ones.

    ``order``: the keys in the order `take` will be called (`OffloadAdam.load_reads`); ``start(key)`` starts a
    key's read (a `PendingRead`); ``nbytes(key)`` its size. Beyond the read being handed over, at most
    ``depth`` reads and ``max_bytes`` are in flight, but always the next one (so a range larger than the bound
    still overlaps its neighbour). A key asked for out of the planned order is read then (correct, not ahead).
    Call `close` at the end, whatever happened: it waits for the reads never taken.
    """

    def __init__(self, order: Sequence[Hashable], start: Callable[[Any], PendingRead], nbytes: Callable[[Any], int], *,
                 depth: int = 8, max_bytes: int = READ_AHEAD_BYTES) -> None:
        self._order, self._start, self._nbytes = list(order), start, nbytes
        self._depth, self._max_bytes = max(1, depth), max_bytes
        self._next = 0  # the first key of ``order`` not started yet
        self._started: dict[Hashable, tuple[PendingRead, int]] = {}
        self._bytes = 0
        self.most_ahead = 0
        """The most reads in flight at once beside the one being handed over (a measure for tests)."""

    def take(self, key: Hashable) -> torch.Tensor:
        """``key``'s elements (sync point: waits for its read); the reads after it are started first. Raises
        the read's TensorIOError / ChecksumError."""
        entry = self._started.pop(key, None)
        if entry is None:  # the first key, or one out of the planned order
            if self._next < len(self._order) and self._order[self._next] == key:
                self._next += 1
            entry = (self._start(key), 0)
        self._bytes -= entry[1]
        self._top_up()
        return entry[0].result()

    def _top_up(self) -> None:
        while self._next < len(self._order) and len(self._started) < self._depth:
            key = self._order[self._next]
            size = self._nbytes(key)
            if self._started and self._bytes + size > self._max_bytes:
                break
            self._next += 1
            self._started[key] = (self._start(key), size)
            self._bytes += size
        self.most_ahead = max(self.most_ahead, len(self._started))

    def close(self) -> None:
        """Wait for the reads started and never taken (after an error, or an order other than planned); drop
        them. Never raises."""
        started, self._started = self._started, {}
        for pending, _ in started.values():
            pending.wait()
        self._bytes = 0


class CheckpointReader:
    """The files of one checkpoint tag (``save_dir/<tag>``), saved by any number of ranks.

    ``tensor(kind, name)`` is the entry of rank 0's file of ``kind`` ("params" or "optimizer");
    `read` returns any element range of a tensor's flat (unpartitioned) form. Use as a context
    manager, or `close` it, to close its I/O handle. ``backend``: tensorio's, for the handle it makes
    (the engine passes its ``aio.backend``).

    Raises FileNotFoundError naming a missing file, SafetensorsError naming a file with a bad
    header or a truncated one, ValueError naming the file for a state file that is not one, or for
    rank files that disagree (tensors, sizes).
    """

    def __init__(self, path: str | os.PathLike, handle: AioHandle | None = None, *,
                 pool_bytes: int = _POOL_BYTES, backend: str = "auto") -> None:
        self.path = os.path.abspath(os.fspath(path))
        self.pool = BufferPool(pool_bytes)
        """The read buffers, reused once dropped (tensors of one size recur in every layer): memory
        faulted in once, not for every tensor."""
        self._own_handle = handle is None
        self.handle = handle if handle is not None else AioHandle(block_size=_BLOCK, queue_depth=8, backend=backend)
        self.file_sizes: dict[str, int] = {}
        self.checksums: dict[str, FileChecksums] = {}
        """Each tensor file's checksums, by file name (empty for a checkpoint saved before they were)."""
        self.bytes_read = 0
        """Tensor bytes read so far (each read widened to whole checksum chunks where they are recorded)."""
        self.bytes_verified = 0
        """Of `bytes_read`, the bytes whose checksums were compared (all of them in a checkpoint that has them)."""
        try:
            first = read_states_file(self.path, 0)
            self.state = decoded_state(first)
            self.world_size = int(self.state["world_size"])
            states = [first, *(read_states_file(self.path, rank) for rank in range(1, self.world_size))]
            files = [(state, name, sums) for state in states for name, sums in state.tensor_files()]
            self.checksums = {name: sums for _, name, sums in files if sums is not None}
            if not self.checksums:
                log.warning("%s: saved without checksums (before they were recorded): read without verifying its "
                            "bytes", self.path)
            else:
                for state, name, sums in files:
                    if sums is None:  # some ranks record them, this one not: not one checkpoint
                        raise ValueError(f"{state.path}: records no checksums for {name} while the other ranks "
                                         f"record theirs; the files are from different checkpoints")
                if not all(state.verified for state in states):
                    log.warning("%s: saved before its state files carried a checksum: their bytes are not verified "
                                "(the tensor files' are)", self.path)
            verify_side_files(states[0])
            self.files = {"params": self._open_all(params_file), "optimizer": self._open_all(optimizer_file)}
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> "CheckpointReader":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the I/O handle this reader made (not one it was given)."""
        if self._own_handle and self.handle is not None:
            self.handle.close()
        self.handle = None

    def rank_state(self, rank: int) -> dict[str, Any]:
        """The counters, schedule and client state that ``rank`` saved; rank 0's for a rank the
        checkpoint does not have (a world size larger than the one that saved it)."""
        if rank == 0 or rank >= self.world_size:
            return self.state
        return read_states(self.path, rank)

    def names(self, kind: str) -> list[str]:
        """The tensors of ``kind`` ("params" or "optimizer"), in file order."""
        return list(self.files[kind][0].entries)

    def tensor(self, kind: str, name: str) -> TensorEntry:
        """Rank 0's entry for ``name``: its dtype, and the saved partition's size (``shape[0]``)."""
        return self.files[kind][0][name]

    def model_config(self) -> dict[str, Any] | None:
        """The model's ``config.json`` saved beside the rank files, or None."""
        config = os.path.join(self.path, "config.json")
        if not os.path.isfile(config):
            return None
        with open(config, encoding="utf-8") as file:
            try:
                return json.load(file)
            except json.JSONDecodeError as error:
                raise ValueError(f"{config}: not a JSON model config ({error})") from None

    def read(self, kind: str, name: str, start: int, stop: int, *, numel: int | None = None) -> PendingRead:
        """Start reading elements ``[start, stop)`` of tensor ``name``'s flat form as saved (each rank's
        partition back to back). Elements at or past ``numel`` (the tensor's real size) read as zeros;
        None keeps the saved padding. Returns a `PendingRead` (``result()`` waits). Raises KeyError
        for an unknown tensor, TensorIOError at once when a file cannot be opened."""
        files = self.files[kind]
        entry = files[0][name]
        size = entry.shape[0]
        stop_data = min(stop, self.world_size * size if numel is None else numel)
        count = stop - start
        pieces = []
        for rank in range(max(0, start // size) if size else 0, self.world_size):
            lo, hi = max(start, rank * size), min(stop_data, (rank + 1) * size)
            if lo >= hi:
                if rank * size >= stop_data:
                    break
                continue
            piece = files[rank][name]
            first_byte = piece.offset + (lo - rank * size) * _itemsize(piece.dtype)
            pieces.append((lo - start, *self._start(piece, first_byte, (hi - lo) * _itemsize(piece.dtype))))
        whole = len(pieces) == 1 and pieces[0][0] == 0 and stop_data - start == count
        out = None
        if pieces and not whole:  # assembled from several files, or with zeros past the tensor's end
            nbytes = count * _itemsize(entry.dtype)
            out = self.pool.take(buffer_bytes(nbytes), torch.uint8)[:nbytes].view(entry.dtype)
            out[stop_data - start:] = 0
        return PendingRead(out, pieces, count, entry.dtype, self)

    def _start(self, piece: TensorEntry, first_byte: int,
               nbytes: int) -> tuple[IOFuture, torch.Tensor, int, int, torch.dtype, int, int]:
        path = piece.path
        sums = self._checksums_of(path)
        lo, hi = first_byte, first_byte + nbytes
        if sums is not None:  # widened to the tensor's whole checksum chunks, verified as the read completes
            chunk_lo, chunk_hi, values = sums.chunks(piece.name, lo - piece.offset, hi - piece.offset, piece.nbytes)
            lo, hi = piece.offset + chunk_lo, piece.offset + chunk_hi
        begin = lo // DIRECT_ALIGN * DIRECT_ALIGN
        end = -(-hi // DIRECT_ALIGN) * DIRECT_ALIGN
        size = self.file_sizes[path]
        length = min(end, size) - begin  # a window may end at the end of the file, unaligned
        buffer = self.pool.take(buffer_bytes(end - begin), torch.uint8)
        verify = Checksums(values, sums.chunk, hi - lo, start=lo - begin) if sums is not None else None
        future = self.handle.read(buffer[:length] if length < buffer.numel() else buffer, path, begin, verify=verify,
                                  what=f"tensor {piece.name!r}")
        return future, buffer, first_byte - begin, nbytes, piece.dtype, hi - lo, hi - lo if sums is not None else 0

    def _checksums_of(self, path: str) -> FileChecksums | None:
        """The checksums of the tensor file at ``path``, by its name in the tag; None only in a checkpoint that
        records none. Raises ValueError naming the file when the checkpoint records them but not for it."""
        if not self.checksums:
            return None
        sums = self.checksums.get(os.path.basename(path))
        if sums is None or os.path.dirname(path) != self.path:
            raise ValueError(f"{path}: the checkpoint {self.path} records no checksums for this file; it is not one "
                             f"of the checkpoint's files")
        return sums

    def _open_all(self, name_of) -> list[SafetensorsCheckpoint]:
        files = []
        for rank in range(self.world_size):
            path = require_file(self.path, name_of(rank))
            sums = self._checksums_of(path)
            if sums is not None:  # before its header is parsed: a flipped bit there is named as such
                try:
                    actual, length = header_checksum(path)
                except OSError:  # shorter than its header: the parse below names what is wrong
                    actual, length = sums.header, 0
                if actual != sums.header:
                    raise ChecksumError(path=path, offset=0, length=length, expected=sums.header, actual=actual,
                                        what="the safetensors header")
            files.append(SafetensorsCheckpoint(path, self.handle))
            if sums is not None and set(sums.tensors) != set(files[-1].entries):
                raise ValueError(f"{path}: holds other tensors than its checksums in {self.path}'s JSON list; the "
                                 f"file and the JSON are from different checkpoints")
        for file in files:
            self.file_sizes.update(file.file_sizes)
        first = files[0]
        for rank, file in enumerate(files[1:], start=1):
            if {n: e.shape for n, e in file.entries.items()} != {n: e.shape for n, e in first.entries.items()}:
                raise ValueError(f"{file.files[0]}: holds other tensors or sizes than {first.files[0]}; the rank files "
                                 f"are from different checkpoints")
        return files


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _view(buffer: torch.Tensor, skip: int, nbytes: int, dtype: torch.dtype) -> torch.Tensor:
    """``nbytes`` bytes of ``buffer`` from byte ``skip`` as ``dtype`` (a view when aligned for it, else a copy)."""
    raw = buffer[skip:skip + nbytes]
    if skip % _itemsize(dtype):
        raw = raw.clone()
    return raw.view(dtype)

