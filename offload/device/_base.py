"""The device interface: what every backend (CPU, CUDA, simulated) offers, with the checks they share.

The public methods validate and count (shapes, pinned sources, the budget); each backend's
``_``-prefixed hooks do the work. See docs/device.md.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

import torch

from offload.device._errors import CollectiveDeviceError, DeviceMemoryError, PinnedMemoryError, describe_bytes
from offload.device._packed import PackedKernels
from tensorio import free_locked_tensor, locked_tensor

__all__ = ["Device", "Event", "Stream"]


class Event(ABC):
    """A point in a stream's work. Done once everything issued to that stream before it has run."""

    @abstractmethod
    def query(self) -> bool:
        """Whether it is done, without waiting. A True answer lets the host reuse what it guards."""

    @abstractmethod
    def synchronize(self) -> None:
        """Block the host until it is done."""


class Stream(ABC):
    """An ordered queue of device work: copies and compute issued to it run in order."""

    name: str

    @abstractmethod
    def wait_event(self, event: Event) -> None:
        """Make work issued to this stream from now on wait for ``event`` (the host does not wait)."""

    @abstractmethod
    def record(self) -> Event:
        """An event that is done once the work issued to this stream so far has run."""

    def synchronize(self) -> None:
        """Block the host until the work issued to this stream so far has run."""
        self.record().synchronize()


@dataclass(slots=True)
class _Held:
    name: str
    nbytes: int
    tensor: torch.Tensor


class Device(ABC):
    """Where compute runs, and everything that differs between the CPU and a GPU.

    - memory: ``empty``/``free`` (device buffers, counted against ``budget_bytes``),
      ``pinned_empty``/``free_pinned`` (page-locked host buffers, `tensorio.locked_tensor`);
    - copies: ``to_device``/``to_host``/``device_copy``, asynchronous on a stream, each returning its `Event`;
    - streams: ``compute_stream`` (where the model's kernels run), ``new_stream`` (side streams) and
      ``record_stream`` (a buffer used on a stream other than the one it was allocated for);
    - checks: ``check_ready`` before a buffer is read, ``check_writable`` before a host buffer is
      refilled (no-ops on real hardware, enforced by the simulated device);
    - collectives: ``collective_backend``, ``collective_tensor``, ``check_collective``, ``collective_on``
      (a collective ordered on a stream);
    - quantized weights: ``packed_kernels``.
    """

    name: str
    """"cpu", "cuda" or "simulated"."""
    torch_device: torch.device
    """Where tensors made for compute go (``torch.device("cuda", i)`` or the CPU)."""
    separate_memory: bool
    """Whether device buffers are memory apart from the host's, reached by copies (False on the CPU:
    host buffers are used in place and nothing needs staging)."""
    collective_backend: str
    """The torch.distributed backend for this compute: "nccl" on CUDA, "gloo" otherwise."""
    packed_kernels: PackedKernels
    """The int8 / int4 weight-only matrix products this device runs and the int4 layout they take
    (offload/device/_packed.py)."""

    def __init__(self, *, budget_bytes: int | None = None, budget_setting: str = "device budget") -> None:
        self.budget_setting = budget_setting
        self.budget_bytes = budget_bytes
        self._held: dict[int, _Held] = {}
        self._held_lock = threading.RLock()  # re-entered by a finalizer that frees during a collection
        if budget_bytes is not None:
            if budget_bytes <= 0:
                raise ValueError(f"{budget_setting}: {budget_bytes} is not allowed; use a number of bytes > 0")
            free, total = self.memory_info()
            if budget_bytes > free:
                raise ValueError(
                    f"{budget_setting}: {describe_bytes(budget_bytes)} is more than the {self.name} device's free "
                    f"memory, {describe_bytes(free)} of {describe_bytes(total)}; lower it to at most that")

    # ---- memory ---------------------------------------------------------------------------------

    @abstractmethod
    def memory_info(self) -> tuple[int, int]:
        """(free bytes, total bytes) of the device's memory now."""

    def load_runtime(self, dtype: torch.dtype) -> None:
        """Load what compute on this device loads at its first operations (a GPU's math libraries), so that
        the host memory it takes is in use before an "auto" budget reads what is available. Nothing
        to load on a device whose runtime is the host's."""

    @property
    def allocated_bytes(self) -> int:
        """Bytes of the device buffers `empty` has made and `free` has not yet given back."""
        with self._held_lock:
            return sum(held.nbytes for held in self._held.values())

    def empty(self, numel: int, dtype: torch.dtype = torch.uint8, *, name: str,
              stream: Stream | None = None) -> torch.Tensor:
        """A 1-D device buffer of ``numel`` elements (contents undefined), counted against the budget
        until `free`. ``name`` appears in every error about it.

        ``stream`` (default: compute) is the stream the buffer is allocated for: once freed, a GPU's
        caching allocator hands its memory out again in that stream's order, so work on that stream
        never needs a wait to reuse it; any other stream that uses it must be named to `record_stream`
        before `free` (or be waited for by it, or by the host).

        Raises ValueError for a negative ``numel``; DeviceMemoryError with the figures when it would
        take the buffers held over ``budget_bytes``.
        """
        if numel < 0:
            raise ValueError(f"{name}: numel must be >= 0, got {numel}")
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        with self._held_lock:
            held = sum(h.nbytes for h in self._held.values())
            if self.budget_bytes is not None and held + nbytes > self.budget_bytes:
                names = ", ".join(f"{h.name} ({describe_bytes(h.nbytes)})" for h in list(self._held.values())[:4])
                raise DeviceMemoryError(
                    f"{name}: allocating {describe_bytes(nbytes)} would take {self.name} device memory to "
                    f"{describe_bytes(held + nbytes)}, over its budget of {describe_bytes(self.budget_bytes)} "
                    f"({self.budget_setting}); held now: {describe_bytes(held)} in {len(self._held)} buffers"
                    f"{': ' + names if names else ''}; free buffers first or raise {self.budget_setting}")
            tensor = self._empty(numel, dtype, name, stream or self.compute_stream)
            self._held[id(tensor)] = _Held(name, nbytes, tensor)
        return tensor

    def free(self, tensor: torch.Tensor) -> None:
        """Give a buffer from `empty` back to the budget; its memory goes with its last reference.

        Raises DeviceSyncError (simulated device) where a copy may still use it; ValueError for a tensor `empty` did not return (a view of one included) or one freed already.
        """
        with self._held_lock:
            held = self._held.get(id(tensor))
            if held is None or held.tensor is not tensor:
                raise ValueError(f"free: this tensor ({tuple(tensor.shape)}, {tensor.dtype}) is not a buffer that "
                                 f"{self.name}.empty returned, or was freed already")
            self._free(tensor, held.name)
            del self._held[id(tensor)]

    @staticmethod
    def pinned_empty(numel: int, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
        """A page-aligned, page-locked host buffer (`tensorio.locked_tensor`: CUDA-registered where CUDA
        is available), the only kind an asynchronous copy may use. Release with `free_pinned`."""
        return locked_tensor(numel, dtype)

    @staticmethod
    def free_pinned(tensor: torch.Tensor) -> None:
        """Unlock a buffer from `pinned_empty`. Raises ValueError for any other tensor."""
        free_locked_tensor(tensor)

    @abstractmethod
    def is_pinned(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is host memory an asynchronous copy may use."""

    @abstractmethod
    def owns(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is device memory of this device (a view of a device buffer counts)."""

    # ---- copies ---------------------------------------------------------------------------------

    def to_device(self, dst: torch.Tensor, src: torch.Tensor, *, stream: Stream) -> Event:
        """Copy host ``src`` into device ``dst``, asynchronously on ``stream``; returns the copy's event.

        ``dst`` may be read by a stream only after that stream has waited for the event
        (``stream.wait_event``); ``src`` may be written by the host only after the event is done
        (``event.synchronize()`` or ``query()`` True). Raises ValueError for a shape or dtype mismatch
        or a ``dst`` that is not this device's; PinnedMemoryError for a pageable ``src`` where
        memory is separate.
        """
        self._check_copy(dst, src, device_side=dst, host_side=src, direction="to_device")
        return self._to_device(dst, src, stream)

    def to_host(self, dst: torch.Tensor, src: torch.Tensor, *, stream: Stream) -> Event:
        """Copy device ``src`` into host ``dst``, asynchronously on ``stream``; returns the copy's event.

        ``dst`` may be read or written by the host only once the event is done. Raises as `to_device`
        (a pageable ``dst`` where memory is separate: PinnedMemoryError).
        """
        self._check_copy(dst, src, device_side=src, host_side=dst, direction="to_host")
        return self._to_host(dst, src, stream)

    def _check_copy(self, dst: torch.Tensor, src: torch.Tensor, *, device_side: torch.Tensor,
                    host_side: torch.Tensor, direction: str) -> None:
        if dst.shape != src.shape or dst.dtype != src.dtype:
            raise ValueError(f"{direction}: dst is {tuple(dst.shape)} {dst.dtype} but src is "
                             f"{tuple(src.shape)} {src.dtype}; they must match")
        if not self.owns(device_side):
            raise ValueError(f"{direction}: the {'dst' if device_side is dst else 'src'} is not memory of the "
                             f"{self.name} device ({device_side.device}); allocate it with {self.name}.empty")
        if self.separate_memory and (host_side.device.type != "cpu" or self.owns(host_side)):
            raise ValueError(f"{direction}: the {'src' if host_side is src else 'dst'} must be host memory, got "
                             f"{self.describe(host_side)}")
        if self.separate_memory and not self.is_pinned(host_side):
            raise PinnedMemoryError(
                f"{direction}: asynchronous copy {'from' if host_side is src else 'into'} pageable host memory "
                f"({self.describe(host_side)}); a GPU would copy it synchronously through a bounce buffer, or "
                f"read it after the host has moved on. Allocate it with Device.pinned_empty (tensorio.locked_tensor)")

    def device_copy(self, dst: torch.Tensor, src: torch.Tensor, *, stream: Stream) -> Event:
        """Copy device ``src`` into device ``dst`` (buffers of this device or views of them, strided
        views included), asynchronously on ``stream``; returns the copy's event.

        ``stream`` must already be ordered after ``src``'s last write (``stream.wait_event`` of it); another
        stream may read ``dst`` once it has waited for the event. Raises ValueError for a shape or dtype
        mismatch or a tensor that is not this device's memory.
        """
        if dst.shape != src.shape or dst.dtype != src.dtype:
            raise ValueError(f"device_copy: dst is {tuple(dst.shape)} {dst.dtype} but src is "
                             f"{tuple(src.shape)} {src.dtype}; they must match")
        for role, tensor in (("dst", dst), ("src", src)):
            if not self.owns(tensor):
                raise ValueError(f"device_copy: the {role} is not memory of the {self.name} device "
                                 f"({tensor.device}); allocate it with {self.name}.empty")
        return self._device_copy(dst, src, stream)

    @abstractmethod
    def _to_device(self, dst: torch.Tensor, src: torch.Tensor, stream: Stream) -> Event: ...

    @abstractmethod
    def _device_copy(self, dst: torch.Tensor, src: torch.Tensor, stream: Stream) -> Event: ...

    @abstractmethod
    def _to_host(self, dst: torch.Tensor, src: torch.Tensor, stream: Stream) -> Event: ...

    # ---- streams --------------------------------------------------------------------------------

    @property
    @abstractmethod
    def compute_stream(self) -> Stream:
        """The stream the model's compute runs on."""

    @abstractmethod
    def new_stream(self, name: str) -> Stream:
        """A side stream (for copies that overlap compute); ``name`` appears in errors."""

    def record_stream(self, tensor: torch.Tensor, stream: Stream) -> None:
        """``tensor`` (a device buffer, or a view of one) is used by work issued to ``stream``, not the
        stream it was allocated for (`empty`): after `free`, its memory is not handed out again until the
        work issued to ``stream`` by then has run (CUDA's ``Tensor.record_stream``). Call it when that
        stream takes the buffer; nothing to do for the stream it was allocated for, nor on the CPU."""

    @abstractmethod
    def synchronize(self) -> None:
        """Block the host until all work issued to every stream has run."""

    # ---- checks (enforced by the simulated device) ----------------------------------------------

    def check_ready(self, tensor: torch.Tensor, stream: Stream | None = None) -> None:
        """Before ``stream`` (default: compute) reads ``tensor``: a device buffer's last copy must have
        been waited on by that stream (or synchronized by the host), a host buffer's copy into it must
        be done. Nothing to check on real hardware; the simulated device raises DeviceSyncError."""

    def check_writable(self, tensor: torch.Tensor) -> None:
        """Before the host writes host ``tensor`` (a refill): no copy may still read or fill it.
        Nothing to check on real hardware; the simulated device raises DeviceSyncError."""

    # ---- collectives ----------------------------------------------------------------------------

    @abstractmethod
    def collective_device(self) -> torch.device:
        """Where this device's collectives need their tensors."""

    def collective_tensor(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` where this device's collective backend needs it (itself when it is there already)."""
        return tensor if tensor.device == self.collective_device() else tensor.to(self.collective_device())

    def collective_empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A 1-D tensor of ``numel`` elements (contents undefined) where this device's collectives need
        it, for a collective's result."""
        return torch.empty(numel, dtype=dtype, device=self.collective_device())

    def collective_to_host(self, tensor: torch.Tensor) -> torch.Tensor:
        """A collective's result ``tensor`` in host memory (itself where collectives run on the host's);
        waits for the collective (sync point)."""
        return tensor.cpu()

    def check_collective(self, *tensors: torch.Tensor, op: str = "collective", stream: Stream | None = None) -> None:
        """Raise CollectiveDeviceError naming the tensor and the fix when one of ``tensors`` does not
        live where ``collective_backend`` needs it. ``stream`` (default: compute): the stream the
        collective is ordered on (the simulated device checks that it waited for the tensors' copies)."""
        for i, tensor in enumerate(tensors):
            if tensor.device != self.collective_device():
                raise CollectiveDeviceError(
                    f"{op}: tensor {i} ({tuple(tensor.shape)}, {tensor.dtype}) is on {tensor.device}, but "
                    f"{self.collective_backend} on the {self.name} device needs it on {self.collective_device()}; "
                    f"pass device.collective_tensor(tensor)")

    def collective_on(self, stream: Stream, issue: Callable[[torch.Tensor, torch.Tensor], object],
                      output: torch.Tensor, input: torch.Tensor, *, op: str) -> Event:
        """Run a collective that reads ``input`` and writes ``output`` (device buffers) in ``stream``'s order,
        without the host waiting: it runs after the work issued to ``stream`` so far, and work issued to
        ``stream`` from now on runs after it. ``issue(output, input)`` starts it without waiting
        (``async_op=True``) and returns its work handle (or None once done). Returns the event after it:
        another stream reads ``output`` once it has waited for that event.

        Calls `check_collective` first (``op`` names it in errors). On a GPU NCCL runs it on a stream of
        its own, which waits for ``stream`` at issue, and ``stream`` then waits for NCCL's; on the CPU it is
        waited for at once (sync point).
        """
        self.check_collective(input, output, op=op, stream=stream)
        return self._collective_on(stream, issue, output, input, op)

    def _collective_on(self, stream: Stream, issue: Callable[[torch.Tensor, torch.Tensor], object],
                       output: torch.Tensor, input: torch.Tensor, op: str) -> Event:
        work = issue(output, input)
        if work is not None:
            work.wait()  # sync point
        return stream.record()

    # ---- lifetime and names ---------------------------------------------------------------------

    def close(self) -> None:
        """Stop what the device runs in the background (the simulated device's copy threads)."""

    def __enter__(self) -> "Device":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def describe(self, tensor: torch.Tensor) -> str:
        """A tensor for an error message: its device buffer's name where it has one, else its place."""
        nbytes = tensor.numel() * tensor.element_size()
        return f"a {tensor.device} tensor at {tensor.data_ptr():#x}, {describe_bytes(nbytes)}"

    @abstractmethod
    def _empty(self, numel: int, dtype: torch.dtype, name: str, stream: Stream) -> torch.Tensor: ...

    def _free(self, tensor: torch.Tensor, name: str) -> None:
        """After `free` has given ``tensor``'s bytes back: what the backend does with the buffer."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.torch_device}, budget={self.budget_bytes})"
