"""The device path of the layer streamer: streamed layers copied from the locked ring buffers into
device buffers on a side stream, through the device seam (offload/device; docs/device.md).

Used where the compute device has memory of its own (CUDA; the simulated device in tests). The
streamer calls ``stage`` when a layer's read has completed and ``release`` when its forward is done:

- ``stage``: on the side stream, wait until compute is done with this slot's previous layer, copy
  the locked host buffer into the slot's device buffer (asynchronous: the host memory is locked),
  and make the compute stream wait for the copy. Returns the device buffer the layer's views are
  made in.
- ``release``: mark where the compute stream is done with the slot, and wait for the copy to have
  read the host buffer, which the streamer refills with the next read right after.
"""

from __future__ import annotations

import torch

from offload.device import Device, Event

__all__ = ["DeviceRing"]


class DeviceRing:
    """One device buffer per ring buffer, filled from it on a side stream (see the module docstring).

    Raises DeviceMemoryError when the buffers exceed the device's budget.
    """

    def __init__(self, device: Device, buffer_count: int, buffer_nbytes: int) -> None:
        self.device = device
        self.buffer_nbytes = buffer_nbytes
        self.stream = device.new_stream("ring-copies")
        self._copied: list[Event | None] = [None] * buffer_count
        self._computed: list[Event | None] = [None] * buffer_count
        self.buffers: list[torch.Tensor] = []
        try:
            for slot in range(buffer_count):
                self.buffers.append(device.empty(buffer_nbytes, torch.uint8, name=f"ring[{slot}]"))
        except BaseException:
            self.close()
            raise

    def stage(self, slot: int, host: torch.Tensor, nbytes: int) -> torch.Tensor:
        """Copy ``host[:nbytes]`` into slot ``slot``'s device buffer; return that buffer."""
        target = self.buffers[slot][:nbytes]
        if self._computed[slot] is not None:
            self.stream.wait_event(self._computed[slot])  # the slot's previous layer has finished computing
        copied = self.device.to_device(target, host[:nbytes], stream=self.stream)
        self.device.compute_stream.wait_event(copied)  # compute waits for the copy, the host does not
        self._copied[slot] = copied
        self.device.check_ready(target)  # the layer's compute reads it next
        return self.buffers[slot]

    def release(self, slot: int) -> None:
        """The layer in slot ``slot`` has computed: its host buffer may take the next read on return."""
        self._computed[slot] = self.device.compute_stream.record()
        if self._copied[slot] is not None:
            self._copied[slot].synchronize()  # the host buffer is about to take the next read

    def check_refill(self, host: torch.Tensor) -> None:
        """Before a read into ring buffer ``host``: raises (simulated device) where a copy still reads it."""
        self.device.check_writable(host)

    def close(self) -> None:
        """Wait for the copies, then give the device buffers back."""
        for copied in self._copied:
            if copied is not None:
                copied.synchronize()
        for buffer in self.buffers:
            self.device.free(buffer)
        self.buffers = []
