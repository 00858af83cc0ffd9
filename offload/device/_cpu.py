"""`CpuDevice`: compute on the CPU. Device buffers are host memory, copies are plain and done at once."""

from __future__ import annotations

import torch

from offload.device._base import Device, Event, Stream
from offload.device._host_memory import host_memory
from offload.device._packed import CPU_KERNELS

__all__ = ["CpuDevice"]


class _DoneEvent(Event):
    """An event of work that ran when it was issued."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


class _CpuStream(Stream):
    """Work on the CPU runs when it is issued: nothing to order, nothing to wait for."""

    def __init__(self, name: str) -> None:
        self.name = name

    def wait_event(self, event: Event) -> None:
        pass

    def record(self) -> Event:
        return _DoneEvent()


class CpuDevice(Device):
    """Compute on the CPU: ``empty`` is ``torch.empty``, copies are ``copy_`` (synchronous; pinned
    memory is not required), streams and events are trivially done, collectives use gloo on CPU
    tensors. ``budget_bytes`` (optional) is checked against the host's available memory."""

    name = "cpu"
    torch_device = torch.device("cpu")
    separate_memory = False
    collective_backend = "gloo"
    packed_kernels = CPU_KERNELS

    def __init__(self, *, budget_bytes: int | None = None, budget_setting: str = "device budget") -> None:
        super().__init__(budget_bytes=budget_bytes, budget_setting=budget_setting)
        self._compute = _CpuStream("compute")

    def memory_info(self) -> tuple[int, int]:
        memory = host_memory()  # MemAvailable, or the cgroup's room where one limits the process
        return memory.available, memory.total

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == "cpu"

    def owns(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == "cpu"

    def _empty(self, numel: int, dtype: torch.dtype, name: str, stream: Stream) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype)

    def _to_device(self, dst: torch.Tensor, src: torch.Tensor, stream: Stream) -> Event:
        dst.copy_(src)
        return _DoneEvent()

    _to_host = _device_copy = _to_device

    @property
    def compute_stream(self) -> Stream:
        return self._compute

    def new_stream(self, name: str) -> Stream:
        return _CpuStream(name)

    def synchronize(self) -> None:
        pass

    def collective_device(self) -> torch.device:
        return self.torch_device
