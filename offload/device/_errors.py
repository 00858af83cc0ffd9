"""The device seam's errors: misuse the simulated device catches, and the budget."""

from __future__ import annotations

__all__ = ["CollectiveDeviceError", "DeviceError", "DeviceMemoryError", "DeviceSyncError", "PinnedMemoryError",
           "describe_bytes"]


class DeviceError(RuntimeError):
    """A device buffer or copy used in a way that is wrong on a GPU; the message names the buffer and the bug."""


class DeviceSyncError(DeviceError):
    """A buffer used before the event that makes it safe: a device buffer read before its copy's event
    was waited on by the reading stream, or a host buffer written while a copy still reads or fills it."""


class PinnedMemoryError(DeviceError):
    """An asynchronous copy to or from pageable host memory (it must be pinned: ``Device.pinned_empty``)."""


class CollectiveDeviceError(DeviceError):
    """A collective given a tensor that does not live where its backend needs it (NCCL: on the GPU; gloo: on the CPU)."""


class DeviceMemoryError(DeviceError, MemoryError):
    """An allocation that would take device memory over its budget; the message has the figures."""


def describe_bytes(nbytes: int) -> str:
    """``"3.0 MiB (3145728 bytes)"``: a size for an error message, rounded and exact."""
    for unit, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= size:
            return f"{nbytes / size:.1f} {unit} ({nbytes} bytes)"
    return f"{nbytes} bytes"
