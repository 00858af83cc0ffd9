"""What a step changes besides the optimizer state, committed and rolled back together with it.

On the fast paths (docs/engine.md, "Updates during backward" and "The step in the next forward") a
step's update runs on the optimizer's thread, partition by partition, and the optimizer commits its
state only once every write of the step has succeeded. `StepRollback` gives the parameters the same
rule: on-disk partitions are written to their uncommitted slot (`SlottedRegion.stage`) and flip
with the optimizer's commit (`committed`); in-memory partitions are copied before their update, up
to ``limit`` elements, and copied back if the step is given up (`aborted`). A step is undone entirely
unless an in-memory partition beyond the limit was updated before the failure.

Steps are numbered as they begin (`begin_step`); the optimizer commits them in that order, one at a
time, and gives up every uncommitted one at once, so commit number k is step k. The next step may
begin (its copies made) before the previous one is committed: that happens on the optimizer's thread,
during the next forward. So each copy and counter snapshot carries its step's number.

Threads: `begin_step`, `before_update`, `counted` and `aborted` run on the caller's thread; `committed`
on whichever thread commits (the optimizer's background thread, usually). Shared fields are touched
under ``_lock``; the store's slots need no lock (see `SlottedRegion.commit`).
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from offload.params.record import ParamRecord
from offload.params.store import ParamStore


class StepRollback:
    """Commit or undo the parameter side of a step with the optimizer's state (its step hooks)."""

    def __init__(self, store: ParamStore, limit: int) -> None:
        self._store, self.limit = store, limit
        self._lock = threading.Lock()
        self._begun = 0
        self._committed = 0
        self._copies: list[tuple[int, ParamRecord, torch.Tensor, torch.Tensor | None]] = []
        self._uncopied: list[tuple[int, str]] = []
        """In-memory partitions updated without a copy (beyond ``limit``), with their step."""
        self._snapshots: list[tuple[int, Any]] = []
        """The engine's counters before each uncommitted step it counted."""
        self._aborts: list[tuple[list[str], Any]] = []

    def begin_step(self) -> None:
        """A step begins to change parameters (before its first hand-over to the optimizer)."""
        with self._lock:
            self._begun += 1

    def counted(self, snapshot: Any) -> None:
        """The engine counted the step begun last (its ``step()``); ``snapshot`` restores its counters."""
        with self._lock:
            self._snapshots.append((self._begun, snapshot))

    def before_update(self, rec: ParamRecord) -> None:
        """``rec``'s partition is about to be handed to the optimizer: keep what undoes its update."""
        if rec.on_disk:
            return  # the update goes to the other slot; the committed one stays
        with self._lock:
            step = self._begun
            if any(s == step and r is rec for s, r, _, _ in self._copies):
                return
            if sum(r.partition_numel for _, r, _, _ in self._copies) + rec.partition_numel > self.limit:
                self._uncopied.append((step, rec.name))
                return
        full = rec.full.clone() if rec.keep_full and rec.full is not None and self._store.world_size > 1 else None
        copy = (step, rec, rec.partition.detach().clone(), full)
        with self._lock:
            self._copies.append(copy)

    def committed(self) -> None:
        """The optimizer committed its oldest uncommitted step (every write landed): final now."""
        if self._store.region is not None:
            self._store.region.commit()
        with self._lock:
            self._committed += 1
            done = self._committed
            self._copies = [c for c in self._copies if c[0] > done]
            self._uncopied = [u for u in self._uncopied if u[0] > done]
            self._snapshots = [s for s in self._snapshots if s[0] > done]

    @property
    def uncommitted(self) -> bool:
        """Whether a step has begun and is not committed."""
        with self._lock:
            return self._begun > self._committed

    def aborted(self) -> None:
        """The optimizer gave up every uncommitted step (its I/O waited for): on-disk partitions read their
        committed slot again and in-memory ones get their copies back (`take_aborts` says how it went)."""
        if self._store.region is not None:
            self._store.region.rollback()
        with self._lock:
            copies, uncopied, snapshots = self._copies, self._uncopied, self._snapshots
            self._copies, self._uncopied, self._snapshots = [], [], []
            self._committed = self._begun
        for _, rec, partition, full in reversed(copies):  # the oldest copy is restored last
            rec.partition.data.copy_(partition)
            if full is not None:
                rec.full.copy_(full)
        with self._lock:
            self._aborts.append(([name for _, name in uncopied], snapshots[0][1] if snapshots else None))

    @property
    def aborted_untaken(self) -> bool:
        """Whether the optimizer gave steps up (`aborted`) since the last `take_aborts`: a failure of an
        earlier step's writes found now (their write-behind) has undone that step, whose counters must
        go back too (`FastPath.give_up`)."""
        with self._lock:
            return bool(self._aborts)

    def take_aborts(self) -> tuple[bool, Any, list[str]]:
        """What the `aborted` calls since the last `take_aborts` undid (the optimizer may give a step up
        more than once: where it failed, then when the engine abandons it): whether they undid
        everything, the counters to restore (the earliest snapshot, or None), and the in-memory
        partitions they could not undo."""
        with self._lock:
            aborts, self._aborts = self._aborts, []
        names = [name for names, _ in aborts for name in names]
        snapshot = next((snap for _, snap in aborts if snap is not None), None)
        return not names, snapshot, names
