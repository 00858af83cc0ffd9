"""`ResidentLoad`: the weights a plan keeps in memory (or on a compute device) read in the background,
while the model already runs; the layer streamer (offload/infer/stream/streamer.py) borrows the units it
has not taken on yet."""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future

import torch

from offload.at_exit import end_at_exit
from offload.infer.stream.unit import Unit
from offload.storage.safetensors_reader import read_windows, tensor_views
from tensorio import AioHandle, aligned_tensor, locked_tensor, prefault

__all__ = ["ResidentLoad"]


class ResidentLoad:
    """Reads ``units`` into memory of their own in the background, while the model already runs.

    Every unit's windows are read into one page-aligned buffer of its own (O_DIRECT) that its
    parameters become views of, so nothing is copied. A thread takes the units on in the given order:
    it faults each buffer in (on every core, `tensorio.prefault`: fresh memory is slow to get on a
    virtual machine, docs/inference.md "Load") and starts its reads, keeping about ``ahead_bytes`` of
    them in flight so that the streamed layers' reads are not queued behind the whole load. With
    ``place`` (compute with memory of its own) it places each unit once its reads are done, before the
    next (`_settle`), so that the load holds one unit's pinned buffer beside the budget. A unit's
    parameters stay meta placeholders until it is needed: a forward pre-hook on each module holding
    one of them waits for that unit's reads (taking it on next if the thread has not yet) and binds
    its tensors (converted where the dtype or device differs). A unit the thread has not taken on
    may be claimed by the layer streamer, which reads it into its ring for one forward and gives it
    back (`claim`, `unclaim`); the thread takes it on afterwards. So the first forward need not wait
    for the load. Created ``held``, the thread takes on only the units that cannot stream, and those
    a forward waits for, until `release` (the engine releases it once the first forward is done):
    that forward reads the others through the ring, with the disk and the cores to itself (faulting
    fresh memory in takes CPU from a forward beside it, docs/inference.md "Load"). A unit whose
    load failed (a read or a fault error) is read again by the forward that needs it; only that
    read's error is raised, and the next forward tries again, so an error that has passed (a shard
    being replaced, a moment short of memory) costs nothing for good.
    """

    def __init__(self, handle: AioHandle, units: list[Unit], *,
                 place: Callable[[Unit, torch.Tensor], torch.Tensor | None] | None = None,
                 ahead_bytes: int = 1 << 30, held: bool = False) -> None:
        self.handle = handle
        self.units = list(units)
        self.place = place
        """Where compute has memory of its own: given a unit and its pinned host buffer (read), returns
        the device buffer its parameters are views of, or None to keep it in pinned host memory
        ("host"). None: parameters are views into the host buffer."""
        self.ahead_bytes = ahead_bytes
        self.nbytes = 0
        """Bytes read by the units bound so far."""
        self.finished_at: float | None = None
        """``time.perf_counter()`` when the last read finished, a forward's read again included (None
        until then)."""
        # With ``place``, pinned (locked) buffers, made by the thread unit by unit (they are copied to the device).
        self._buffers = [None if place else aligned_tensor(unit.buffer_nbytes, torch.uint8) for unit in self.units]
        self._issued: list[Future] = [Future() for _ in self.units]
        """Per unit: its read futures once they are started, or why they were not."""
        self._settled: list[tuple[int, torch.Tensor | None] | None] = [None] * len(self.units)
        """Per unit, once its reads are done and it is placed (`_settle`): (bytes read, the buffer its
        parameters become views of, None where it stays in pinned host memory)."""
        self._unit_locks = [threading.Lock() for _ in self.units]
        """Per unit: held while it is settled or given up, so that the two never overlap."""
        self._paused = False
        self._placing = False
        """Guarded by ``_changed``: whether `paused` holds the thread's placements back, and whether the
        thread is settling a unit now."""
        self._index = {id(unit): i for i, unit in enumerate(self.units)}
        self._changed = threading.Condition()
        # Guarded by ``_changed`` (with each unit's ``claimed``): units the thread has taken on, given
        # up, and wanted by a forward first.
        self._taken: set[int] = set()
        self._dropped: set[int] = set()
        self._wanted: deque[int] = deque()
        self._held = held
        for unit in self.units:
            unit.state, unit.loading = "loading", self
            owners = {id(module): module for ref in unit.params for module, _ in ref.owners}
            unit.load_hooks = [module.register_forward_pre_hook(lambda module, args, unit=unit: self.wait(unit))
                               for module in owners.values()]
        self._thread = threading.Thread(target=self._run, name="load-resident", daemon=True)
        self._thread.start()
        end_at_exit(self, ResidentLoad.close)  # an engine nobody closed (offload/at_exit.py)

    # ---- the thread -------------------------------------------------------------------------------

    def _run(self) -> None:
        """Fault each buffer in, then start its reads, unit by unit. A unit that fails keeps its error
        for `wait` (which reads it again); the others go on.

        The thread and the fault threads it starts keep the caller's CPU priority. At a lower one
        (it ran at nice 19) they stalled the forward whenever other processes kept the cores busy:
        each of them takes the GIL between its calls, and a thread asking for the GIL makes the
        forward's thread hand it over and wait until the asker runs, which a niced thread rarely
        does on a busy machine; a forward also waits for a unit the thread has taken on. Measured
        with two busy loops beside a streamed int4 decode (docs/benchmarks.md, "Quantized weights"):
        decode steps of 4-26 s at nice 19 against 2.9 s at the caller's priority.
        """
        in_flight: deque[int] = deque()
        while (i := self._take()) is not None:
            try:
                unit, buffer = self.units[i], self._buffer(i)
                if self.place is None:
                    prefault(buffer)
                while in_flight and sum(self.units[j].read_nbytes for j in in_flight) + unit.read_nbytes > self.ahead_bytes:
                    self._reads_done(in_flight.popleft())  # finished, either way: its errors are for `wait`
                self._issued[i].set_result(read_windows(self.handle, unit.windows, buffer))
                if self.place is None:
                    in_flight.append(i)
                else:  # placed now: a unit the device keeps gives its pinned host buffer back at once
                    self._settle_between_pauses(i)
            except BaseException as exc:  # noqa: BLE001 - handed to whoever waits for this unit
                if not self._issued[i].done():
                    self._issued[i].set_exception(exc)
        for i in in_flight:
            self._reads_done(i)
        self._finished()

    def _settle_between_pauses(self, i: int) -> None:
        """`_settle` unit ``i`` in the thread, once no `paused` holds placements back."""
        with self._changed:
            while self._paused:
                self._changed.wait()
            self._placing = True
        try:
            self._settle(i)
        finally:
            with self._changed:
                self._placing = False
                self._changed.notify_all()

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Hold the thread's placements back (its reads go on) while the context is open; entered once
        the thread is not placing a unit. The engine pauses its loads while it changes the plan that
        ``place`` follows, so that no unit is placed by the plan that is going."""
        with self._changed:
            self._paused = True
            while self._placing:
                self._changed.wait()
        try:
            yield
        finally:
            with self._changed:
                self._paused = False
                self._changed.notify_all()

    def _settle(self, i: int, *, again: bool = False) -> tuple[int, BaseException | None, torch.Tensor | None]:
        """Wait for unit ``i``'s reads (``again``: read it once more first, in this thread) and place it:
        (bytes read, the first error, the buffer its parameters become views of: the host buffer
        without ``place``, ``place``'s device buffer, or None where it stays in pinned host memory).
        Once per unit: the load's thread settles each unit as soon as its reads are done where
        ``place`` is given (the pinned host buffer of a unit the device keeps would otherwise be held
        until a forward reaches it: the whole device tier at once, over the host budget), `wait` the
        others. Failed reads are not kept: the next call waits for (or makes) new ones."""
        with self._unit_locks[i]:
            if self._settled[i] is not None:
                return self._settled[i][0], None, self._settled[i][1]
            if self.units[i].loading is not self:  # given up meanwhile (`drop`)
                return 0, None, None
            nbytes, error = self._read_again(i) if again else self._reads_done(i)
            if error is not None:
                return 0, error, None
            buffer = self._buffers[i]
            if self.place is not None:
                buffer = self.place(self.units[i], buffer)
                if buffer is not None:
                    self._buffers[i] = None  # on the device: its pinned host memory goes now
            self._settled[i] = (nbytes, buffer)
            return nbytes, None, buffer

    def _buffer(self, i: int) -> torch.Tensor:
        """Unit ``i``'s host buffer, made now where it is pinned (`locked_tensor` faults it in)."""
        if self._buffers[i] is None:
            self._buffers[i] = locked_tensor(self.units[i].buffer_nbytes, torch.uint8)
        return self._buffers[i]

    def _finished(self) -> None:
        """Note that reads have just finished (the last note is `finished_at`)."""
        with self._changed:
            self.finished_at = max(self.finished_at or 0.0, time.perf_counter())

    def _take(self) -> int | None:
        """The next unit to take on: one a forward waits for, else the first free one in order (while
        held, only one that cannot stream); while every other is lent to the streamer or held, wait.
        None once all are taken or given up."""
        with self._changed:
            while True:
                left = [i for i in range(len(self.units)) if i not in self._taken and i not in self._dropped]
                free = [i for i in self._wanted if i in left and not self.units[i].claimed] + [
                    i for i in left if not self.units[i].claimed and not (self._held and self.units[i].streamable)]
                if free:
                    self._taken.add(free[0])
                    return free[0]
                if not left:
                    return None
                self._changed.wait()

    def _lent(self) -> list[Unit]:
        """The units lent to the streamer now (under ``_changed``)."""
        return [unit for i, unit in enumerate(self.units) if unit.claimed and i not in self._dropped]

    def _reads_done(self, i: int) -> tuple[int, BaseException | None]:
        """Wait for every read of unit ``i``: (bytes read, the first error, or what kept its reads from
        starting)."""
        try:
            futures = self._issued[i].result()
        except BaseException as exc:  # noqa: BLE001 - the caller raises or ignores it
            return 0, exc
        nbytes, error = 0, None
        for future in futures:
            try:
                nbytes += future.result()
            except BaseException as exc:  # noqa: BLE001 - the caller raises or ignores it
                error = error or exc
        return nbytes, error

    def _read_again(self, i: int) -> tuple[int, BaseException | None]:
        """Read unit ``i`` once more, in the caller's thread (its load failed): as `_reads_done`."""
        issued: Future = Future()
        try:
            issued.set_result(read_windows(self.handle, self.units[i].windows, self._buffer(i)))
        except BaseException as exc:  # noqa: BLE001 - kept for the next try, like the thread's
            issued.set_exception(exc)
        self._issued[i] = issued
        result = self._reads_done(i)
        if result[1] is None:
            self._finished()
        return result

    def _let_go(self, i: int, state: str) -> None:
        """Unit ``i`` is no longer this load's: its hooks go, its state becomes ``state``."""
        unit = self.units[i]
        for hook in unit.load_hooks:
            hook.remove()
        unit.state, unit.loading, unit.load_hooks = state, None, []
        self._buffers[i] = self._settled[i] = None  # bound: its views (or converted copy) hold what stays

    # ---- the streamer's side ----------------------------------------------------------------------

    @property
    def dropped(self) -> frozenset[int]:
        """Indices into ``units`` of those given up before the thread took them on (`drop`, `close`)."""
        with self._changed:
            return frozenset(self._dropped)

    def claim(self, unit: Unit) -> bool:
        """Lend ``unit`` to the streamer for one forward, if the thread has not taken it on; whether lent."""
        i = self._index[id(unit)]
        with self._changed:
            if i in self._taken or i in self._dropped:
                return False
            unit.claimed = True
            return True

    def unclaim(self, unit: Unit) -> None:
        """The streamer is done with ``unit``: the thread may take it on."""
        with self._changed:
            unit.claimed = False
            self._changed.notify_all()

    def release(self) -> None:
        """Let a held load take on the rest of its units (nothing to do otherwise)."""
        with self._changed:
            self._held = False
            self._changed.notify_all()

    # ---- waiting and binding ----------------------------------------------------------------------

    def wait(self, unit: Unit) -> None:
        """Wait for ``unit``'s reads (asking the thread to take it on next) and bind its parameters
        there for good. Nothing to do once bound, or while the streamer has it.

        Where its load failed, reads it again here. Raises that read's error (a TensorIOError naming
        the file and offset) once every read started into its buffer has finished; the unit then
        stays unbound, and the next call tries again.
        """
        if unit.loading is not self or unit.claimed:
            return
        i = self._index[id(unit)]
        with self._changed:
            if i not in self._taken:
                self._wanted.append(i)
                self._changed.notify_all()
        nbytes, error, buffer = self._settle(i)
        if error is not None:
            nbytes, error, buffer = self._settle(i, again=True)
        if error is not None:
            raise error
        if unit.loading is not self:  # given up while this waited
            return
        self.nbytes += nbytes
        if buffer is None:  # kept in pinned host memory, copied to the device for each forward
            self._let_go(i, "host")
            return
        views = unit.device_layout.views(buffer) if self.place else tensor_views(unit.windows, buffer)
        # Fused experts are copies (`ParamRef.value`): the unit's other tensors are copied out too, so that the
        # buffer goes once bound and the unit holds its weights' bytes once, not the read bytes beside them.
        fused = any(ref.conversion is not None for ref in unit.params)
        storage = buffer.untyped_storage().data_ptr()
        for ref in unit.params:
            value = ref.value(views)  # converted to the dtype the model keeps it in, where it differs
            if fused and value.untyped_storage().data_ptr() == storage:
                value = value.clone()
            ref.bind(value)
        self._let_go(i, "resident")

    def join(self) -> None:
        """Wait for the load's thread to end: every unit it takes on read and, with ``place``, placed;
        nothing bound (a forward binds, or `wait`). A held load's thread ends only after `release`."""
        self._thread.join()

    def wait_all(self) -> None:
        """Wait for every unit and bind it. Raises the first error once every started read has
        finished; RuntimeError where the streamer holds a unit (`LayerStreamer.reset` it first)."""
        with self._changed:
            lent = self._lent()
        if lent:
            raise RuntimeError(f"the layer streamer holds {lent[0].name} (and {len(lent) - 1} more); reset it first")
        error = None
        for unit in self.units:
            try:
                self.wait(unit)
            except BaseException as exc:  # noqa: BLE001 - raised below
                error = error or exc
        self._thread.join()  # it has only to note the time
        if error is not None:
            raise error

    @property
    def done(self) -> bool:
        """Whether every unit is bound."""
        return all(unit.loading is not self for unit in self.units)

    def drop(self, unit: Unit) -> None:
        """Give ``unit`` up ("on disk", unbound) without waiting for the load to reach it: the thread
        skips it, or, where its reads have started, they are waited for (errors ignored; no forward
        needs its data). Nothing to do once it is bound. The streamer must not hold it."""
        if unit.loading is not self:
            return
        i = self._index[id(unit)]
        with self._changed:
            taken = i in self._taken
            if not taken:
                self._dropped.add(i)
                self._changed.notify_all()
        with self._unit_locks[i]:  # not while the thread places it
            if taken:
                self._reads_done(i)  # errors ignored: no forward needs its data
            self._let_go(i, "on disk")

    def close(self) -> None:
        """Give up every unit not yet bound (`drop`): none is started any more, those started are
        waited for."""
        with self._changed:
            self._dropped.update(i for i, unit in enumerate(self.units) if i not in self._taken and unit.loading is self)
            self._changed.notify_all()
        for unit in self.units:
            self.drop(unit)
        self._thread.join()
