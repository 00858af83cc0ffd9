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

import time
from typing import TYPE_CHECKING
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from offload.infer.stream.device_ring import DeviceRing
from offload.infer.stream.unit import Unit
from offload.storage.safetensors_reader import read_windows, tensor_views
from tensorio import AioHandle, free_locked_tensor, locked_tensor

if TYPE_CHECKING:
    from offload.infer.experts.store import ExpertStore

__all__ = ["LayerStreamer"]


class LayerStreamer:
    """Streams the non-resident units through ``buffer_count`` locked buffers of ``buffer_nbytes``.

    ``set_units`` (the streamable units in forward order, which can change between calls) installs
    the hooks of those not resident and removes the others'. ``stager``
    (a `DeviceRing`, where the compute device has memory of its own) copies a buffer to the device
    before the layer computes, and the next units' ahead of use while it does; None computes on the
    CPU, in the ring buffer itself. ``experts`` (a mixture-of-experts model's `ExpertStore`, which reads
    the experts the router picks inside their layers' forwards) is reset and closed with the ring.
    """

    def __init__(self, handle: AioHandle, *, buffer_count: int, stager: DeviceRing | None = None,
                 experts: ExpertStore | None = None) -> None:
        self.handle = handle
        self.experts = experts
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

    def _attach(self, unit: Unit) -> None:
        """Install ``unit``'s hooks (once): acquire before its forward (before any other pre-hook, a load's
        included: the ring claims a unit its load has not taken on), release after (also when it raises)."""
        if not unit.hooks:
            unit.hooks = [
                unit.module.register_forward_pre_hook(lambda module, args: self.acquire(unit), prepend=True),
                unit.module.register_forward_hook(lambda module, args, out: self.release(unit), always_call=True),
            ]

    @staticmethod
    def _detach(unit: Unit) -> None:
        """Remove ``unit``'s hooks: it is resident, so a forward has nothing to bind (each call through
        hooks cost 15 us a unit, 2.2% of a decode step of a 44-layer model computing on the CPU)."""
        for hook in unit.hooks:
            hook.remove()
        unit.hooks = []

    def set_units(self, units: list[Unit], buffer_nbytes: int, lookahead: int | None = None) -> None:
        """Serve ``units`` (forward order) from now on, through buffers of ``buffer_nbytes`` bytes (0:
        no ring), with at most ``lookahead`` reads in flight (None: as many as buffers). Those
        "resident" are left alone (without hooks), those "loading" are read into the ring while their
        load has not taken them on (`ResidentLoad.claim`), the others are streamed."""
        self.reset()
        self.lookahead = self.buffer_count if lookahead is None else max(1, min(lookahead, self.buffer_count))
        self._allocate(buffer_nbytes)
        for unit in self.units:
            if unit not in units:
                self._detach(unit)
        self.units = list(units)
        for unit in self.units:
            if unit.state == "resident":
                self._detach(unit)
            else:
                self._attach(unit)
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
        if unit.state == "resident":  # its load has bound it since `set_units`: its hooks go
            self._detach(unit)
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
                    self._detach(unit)
                    return
        if unit.state in ("in use", "staged"):  # re-entered (a module called twice in one forward)
            unit.users += 1
            return
        if unit.state == "host":  # copied to the device ring (ahead of use, where the ring had room)
            self._bind(unit, self.stager.stage(unit, unit.host_buffer, unit.device_layout.copies), "staged")
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
            buffer = self.stager.stage(unit, buffer, unit.device_layout.copies)
        self._bind(unit, buffer, "in use")

    def _bind(self, unit: Unit, buffer: torch.Tensor, state: str) -> None:
        """Bind ``unit``'s parameters to views into ``buffer``; on a device, start the next copies."""
        views = tensor_views(unit.windows, buffer) if self.stager is None else unit.device_layout.views(buffer)
        for ref in unit.params:
            ref.bind(ref.value(views))
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
                self.stager.prefetch(after, after.host_buffer, after.device_layout.copies)
            elif after.state == "in flight" and all(future.done() for future in after.futures):
                # A failed read raises at acquire, and is discarded.
                self.stager.prefetch(after, self.buffers[after.slot], after.device_layout.copies)
            else:
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
                unit.futures = self.read_into(unit.windows, self.buffers[unit.slot])
                unit.state = "in flight"
                self._inflight.append(unit)
                skipped = 0
            else:  # resident, or loading and its load's: the forward does not need the ring for it
                skipped += 1
            self._next = (self._next + 1) % len(self.units)

    def read_into(self, windows: list, buffer: torch.Tensor) -> list:
        """Start reading a unit's ``windows`` into ``buffer`` (one of the ring's); their futures. Every
        streamed read goes through here (`benchmarks._floor` makes them complete unread, to time the
        compute alone)."""
        return read_windows(self.handle, windows, buffer)

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
        if self.experts is not None:
            self.experts.reset()
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
        for unit in self.units:
            self._detach(unit)
        self.units = []
        if self.stager is not None:
            self.stager.close()
            self.stager = None
        if self.experts is not None:
            self.experts.close()
            self.experts = None
        self._free_buffers()
