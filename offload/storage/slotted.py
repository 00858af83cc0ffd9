"""`SlottedRegion`: extents of two slots (A/B) in a swap file, written by a step and committed or rolled back.

Parameter partitions and optimizer state keep the same rule, so that a failed step never leaves a
half-written value that is later read as good: each extent (`SlotPair`) has a committed slot, which
holds the values of the last committed step; a step writes the other slot (`stage`), and from then on
reads take the staged slot (the newest values). `commit`, called once every staged write has landed,
makes the staged slots the committed ones; `rollback` forgets them, and reads take the committed
slots again. Between a commit and the next `stage` the uncommitted slot holds nothing anyone needs
(`SlotPair.spare_offset`: the engine keeps a gradient there).

A `SlotPin` holds the committed slots of a set of pairs for a reader on another thread (an asynchronous
checkpoint save): until it lets a pair go, any write to that pair's pinned slot (a later step's `stage`, a
gradient kept in the spare slot, a write in place) waits. The next step writes the other slot, so it
never waits; the step after it waits only for the pairs the reader has not read yet.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Iterable

import torch

from tensorio import IOFuture

from offload.storage.swapfile import SwapFile, aligned_size

__all__ = ["SlotPair", "SlotPin", "SlottedRegion", "allocate_pair"]


@dataclass(slots=True, eq=False)
class SlotPair:
    """One extent of two page-aligned slots of ``slot_bytes`` each, the second right after the first."""

    offset: int
    """Byte offset of slot 0; slot 1 starts at ``offset + slot_bytes``."""
    slot_bytes: int
    committed: int = 0
    """The slot holding the values of the last committed step."""
    staged: bool = False
    """The other slot holds newer values (written, or being written, by a step not committed yet)."""
    filled: bool = False
    """The committed slot was ever written; if neither slot was, the values are all zeros."""
    pin: "SlotPin | None" = None
    """The reader holding one of the slots (`SlotPin`), if any; writes to that slot wait for it."""

    def slot_offset(self, slot: int) -> int:
        """Byte offset of slot ``slot`` (0 or 1)."""
        return self.offset + slot * self.slot_bytes

    @property
    def newest_slot(self) -> int:
        """The slot reads take: the staged one while a step's write is not committed, else the committed one."""
        return 1 - self.committed if self.staged else self.committed

    @property
    def newest_offset(self) -> int:
        """Byte offset of `newest_slot`."""
        return self.slot_offset(self.newest_slot)

    @property
    def holds_values(self) -> bool:
        """Whether either slot was written (else the values are all zeros and need no read)."""
        return self.filled or self.staged

    def spare_offset(self) -> int:
        """Byte offset of the uncommitted slot while nothing is staged there (free scratch space until the
        next `SlottedRegion.stage`). Raises RuntimeError while a step's write is staged in it."""
        if self.staged:
            raise RuntimeError(f"internal error: the spare slot at byte {self.slot_offset(1 - self.committed)} "
                               f"holds a step's write that is not committed yet")
        _wait_unpinned(self, 1 - self.committed)  # sync point: a checkpoint save may still read it
        return self.slot_offset(1 - self.committed)


def allocate_pair(file: SwapFile, nbytes: int) -> SlotPair:
    """Reserve two page-aligned slots of ``nbytes`` at the end of ``file`` (see `SwapFile.allocate`)."""
    return SlotPair(offset=file.allocate(nbytes, slots=2), slot_bytes=aligned_size(nbytes))


def _in_slot(what: str, slot: int) -> str:
    return f"{what}, slot {'AB'[slot]}" if what else ""


class SlottedRegion:
    """The slot pairs of one swap file and the step's commit rule over all of them (module docstring).

    Not thread-safe by itself: a step stages from one thread at a time, and commits or rolls back once its
    writes are done (the caller orders these; see `offload.train.step.rollback`)."""

    def __init__(self, file: SwapFile, pairs: list[SlotPair] | None = None) -> None:
        self.file = file
        self.pairs: list[SlotPair] = list(pairs or [])

    def add(self, nbytes: int) -> SlotPair:
        """A new pair of ``nbytes`` slots at the end of the file, all zeros until written."""
        pair = allocate_pair(self.file, nbytes)
        self.pairs.append(pair)
        return pair

    def adopt(self, pair: SlotPair) -> None:
        """Take in a pair allocated in this region's file by `allocate_pair` (placed before the region existed)."""
        self.pairs.append(pair)

    def read(self, pair: SlotPair, buffer: torch.Tensor, *, at: int = 0, chunk: int | None = None,
             what: str = "") -> IOFuture:
        """Start filling ``buffer`` from ``pair``'s newest values, ``at`` bytes into the slot, verified against
        the checksums of their write in chunks of ``chunk`` bytes (`SwapFile.read`); ``what`` names them."""
        return self.file.read(buffer, pair.newest_offset + at, chunk=chunk, what=_in_slot(what, pair.newest_slot))

    def read_new(self, pair: SlotPair, numel: int, dtype: torch.dtype, *, what: str = "") -> tuple[torch.Tensor, IOFuture]:
        """Start reading ``pair``'s newest values (``numel`` elements of ``dtype``) into a new page-aligned buffer,
        verified (`SwapFile.read`)."""
        return self.file.read_new(numel, dtype, pair.newest_offset, what=_in_slot(what, pair.newest_slot))

    def write_in_place(self, pair: SlotPair, values: torch.Tensor) -> IOFuture:
        """Start writing ``values`` over ``pair``'s newest slot, outside a step (placing, loading weights):
        nothing to commit. Keep ``values`` unchanged until the future is done."""
        _wait_unpinned(pair, pair.newest_slot)  # sync point: a checkpoint save may still read it
        if not pair.staged:
            pair.filled = True
        return self.file.write(values, pair.newest_offset)

    def stage_offset(self, pair: SlotPair) -> int:
        """Byte offset a step writes ``pair``'s new values to (its uncommitted slot), marking it staged:
        reads take that slot from now on, so none may start before the caller's write there is done.
        Waits while a `SlotPin` holds that slot (sync point)."""
        _wait_unpinned(pair, 1 - pair.committed)
        pair.staged = True
        return pair.slot_offset(1 - pair.committed)

    def stage(self, pair: SlotPair, values: torch.Tensor, *, at: int = 0, chunk: int | None = None) -> IOFuture:
        """Start writing a step's ``values`` to ``pair``'s uncommitted slot, ``at`` bytes into it (`stage_offset`),
        checksummed in chunks of ``chunk`` bytes (`SwapFile.write`)."""
        return self.file.write(values, self.stage_offset(pair) + at, chunk=chunk)

    def commit(self) -> None:
        """Every staged write has landed and the step is final: the staged slots become the committed ones."""
        for pair in self.pairs:
            if pair.staged:
                pair.committed, pair.staged, pair.filled = 1 - pair.committed, False, True

    def rollback(self) -> list[SlotPair]:
        """A step failed: forget its staged writes; reads take the committed slots again. Returns the pairs
        rolled back. The caller waits for those writes first (never read a slot being written)."""
        rolled = [pair for pair in self.pairs if pair.staged]
        for pair in rolled:
            pair.staged = False
        return rolled

    @property
    def staged(self) -> bool:
        """Whether a write is staged and not committed yet."""
        return any(pair.staged for pair in self.pairs)


class SlotPin:
    """The committed slot of each of ``pairs``, held for a reader (an asynchronous checkpoint save) until it
    `release`s the pair: meanwhile a write to that slot waits (`SlottedRegion.stage_offset`,
    `SlotPair.spare_offset`, `SlottedRegion.write_in_place`), so the reader sees the values of the step
    that was committed when the pin was taken, without a copy. Thread-safe: the reader releases from its
    thread, the writers wait on theirs.

    Raises RuntimeError when a pair has a staged (uncommitted) write, or is pinned already: pin between
    steps, once the last step has committed, and one reader at a time.
    """

    def __init__(self, pairs: Iterable[SlotPair]) -> None:
        self._changed = threading.Condition()
        self.slots: dict[int, int] = {}
        """id(pair) -> the slot pinned (its committed slot when pinned)."""
        self.wait_seconds = 0.0
        """Seconds writers have waited for this pin (the time training waited for the reader)."""
        pairs = list(pairs)
        for pair in pairs:
            if pair.staged or pair.pin is not None:
                raise RuntimeError(f"internal error: cannot pin the slots at byte {pair.offset}: "
                                   f"{'a step has written them and not committed' if pair.staged else 'pinned already'}")
        for pair in pairs:
            pair.pin, self.slots[id(pair)] = self, pair.committed

    def slot(self, pair: SlotPair) -> int:
        """The slot pinned for ``pair`` (read it with `SlotPair.slot_offset`)."""
        return self.slots[id(pair)]

    def release(self, pair: SlotPair) -> None:
        """The reader is done with ``pair``: writes to its pinned slot may go ahead."""
        with self._changed:
            if pair.pin is self:
                pair.pin = None
            self.slots.pop(id(pair), None)
            self._changed.notify_all()

    def release_all(self, pairs: Iterable[SlotPair]) -> None:
        """Let every one of ``pairs`` still held go (the save ended, or failed)."""
        with self._changed:
            for pair in pairs:
                if pair.pin is self:
                    pair.pin = None
            self.slots.clear()
            self._changed.notify_all()

    def wait(self, pair: SlotPair, slot: int) -> None:
        """Sync point: return once ``pair``'s ``slot`` is not held by this pin."""
        with self._changed:
            began = None
            while pair.pin is self and self.slots.get(id(pair)) == slot:
                began = began or time.perf_counter()
                self._changed.wait()
            if began is not None:
                self.wait_seconds += time.perf_counter() - began


def _wait_unpinned(pair: SlotPair, slot: int) -> None:
    """Before writing ``pair``'s ``slot``: wait while a `SlotPin` holds it."""
    pin = pair.pin
    if pin is not None:
        pin.wait(pair, slot)
