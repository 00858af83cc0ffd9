"""THE CUDA PATH: streamed layers copied from the locked ring buffers to the GPU on a side stream.

Untested on the development machine (it has no GPU); everything else is tested on the CPU. Kept to
this one class so that the CPU path does not depend on it. The streamer calls ``stage`` when a
layer's read has completed and ``release`` when its forward is done:

- ``stage``: on the side stream, wait until the GPU is done with this slot's previous layer, copy the
  locked host buffer into the slot's GPU buffer (asynchronous: the host memory is page-locked), and
  make the compute stream wait for the copy. Returns the GPU buffer the layer's views are made in.
- ``release``: mark where the compute stream is done with the slot, and wait for the copy to have
  read the host buffer, which the streamer refills with the next read right after.
"""

from __future__ import annotations

import torch

__all__ = ["CudaStager"]


class CudaStager:
    """One GPU buffer per ring buffer, filled from it on a side stream (see the module docstring)."""

    def __init__(self, buffer_count: int, buffer_nbytes: int, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device)
        self.gpu_buffers = [torch.empty(buffer_nbytes, dtype=torch.uint8, device=device) for _ in range(buffer_count)]
        self._copied: list[torch.cuda.Event | None] = [None] * buffer_count
        self._computed: list[torch.cuda.Event | None] = [None] * buffer_count

    def stage(self, slot: int, host: torch.Tensor, nbytes: int) -> torch.Tensor:
        gpu = self.gpu_buffers[slot]
        with torch.cuda.stream(self.stream):
            if self._computed[slot] is not None:
                self.stream.wait_event(self._computed[slot])  # the slot's previous layer has finished computing
            gpu[:nbytes].copy_(host[:nbytes], non_blocking=True)
            copied = torch.cuda.Event()
            copied.record(self.stream)
        torch.cuda.current_stream(self.device).wait_event(copied)  # compute waits for the copy, the host does not
        self._copied[slot] = copied
        return gpu

    def release(self, slot: int) -> None:
        computed = torch.cuda.Event()
        computed.record(torch.cuda.current_stream(self.device))
        self._computed[slot] = computed
        if self._copied[slot] is not None:
            self._copied[slot].synchronize()  # the host buffer is about to take the next read
