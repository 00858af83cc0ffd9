"""Where a unit's tensors go in a device buffer: each at an offset aligned as a fresh allocation's is.

A unit is read with O_DIRECT into a page-aligned host buffer, each tensor at its offset within the
file's pages, so a tensor starts wherever its file put it. safetensors aligns tensors to 8 bytes only
(its header is padded to 8): in the 7.1 GB checkpoint of `benchmarks.gpu infer`, 282 of its 399
tensors start 8 bytes past a 16-byte boundary. PyTorch tells cuBLASLt each operand's alignment (up to
256 bytes, ``_getAlignment`` in ATen's CUDABlas.cpp), whose heuristics then choose only among kernels
that read such a matrix 8 bytes at a time; a weight that transformers or Accelerate load gets an
allocation of its own, at least 256-byte aligned.

So a unit is not copied to the device as its host buffer lies: each run of its tensors whose offsets
from the run's first are multiples of `DEVICE_ALIGN` is copied to a `DEVICE_ALIGN`-aligned place (in
a checkpoint whose tensor sizes are multiples of 256 bytes, as a transformer's are, one run per
window: one copy, as before). Computing on the CPU, the engine uses the host buffer itself: there the
alignment made no measurable difference to a decode (every linear layer of a 2.7 GB and of a 3.2 GB
model, 8 bytes off a cache line against aligned, interleaved in one process: 0.99-1.04x; one matrix
timed over and over, partly cached, was 1.10-1.29x slower off it).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from offload.device import Device, Event, Stream
from offload.storage.safetensors_reader import TensorEntry, Window

__all__ = ["DEVICE_ALIGN", "Copy", "DeviceLayout", "copy_to_device", "whole"]

DEVICE_ALIGN = 256
"""Bytes each tensor's start is aligned to in a device buffer: the most ATen tells cuBLASLt, and what
the CUDA allocator gives every allocation."""

Copy = tuple[int, int, int]
"""(host buffer offset, device buffer offset, bytes) of one copy."""


def whole(nbytes: int) -> tuple[Copy, ...]:
    """The copies of the first ``nbytes`` of a host buffer to the start of a device buffer (none for 0)."""
    return ((0, 0, nbytes),) if nbytes else ()


@dataclass(frozen=True, slots=True)
class DeviceLayout:
    """A unit's tensors in a device buffer (see the module docstring). Built by `DeviceLayout.of`."""

    windows: Sequence[Window]
    """The windows it was made from (the host buffer's layout)."""
    copies: tuple[Copy, ...]
    """From the host buffer ``windows`` were read into to the device buffer, in order."""
    places: tuple[tuple[TensorEntry, int], ...]
    """Each tensor and its offset in the device buffer."""
    nbytes: int
    """Bytes of the device buffer."""

    @classmethod
    def of(cls, windows: Sequence[Window], *, align: int = DEVICE_ALIGN) -> "DeviceLayout":
        """The layout of the tensors of ``windows`` (read into a host buffer by `read_windows`)."""
        copies: list[Copy] = []
        places: list[tuple[TensorEntry, int]] = []
        end = 0
        for window in windows:
            runs: list[list[TensorEntry]] = []
            for entry in sorted(window.entries, key=lambda e: (e.offset, e.nbytes)):
                if runs and (entry.offset - runs[-1][0].offset) % align == 0:
                    runs[-1].append(entry)
                else:
                    runs.append([entry])
            for run in runs:
                first, last = run[0].offset, max(e.end for e in run)
                start = -(-end // align) * align
                copies.append((window.buffer_offset + first - window.offset, start, last - first))
                places.extend((entry, start + entry.offset - first) for entry in run)
                end = start + last - first
        return cls(windows, tuple(copies), tuple(places), end)

    def views(self, buffer: torch.Tensor) -> dict[str, torch.Tensor]:
        """Each tensor as a view into ``buffer`` (a 1-D uint8 device buffer filled by `copy_to_device`)."""
        return {entry.name: buffer[at: at + entry.nbytes].view(entry.dtype).view(entry.shape)
                for entry, at in self.places}


def copy_to_device(device: Device, target: torch.Tensor, host: torch.Tensor, copies: Sequence[Copy],
                   stream: Stream) -> Event:
    """Issue ``copies`` from pinned ``host`` into device buffer ``target`` on ``stream``; the event
    after the last (a recorded one where there is nothing to copy)."""
    event = None
    for host_at, target_at, nbytes in copies:
        event = device.to_device(target[target_at: target_at + nbytes], host[host_at: host_at + nbytes], stream=stream)
    return event if event is not None else stream.record()
