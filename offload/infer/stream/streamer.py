"""The layer streamer: a ring of locked buffers that the next streamed layers are read into while the
current one computes, and the hooks that swap a layer's parameters to views into its buffer.

One record per unit (`Unit`): its module, its parameters' owners, its windows in the checkpoint and
its state: "resident" (its own memory, never streamed), "on disk", "in flight" (a read into a ring
buffer is under way), "in use" (its parameters are views into that buffer). Outside its forward a
streamed unit's parameters are meta placeholders, so the model never holds it. Where the compute
device has memory of its own, a unit is "resident" in device memory, or "host" (kept in pinned host
memory and copied to the device ring for each forward: "staged" while it computes there), or streamed
from the disk through the locked ring and then the device ring (offload/infer/stream/device_ring.py).

Reads are issued in forward order and wrap around to the next forward, so the disk reads the first
layers of the next token while the last ones of this token compute. A buffer is reused as soon as
its layer's forward has returned.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from offload.infer.stream.device_ring import DeviceRing
from offload.infer.stream.unit import Unit
from offload.storage.safetensors_reader import read_windows, tensor_views
from tensorio import AioHandle, aligned_tensor, free_locked_tensor, locked_tensor, prefault

__all__ = ["LayerStreamer", "ResidentLoad"]


class LayerStreamer:
    """Streams the non-resident units through ``buffer_count`` locked buffers of ``buffer_nbytes``.

    ``attach(unit)`` installs the hooks once per streamable unit; whether it streams is decided by
    ``set_units`` (the streamed units in forward order), which can change between calls. ``stager``
    (a `DeviceRing`, where the compute device has memory of its own) copies a buffer to the device
    before the layer computes, and the next units' ahead of use while it does; None computes on the
    CPU, in the ring buffer itself.
    """

    def __init__(self, handle: AioHandle, *, buffer_count: int, stager: DeviceRing | None = None) -> None:
        self.handle = handle
        self.buffer_count = buffer_count
        self.lookahead = buffer_count
        """Reads in flight at most (``stage3_prefetch_bucket_size``), at most ``buffer_count``."""
        self.stager = stager
        self.buffers: list[torch.Tensor] = []
        self.buffer_nbytes = 0
        self.units: list[Unit] = []
        self._free: deque[int] = deque()
        self._allocating: deque[Future] = deque()
        """Ring buffers still being made, in order."""
        self._inflight: deque[Unit] = deque()
        self._next = 0
        self.bytes_read = 0
        """Bytes read by completed streaming reads."""
        self.wait_seconds = 0.0
        """Time the forward spent waiting for reads (the part of the I/O not hidden behind compute)."""

    # ---- setup ------------------------------------------------------------------------------------

    def attach(self, unit: Unit) -> None:
        """Install ``unit``'s hooks: acquire before its forward, release after (also when it raises)."""
        unit.hooks = [
            unit.module.register_forward_pre_hook(lambda module, args: self.acquire(unit)),
            unit.module.register_forward_hook(lambda module, args, out: self.release(unit), always_call=True),
        ]

    def set_units(self, units: list[Unit], buffer_nbytes: int, lookahead: int | None = None) -> None:
        """Serve ``units`` (forward order) from now on, through buffers of ``buffer_nbytes`` bytes (0:
        no ring), with at most ``lookahead`` reads in flight (None: as many as buffers). Those
        "resident" are left alone, those "loading" are read into the ring while their load has not
        taken them on (`ResidentLoad.claim`), the others are streamed."""
        self.reset()
        self.lookahead = self.buffer_count if lookahead is None else max(1, min(lookahead, self.buffer_count))
        self._allocate(buffer_nbytes)
        self.units = list(units)
        for unit in self.units:
            if unit.state not in ("resident", "loading", "host"):
                unit.state = "on disk"
                unit.unbind()
        self._free = deque(range(len(self.buffers)))
        self._next = 0
        self._issue()

    def _allocate(self, buffer_nbytes: int) -> None:
        """Make the ring ``buffer_count`` locked buffers of ``buffer_nbytes`` bytes (0: none), in the
        background: a thread locks them one by one (fresh memory is slow to fault in, docs/inference.md
        "Load") and each takes reads as soon as it is ready. Nothing to do when the ring already is
        (or is being) that. No read may be in flight (`reset` first)."""
        if buffer_nbytes != self.buffer_nbytes:
            self._free_buffers()
        if buffer_nbytes and not self.buffers and not self._allocating:
            maker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ring-buffers")
            self._allocating = deque(maker.submit(locked_tensor, buffer_nbytes, torch.uint8)
                                     for _ in range(self.buffer_count))
            maker.shutdown(wait=False)
            self.buffer_nbytes = buffer_nbytes

    @property
    def idle_buffers(self) -> int:
        """Ring buffers free for the next read (made and not holding a unit)."""
        return len(self._free)

    @property
    def reads_in_flight(self) -> int:
        """Units being read into a ring buffer now."""
        return len(self._inflight)

    def wait_buffers(self) -> None:
        """Wait until every ring buffer is made. Raises the error that kept one from being made."""
        while self._allocating:
            self._collect(block=True)

    def _collect(self, *, block: bool = False) -> None:
        """Add the ring buffers made so far to the free ones (with ``block``: wait for the next one).
        Raises the error that kept a buffer from being made (OSError, MemoryError)."""
        while self._allocating and (block or self._allocating[0].done()):
            self.buffers.append(self._allocating.popleft().result())
            self._free.append(len(self.buffers) - 1)
            block = False

    # ---- the hot path -----------------------------------------------------------------------------

    def acquire(self, unit: Unit) -> None:
        """Before ``unit``'s forward: wait for its read and bind its parameters to views into its buffer."""
        if unit.state == "resident":
            return
        if unit.state == "loading":
            self._issue()  # the ring takes it where it has come to it and its load has not
            while unit.state == "loading" and not self._free and self._allocating:
                self._collect(block=True)  # the ring is still being made: its next buffer comes sooner than
                self._issue()              # the load's fresh memory would (both are faulted in from nothing)
            if unit.state == "loading" and self.stager is None:
                return  # its load's hook waits for it
            if unit.state == "loading":  # on a device: kept there ("resident") or in pinned host memory ("host")
                unit.loading.wait(unit)
                if unit.state == "resident":
                    return
        if unit.state in ("in use", "staged"):  # re-entered (a module called twice in one forward)
            unit.users += 1
            return
        if unit.state == "host":  # copied to the device ring (ahead of use, where the ring had room)
            self._bind(unit, self.stager.stage(unit, unit.host_buffer, unit.buffer_nbytes), "staged")
            return
        # 1. Its read must be under way. Out of the expected order, restart the ring at it.
        if unit.state == "on disk":
            self._drain()
            self._next = self.units.index(unit)
            self._issue()
            while unit.state == "on disk" and self._allocating:  # the ring is still being made
                self._collect(block=True)
                self._issue()
        else:
            self._issue()  # ring buffers made since the last call take reads now
        while self._inflight[0] is not unit:  # prefetched, but this forward skipped them
            self._settle(self._inflight.popleft())
        self._inflight.popleft()
        # 2. Sync point: wait for its reads (the time not hidden behind compute is counted).
        start = time.perf_counter()
        self._settle(unit, keep=True)
        self.wait_seconds += time.perf_counter() - start
        # 3. Bind its parameters to views into its buffer (on a device: copied there first, on a side stream).
        buffer = self.buffers[unit.slot]
        if self.stager is not None:
            buffer = self.stager.stage(unit, buffer, unit.buffer_nbytes)
        self._bind(unit, buffer, "in use")

    def _bind(self, unit: Unit, buffer: torch.Tensor, state: str) -> None:
        """Bind ``unit``'s parameters to views into ``buffer``; on a device, start the next copies."""
        views = tensor_views(unit.windows, buffer)
        for ref in unit.params:
            ref.bind(views[ref.tensor])
        unit.state, unit.users = state, 1
        if self.stager is not None:
            self._prefetch_after(unit)

    def _prefetch_after(self, unit: Unit) -> None:
        """Copy the units after ``unit`` whose host bytes are ready to free device ring buffers, in
        forward order (wrapping around), so that the copies overlap this unit's compute. Stops at the
        first unit whose read has not finished."""
        start = self.units.index(unit)
        for step in range(1, len(self.units)):
            if not self.stager.free_count:
                return
            after = self.units[(start + step) % len(self.units)]
            if after.state == "resident":
                continue
            if after.state == "host":
                self.stager.prefetch(after, after.host_buffer, after.buffer_nbytes)
            elif after.state == "in flight" and all(future.done() for future in after.futures):
                self.stager.prefetch(after, self.buffers[after.slot], after.buffer_nbytes)  # a failed read raises at
            else:                                                                       # acquire, and is discarded
                return

    def release(self, unit: Unit) -> None:
        """After ``unit``'s forward: back to placeholders; its buffer takes the next read at once."""
        if unit.state not in ("in use", "staged"):
            return
        unit.users -= 1
        if unit.users:
            return
        unit.unbind()
        if self.stager is not None:
            self.stager.release(unit)
        if unit.state == "staged":
            unit.state = "host"
            return
        self._give_back(unit)
        self._issue()

    def _issue(self) -> None:
        """Start reads into free buffers, in forward order, wrapping around to the next forward: the
        streamed units, and the loading ones their load has not taken on yet (claimed)."""
        self._collect()
        skipped = 0
        while self._free and self.units and len(self._inflight) < self.lookahead and skipped < len(self.units):
            unit = self.units[self._next]
            if unit.state in ("in flight", "in use"):  # wrapped around to reads under way
                return
            if unit.state == "on disk" or self._claim(unit):
                unit.slot = self._free.popleft()
                if self.stager is not None:
                    self.stager.check_refill(self.buffers[unit.slot])  # its last copy to the device has read it
                unit.futures = read_windows(self.handle, unit.windows, self.buffers[unit.slot])
                unit.state = "in flight"
                self._inflight.append(unit)
                skipped = 0
            else:  # resident, or loading and its load's: the forward does not need the ring for it
                skipped += 1
            self._next = (self._next + 1) % len(self.units)

    def _claim(self, unit: Unit) -> bool:
        return unit.state == "loading" and unit.buffer_nbytes <= self.buffer_nbytes and unit.loading.claim(unit)

    def _give_back(self, unit: Unit) -> None:
        """``unit``'s ring buffer is free again: a streamed unit goes back on disk, a claimed one to its load."""
        if self.stager is not None:
            self.stager.discard(unit)  # a copy to the device prefetched from it is done reading it
        self._free.append(unit.slot)
        unit.slot, unit.users = None, 0
        if unit.claimed:
            unit.state = "loading"
            unit.loading.unclaim(unit)
        else:
            unit.state = "on disk"

    def _settle(self, unit: Unit, *, keep: bool = False) -> None:
        """Wait for every read of ``unit``; keep its buffer (``keep``) or give it back. Raises the first
        read's error (after all have finished, so that no read is still filling the buffer)."""
        error = None
        for future in unit.futures:
            try:
                self.bytes_read += future.result()
            except BaseException as exc:  # noqa: BLE001 - re-raised below, once all are done
                error = error or exc
        unit.futures = []
        if error is not None or not keep:
            self._give_back(unit)
        if error is not None:
            raise error

    def _drain(self) -> None:
        """Wait for every read in flight and give its buffer back; errors of unused prefetches are dropped."""
        while self._inflight:
            try:
                self._settle(self._inflight.popleft())
            except Exception:  # noqa: BLE001 - nobody needs that data; a needed read raises when it is acquired
                pass

    def reset(self) -> None:
        """After an error or before a change of plan: no read in flight, every streamed unit back on disk."""
        if self.stager is not None:
            self.stager.reset()  # first: no copy to the device still reads a host buffer given back below
        self._drain()
        for unit in self.units:
            if unit.state in ("in use", "staged"):
                unit.unbind()
                if unit.state == "staged":
                    unit.state = "host"
                else:
                    self._give_back(unit)
        self._next = 0

    def _free_buffers(self) -> None:
        while self._allocating:  # let the maker finish (or skip) every buffer, then free them with the rest
            future = self._allocating.popleft()
            if not future.cancel() and future.exception() is None:
                self.buffers.append(future.result())
        for buffer in self.buffers:
            try:
                free_locked_tensor(buffer)
            except ValueError:
                pass
        self.buffers, self.buffer_nbytes, self._free = [], 0, deque()

    def close(self) -> None:
        """Wait for reads in flight, remove the hooks and free the buffers (the device's too)."""
        self.reset()
        self.units = []
        if self.stager is not None:
            self.stager.close()
            self.stager = None
        self._free_buffers()


class ResidentLoad:
    """Reads ``units`` into memory of their own in the background, while the model already runs.

    Every unit's windows are read into one page-aligned buffer of its own (O_DIRECT) that its
    parameters become views of, so nothing is copied. A thread takes the units on in the given order:
    it faults each buffer in (on every core, `tensorio.prefault`: fresh memory is slow to get on a
    virtual machine, docs/inference.md "Load") and starts its reads, keeping about ``ahead_bytes`` of
    them in flight so that the streamed layers' reads are not queued behind the whole load. A unit's
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
        """Guarded by ``_changed``: whether `pause` holds the thread's placements back, and whether the
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
        """`_settle` unit ``i`` in the thread, once no `pause` holds placements back."""
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

    def pause(self) -> None:
        """Hold the thread's placements back (its reads go on) until `resume`; returns once it is not
        placing a unit. The engine pauses its loads while it changes the plan that ``place`` follows,
        so that no unit is placed by the plan that is going."""
        with self._changed:
            self._paused = True
            while self._placing:
                self._changed.wait()

    def resume(self) -> None:
        """Let the thread place units again (after `pause`)."""
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
        views = tensor_views(unit.windows, buffer)
        for ref in unit.params:
            value = views[ref.tensor]
            if value.dtype != ref.placeholder.dtype:  # on the CPU only: a device's units are read in its dtype
                value = value.to(dtype=ref.placeholder.dtype)
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
