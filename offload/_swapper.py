"""The optimizer-state swapper: sub-group state moved between one swap file and a few locked buffers.

One `SwapRecord` per offloaded sub-group holds everything about it: where its state is, which of
its two file slots is current, the buffer it occupies and the I/O in flight. The file holds two
slots per sub-group (A/B): a step reads the committed slot and writes the other one, and only
`commit()`, called once every write of the step has succeeded, makes the new slots current. So a
failed step leaves the previous state on disk, where a reload finds it.
"""

from __future__ import annotations

import collections
import contextlib
import enum
import errno
import os
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch

from tensorio import AioConfig, AioHandle, IOFuture, TensorIOError, aligned_tensor, locked_tensor

from ._subgroups import SubGroupPlan

PAGE = 4096


@dataclass(kw_only=True, slots=True)
class SwapConfig:
    """How offloaded optimizer state is swapped (DeepSpeed's ``offload_optimizer`` key names)."""

    buffer_count: int = 4
    """Locked buffers of one sub-group's state each. At least ``buffers_needed``."""

    pin_memory: bool = True
    """Lock (mlock/pin) the buffers; False uses plain page-aligned memory."""

    pipeline_read: bool = True
    """Read the next sub-group's state while the current one is updated."""

    pipeline_write: bool = True
    """Write the previous sub-group's state while the current one is updated."""

    sub_group_size: int = 1 << 22
    """Most parameter elements updated by one kernel call, and so held by one buffer. At least 1024."""

    aio: AioConfig = field(default_factory=AioConfig)
    """tensorio settings of the swap file's I/O (an `AioConfig` or a dict of its keys)."""

    def __post_init__(self) -> None:
        for key in ("pin_memory", "pipeline_read", "pipeline_write"):
            if not isinstance(getattr(self, key), bool):
                raise ValueError(f"{key}: {getattr(self, key)!r} is not allowed; use true or false")
        for key, minimum in (("buffer_count", 1), ("sub_group_size", 1024)):
            value = getattr(self, key)
            if isinstance(value, float) and value.is_integer():  # JSON configs spell 1e9
                value = int(value)
                setattr(self, key, value)
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise ValueError(f"{key}: {value!r} is not allowed; use an integer >= {minimum}")
        if isinstance(self.aio, Mapping):
            self.aio = AioConfig.from_dict(dict(self.aio))
        if not isinstance(self.aio, AioConfig):
            raise ValueError(f"aio: {self.aio!r} is not allowed; use an AioConfig or a dict of its keys")
        if self.buffer_count < self.buffers_needed:
            raise ValueError(f"buffer_count: {self.buffer_count} is too few; pipeline_read={self.pipeline_read} "
                             f"and pipeline_write={self.pipeline_write} need at least {self.buffers_needed}")

    @property
    def buffers_needed(self) -> int:
        """Buffers the pipeline needs: one being updated, one being read ahead, one being written."""
        return 1 + int(self.pipeline_read) + int(self.pipeline_write)

    @property
    def read_ahead(self) -> int:
        """Sub-groups that may be read ahead of the one being updated: every other buffer.

        A sub-group is written from the buffer it was updated in, so a write needs no buffer of
        its own; read-ahead only ever takes buffers that are free (see `StateSwapper.free_buffers`).
        """
        return self.buffer_count - 1 if self.pipeline_read else 0


class Where(enum.Enum):
    """Where a sub-group's state is."""

    ON_DISK = "on disk"
    READING = "reading"
    RESIDENT = "resident"
    WRITING = "writing"


@dataclass(slots=True, eq=False)
class SwapRecord:
    """Everything about one offloaded sub-group's state."""

    plan: SubGroupPlan
    offset: int
    """Byte offset of slot 0 in the swap file; slot 1 follows at ``offset + plan.state_bytes``."""
    slot: int = 0
    """The committed slot: the state as of the last committed step."""
    on_disk: bool = False
    """Whether the committed slot was ever written; if not, the state is all zeros."""
    written: bool = False
    """Whether the other slot holds this step's new state (not committed yet)."""
    where: Where = Where.ON_DISK
    buffer: torch.Tensor | None = None
    future: IOFuture | None = None

    def slot_offset(self, slot: int) -> int:
        return self.offset + slot * self.plan.state_bytes


class StateSwapper:
    """Moves the state of offloaded sub-groups between the swap file and ``buffer_count`` buffers.

    Host memory held: ``buffer_count`` buffers of the largest offloaded sub-group's state, whatever
    the number of sub-groups. Raises FileNotFoundError / PermissionError / TensorIOError at
    construction when the swap file cannot be created in ``directory``.
    """

    def __init__(self, plans: list[SubGroupPlan], directory: str, config: SwapConfig) -> None:
        self.config = config
        self.records: dict[int, SwapRecord] = {}
        offset = 0
        for plan in plans:
            if plan.offloaded:
                self.records[plan.index] = SwapRecord(plan=plan, offset=offset)
                offset += 2 * plan.state_bytes  # slots A and B; state_bytes is a multiple of 4096
        self.file_bytes = offset
        self.path = os.path.join(directory, f"offload-adam-{os.getpid()}-{uuid.uuid4().hex[:8]}.swp")
        self._handle: AioHandle | None = None
        self._free: list[torch.Tensor] = []
        self._by_address: dict[int, torch.Tensor] = {}
        self._writes: collections.deque[SwapRecord] = collections.deque()  # in flight, oldest first
        self.buffer_bytes = 0
        self.wait_seconds = 0.0
        """Seconds the caller has spent blocked on this swapper's I/O (every sync point below)."""
        if not self.records:
            return
        _check_directory(directory)
        # Create the file now so that a bad directory fails here, not in the middle of a step.
        os.close(os.open(self.path, os.O_CREAT | os.O_WRONLY, 0o600))
        self._handle = AioHandle.from_config(config.aio)
        largest = max(r.plan.state_bytes for r in self.records.values())
        make = locked_tensor if config.pin_memory else aligned_tensor
        self._free = [make(largest // 4, torch.float32) for _ in range(config.buffer_count)]
        self._by_address = {buffer.data_ptr(): buffer for buffer in self._free}
        self.buffer_bytes = largest * config.buffer_count

    # ---- moving one sub-group ---------------------------------------------------------------------

    def has_free_buffer(self) -> bool:
        """Whether a buffer is free now, or can be freed by waiting for a write in flight."""
        return bool(self._free or self._writes)

    @property
    def free_buffers(self) -> int:
        """Buffers free now, without waiting for anything."""
        return len(self._free)

    def reap(self) -> None:
        """Free the buffers of writes that have already finished; never waits. Raises TensorIOError."""
        for rec in [r for r in self._writes if r.future.done()]:
            self._writes.remove(rec)
            self._finish_write(rec)
            self._release(rec)

    def start_read(self, rec: SwapRecord) -> None:
        """Start bringing ``rec``'s latest state into a buffer (waits for a write to free one if needed).

        A sub-group still being written keeps its buffer and needs no read. Raises TensorIOError.
        """
        if rec.where is Where.WRITING:
            self._writes.remove(rec)
            self._finish_write(rec)  # sync point: its buffer already holds the latest state
            rec.where = Where.RESIDENT
            return
        assert rec.where is Where.ON_DISK, rec.where
        rec.buffer = self._acquire()[: rec.plan.state_bytes // 4]
        latest_on_disk = rec.written or rec.on_disk
        if not latest_on_disk:
            rec.buffer.zero_()
            rec.where = Where.RESIDENT
            return
        source = 1 - rec.slot if rec.written else rec.slot
        rec.future = self._handle.read(rec.buffer, self.path, rec.slot_offset(source))
        rec.where = Where.READING

    def wait_read(self, rec: SwapRecord) -> torch.Tensor:
        """Wait for ``rec``'s read (sync point) and return its state buffer. Raises TensorIOError."""
        if rec.where is Where.READING:
            future, rec.future = rec.future, None
            try:
                with self._blocked():
                    moved = future.result()
                _check_count(moved, rec, "read")
            except BaseException:
                self._release(rec)
                raise
            rec.where = Where.RESIDENT
        assert rec.where is Where.RESIDENT, rec.where
        return rec.buffer

    def start_write(self, rec: SwapRecord) -> None:
        """Start writing ``rec``'s buffer to its uncommitted slot; the buffer is freed when it is done."""
        assert rec.where is Where.RESIDENT, rec.where
        rec.future = self._handle.write(rec.buffer, self.path, rec.slot_offset(1 - rec.slot))
        rec.where = Where.WRITING
        self._writes.append(rec)

    def evict(self, rec: SwapRecord) -> None:
        """Give up ``rec``'s unmodified buffer (read ahead but not needed yet). Raises TensorIOError."""
        if rec.where is Where.READING:
            self.wait_read(rec)
        self._release(rec)

    # ---- whole-step synchronisation -----------------------------------------------------------------

    def drain(self) -> None:
        """Wait for every write in flight (sync point). Raises the first failure's TensorIOError."""
        while self._writes:
            rec = self._writes.popleft()
            self._finish_write(rec)
            self._release(rec)

    def commit(self) -> None:
        """Make the slots written this step current. Call only after `drain` succeeded."""
        assert not self._writes
        for rec in self.records.values():
            if rec.written:
                rec.slot, rec.on_disk, rec.written = 1 - rec.slot, True, False

    def abort(self) -> None:
        """After a failure: wait for all I/O (errors ignored), free the buffers, forget this step's writes."""
        for rec in self.records.values():
            if rec.future is not None:
                rec.future.exception()
                rec.future = None
            if rec.buffer is not None:
                self._release(rec)
            rec.written = False
        self._writes.clear()

    @property
    def idle(self) -> bool:
        """No buffer in use and no I/O in flight."""
        return all(r.where is Where.ON_DISK for r in self.records.values())

    def close(self) -> None:
        """Finish the I/O in flight, stop the I/O workers and remove the swap file."""
        self.abort()
        if self._handle is not None:
            self._handle.close()
            self._handle = None
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
        self._free = []

    # ---- buffers --------------------------------------------------------------------------------------

    def _acquire(self) -> torch.Tensor:
        if not self._free:
            if not self._writes:
                raise RuntimeError("internal error: every swap buffer is held by a sub-group being updated")
            rec = self._writes.popleft()  # sync point: the oldest write frees its buffer
            self._finish_write(rec)
            self._release(rec)
        return self._free.pop()

    def _release(self, rec: SwapRecord) -> None:
        self._free.append(self._by_address[rec.buffer.data_ptr()])
        rec.buffer, rec.future, rec.where = None, None, Where.ON_DISK

    def _finish_write(self, rec: SwapRecord) -> None:
        future, rec.future = rec.future, None
        with self._blocked():
            moved = future.result()
        _check_count(moved, rec, "write")
        rec.written = True

    @contextlib.contextmanager
    def _blocked(self):
        """Count the time spent in the block as waiting for I/O (`wait_seconds`)."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.wait_seconds += time.perf_counter() - start


def _check_count(moved: Any, rec: SwapRecord, verb: str) -> None:
    if moved != rec.plan.state_bytes:
        raise TensorIOError(errno.EIO, f"short {verb} of sub-group {rec.plan.index}: {moved} of "
                            f"{rec.plan.state_bytes} bytes", path="swap file", offset=rec.offset,
                            length=rec.plan.state_bytes)


def _check_directory(directory: str) -> None:
    if not os.path.isdir(directory):
        raise FileNotFoundError(errno.ENOENT, f"nvme_offload_dir {directory!r} does not exist; create it first "
                                "or pass nvme_offload_dir=None for a private temporary directory")
    if not os.access(directory, os.W_OK | os.X_OK):
        raise PermissionError(errno.EACCES, f"nvme_offload_dir {directory!r} is not writable by this process; "
                              "choose a directory you can create files in")
