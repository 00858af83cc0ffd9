"""The device seam: everything that differs between computing on the CPU and on a GPU.

Allocation (device buffers against a budget, pinned host buffers), asynchronous copies, streams,
events, the collective backend, where a collective's tensors live and the packed-int kernels of
quantized weights go through a `Device`:
`CpuDevice`, `CudaDevice` (the only code in offload/ that computes with torch.cuda; the simulated
device's install only asks ``torch.cuda.is_available()``), or `SimulatedDevice`,
which runs the GPU path on the CPU and fails loudly on the GPU-only bugs. See docs/device.md.
"""

from offload.device._base import Device, Event, Stream
from offload.device._cpu import CpuDevice
from offload.device._cuda import CudaDevice, CudaPackedKernels, cuda_available
from offload.device._errors import (CollectiveDeviceError, DeviceError, DeviceMemoryError, DeviceSyncError,
                                    PinnedMemoryError)
from offload.device._select import (DEVICE_CHOICES, check_process_group, collective_device, device_for,
                                    process_group_backend, start_process_group)
from offload.device._host_memory import (AUTO_MARGIN_BYTES, AUTO_MARGIN_SHARE, HostMemory, auto_budget, host_memory,
                                        local_ranks)
from offload.device._packed import CPU_KERNELS, PackedKernels
from offload.device._ranks import check_rank_devices
from offload.device._simtorch import count_host_syncs
from offload.device._simulated import CollectiveRecord, CopyRecord, SimulatedDevice

__all__ = [
    "AUTO_MARGIN_BYTES",
    "AUTO_MARGIN_SHARE",
    "CPU_KERNELS",
    "DEVICE_CHOICES",
    "CollectiveDeviceError",
    "CollectiveRecord",
    "CopyRecord",
    "CpuDevice",
    "CudaDevice",
    "CudaPackedKernels",
    "Device",
    "DeviceError",
    "DeviceMemoryError",
    "DeviceSyncError",
    "Event",
    "HostMemory",
    "PackedKernels",
    "PinnedMemoryError",
    "SimulatedDevice",
    "Stream",
    "auto_budget",
    "check_process_group",
    "check_rank_devices",
    "collective_device",
    "count_host_syncs",
    "cuda_available",
    "device_for",
    "host_memory",
    "local_ranks",
    "process_group_backend",
    "start_process_group",
]
