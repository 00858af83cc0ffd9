"""The swap schedule: which offloaded sub-group's state is read when, and which is given up for room.

Sub-groups are updated in the order their gradients become final, learnt each step (`end_step`; first
guess: reverse plan order). While one is updated the next ones in that order are read into the free
swap buffers (`prefetch`), and, with overlap_backward, into memory lent by applied gradients (from the
end of the order, which becomes ready last, or from its front for a step whose gradients are all known:
``in_order``). A sub-group needed now when every buffer is taken gets the buffer of the one read ahead
furthest away (`update_offloaded`): never "out of swap buffers".

Threads: with overlap_backward every method runs on the optimizer's worker thread, or on the caller's
once it has joined that thread (see `BackwardUpdates`).
"""

from __future__ import annotations

from typing import Callable

import torch

from tensorio import aligned_tensor

from offload.optim.subgroups import SubGroupPlan
from offload.optim.swapper import StateSwapper, SwapRecord, Where


Update = Callable[[SubGroupPlan, list[torch.Tensor]], None]
"""Runs the kernel on a sub-group's state regions (`StepRun.update`, offload/optim/step.py)."""


class SwapSchedule:
    """Reads, read-ahead and eviction of the offloaded sub-groups' state (see the module docstring)."""

    def __init__(self, swapper: StateSwapper, plans: list[SubGroupPlan], *, read_ahead: int,
                 pipeline_write: bool) -> None:
        self.swapper = swapper
        self._ahead, self._pipeline_write = read_ahead, pipeline_write
        self.order: list[int] = [p.index for p in reversed(plans) if p.offloaded]
        """Offloaded sub-groups in the order they became ready in the last step."""
        self.done: set[int] = set()
        """Sub-groups updated in this step."""
        self._seen: list[int] = []
        self.in_order = False
        """This step's gradients are all known and handed over in ``order`` (`OffloadAdam.start_step`)."""

    def end_step(self) -> None:
        """The step is over: learn its order, forget what it updated."""
        if self._seen:
            self.order = self._seen + [i for i in self.order if i not in self._seen]
        self.forget()

    def forget(self) -> None:
        """Forget the step under way (ended or given up)."""
        self._seen, self.done = [], set()
        self.in_order = False

    def next_unread(self) -> SwapRecord | None:
        """The first sub-group in the learnt order still to be updated this step whose state is on disk."""
        records = self.swapper.records
        return next((records[i] for i in self.order if i not in self.done and records[i].where is Where.ON_DISK),
                    None)

    def update_offloaded(self, index: int, order: list[int], update: Update) -> None:
        """Phases of one offloaded sub-group: read, read ahead, ``update(plan, state regions)``, write behind."""
        rec = self.swapper.records[index]
        # 1. Make sure its read has started; if every buffer is held by sub-groups read ahead, give
        #    the furthest one's buffer up (never "out of swap buffers").
        if rec.where is Where.ON_DISK or rec.where is Where.WRITING:
            if rec.where is Where.ON_DISK and not self.swapper.has_free_buffer(rec):
                self._evict_furthest(order, index)
            self.swapper.start_read(rec)
        # 2. Read the next sub-groups ahead while this one is updated.
        self.done.add(index)
        self._seen.append(index)
        self.prefetch(order)
        # 3. Sync point: wait for this sub-group's state, then update it.
        update(rec.plan, self.swapper.wait_read(rec))
        # 4. Write behind: the write runs during the next sub-groups' updates (or, with
        #    overlap_backward, during the rest of backward and the next forward).
        self.swapper.start_write(rec)
        if not self._pipeline_write:
            self.swapper.drain()  # sync point

    def prefetch(self, order: list[int]) -> None:
        """Start reads of the next sub-groups in ``order`` into the buffers free now; never waits.

        Waiting here for a write to free a buffer would stall the update (or, with overlap_backward,
        the backward pass) for a read that is not needed yet; a later call picks the buffer up.
        Spare memory (applied gradients, overlap_backward) takes sub-groups from the *end* of the
        order: those become ready last, when nothing is left to hide their reads behind.
        """
        swapper = self.swapper
        records = swapper.records
        swapper.reap()
        ahead = self._ahead
        todo = [records[i] for i in order if i not in self.done]
        in_flight = sum(1 for rec in todo if rec.where in (Where.READING, Where.RESIDENT) and not swapper.holds_spare(rec))
        for rec in todo:
            if in_flight >= ahead or not swapper.free_buffers:
                break
            if rec.where is Where.ON_DISK:
                swapper.start_read(rec)
                in_flight += 1
        if ahead:
            for rec in (todo if self.in_order else reversed(todo)):
                if rec.where is not Where.ON_DISK:
                    continue
                if not swapper.fits_in_spares(rec):
                    break
                swapper.start_read(rec, spare=True)

    def read_ahead(self, nbytes: int, *, keep_memory: bool) -> None:
        """Between steps: read the state of the first sub-groups of the learnt order into at most ``nbytes``
        of memory lent to the swapper (`OffloadAdam.read_ahead`): memory the swapper keeps across steps
        (`StateSwapper.lend_kept`) if ``keep_memory``, else new memory, freed once those sub-groups are
        written."""
        records = self.swapper.records
        chosen, total = [], 0
        for index in self.order:
            rec = records[index]
            if rec.where is not Where.ON_DISK:
                continue
            if total + rec.plan.state_bytes > nbytes:
                break
            chosen.append(rec)
            total += rec.plan.state_bytes
        if not chosen:
            return
        if keep_memory:
            self.swapper.lend_kept(total, nbytes)
        else:
            self.swapper.add_spare(aligned_tensor(total // 4, torch.float32))
        for rec in chosen:
            if not self.swapper.fits_in_spares(rec):
                break  # not lent: beyond the spare limit
            self.swapper.start_read(rec, spare=True)

    def _evict_furthest(self, order: list[int], needed: int) -> None:
        records = self.swapper.records
        for i in reversed(order):
            if (i != needed and i not in self.done and records[i].where in (Where.READING, Where.RESIDENT)
                    and not self.swapper.holds_spare(records[i])):
                self.swapper.evict(records[i])
                return
