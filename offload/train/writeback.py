"""On-disk partitions updated during backward, written back as soon as the optimizer is done with them.

With parameters on NVMe and the updates running during backward (docs/engine.md), a partition's
gradient arrives while the buffer its backward read is still in memory (`ParamStore.take_buffer`).
`PartitionWriteBack.hand_over` gives both to `OffloadAdam`, whose background thread updates the
partition and calls back; the callback starts the write. The buffer is let go, and its elements
leave the swap budget, once that write has landed (`reap`). Backward is held back while more than
``limit`` elements wait for their update or their write.
"""

from __future__ import annotations

import functools
import threading

import torch

from tensorio import IOFuture

from offload.params.store import ParamRecord, ParamStore


class PartitionWriteBack:
    """Hands on-disk partitions and their gradients to the optimizer and writes them back when updated."""

    def __init__(self, store: ParamStore, optimizer, limit: int) -> None:
        self._store, self._optimizer, self._limit = store, optimizer, limit
        self._lock = threading.Lock()
        self._held: dict[int, ParamRecord] = {}
        """Records whose buffer was handed over and not yet written back and let go."""
        self._writes: list[tuple[ParamRecord, IOFuture]] = []
        """Writes started by the optimizer's thread, not yet reaped (under ``_lock``)."""
        self._waiting = 0
        """Elements handed over and not yet updated (under ``_lock``)."""
        self._writing = 0
        """Elements being written (under ``_lock``)."""
        self._error: BaseException | None = None

    def hand_over(self, rec: ParamRecord, grad: torch.Tensor) -> None:
        """Backward (a gradient hook): give ``rec``'s partition, with its values, and its reduced
        gradient to the optimizer. Waits while too much is handed over and not yet written."""
        self.reap()
        rec.partition.data = self._store.take_buffer(rec)
        rec.partition.grad = grad.view(rec.partition.shape).to(rec.partition.dtype)
        self._held[rec.index] = rec
        with self._lock:
            self._waiting += rec.partition_numel
        self._optimizer.grad_ready(rec.partition, on_updated=functools.partial(self._updated, rec))
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
        future = self._store.write_partition(rec, partition.data)
        with self._lock:
            self._writes.append((rec, future))
            self._waiting -= rec.partition_numel
            self._writing += rec.partition_numel
        return future

    def reap(self) -> None:
        """Let go of the partitions whose write has landed; never waits. A failed write is reported by
        `finish`."""
        with self._lock:
            done = [item for item in self._writes if item[1].done()]
            self._writes = [item for item in self._writes if item not in done]
        for rec, future in done:
            self._let_go(rec, future)

    def _wait_oldest_write(self) -> None:
        with self._lock:
            if not self._writes:
                return
            rec, future = self._writes.pop(0)
        future.exception()  # sync point
        self._let_go(rec, future)

    def _let_go(self, rec: ParamRecord, future: IOFuture) -> None:
        error = future.exception()
        if error is not None and self._error is None:
            self._error = error
        self._release(rec)
        with self._lock:
            self._writing -= rec.partition_numel

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
        self._store.return_buffer(rec)
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
        for rec in list(self._held.values()):  # never updated: the step failed before them
            self._release(rec)
        with self._lock:
            self._waiting = self._writing = 0
        error, self._error = self._error, None
        return error
