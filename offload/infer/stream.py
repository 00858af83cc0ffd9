"""The layer streamer: a ring of locked buffers that the next streamed layers are read into while the
current one computes, and the hooks that swap a layer's parameters to views into its buffer.

One record per unit (`Unit`): its module, its parameters' owners, its windows in the checkpoint and
its state: "resident" (its own memory, never streamed), "on disk", "in flight" (a read into a ring
buffer is under way), "in use" (its parameters are views into that buffer). Outside its forward a
streamed unit's parameters are meta placeholders, so the model never holds it.

Reads are issued in forward order and wrap around to the next forward, so the disk reads the first
layers of the next token while the last ones of this token compute. A buffer is reused as soon as
its layer's forward has returned.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch
from torch import nn

from offload.storage.safetensors_reader import Window, read_windows, tensor_views, windows_nbytes
from tensorio import AioHandle, IOFuture, aligned_tensor, free_locked_tensor, locked_tensor, prefault

__all__ = ["LayerStreamer", "ParamRef", "Unit"]


@dataclass(frozen=True, slots=True)
class ParamRef:
    """One parameter of a unit: every (module, attribute) that holds it (more than one when tied),
    the checkpoint tensor it is read from, and its meta placeholder."""

    owners: tuple[tuple[nn.Module, str], ...]
    tensor: str
    placeholder: nn.Parameter

    def bind(self, value: torch.Tensor) -> None:
        param = value if isinstance(value, nn.Parameter) else nn.Parameter(value, requires_grad=False)
        for module, attr in self.owners:
            module._parameters[attr] = param

    def unbind(self) -> None:
        for module, attr in self.owners:
            module._parameters[attr] = self.placeholder


@dataclass(eq=False, slots=True)
class Unit:
    """One unit of placement (a decoder layer, the output head, ...) and its state."""

    name: str
    module: nn.Module
    params: tuple[ParamRef, ...]
    windows: list[Window]
    """Its tensors' aligned windows, packed from buffer offset 0."""
    nbytes: int
    """Its weights' bytes in memory."""
    streamable: bool
    state: str = "on disk"
    """"resident", "on disk", "in flight" or "in use"."""
    slot: int | None = None
    """The ring buffer it is read into (in flight or in use)."""
    futures: list[IOFuture] = field(default_factory=list)
    users: int = 0
    hooks: list = field(default_factory=list)

    @property
    def read_nbytes(self) -> int:
        return sum(w.nbytes for w in self.windows)

    @property
    def buffer_nbytes(self) -> int:
        return windows_nbytes(self.windows)

    def unbind(self) -> None:
        for ref in self.params:
            ref.unbind()


class LayerStreamer:
    """Streams the non-resident units through ``buffer_count`` locked buffers of ``buffer_nbytes``.

    ``attach(unit)`` installs the hooks once per streamable unit; whether it streams is decided by
    ``set_units`` (the streamed units in forward order), which can change between calls. ``stager``
    (the CUDA path) copies a buffer to the GPU before the layer computes; None computes on the CPU.
    """

    def __init__(self, handle: AioHandle, *, buffer_count: int, stager=None) -> None:
        self.handle = handle
        self.buffer_count = buffer_count
        self.lookahead = buffer_count
        """Reads in flight at most (``stage3_prefetch_bucket_size``), at most ``buffer_count``."""
        self.stager = stager
        self.buffers: list[torch.Tensor] = []
        self.buffer_nbytes = 0
        self.units: list[Unit] = []
        self._free: deque[int] = deque()
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
        """Stream ``units`` (forward order) from now on, through buffers of ``buffer_nbytes`` bytes,
        with at most ``lookahead`` reads in flight (None: as many as buffers)."""
        self.reset()
        self.lookahead = self.buffer_count if lookahead is None else max(1, min(lookahead, self.buffer_count))
        self.allocate(buffer_nbytes if units else 0)
        self.units = list(units)
        for unit in self.units:
            unit.state = "on disk"
            unit.unbind()
        self._free = deque(range(len(self.buffers)))
        self._next = 0
        self._issue()

    def allocate(self, buffer_nbytes: int) -> None:
        """Make the ring ``buffer_count`` locked buffers of ``buffer_nbytes`` bytes (0: none); nothing to
        do when it already is. No read may be in flight (`reset` first)."""
        if buffer_nbytes != self.buffer_nbytes:
            self._free_buffers()
        if buffer_nbytes and not self.buffers:
            self.buffers = [locked_tensor(buffer_nbytes, torch.uint8) for _ in range(self.buffer_count)]
            self.buffer_nbytes = buffer_nbytes

    # ---- the hot path -----------------------------------------------------------------------------

    def acquire(self, unit: Unit) -> None:
        """Before ``unit``'s forward: wait for its read and bind its parameters to views into its buffer."""
        if unit.state == "resident":
            return
        if unit.state == "in use":  # re-entered (a module called twice in one forward)
            unit.users += 1
            return
        # 1. Its read must be under way. Out of the expected order, restart the ring at it.
        if unit.state == "on disk":
            self._drain()
            self._next = self.units.index(unit)
            self._issue()
        while self._inflight[0] is not unit:  # prefetched, but this forward skipped them
            self._settle(self._inflight.popleft())
        self._inflight.popleft()
        # 2. Sync point: wait for its reads (the time not hidden behind compute is counted).
        start = time.perf_counter()
        self._settle(unit, keep=True)
        self.wait_seconds += time.perf_counter() - start
        # 3. Bind its parameters to views into its buffer (on the GPU: copied there first, on a side stream).
        buffer = self.buffers[unit.slot]
        if self.stager is not None:
            buffer = self.stager.stage(unit.slot, buffer, unit.buffer_nbytes)
        views = tensor_views(unit.windows, buffer)
        for ref in unit.params:
            ref.bind(views[ref.tensor])
        unit.state, unit.users = "in use", 1

    def release(self, unit: Unit) -> None:
        """After ``unit``'s forward: back to placeholders; its buffer takes the next read at once."""
        if unit.state != "in use":
            return
        unit.users -= 1
        if unit.users:
            return
        unit.unbind()
        if self.stager is not None:
            self.stager.release(unit.slot)
        self._free.append(unit.slot)
        unit.state, unit.slot = "on disk", None
        self._issue()

    def _issue(self) -> None:
        """Start reads into free buffers, in forward order, wrapping around to the next forward."""
        while self._free and self.units and len(self._inflight) < self.lookahead:
            unit = self.units[self._next]
            if unit.state != "on disk":  # every streamed unit is in flight or in use already
                return
            unit.slot = self._free.popleft()
            unit.futures = read_windows(self.handle, unit.windows, self.buffers[unit.slot])
            unit.state = "in flight"
            self._inflight.append(unit)
            self._next = (self._next + 1) % len(self.units)

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
            self._free.append(unit.slot)
            unit.state, unit.slot = "on disk", None
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
        self._drain()
        for unit in self.units:
            if unit.state == "in use":
                unit.unbind()
                if self.stager is not None:
                    self.stager.release(unit.slot)
                self._free.append(unit.slot)
                unit.state, unit.slot, unit.users = "on disk", None, 0
        self._next = 0

    def _free_buffers(self) -> None:
        for buffer in self.buffers:
            try:
                free_locked_tensor(buffer)
            except ValueError:
                pass
        self.buffers, self.buffer_nbytes, self._free = [], 0, deque()

    def close(self) -> None:
        """Wait for reads in flight, remove the hooks and free the buffers."""
        self.reset()
        for unit in self.units:
            unit.unbind()
        self.units = []
        self._free_buffers()


def load_resident(handle: AioHandle, units: list[Unit], *, device: torch.device | None = None,
                  meanwhile: Callable[[], None] | None = None) -> int:
    """Read ``units`` into memory of their own and bind their parameters there for good; returns bytes read.

    Every unit's windows are read into one page-aligned buffer of its own (O_DIRECT) that its
    parameters are views of, so nothing is copied. Fresh memory is slow to fault in on a virtual
    machine (docs/inference.md, "Load"), so a thread faults the buffers in ahead of the reads, unit by
    unit in order and each on every core (`tensorio.prefault`), and each unit's reads start as soon
    as its buffer is ready. ``meanwhile`` runs on that thread last, while the last reads finish (the
    engine locks the ring's buffers there). A tensor whose dtype differs from its parameter's is
    converted (then only the converted copy stays). Raises the first error (a read's TensorIOError,
    a fault's OSError or ``meanwhile``'s) once every started read has finished.
    """
    buffers = [aligned_tensor(unit.buffer_nbytes, torch.uint8) for unit in units]
    pending, errors = [], []
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="load-resident") as faulter:
        # 1. Queue every buffer's faults, in unit order, then the caller's work.
        faulted = [faulter.submit(prefault, buffer) for buffer in buffers]
        side = faulter.submit(meanwhile) if meanwhile is not None else None
        # 2. Start each unit's reads once its buffer is faulted in; stop starting at the first error.
        for unit, buffer, ready in zip(units, buffers, faulted):
            if ready.exception() is not None:
                errors.append(ready.exception())
                for later in faulted:
                    later.cancel()
                break
            pending.append((unit, buffer, read_windows(handle, unit.windows, buffer)))
        if side is not None and side.exception() is not None:
            errors.append(side.exception())
    # 3. Sync point: wait for every started read, then bind (or convert) each unit's tensors.
    nbytes = 0
    for unit, buffer, futures in pending:
        for future in futures:
            try:
                nbytes += future.result()
            except BaseException as exc:  # noqa: BLE001 - raised below, once every read has finished
                errors.append(exc)
    if errors:
        raise errors[0]
    for unit, buffer, _ in pending:
        views = tensor_views(unit.windows, buffer)
        for ref in unit.params:
            value = views[ref.tensor]
            dtype = ref.placeholder.dtype
            if value.dtype != dtype or (device is not None and device.type != "cpu"):
                value = value.to(device=device or "cpu", dtype=dtype)
            ref.bind(value)
        unit.state = "resident"
    return nbytes
