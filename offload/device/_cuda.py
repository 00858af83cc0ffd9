"""`CudaDevice`: compute on a CUDA GPU. The only module of offload/ that calls torch.cuda.

It mirrors `SimulatedDevice` call for call (the simulated device is how this path is tested on a
machine without a GPU; docs/device.md); keep it that thin.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

from offload.device._base import Device, Event, Stream
from offload.device._packed import PackedKernels, tinygemm_refusal
from offload.device._ranks import rank_gpu
from tensorio import HostRegistration, lock_status, set_host_registration

__all__ = ["CUDA_HOST_REGISTRATION", "CudaDevice", "CudaPackedKernels", "cuda_available", "rank_gpu"]


def cuda_available() -> bool:
    """Whether this torch build has CUDA and sees a GPU."""
    return torch.cuda.is_available()


def _register(ptr: int, nbytes: int) -> str | None:
    err = torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 0)
    return None if int(err) == 0 else f"cudaHostRegister failed ({err})"


def _unregister(ptr: int) -> None:
    torch.cuda.cudart().cudaHostUnregister(ptr)


CUDA_HOST_REGISTRATION = HostRegistration("cuda-registered", _register, _unregister)
"""tensorio's locked buffers page-locked and registered with CUDA, for asynchronous copies from and to them."""

if cuda_available():  # every tensorio.locked_tensor from here on is registered (tensorio knows no GPU)
    set_host_registration(CUDA_HOST_REGISTRATION)


class _CudaEvent(Event):
    def __init__(self, event: torch.cuda.Event) -> None:
        self.raw = event

    def query(self) -> bool:
        return self.raw.query()

    def synchronize(self) -> None:
        self.raw.synchronize()


class _CudaStream(Stream):
    def __init__(self, stream: torch.cuda.Stream, name: str) -> None:
        self.raw = stream
        self.name = name

    def wait_event(self, event: Event) -> None:
        self.raw.wait_event(event.raw)

    def record(self) -> Event:
        event = torch.cuda.Event()
        event.record(self.raw)
        return _CudaEvent(event)

    def synchronize(self) -> None:
        self.raw.synchronize()


class CudaDevice(Device):
    """Compute on GPU ``index`` (default: the current one, or under a launcher this rank's, `rank_gpu`). ``budget_bytes`` (optional) bounds the
    buffers `empty` makes and must fit in the GPU's free memory. Raises ValueError when CUDA is not
    available, or for a budget over the free memory (naming ``budget_setting`` and the figures)."""

    name = "cuda"
    separate_memory = True
    collective_backend = "nccl"

    def __init__(self, index: int | None = None, *, budget_bytes: int | None = None,
                 budget_setting: str = "device budget") -> None:
        if not cuda_available():
            raise ValueError("CudaDevice: CUDA is not available here (a CPU build of torch, or no GPU visible)")
        if index is None:  # a rank's own GPU under a launcher, unless the caller chose one
            index = rank_gpu(torch.cuda.current_device(), os.environ.get("LOCAL_RANK"), torch.cuda.device_count())
            torch.cuda.set_device(index)
        self.torch_device = torch.device("cuda", index)
        super().__init__(budget_bytes=budget_bytes, budget_setting=budget_setting)
        self._compute = _CudaStream(torch.cuda.current_stream(self.torch_device), "compute")
        self.packed_kernels = CudaPackedKernels(self.torch_device)

    def memory_info(self) -> tuple[int, int]:
        return torch.cuda.mem_get_info(self.torch_device)

    def load_runtime(self, dtype: torch.dtype) -> None:
        """A matrix product and an attention in ``dtype``: CUDA loads cuBLAS's and the attention kernels'
        modules into host memory at their first call (on an H200 a generation in a cgroup sized from the
        bare context's memory was killed by the OOM killer after "auto" had read the room)."""
        x = torch.ones(1, 2, 16, 64, dtype=dtype, device=self.torch_device)
        (x[0, 0] @ x[0, 0].T).sum()
        torch.nn.functional.scaled_dot_product_attention(x, x, x, is_causal=True)
        torch.cuda.synchronize(self.torch_device)

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == "cpu" and (tensor.is_pinned() or lock_status(tensor) == CUDA_HOST_REGISTRATION.status)

    def owns(self, tensor: torch.Tensor) -> bool:
        return tensor.device == self.torch_device

    def _empty(self, numel: int, dtype: torch.dtype, name: str, stream: Stream) -> torch.Tensor:
        with torch.cuda.stream(stream.raw):  # the caching allocator's pool of that stream
            return torch.empty(numel, dtype=dtype, device=self.torch_device)

    def _to_device(self, dst: torch.Tensor, src: torch.Tensor, stream: Stream) -> Event:
        with torch.cuda.stream(stream.raw):
            dst.copy_(src, non_blocking=True)
            return stream.record()

    _to_host = _device_copy = _to_device

    def record_stream(self, tensor: torch.Tensor, stream: Stream) -> None:
        tensor.record_stream(stream.raw)

    def _collective_on(self, stream: Stream, issue: Callable[[torch.Tensor, torch.Tensor], object],
                       output: torch.Tensor, input: torch.Tensor, op: str) -> Event:
        with torch.cuda.stream(stream.raw):
            work = issue(output, input)  # NCCL's stream waits for this one's work so far
            if work is not None:
                work.wait()  # this stream waits for NCCL's; the host does not
            return stream.record()

    @property
    def compute_stream(self) -> Stream:
        return self._compute

    def new_stream(self, name: str) -> Stream:
        return _CudaStream(torch.cuda.Stream(self.torch_device), name)

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.torch_device)

    def collective_device(self) -> torch.device:
        return self.torch_device


def _inner_k_tiles(in_features: int) -> int:
    """tinygemm's k-tiles per packed word group: the most of 8, 4, 2 whose 16-value tiles divide the inputs."""
    return next(tiles for tiles in (8, 4, 2) if in_features % (tiles * 16) == 0)


class CudaPackedKernels(PackedKernels):
    """A CUDA GPU's packed-int kernels: ``torch._weight_int8pack_mm`` (its CUDA kernel) for int8, and
    tinygemm (``_weight_int4pack_mm`` on ``_convert_weight_to_int4pack``'s tiles: int32
    [out / 8, in / (k-tiles x 16), 32, k-tiles / 2], as many bytes as the CPU's packing) for int4.
    int4 weights are packed on this GPU when the quantized cache is written (the tiles are
    tinygemm's, not the CPU's), then stored, streamed and copied in that layout."""

    name = "cuda"
    int4_layout = "tinygemm"

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def unsupported(self, num_bits: int, dtype: torch.dtype) -> str | None:
        op = "_weight_int8pack_mm" if num_bits == 8 else "_weight_int4pack_mm"
        if not torch._C._dispatch_has_kernel_for_dispatch_key(f"aten::{op}", "CUDA"):
            return f"torch {torch.__version__} has no CUDA kernel for {op}; use a newer torch, or compute_device \"cpu\""
        if num_bits == 4 and torch.cuda.get_device_capability(self.device) < (8, 0):
            major, minor = torch.cuda.get_device_capability(self.device)
            return (f"int4 runs there on torch's tinygemm kernel, which needs compute capability 8.0 (Ampere) or "
                    f"newer; this GPU has {major}.{minor}: use num_bits 8")
        return tinygemm_refusal(num_bits, dtype, "")

    def int4_weight(self, out_features: int, in_features: int) -> tuple[torch.dtype, tuple[int, ...]]:
        tiles = _inner_k_tiles(in_features)
        return torch.int32, (out_features // 8, in_features // (tiles * 16), 32, tiles // 2)

    def pack_int4(self, q: torch.Tensor) -> torch.Tensor:
        pairs = (q[:, ::2] << 4 | q[:, 1::2]).to(torch.uint8)  # two values a byte, the even one high
        return torch._convert_weight_to_int4pack(pairs.to(self.device), _inner_k_tiles(q.shape[1])).cpu()

    def int4_mm(self, x: torch.Tensor, qweight: torch.Tensor, group_size: int,
                scales_and_zeros: torch.Tensor) -> torch.Tensor:
        return torch._weight_int4pack_mm(x.contiguous(), qweight, group_size, scales_and_zeros)
