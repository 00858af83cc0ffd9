"""The optimizer-state swapper: sub-group state moved between one swap file and a few locked buffers.

One `SwapRecord` per offloaded sub-group holds everything about it: where its state is, its two file
slots, the buffer it occupies and the I/O in flight. The slots follow the commit rule of
`offload.storage.slotted`, as the parameter partitions' do: a step reads the newest slot and writes the
uncommitted one, and only `commit()`, called once every write of the step has succeeded, makes the new
slots current. So a failed step leaves the previous state on disk, where a reload finds it.
"""

from __future__ import annotations

import contextlib
import enum
import errno
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from tensorio import BufferPool, IOFuture, TensorIOError, aligned_tensor, locked_tensor

from offload.config.swap import SwapConfig
from offload.optim.spare import SparePool
from offload.optim.subgroups import SubGroupPlan
from offload.storage.slotted import SlotPair, SlottedRegion
from offload.storage.striped import open_swap_file
from offload.storage.swapfile import PAGE, SwapFile
from offload.storage.write_queue import WriteQueue


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
    slots: SlotPair
    """Its state's two slots in the swap file (never written: the state is all zeros)."""
    where: Where = Where.ON_DISK
    regions: list[torch.Tensor] | None = None
    """The state in memory: ``plan.regions`` fp32 tensors of ``plan.region`` elements (exp_avg,
    exp_avg_sq[, master copy]); views of one fixed buffer, or of spare memory (see `add_spare`)."""
    buffer: torch.Tensor | None = None
    """The fixed buffer holding the regions back to back; None while they are in spare memory."""
    futures: list[IOFuture] = field(default_factory=list)
    spare_chunks: list = field(default_factory=list)
    """The spare-memory chunk of each region, while the regions are in spare memory."""


class StateSwapper:
    """Moves the state of offloaded sub-groups between the swap file and ``buffer_count`` buffers.

    Host memory held: ``buffer_count`` buffers of the largest offloaded sub-group's state, whatever
    the number of sub-groups, the memory kept for reads ahead between steps (`lend_kept`, at most the
    largest size asked for), plus the spare memory the caller lends (`add_spare`, at most
    ``spare_limit`` bytes until `drop_spares`; None: no limit). Raises
    FileNotFoundError / PermissionError / TensorIOError at construction when the swap file cannot
    be created in ``directory`` (a list of directories: striped over them, `open_swap_file`, with
    ``stripe_weights``, or weights measured where None).
    """

    def __init__(self, plans: list[SubGroupPlan], directory: str | Sequence[str], config: SwapConfig,
                 spare_limit: int | None = None, stripe_weights: Sequence[int] | None = None) -> None:
        self.config = config
        offloaded = [plan for plan in plans if plan.offloaded]
        # The file is made now so that a bad directory fails here, not in the middle of a step.
        self._file = (open_swap_file(directory, config.aio, kind="adam", key="nvme_offload_dir", weights=stripe_weights)
                      if offloaded else None)
        self._region = SlottedRegion(self._file) if offloaded else None
        self.records: dict[int, SwapRecord] = {  # slots A and B; state_bytes is a multiple of the page
            plan.index: SwapRecord(plan=plan, slots=self._region.add(plan.state_bytes)) for plan in offloaded}
        self.file_bytes = self._file.allocated_bytes if self._file is not None else 0
        if self._file is not None:  # a full disk is named now, not in a step
            try:
                self._file.preallocate()
            except BaseException:
                self._file.close()  # the file goes: nothing left behind
                raise
        self._free: list[torch.Tensor] = []
        self._by_address: dict[int, torch.Tensor] = {}
        self._writes = WriteQueue()  # each sub-group's state write in flight, oldest first
        self._spares = SparePool(spare_limit)  # memory lent by the caller (applied gradients)
        self._kept: BufferPool | None = None  # `lend_kept`'s memory, faulted in once
        self._smallest_region = min((4 * p.region for p in plans if p.offloaded), default=0)
        self.buffer_bytes = 0
        self.wait_seconds = 0.0
        """Seconds the caller has spent blocked on this swapper's I/O (every sync point below)."""
        if not self.records:
            return
        largest = max(r.plan.state_bytes for r in self.records.values())
        make = locked_tensor if config.pin_memory else aligned_tensor
        self._free = [make(largest // 4, torch.float32) for _ in range(config.buffer_count)]
        self._by_address = {buffer.data_ptr(): buffer for buffer in self._free}
        self.buffer_bytes = largest * config.buffer_count

    @property
    def path(self) -> str | None:
        """The swap file's path; None when no sub-group is offloaded."""
        return self._file.path if self._file is not None else None

    # ---- memory -------------------------------------------------------------------------------------

    def io_bytes(self) -> dict[str, int]:
        """Bytes read from and written to the swap file so far."""
        return SwapFile.io_bytes_of(self._file)

    def where_counts(self) -> dict[str, int]:
        """Offloaded sub-groups by where their state is now: "on disk", "reading", "resident", "writing"."""
        counts = {where.value: 0 for where in Where}
        for rec in self.records.values():
            counts[rec.where.value] += 1
        return counts

    @property
    def free_buffers(self) -> int:
        """Fixed buffers free now, without waiting for anything."""
        return len(self._free)

    def has_free_buffer(self, rec: SwapRecord) -> bool:
        """Whether memory for ``rec`` is free now, or can be freed by waiting for a write in flight."""
        return bool(self._free or self._writes) or self.fits_in_spares(rec)

    def add_spare(self, tensor: torch.Tensor) -> None:
        """Lend the memory of a contiguous CPU ``tensor`` the caller is done with (a gradient already
        applied) for state read ahead. Its page-aligned part is cut into regions as needed; the memory
        is given back when `drop_spares` has been called and the last region cut from it is written."""
        self._spares.lend(tensor, self._smallest_region)

    @property
    def kept_reused(self) -> int:
        """Reads ahead that landed in the memory kept across steps rather than in memory mapped anew."""
        return self._kept.reused if self._kept is not None else 0

    @property
    def kept_bytes(self) -> int:
        """Bytes of the memory kept across steps for reads ahead (`lend_kept`), lent or idle."""
        return self._kept.held_bytes if self._kept is not None else 0

    def lend_kept(self, nbytes: int, capacity: int) -> None:
        """Lend ``nbytes`` of memory this swapper keeps across steps, as `add_spare` lends a gradient's: one
        buffer of ``capacity`` bytes (the most any call asks for), reused while no region cut from it in an
        earlier step is still in use, else new memory freed as usual. Memory new to a process costs a
        page fault and the zeroing of each page, on a virtual machine about as much as reading it from the
        disk (docs/engine.md, "Memory bound"); kept, it is faulted in once. Raises ValueError if ``nbytes``
        exceeds ``capacity``."""
        if nbytes > capacity:
            raise ValueError(f"lend_kept: {nbytes} bytes asked for, more than the capacity {capacity}")
        if self._kept is None or self._kept.max_bytes < capacity:
            self._kept = BufferPool(-(-capacity // PAGE) * PAGE)
        # Taken whole so that the pool matches it by size every step; the pages past nbytes stay untouched.
        buffer = self._kept.take(capacity)
        self.add_spare(buffer[: nbytes - nbytes % 4].view(torch.float32))

    def drop_spares(self) -> None:
        """Stop using the lent memory; regions already cut from it stay until their writes finish."""
        self._spares.clear()

    def fits_in_spares(self, rec: SwapRecord) -> bool:
        """Whether the spare memory has room for every region of ``rec``'s state."""
        return self._spares.cut(rec.plan.regions, 4 * rec.plan.region, take=False) is not None

    def holds_spare(self, rec: SwapRecord) -> bool:
        """Whether ``rec``'s state is in spare memory."""
        return bool(rec.spare_chunks)

    # ---- moving one sub-group ---------------------------------------------------------------------

    def reap(self) -> None:
        """Free the memory of writes that have already finished; never waits. Raises TensorIOError."""
        for rec, _ in self._writes.reap():
            self._wait(rec, "write")  # done: raises its error, or one for a short write
            self._release(rec)

    def readiness(self, rec: SwapRecord) -> int:
        """0: ``rec``'s state is in memory (read, or still being written); 1: its read is in flight;
        2: it is on disk. Never waits."""
        if rec.where is Where.ON_DISK:
            return 2
        if rec.where is Where.READING and not all(f.done() for f in rec.futures):
            return 1
        return 0

    def finish_oldest_write(self) -> bool:
        """Wait for the oldest write in flight (sync point) and free its memory; False if there is none.

        Raises TensorIOError."""
        if not self._writes:
            return False
        with self._blocked():
            rec, _ = self._writes.wait_oldest()
        self._wait(rec, "write")  # done: raises its error, or one for a short write
        self._release(rec)
        return True

    def start_read(self, rec: SwapRecord, *, spare: bool = False) -> None:
        """Start bringing ``rec``'s latest state into memory (waits for a write to free a buffer if needed).

        ``spare``: into spare memory (see `add_spare`) rather than a fixed buffer. A sub-group still
        being written keeps its memory and needs no read. Raises TensorIOError.
        """
        if rec.where is Where.WRITING:
            self._writes.remove(rec)
            self._wait(rec, "write")  # sync point: its memory already holds the latest state
            rec.where = Where.RESIDENT
            return
        _expect(rec, Where.ON_DISK, "read")
        self._acquire(rec, spare=spare)
        if not rec.slots.holds_values:
            for region in rec.regions:
                region.zero_()
            rec.where = Where.RESIDENT
            return
        rec.futures = self._transfer(rec, rec.slots.newest_offset, self._file.read,
                                     what=f"{_describe(rec)}, slot {'AB'[rec.slots.newest_slot]}")
        rec.where = Where.READING

    def wait_read(self, rec: SwapRecord) -> list[torch.Tensor]:
        """Wait for ``rec``'s read (sync point) and return its state regions. Raises TensorIOError."""
        if rec.where is Where.READING:
            try:
                self._wait(rec, "read")
            except BaseException:
                self._release(rec)
                raise
            rec.where = Where.RESIDENT
        _expect(rec, Where.RESIDENT, "return the state of")
        return rec.regions

    def read_now(self, rec: SwapRecord) -> list[torch.Tensor]:
        """Sync point: ``rec``'s state regions, read now unless they were read ahead (unmodified, between
        steps). Raises TensorIOError."""
        if rec.where is Where.ON_DISK:
            self.start_read(rec)
        return self.wait_read(rec)

    def blank(self, rec: SwapRecord) -> list[torch.Tensor]:
        """Memory for ``rec``'s state without reading it, **contents unspecified** (a buffer's last user's): for
        a load, which writes every element (`offload.optim.state_io.fill`) and must work when what is on disk
        is corrupt. Its state must be on disk (sync point: may wait for a write to free a buffer)."""
        _expect(rec, Where.ON_DISK, "overwrite")
        self._acquire(rec, spare=False)
        rec.where = Where.RESIDENT
        return rec.regions

    def start_write(self, rec: SwapRecord) -> None:
        """Start writing ``rec``'s state to its uncommitted slot; its memory is freed when it is done."""
        _expect(rec, Where.RESIDENT, "write")
        rec.futures = self._transfer(rec, self._region.stage_offset(rec.slots), self._file.write)
        rec.where = Where.WRITING
        self._writes.push(rec.futures, rec)

    def evict(self, rec: SwapRecord) -> None:
        """Give up ``rec``'s unmodified state (read ahead but not needed yet). Raises TensorIOError."""
        if rec.where is Where.READING:
            self.wait_read(rec)
        self._release(rec)

    # ---- whole-step synchronisation -----------------------------------------------------------------

    def drain(self) -> None:
        """Wait for every write in flight (sync point). Raises the first failure's TensorIOError."""
        while self.finish_oldest_write():
            pass

    def commit(self) -> None:
        """Make the slots written this step current. Call only after `drain` succeeded."""
        if self._writes:
            raise RuntimeError("internal error: commit with writes in flight; call drain() first")
        if self._region is not None:
            self._region.commit()

    def abort(self) -> None:
        """After a failure: wait for all I/O (errors ignored), free the memory, forget this step's writes."""
        for rec in self.records.values():
            for future in rec.futures:
                future.exception()
            rec.futures = []
            if rec.regions is not None:
                self._release(rec)
        if self._region is not None:
            self._region.rollback()
        self._writes.abort()  # every request was waited for above; forgets the errors
        self.drop_spares()

    @property
    def idle(self) -> bool:
        """No buffer in use and no I/O in flight."""
        return all(r.where is Where.ON_DISK for r in self.records.values())

    def close(self) -> None:
        """Finish the I/O in flight, stop the I/O workers, remove the swap file and let the buffers go
        (their memory is unlocked and freed once no tensor refers to it)."""
        self.abort()
        if self._file is not None:
            self._file.close()
        self._free = []
        self._by_address = {}
        self._kept = None

    # ---- internals ------------------------------------------------------------------------------------

    def _transfer(self, rec: SwapRecord, offset: int, move, **what) -> list[IOFuture]:
        """Start reading or writing (``move``) ``rec``'s regions at the slot at ``offset``: one request per
        fixed buffer (the regions are back to back there as in the file), else one per region. Checksummed
        per region either way, so that a read verifies whichever way the write went."""
        region_bytes = rec.plan.region * 4
        if rec.buffer is not None:
            return [move(rec.buffer, offset, chunk=region_bytes, **what)]
        return [move(region, offset + r * region_bytes, chunk=region_bytes, **what)
                for r, region in enumerate(rec.regions)]

    def _acquire(self, rec: SwapRecord, *, spare: bool) -> None:
        """Give ``rec`` memory: a fixed buffer free now, else spare memory (first if ``spare``), else the
        fixed buffer the oldest write frees (sync point)."""
        plan = rec.plan
        while True:
            if spare or not self._free:
                cuts = self._spares.cut(plan.regions, 4 * plan.region)
                if cuts is not None:
                    rec.regions, rec.spare_chunks = [region for region, _ in cuts], [chunk for _, chunk in cuts]
                    return
            if self._free:
                rec.buffer = self._free.pop()[: plan.state_bytes // 4]
                rec.regions = list(rec.buffer.split(plan.region))
                return
            if not self.finish_oldest_write():  # sync point: the oldest write frees its memory
                raise RuntimeError("internal error: every swap buffer is held by a sub-group being updated")

    def _release(self, rec: SwapRecord) -> None:
        if rec.buffer is not None:
            self._free.append(self._by_address[rec.buffer.data_ptr()])
        self._spares.give_back(rec.spare_chunks)
        rec.spare_chunks = []
        rec.regions, rec.buffer, rec.futures, rec.where = None, None, [], Where.ON_DISK

    def _wait(self, rec: SwapRecord, verb: str) -> None:
        """Wait for every request of ``rec`` (so that its memory is no longer in use), then raise the
        first failure's TensorIOError, or one for a short transfer."""
        futures = rec.futures
        with self._blocked():
            for future in futures:
                future.exception()
        rec.futures = []
        _check_count(sum(future.result() for future in futures), rec, verb)

    @contextlib.contextmanager
    def _blocked(self):
        """Count the time spent in the block as waiting for I/O (`wait_seconds`)."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.wait_seconds += time.perf_counter() - start


def _describe(rec: SwapRecord) -> str:
    """How errors name ``rec``'s state on disk."""
    members = rec.plan.members
    params = f"parameters {members[0].param}..{members[-1].param}" if members else "no parameters"
    return f"optimizer state of sub-group {rec.plan.index} ({params}; exp_avg, exp_avg_sq{', master' if rec.plan.regions > 2 else ''})"


def _check_count(moved: Any, rec: SwapRecord, verb: str) -> None:
    if moved != rec.plan.state_bytes:
        raise TensorIOError(errno.EIO, f"short {verb} of sub-group {rec.plan.index}: {moved} of "
                            f"{rec.plan.state_bytes} bytes", path="swap file", offset=rec.slots.offset,
                            length=rec.plan.state_bytes)


def _expect(rec: SwapRecord, where: Where, verb: str) -> None:
    """Raise RuntimeError unless ``rec`` is ``where`` (a broken invariant of the caller's schedule)."""
    if rec.where is not where:
        raise RuntimeError(f"internal error: cannot {verb} sub-group {rec.plan.index}: its state is "
                           f"{rec.where.value}, not {where.value}")
