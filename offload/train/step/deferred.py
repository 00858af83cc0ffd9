"""The step in the next forward: updates that had to wait for every gradient, run in the forward's order.

Gradient clipping needs the global norm, fp16 the overflow check over every gradient, accumulation the
last micro-batch: none of them lets a partition be updated while backward produces its gradient. So
`engine.step()` only validates (norm, overflow: a handful of numbers, each partition's norm having been
taken as its gradient was reduced) and hands the step to `DeferredStep.begin`, with the clip coefficient
times the inverse loss scale. The updates then run on the optimizer's thread while the next forward
runs, in the order that forward gathers the parameters (recorded in the first step):

1. a partition in memory is handed to the optimizer as soon as it comes up in that order; an on-disk
   one once the read the forward prefetches anyway has arrived (`PartitionWriteBack.hand_over` with
   ``hold``), never waiting for it, except for the partition the forward needs now. Gradients are in
   memory, or, when they would take too much of it, in the gradient swap file, read back in the same
   order a bounded number of elements ahead;
2. the forward's gather of a parameter (`values`, called by `ParamStore.gather`) waits for its update
   and takes the updated buffer itself, while its write to the uncommitted slot goes on: the read for
   the update is the forward's read (saving one per partition against updating after backward). A
   16-bit partition is not read at all: its update writes it whole from the fp32 master (`overwrites`),
   so the forward reads only the optimizer state;
3. the next backward (or a save, an evaluation through `full_parameters`) first hands over what the
   forward did not use and lets the optimizer finish (`finish`), which commits the step once every
   write of state and partitions has landed.

The update is exactly the one after backward would be (the same fused kernel on the same numbers: the
optimizer multiplies each gradient by the coefficient as ``clip_grad_norm_`` does, and uses the
hyperparameters of the moment ``begin`` was called). Partitions that share an optimizer sub-group are
updated together (`OffloadAdam.update_groups`), so the forward's first use of one waits for all of them.

Threads: everything here runs on the caller's thread; the optimizer's thread only runs the updates and
the callbacks (`_updated`), which touch ``_updated`` under ``_lock``.
"""

from __future__ import annotations

import functools
import threading

import torch

from offload.optim.protocol import StepOptimizer
from offload.params.record import ParamRecord
from offload.params.store import ParamStore
from offload.train.step.kept_buffers import KeptBuffers
from offload.train.step.rollback import StepRollback
from offload.train.step.writeback import PartitionWriteBack


class DeferredStep:
    """Runs a validated step's updates during the next forward (see the module docstring)."""

    def __init__(self, store: ParamStore, kept: KeptBuffers, optimizer: StepOptimizer, writeback: PartitionWriteBack | None,
                 records: list[ParamRecord], rollback: StepRollback, grad_reads=None, read_ahead: int = 0) -> None:
        self._store, self._kept, self._opt, self._writeback, self._rollback = store, kept, optimizer, writeback, rollback
        self._grad_reads = grad_reads
        """``start_read(rec) -> (buffer, future)`` of the gradient swap file (gradients not kept in memory)."""
        self._read_ahead = read_ahead
        """Gradient elements read ahead of their hand-over at most."""
        self._reading: dict[int, tuple[torch.Tensor, object]] = {}
        self._unit: dict[int, list[ParamRecord]] = {}
        for group in optimizer.update_groups():  # optimizer parameter i is records[i]'s partition
            unit = [records[i] for i in group]
            for rec in unit:
                self._unit[rec.index] = unit
        self._pending: dict[int, torch.Tensor | None] = {}
        """Record index -> its gradient partition (fp32; None: in the gradient swap file), not handed over yet."""
        self._order: list[list[ParamRecord]] = []
        """Units with a pending update, in the order the next forward needs them."""
        self._cursor = 0
        self._handed: set[int] = set()
        self._refresh: set[int] = set()
        """Kept whole parameters (world size > 1) to gather again once updated."""
        self._lock = threading.Lock()
        self._updated: set[int] = set()
        """In-memory records whose update has run (under ``_lock``; on-disk ones: the write-back knows)."""
        self.active = False
        """A step is handed over and not finished yet."""
        self.failed = False
        """Its update raised in `values` (the forward's gather): the engine gives the step up."""
        self.steps = 0
        """Steps begun here (for tests and benchmarks: the path was taken)."""

    # ---- the step ---------------------------------------------------------------------------------

    def begin(self, grads: dict[int, torch.Tensor | None], grad_scale: float) -> None:
        """Start the step: ``grads`` (record index -> reduced fp32 gradient partition, which the optimizer
        frees as it applies them; None: in the gradient swap file) multiplied by ``grad_scale``. Starts
        the store's prefetch of the next forward's first partitions, hands over what needs no read, and
        starts reading gradients."""
        self._opt.start_step(grad_scale, in_order=True)
        self.failed = False
        self.steps += 1
        self._pending = dict(grads)
        self._handed = set()
        with self._lock:
            self._updated = set()
        self._order = self._forward_order(set(self._pending))
        self._cursor = 0
        self.active = True
        self._store.prefetch_from_start()  # the forward's first partitions: read for their updates, or not (`overwrites`)
        self._advance()
        self._kept.next = set()  # those not handed over yet are prefetched buffers like any other

    def prepare(self, keep_elements: int) -> None:
        """A backward whose step will be handed over begins: keep the buffers its gathers read of the
        on-disk partitions the next forward updates first, up to ``keep_elements`` (`KeptBuffers.next`),
        so that their updates need no read."""
        keep, held = set(), 0
        on_disk = [rec for unit in self._forward_order(set(self._unit)) for rec in unit if rec.on_disk]
        for rec in on_disk:  # a prefix of the order
            if held + rec.partition_numel > keep_elements:
                break
            keep.add(rec.index)
            held += rec.partition_numel
        self._kept.next = keep

    def values(self, rec: ParamRecord) -> torch.Tensor | None:
        """The store is gathering ``rec``: make sure its update has run (handing it over, and reading it,
        if that has not happened yet; sync point), and return its updated values when they are held here
        rather than in the store (None: gather as usual). Raises the update's error (TensorIOError)."""
        if not self.active:
            return None
        try:
            if rec.index in self._pending:
                self._hand_over(self._unit[rec.index])
            self._advance()
            if rec.index in self._handed:
                self._wait(rec)
        except BaseException:
            self.failed = True
            raise
        if rec.index in self._refresh:
            self._refresh.discard(rec.index)
            self._store.refresh(rec)  # all-gather of the updated partition (every rank does this here)
        if self._writeback is not None and self._writeback.holds(rec):
            values = rec.partition.data
            self._writeback.use(rec)  # may let the buffer go now: ``values`` keeps it alive
            return values
        return None

    def overwrites(self, rec: ParamRecord) -> bool:
        """Whether ``rec``'s update, still to be handed over, writes every element of its partition from
        the optimizer's fp32 master without reading it (`OffloadAdam.overwrites`): reading it first would
        be wasted (16-bit partitions, from their second update on)."""
        return self.active and rec.index in self._pending and self._opt.overwrites(rec.partition)

    def settled(self, rec: ParamRecord) -> bool:
        """Whether ``rec``'s values are final for the forward without waiting: no update of it in this step,
        or its update has run (any later write to its host memory waits for the copies that read it)."""
        if not self.active:
            return True
        if rec.index in self._pending:
            return False
        return rec.index not in self._handed or self._is_updated(rec)

    def holds(self, rec: ParamRecord) -> bool:
        """Whether ``rec``'s values are held by the step (handed over), not by the store."""
        return self._writeback is not None and self._writeback.holds(rec)

    def finish(self) -> None:
        """Hand over every update the forward did not reach (reading those partitions: sync points), let
        the optimizer run them all and start committing (sync point). Raises the step's first error."""
        if not self.active:
            return
        for unit in self._order[self._cursor:]:
            self._hand_over(unit)
        for index in list(self._pending):  # not in any unit: cannot happen, but never drop an update
            self._hand_over(self._unit[index])
        self._cursor = len(self._order)
        self.active = False
        self._reading = {}
        self._opt.step()  # sync point: every update has run; commits now or once its writes land
        if self._writeback is not None:
            self._writeback.finish()  # sync point: the partitions' writes have landed
        refresh, self._refresh = sorted(self._refresh), set()
        self._store.refresh_many([self._store.records[index] for index in refresh])

    def abandon(self) -> None:
        """Forget the step (after the engine gave it up: the optimizer and the write-back let go first)."""
        for _, future in self._reading.values():
            future.exception()  # never let go of memory the kernel may still write to
        self._reading = {}
        self._pending, self._order, self._cursor = {}, [], 0
        self._handed, self._refresh = set(), set()
        self.active = False

    # ---- internals --------------------------------------------------------------------------------

    def _forward_order(self, wanted: set[int]) -> list[list[ParamRecord]]:
        """Units holding any of the records ``wanted``: first as the recorded order gathers them, then the rest."""
        seen: set[int] = set()
        order = []
        for index in list(self._store.prefetcher.trace) + sorted(wanted):
            unit = self._unit.get(index)
            if unit is None or id(unit) in seen or not any(r.index in wanted for r in unit):
                continue
            seen.add(id(unit))
            order.append(unit)
        return order

    def _advance(self) -> None:
        """Hand over the next units in order while their partitions (and gradients) are in memory, and
        read gradients ahead (never waits)."""
        while self._cursor < len(self._order):
            unit = self._order[self._cursor]
            if not all(self._arrived(rec) for rec in unit if rec.index in self._pending):
                break
            self._hand_over(unit)
            self._cursor += 1
        self._read_grads_ahead()

    def _arrived(self, rec: ParamRecord) -> bool:
        if self._pending.get(rec.index, 0) is None and not (rec.index in self._reading and
                                                            self._reading[rec.index][1].done()):
            return False  # its gradient is still in the swap file
        return not rec.on_disk or (rec.buffer is not None and (rec.read is None or rec.read.done()))

    def _read_grads_ahead(self) -> None:
        """Start reading the gradients of the next units from the swap file, ``read_ahead`` elements at most."""
        if self._grad_reads is None:
            return
        ahead = sum(buffer.numel() for buffer, _ in self._reading.values())
        for unit in self._order[self._cursor:]:
            for rec in unit:
                if self._pending.get(rec.index, 0) is not None or rec.index in self._reading:
                    continue
                if ahead and ahead + rec.partition_numel > self._read_ahead:
                    return
                self._reading[rec.index] = self._grad_reads(rec)
                ahead += rec.partition_numel

    def _gradient(self, rec: ParamRecord) -> torch.Tensor | None:
        """``rec``'s pending gradient, taken from the pending set: from memory, or read (sync point)."""
        if rec.index not in self._pending:
            return None
        grad = self._pending.pop(rec.index)
        if grad is None:
            buffer, future = self._reading.pop(rec.index, None) or self._grad_reads(rec)
            future.result()  # sync point (raises TensorIOError)
            grad = buffer
        return grad

    def _hand_over(self, unit: list[ParamRecord]) -> None:
        for rec in unit:
            grad = self._gradient(rec)
            if grad is None:
                continue
            self._rollback.before_update(rec)
            self._store.before_host_write(rec)  # no copy to a device may still read it
            self._handed.add(rec.index)
            if self._store.kept_elsewhere(rec):
                self._refresh.add(rec.index)
            if rec.on_disk:
                self._writeback.hand_over(rec, grad, hold=True)  # sync point if its read is in flight
            else:
                self._opt.grad_ready(rec.partition, on_updated=functools.partial(self._updated_in_memory, rec),
                                     grad=grad.view(rec.partition.shape))
            del grad  # the optimizer frees (or reuses) it once applied

    def _updated_in_memory(self, rec: ParamRecord, partition: torch.Tensor) -> None:
        """The optimizer's thread: ``rec``'s in-memory partition is updated."""
        with self._lock:
            self._updated.add(rec.index)

    def _is_updated(self, rec: ParamRecord) -> bool:
        if rec.on_disk:
            return self._writeback.is_updated(rec)
        with self._lock:
            return rec.index in self._updated

    def _wait(self, rec: ParamRecord) -> None:
        """Sync point: wait for ``rec``'s update (the optimizer's thread runs it). Raises its error."""
        if self._is_updated(rec):
            return
        self._opt.wait_for_updates(lambda: self._is_updated(rec))
        if not self._is_updated(rec):
            self._opt.raise_if_failed()
            raise RuntimeError(f"internal error: the update of {rec.name!r} was handed over but has not run")
