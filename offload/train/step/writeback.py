"""On-disk partitions updated during backward, written back as soon as the optimizer is done with them.

With parameters on NVMe and the updates running during backward (docs/engine.md), a partition's
gradient arrives while the buffer its backward read is still in memory (`KeptBuffers.take`).
`PartitionWriteBack.hand_over` gives both to `OffloadAdam`, whose background thread updates the
partition and calls back; the callback starts the write. The buffer is let go, and its elements
leave the swap budget, once that write has landed (`reap`). Backward is held back while more than
``limit`` elements wait for their update or their write.

The update is written to the partition's uncommitted slot (`SlottedRegion.stage`): the previous
values stay readable until the optimizer commits the step. The same hand-over serves the step that runs
during the next forward (`offload.train.step.deferred`): there a partition handed over with ``hold`` keeps
its buffer after the write has landed, until the forward has used it (`use`), which saves reading it
again.
"""

from __future__ import annotations

import functools
import threading

import torch

from tensorio import IOFuture

from offload.optim.protocol import StepOptimizer
from offload.params.record import ParamRecord
from offload.params.store import ParamStore
from offload.storage.write_queue import WriteQueue
from offload.train.step.kept_buffers import KeptBuffers


class PartitionWriteBack:
    """Hands on-disk partitions and their gradients to the optimizer and writes them back when updated."""

    def __init__(self, store: ParamStore, kept: KeptBuffers, optimizer: StepOptimizer, limit: int) -> None:
        self._store, self._kept, self._optimizer, self._limit = store, kept, optimizer, limit
        self._lock = threading.Lock()
        self._held: dict[int, ParamRecord] = {}
        """Records whose buffer was handed over and not yet written back and let go."""
        self._writes = WriteQueue()
        """Writes started by the optimizer's thread, not yet reaped, each with its record (the first error
        is kept for `finish`)."""
        self._waiting = 0
        """Elements handed over and not yet updated (under ``_lock``)."""
        self._writing = 0
        """Elements being written (under ``_lock``)."""
        self._updated_recs: set[int] = set()
        """Records handed over whose update has run (under ``_lock``)."""
        self._unused: set[int] = set()
        """Records handed over with ``hold`` that the forward has not used yet."""
        self._landed: dict[int, ParamRecord] = {}
        """Records whose write has landed, kept for a use to come."""

    def hand_over(self, rec: ParamRecord, grad: torch.Tensor, *, hold: bool = False) -> None:
        """Give ``rec``'s partition, with its values, and its reduced gradient to the optimizer (from a
        gradient hook in backward, or from the step that runs in the next forward). Waits while too
        much is handed over and not yet written. ``hold``: keep the buffer after its write, until `use`.
        The gradient is passed as it is (fp32 for a 16-bit partition: the optimizer's master copy takes it)."""
        self.reap()
        rec.partition.data = self._kept.take(rec, observe=not hold)
        self._held[rec.index] = rec
        if hold:
            self._unused.add(rec.index)
        with self._lock:
            self._waiting += rec.partition_numel
        self._optimizer.grad_ready(rec.partition, on_updated=functools.partial(self._updated, rec),
                                   grad=grad.view(rec.partition.shape))
        if hold:
            return  # the step in the next forward: its buffer came from the store's budget, its gradient was kept
        # Back-pressure, deadlock-free: updates may wait for gradients still to come, so this waits
        # for them only while the optimizer's thread has work; writes always finish by themselves.
        # So about ``limit`` elements wait or are being written, more only while the updates wait
        # for gradients still to come (parameters sharing a sub-group with ones not reached yet).
        self._optimizer.wait_for_updates(lambda: self._waiting <= self._limit)
        while self._writes and self._waiting + self._writing > self._limit:
            self._wait_oldest_write()

    def _updated(self, rec: ParamRecord, partition: torch.Tensor) -> IOFuture:
        """The optimizer's thread: ``rec``'s partition is updated; start writing it back. The optimizer
        commits its step only once this write has succeeded."""
        future = self._store.region.stage(rec.slots, partition.data)
        with self._lock:
            self._updated_recs.add(rec.index)
            self._writes.push(future, rec)
            self._waiting -= rec.partition_numel
            self._writing += rec.partition_numel
        return future

    def reap(self) -> None:
        """Let go of the partitions whose write has landed; never waits. A failed write is reported by
        `finish`."""
        for rec, error in self._writes.reap():
            self._let_go(rec, error)

    def _wait_oldest_write(self) -> None:
        if self._writes:
            self._let_go(*self._writes.wait_oldest())  # sync point

    def _let_go(self, rec: ParamRecord, error: BaseException | None) -> None:
        with self._lock:
            self._writing -= rec.partition_numel
        if rec.index in self._unused and error is None:
            self._landed[rec.index] = rec  # the forward will use it: keep the buffer until then
            return
        self._release(rec)

    def holds(self, rec: ParamRecord) -> bool:
        """Whether ``rec``'s partition is handed over (its values are in ``rec.partition``, being or
        about to be updated, or updated and kept)."""
        return rec.index in self._held

    def counts(self) -> tuple[int, int]:
        """``(partitions handed over and not let go yet, writes not reaped yet)`` (any thread)."""
        return len(self._held), len(self._writes)

    def is_updated(self, rec: ParamRecord) -> bool:
        """Whether the optimizer has updated ``rec`` (any thread)."""
        with self._lock:
            return rec.index in self._updated_recs

    def use(self, rec: ParamRecord) -> None:
        """The forward has taken ``rec``'s updated values (it holds a view): once written, the buffer
        may go."""
        self._unused.discard(rec.index)
        landed = self._landed.pop(rec.index, None)
        if landed is not None:
            self._release(landed)

    def settle(self) -> None:
        """Wait until the optimizer's thread has run every update handed over (sync point) and every
        write-back has landed; those partitions are let go. Partitions still waiting for gradients stay
        handed over. Errors are kept for `finish`. Returns at once when nothing is handed over (after a
        step): the optimizer's own write-behind then goes on into the forward."""
        if not self._held:
            return
        self._optimizer.wait_for_updates(lambda: False)
        while self._writes:
            self._wait_oldest_write()

    def _release(self, rec: ParamRecord) -> None:
        """``rec``'s partition is an empty placeholder again and its buffer leaves the budget."""
        rec.partition.grad = None
        rec.partition.data = self._store.placeholder(rec.partition.dtype)
        self._kept.give_back(rec)
        del self._held[rec.index]

    def finish(self) -> None:
        """After the optimizer's step: wait for every write (sync point) and let go of the buffers.
        Raises the first write's error (TensorIOError), after letting everything go."""
        error = self._drain()
        if error is not None:
            raise error

    def abort(self) -> None:
        """After a failed step: wait for the writes in flight (errors dropped), let every buffer go."""
        self._drain()

    def _drain(self) -> BaseException | None:
        """Wait for every write, let go of every buffer handed over (written or not); return the first
        write error since the last drain."""
        while self._writes:
            self._wait_oldest_write()
        self._unused.clear()
        self._landed.clear()
        for rec in list(self._held.values()):  # kept for a use, or never updated: the step failed before them
            self._release(rec)
        with self._lock:
            self._waiting = self._writing = 0
            self._updated_recs.clear()
        return self._writes.take_error()
