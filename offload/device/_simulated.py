"""`SimulatedDevice`: the GPU path run on the CPU, with checks that fail loudly on the GPU-only bugs.

Device buffers are CPU tensors the device owns (a registry of address ranges tells them from host
tensors, views included). Copies on a side stream run on a worker thread per stream, in stream
order, after a seeded random delay (``schedule="random"``) or only when something waits for them
(``schedule="late"``: the latest a GPU may run them, so a missing wait is never hidden by luck).
The compute stream is the host thread: compute runs when issued.

Two kinds of check, both raising an error that names the buffer and the bug (docs/device.md):

- model checks, deterministic, on the CUDA ordering rules: every stream (and the host) carries a
  vector clock of the side-stream work it is ordered after (merged by ``wait_event`` and, for the
  host, by ``synchronize`` or a True ``query``). ``check_ready`` raises DeviceSyncError when a
  device buffer's last copy is not ordered before the reading stream; ``check_writable`` when a
  host buffer still has a copy reading or filling it that the host has not seen finish; a copy
  from a device buffer checks its source the same way. ``free`` follows CUDA's caching allocator:
  a buffer is allocated for a stream (``empty(stream=)``, default compute), whose next work may reuse
  its memory at once, so every use of it by another stream (copies, collectives, compute's
  ``check_ready``) must be ordered before that stream, seen done by the host, or named to
  ``record_stream``.
- ground truth: a device buffer holds NaN bytes (0xFF) from its allocation, from the issue of a
  copy into it until that copy runs, and after ``free``, so a read that slips past the model checks
  computes on NaN (after ``free`` once the buffer's stream and the ``record_stream`` ones have run the
  work issued by then); a copy compares its host source with the snapshot taken when it was issued and
  reports a host write in between (raised by the next call into the device).

Every copy is logged in issue order (``copy_log``: its number, direction, device buffer, stream and
size), so a test can tell when a copy was issued relative to the compute around it; every collective
ordered on a stream (``collective_on``) in ``collective_log``. Such a collective is issued by the host in
program order (gloo, as NCCL's calls), into a buffer of its own; its result lands in the output only
when its stream runs past it, as a GPU's stream waiting for NCCL's.

With ``register_host=True`` the device also stands in for CUDA's host registration: it installs its
own `tensorio.HostRegistration` ("simulated-registered", recorded in ``registered_host``) until
`close`, and takes as pinned only what that registered (or torch pinned), as `CudaDevice` does, so a
copy from a locked buffer that did not go through the registration raises PinnedMemoryError.

Also raised: PinnedMemoryError for an async copy to or from pageable memory, CollectiveDeviceError
for a collective tensor that is not a device buffer (the device models NCCL), DeviceMemoryError
over the budget, DeviceSyncError for a buffer used after ``free``.
"""

from __future__ import annotations

import math
import os
import random
import threading
import weakref
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from offload.device._base import Device, Event, Stream
from offload.device._errors import CollectiveDeviceError, DeviceSyncError, describe_bytes
from offload.device._packed import SimulatedPackedKernels
from offload.device._simstreams import COMPUTE, SCHEDULES, Clock, ComputeStream, Queue, SideStream, SimEvent, merge
from offload.device._ranks import rank_gpu
from offload.device._simtorch import (COUNT_ENV, DEVICE_TYPE, check_index, current_device, device_count, host_view,
                                      install, new_device_tensor, note_host_sync, set_device)
from tensorio import HostRegistration, in_locked_buffer, lock_status, set_host_registration

__all__ = ["CollectiveRecord", "CopyRecord", "SimulatedDevice"]

def _span(tensor: torch.Tensor) -> tuple[int, int]:
    """The byte range ``[start, end)`` a tensor's elements lie in (a strided view: first to last element)."""
    if tensor.numel() == 0:
        return tensor.data_ptr(), tensor.data_ptr()
    last = sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride()))
    return tensor.data_ptr(), tensor.data_ptr() + (last + 1) * tensor.element_size()


def _poison(tensor: torch.Tensor) -> None:
    """Fill with the sentinel: all-ones bytes, which read as NaN in every float dtype."""
    if tensor.device.type == DEVICE_TYPE:
        tensor = host_view(tensor)
    if tensor.is_floating_point() or tensor.is_complex():
        tensor.fill_(math.nan)
    elif tensor.dtype == torch.bool:
        tensor.fill_(True)
    else:
        tensor.fill_(torch.iinfo(tensor.dtype).max if tensor.dtype == torch.uint8 else -1)


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


@dataclass(frozen=True, slots=True)
class CopyRecord:
    """One copy as issued: ``number`` (1, 2, ... in issue order, as in the errors), ``direction``
    ("to_device" or "to_host"), the device ``buffer``'s name, the ``stream``'s name and ``nbytes``."""

    number: int
    direction: str
    buffer: str
    stream: str
    nbytes: int


@dataclass(frozen=True, slots=True)
class CollectiveRecord:
    """One collective as issued by `SimulatedDevice.collective_on`: ``number`` (1, 2, ...), ``op`` (as the
    caller named it), the output device ``buffer``'s name, the ``stream`` it is ordered on and the output's
    ``nbytes``."""

    number: int
    op: str
    buffer: str
    stream: str
    nbytes: int


@dataclass(eq=False)
class _Alloc:
    name: str
    start: int
    end: int
    base: torch.Tensor | None
    """None once freed (``alive`` then says whether a view still holds its memory)."""
    stream: Any = None
    """The stream it was allocated for (`Device.empty`): the one whose next work may reuse it once freed."""
    alive: Callable[[], torch.Tensor | None] = lambda: None
    write: SimEvent | None = None
    """The last copy (or collective) into it."""
    reads: list[SimEvent] = field(default_factory=list)
    """Copies (or collectives) out of it not yet run."""
    recorded: dict[int, Any] = field(default_factory=dict)
    """Streams named to `record_stream`, by index: their work at its free comes before any reuse."""
    compute_read: int = 0
    """Where in compute's order compute last read it (`check_ready`), when it was allocated for a side stream."""


@dataclass(eq=False)
class _HostUse:
    kind: str
    """"read" (a copy to the device reads it) or "fill" (a copy to the host fills it)."""
    start: int
    end: int
    event: SimEvent
    other: str
    host: torch.Tensor
    """Held until the host has seen the copy finish, so its address is not reused meanwhile."""


class SimulatedDevice(Device):
    """A GPU simulated on the CPU for tests (see the module docstring and docs/device.md).

    ``index``: the device, ``simgpu:index``, one of `device_count` (``OFFLOAD_SIMGPU_COUNT``); default: the
    current one, or under a launcher this rank's (LOCAL_RANK), by CUDA's rule (`rank_gpu`), which it then
    makes current. An index beyond the count raises RuntimeError, as ``torch.cuda.set_device``; a rank
    with no device of its own ValueError naming LOCAL_RANK. Each device has its own streams and threads.
    On an index above 0 autograd runs backward on the calling thread (see docs/device.md: torch gives a
    Python backend one device queue). ``seed`` fixes each side stream's delays; ``schedule`` is "random" (delays up to ``max_delay_s``)
    or "late" (a copy runs only when waited for); ``memory_bytes`` is the simulated device's memory
    (the budget defaults to all of it); ``register_host``: pin host buffers through its own host
    registration, as CUDA's (see the module docstring). Its buffers are tensors of the "simgpu" device
    type: a host tensor mixed into device compute raises, as on CUDA. Close it (or use it as a context
    manager) to stop its threads (and remove its registration).
    """

    name = "simulated"
    separate_memory = True
    collective_backend = "gloo"  # the transport; collective tensors must still be device buffers, as NCCL's
    packed_kernels = SimulatedPackedKernels()  # the CPU's, with the GPU's rule on what it takes

    def __init__(self, index: int | None = None, *, seed: int = 0, schedule: str = "random",
                 max_delay_s: float = 0.002, memory_bytes: int = 1 << 30, budget_bytes: int | None = None,
                 budget_setting: str = "device budget", register_host: bool = False) -> None:
        install()  # the "simgpu" device type, once per process
        if index is None:  # a rank's own device under a launcher, unless the caller chose one (as CudaDevice)
            index = rank_gpu(current_device(), os.environ.get("LOCAL_RANK"), device_count(), count_setting=COUNT_ENV)
            set_device(index)
        self.torch_device = torch.device(DEVICE_TYPE, check_index(index))
        if schedule not in SCHEDULES:
            raise ValueError(f"schedule: {schedule!r} is not allowed; use one of {', '.join(map(repr, SCHEDULES))}")
        self.memory_bytes = memory_bytes
        self.seed, self.schedule, self.max_delay_s = seed, schedule, max_delay_s
        self._allocs: list[_Alloc] = []
        self._freed: list[_Alloc] = []
        self._uses: list[_HostUse] = []
        self._host_clock: Clock = {}
        self._queues: list[Queue] = []
        self._faults: deque[BaseException] = deque()
        self._lock = threading.Lock()
        self.copy_log: list[CopyRecord] = []
        """Every copy issued so far, in issue order."""
        self.collective_log: list[CollectiveRecord] = []
        """Every collective issued through `collective_on` so far, in issue order."""
        super().__init__(budget_bytes=budget_bytes, budget_setting=budget_setting)
        self._compute = ComputeStream(self)
        self.registered_host: dict[int, int] = {}
        """Host buffers its registration pinned and has not unpinned yet: address -> bytes."""
        self.registration = HostRegistration("simulated-registered", self._register_host,
                                             self._unregister_host) if register_host else None
        self._previous_registration = set_host_registration(self.registration) if register_host else None
        # torch sizes autograd's device queues by the device guard's count, 1 for a Python backend, and fails an
        # internal assert for a backward on a later index: there, backward runs on this (the host) thread.
        self._threaded_backward = torch._C._is_multithreading_enabled()
        if index > 0:
            torch._C._set_multithreading_enabled(False)

    def _register_host(self, ptr: int, nbytes: int) -> str | None:
        self.registered_host[ptr] = nbytes
        return None

    def _unregister_host(self, ptr: int) -> None:
        self.registered_host.pop(ptr, None)  # a buffer another simulated device registered: nothing here

    @property
    def copies(self) -> int:
        """Copies issued so far."""
        return len(self.copy_log)

    def _log(self, direction: str, alloc: "_Alloc", stream: Stream, tensor: torch.Tensor) -> int:
        number = len(self.copy_log) + 1
        nbytes = tensor.numel() * tensor.element_size()
        self.copy_log.append(CopyRecord(number, direction, alloc.name, stream.name, nbytes))
        return number

    # ---- memory ---------------------------------------------------------------------------------

    def memory_info(self) -> tuple[int, int]:
        return self.memory_bytes - self.allocated_bytes, self.memory_bytes

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        if tensor.device.type != "cpu" or self.owns(tensor):
            return False
        if self.registration is not None:  # as CudaDevice: registered through the seam, or torch-pinned
            return tensor.is_pinned() or lock_status(tensor) == self.registration.status
        return in_locked_buffer(tensor) or tensor.is_pinned()

    def owns(self, tensor: torch.Tensor) -> bool:
        return self._alloc_of(tensor) is not None

    def _alloc_of(self, tensor: torch.Tensor) -> _Alloc | None:
        if tensor.device != self.torch_device:
            return None
        start, end = _span(tensor)
        for alloc in self._allocs:
            if alloc.start <= start and end <= alloc.end and (start < alloc.end or alloc.start == alloc.end == start):
                return alloc
        self._freed = [alloc for alloc in self._freed if alloc.alive() is not None]
        return next((alloc for alloc in self._freed if alloc.start <= start < alloc.end), None)

    def _empty(self, numel: int, dtype: torch.dtype, name: str, stream: Stream) -> torch.Tensor:
        stream = self._own(stream)
        tensor = new_device_tensor((numel,), (1,), dtype, self.torch_device.index)
        _poison(tensor)
        self._allocs.append(_Alloc(name, *_span(tensor), tensor, stream))
        return tensor

    def _free(self, tensor: torch.Tensor, name: str) -> None:
        """CUDA's caching allocator: the buffer's stream may reuse the memory at once (its own work is in
        order), the `record_stream` ones once their work issued by now has run; any other use must be
        ordered before the buffer's stream or seen done by the host."""
        alloc = next(a for a in self._allocs if a.base is tensor)
        pending = [e for e in ([alloc.write] if alloc.write else []) + alloc.reads
                   if not self._reusable_after(alloc, e.index, e.seq)]
        if pending:
            raise DeviceSyncError(
                f"device buffer {name!r} freed while {pending[0].label} on stream {pending[0].stream_name!r} may "
                f"still use it; synchronize that event first, or name that stream to record_stream when it takes "
                f"the buffer (allocated for stream {alloc.stream.name!r})")
        if alloc.compute_read and not self._reusable_after(alloc, COMPUTE, alloc.compute_read):
            raise DeviceSyncError(
                f"device buffer {name!r} freed while compute may still read it: it was allocated for stream "
                f"{alloc.stream.name!r}, whose next work may reuse its memory at once; record_stream(it, "
                f"compute_stream) when compute takes it")
        self._allocs.remove(alloc)
        alloc.alive, alloc.base = weakref.ref(tensor), None
        self._freed.append(alloc)
        in_use = any(not e.done for e in ([alloc.write] if alloc.write else []) + alloc.reads)
        self._reclaim(tensor, [alloc.stream, *alloc.recorded.values()], in_use)

    def _reusable_after(self, alloc: _Alloc, index: int, seq: int) -> bool:
        """Whether work ``seq`` of stream ``index`` that used ``alloc`` is over before any reuse of its memory."""
        return (index == alloc.stream.index or index in alloc.recorded
                or max(alloc.stream.clock.get(index, 0), self._host_clock.get(index, 0)) >= seq)

    def _reclaim(self, tensor: torch.Tensor, streams: list[Any], in_use: bool) -> None:
        """Poison freed ``tensor`` (its memory may be reused) once each of ``streams`` has run its work issued
        so far (``in_use``: a copy or collective of it has not run yet)."""
        if in_use and any(stream is self._compute for stream in streams):
            self._compute.run_pending()  # the compute stream is the host: the uses it waited for run first
        waiting = [s for s in {id(s): s for s in streams}.values()
                   if isinstance(s, SideStream) and not s.queue.stopped and s.queue.executed < s.queue.issued]
        if not waiting:
            _poison(tensor)
            return
        left, lock = [len(waiting)], threading.Lock()

        def one_done() -> None:
            with lock:
                left[0] -= 1
                last = left[0] == 0
            if last:
                _poison(tensor)

        for stream in waiting:
            stream.submit(one_done)

    # ---- copies ---------------------------------------------------------------------------------

    def _to_device(self, dst: torch.Tensor, src: torch.Tensor, stream: Stream) -> Event:
        self.raise_faults()
        stream = self._own(stream)
        alloc = self._live(dst, "copied into")
        snapshot = src.clone()
        if not any(not read.done for read in alloc.reads):
            _poison(dst)  # the data is not there until the copy runs (unless an earlier copy still reads the old)
        number = self._log("to_device", alloc, stream, dst)
        where = self.describe(src)

        def copy() -> None:
            if not _same_bytes(src, snapshot):
                raise DeviceSyncError(
                    f"{where} was written while copy #{number} from it to device buffer {alloc.name!r} was in "
                    f"flight: the copy read the new bytes. Wait for the copy's event (synchronize) before refilling "
                    f"a host buffer")
            dst.copy_(src)

        event = stream.submit(copy)
        event.number = number
        alloc.write = event
        self._uses.append(_HostUse("read", *_span(src), event, alloc.name, src))
        return event

    def _to_host(self, dst: torch.Tensor, src: torch.Tensor, stream: Stream) -> Event:
        self.raise_faults()
        stream = self._own(stream)
        alloc = self._live(src, "copied from")
        self._check_ordered(alloc, src, stream, "copied to the host")
        _poison(dst)  # the host's bytes are not there until the copy runs
        number = self._log("to_host", alloc, stream, src)
        alloc.reads = [e for e in alloc.reads if not e.done]
        event = stream.submit(lambda: dst.copy_(src))
        event.number = number
        alloc.reads.append(event)
        self._uses.append(_HostUse("fill", *_span(dst), event, alloc.name, dst))
        return event

    def _device_copy(self, dst: torch.Tensor, src: torch.Tensor, stream: Stream) -> Event:
        self.raise_faults()
        stream = self._own(stream)
        dst_alloc, src_alloc = self._live(dst, "copied into"), self._live(src, "copied from")
        self._check_ordered(src_alloc, src, stream, f"copied on stream {stream.name!r}")
        if not any(not read.done for read in dst_alloc.reads):
            _poison(dst)  # the data is not there until the copy runs
        number = self._log("on_device", dst_alloc, stream, dst)
        event = stream.submit(lambda: host_view(dst).copy_(host_view(src)))
        event.number = number
        dst_alloc.write = event
        src_alloc.reads = [e for e in src_alloc.reads if not e.done] + [event]
        return event

    def _collective_on(self, stream: Stream, issue: Callable[[torch.Tensor, torch.Tensor], object],
                       output: torch.Tensor, input: torch.Tensor, op: str) -> Event:
        self.raise_faults()
        stream = self._own(stream)
        out_alloc, in_alloc = self._live(output, f"written by {op}"), self._live(input, f"read by {op}")
        # gloo reads the input when it runs: the host lets the stream reach this point first (a step of the
        # simulation, not a wait a GPU's host makes: nothing is observed)
        if isinstance(stream, SideStream):
            stream.queue.wait_executed(stream.queue.issued)
        staging = torch.empty_like(output)  # the result in flight, in the output once the stream runs past it
        work = issue(staging, input)
        if not any(not read.done for read in out_alloc.reads):
            _poison(output)
        number = len(self.collective_log) + 1
        self.collective_log.append(CollectiveRecord(number, op, out_alloc.name, stream.name,
                                                    output.numel() * output.element_size()))

        def land() -> None:
            if work is not None:
                work.wait()
            host_view(output).copy_(host_view(staging))

        event = stream.submit(land)
        event.work = f"collective #{number} ({op})"
        out_alloc.write = event
        in_alloc.reads = [e for e in in_alloc.reads if not e.done] + [event]
        return event

    def record_stream(self, tensor: torch.Tensor, stream: Stream) -> None:
        if not self.owns(tensor):
            raise ValueError(f"record_stream: {self.describe(tensor)} is not a buffer of this device")
        alloc = self._live(tensor, "named to record_stream")
        stream = self._own(stream)
        alloc.recorded[stream.index] = stream

    def _own(self, stream: Stream) -> SideStream | ComputeStream:
        if stream is not self._compute and not (isinstance(stream, SideStream) and stream._device is self):
            raise ValueError(f"stream {getattr(stream, 'name', stream)!r} is not a stream of this simulated device; "
                             f"use its compute_stream or new_stream()")
        return stream

    def _live(self, tensor: torch.Tensor, what: str) -> _Alloc:
        alloc = self._alloc_of(tensor)
        if alloc.base is None:
            raise DeviceSyncError(f"device buffer {alloc.name!r} {what} after it was freed")
        return alloc

    # ---- streams --------------------------------------------------------------------------------

    @property
    def compute_stream(self) -> Stream:
        return self._compute

    def new_stream(self, name: str) -> Stream:
        self._queues = [q for q in self._queues if not q.stopped]
        index = 1 + max((q.index for q in self._queues), default=0)
        queue = Queue(index, name, self.schedule, random.Random(self.seed * 7919 + index), self.max_delay_s,
                       self._fault)
        self._queues.append(queue)
        return SideStream(self, queue)

    def synchronize(self) -> None:
        note_host_sync("synchronize")
        self.raise_faults()
        self._compute.run_pending()
        self._compute.mark()  # the compute issued so far, now seen done
        for queue in list(self._queues):
            if not queue.stopped:
                queue.wait_executed(queue.issued)
                self._observe({queue.index: queue.issued})
        self._observe(dict(self._compute.clock))
        self.raise_faults()

    def close(self) -> None:
        if self.torch_device.index > 0:
            torch._C._set_multithreading_enabled(self._threaded_backward)
        for queue in self._queues:
            queue.stop()
        for queue in self._queues:
            queue.join()
        if self.registration is not None:
            set_host_registration(self._previous_registration)
            self.registration = None

    # ---- checks ---------------------------------------------------------------------------------

    def check_ready(self, tensor: torch.Tensor, stream: Stream | None = None) -> None:
        """Raise DeviceSyncError where ``stream`` (default: compute) would read ``tensor`` too early:
        a device buffer whose last copy is not ordered before the stream, or freed; a host buffer a
        copy still fills. On the compute stream, waits for the copy it is ordered after (the stream
        runs on the host)."""
        self.raise_faults()
        stream = stream or self._compute
        alloc = self._alloc_of(tensor)
        if alloc is not None:
            if alloc.base is None:
                raise DeviceSyncError(f"device buffer {alloc.name!r} read on stream {stream.name!r} after it was freed")
            self._check_ordered(alloc, tensor, stream, f"read on stream {stream.name!r}")
            if stream is self._compute and alloc.stream is not self._compute:
                alloc.compute_read = self._compute.mark()
            if stream is self._compute and alloc.write is not None:
                alloc.write.run()
            self.raise_faults()
            return
        for use in self._pending_uses(tensor):
            if use.kind == "fill":
                raise DeviceSyncError(
                    f"{self.describe(tensor)} read by the host while copy #{use.event.number} from device buffer "
                    f"{use.other!r} may still fill it; synchronize the copy's event first")

    def check_writable(self, tensor: torch.Tensor) -> None:
        """Raise DeviceSyncError when host ``tensor`` has a copy reading or filling it that the host
        has not seen finish (``synchronize``/``query`` on its event, or a later one)."""
        self.raise_faults()
        for use in self._pending_uses(tensor):
            action = "read it into" if use.kind == "read" else "fill it from"
            raise DeviceSyncError(
                f"{self.describe(tensor)} written by the host while copy #{use.event.number} on stream "
                f"{use.event.stream_name!r} may still {action} device buffer {use.other!r}; synchronize the "
                f"copy's event before refilling it")

    def _check_ordered(self, alloc: _Alloc, tensor: torch.Tensor, stream: Stream, what: str) -> None:
        write = alloc.write
        if write is not None and max(stream.clock.get(write.index, 0), self._host_clock.get(write.index, 0)) < write.seq:
            raise DeviceSyncError(
                f"device buffer {alloc.name!r} {what} before the event of its {write.label} on stream "
                f"{write.stream_name!r} was waited for: {stream.name}.wait_event(that event) first "
                f"(its bytes are {'still NaN' if not write.done else 'there here only by chance'})")

    def _pending_uses(self, tensor: torch.Tensor) -> list[_HostUse]:
        self._uses = [use for use in self._uses if not self._observed(use.event)]
        start, end = _span(tensor)
        return [use for use in self._uses if use.start < end and start < use.end]

    def _observed(self, event: SimEvent) -> bool:
        return self._host_clock.get(event.index, 0) >= event.seq

    def _observe(self, clock: Clock) -> None:
        with self._lock:
            self._host_clock = merge(self._host_clock, clock)

    def _fault(self, exc: BaseException) -> None:
        with self._lock:
            self._faults.append(exc)

    def raise_faults(self) -> None:
        """Raise the first error a copy thread has found (a host buffer written under a copy), once."""
        with self._lock:
            fault = self._faults.popleft() if self._faults else None
        if fault is not None:
            raise fault

    # ---- collectives ----------------------------------------------------------------------------

    def collective_device(self) -> torch.device:
        return self.torch_device

    def collective_tensor(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` itself when it is a device buffer, else a copy in a new one (freed when dropped)."""
        if self.owns(tensor):
            return tensor
        result = self._collective_buffer(tensor.numel(), tensor.dtype, tensor.shape)
        result.copy_(tensor)
        return result

    def collective_empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A device buffer (freed when dropped) for a collective's result."""
        return self._collective_buffer(numel, dtype, (numel,))

    def _collective_buffer(self, numel: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        buffer = self.empty(numel, dtype, name="collective")
        result = buffer.view(shape)
        weakref.finalize(result, self.free, buffer)  # the caller's tensor: freed with it
        return result

    def collective_to_host(self, tensor: torch.Tensor) -> torch.Tensor:
        """A host copy of device buffer ``tensor`` (a collective's result), read once it is ready."""
        self.check_ready(tensor)
        return tensor.cpu()

    def check_collective(self, *tensors: torch.Tensor, op: str = "collective", stream: Stream | None = None) -> None:
        """Raise CollectiveDeviceError for a tensor that is not a device buffer (NCCL's rule), and
        DeviceSyncError for one whose copy ``stream`` (default: compute) has not waited for."""
        for i, tensor in enumerate(tensors):
            if not self.owns(tensor):
                raise CollectiveDeviceError(
                    f"{op}: tensor {i} ({tuple(tensor.shape)}, {tensor.dtype}) is host memory, not a device buffer; "
                    f"NCCL on a GPU takes device tensors only: pass device.collective_tensor(tensor)")
            self.check_ready(tensor, stream)

    # ---- names ----------------------------------------------------------------------------------

    def describe(self, tensor: torch.Tensor) -> str:
        alloc = self._alloc_of(tensor)
        if alloc is None:
            return f"host buffer at {tensor.data_ptr():#x} ({describe_bytes(tensor.numel() * tensor.element_size())})"
        return f"device buffer {alloc.name!r} (bytes {tensor.data_ptr() - alloc.start} to {_span(tensor)[1] - alloc.start})"
