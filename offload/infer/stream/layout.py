"""Where a unit's tensors lie in the buffer its forward computes from: each aligned as a fresh
allocation's would be, where the checkpoint did not align it.

A unit is read with O_DIRECT into a page-aligned host buffer, each tensor at its offset within the
file's pages, so a tensor starts wherever its file put it, and safetensors aligns tensors to 8 bytes
only (its header is padded to 8): in the 7.1 GB checkpoint of `benchmarks.gpu infer`, 282 of its
399 tensors start 8 bytes past a 16-byte boundary, and a file's tensors are 64-byte aligned only
where its header happens to end on 64 bytes. The kernels read an unaligned weight more slowly:

- On a GPU, ATen tells cuBLASLt each operand's alignment (up to 256 bytes, ``_getAlignment`` in
  ATen's CUDABlas.cpp), whose heuristics then choose only among kernels that read such a matrix 8
  bytes at a time; a weight that transformers or Accelerate load gets an allocation of its own, at
  least 256-byte aligned. `DeviceLayout`: a unit is copied to the device with each run of tensors at
  a `DEVICE_ALIGN` boundary.
- On the CPU, a bf16 matrix-vector product (one token's decode) on a weight 8, 16 or 32 bytes off
  a 64-byte boundary took 1.10-1.29x the time of the same weight aligned (this AMD EPYC, one and two
  threads, 4096 x 4096 to 13824 x 5120): a 64-byte load then spans two cache lines. `HostLayout`: a
  unit kept in memory has its tensors moved down to `HOST_ALIGN` boundaries, in place, once read
  (a memmove of its bytes, once; nothing more held). A streamed unit is computed on as read: a copy
  per forward would cost more than the slower kernel.

A run is tensors whose offsets from its first are multiples of the alignment: in a checkpoint whose
tensor sizes are multiples of 256 bytes, as a transformer's are, a window is one run, so one move or
one copy per window.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from offload.device import Device, Event, Stream
from offload.storage.safetensors_reader import TensorEntry, Window

__all__ = ["DEVICE_ALIGN", "HOST_ALIGN", "Copy", "DeviceLayout", "HostLayout", "copy_to_device", "whole"]

DEVICE_ALIGN = 256
"""Bytes each tensor's start is aligned to in a device buffer: the most ATen tells cuBLASLt, and what
the CUDA allocator gives every allocation."""

HOST_ALIGN = 64
"""Bytes each tensor's start is aligned to in a unit kept in host memory: a cache line, what torch's
CPU allocator gives every allocation."""

Copy = tuple[int, int, int]
"""(source buffer offset, target buffer offset, bytes) of one copy or move."""


def whole(nbytes: int) -> tuple[Copy, ...]:
    """The copies of the first ``nbytes`` of a host buffer to the start of a device buffer (none for 0)."""
    return ((0, 0, nbytes),) if nbytes else ()


def _runs(window: Window, align: int) -> list[list[TensorEntry]]:
    """``window``'s tensors in file order, in runs whose offsets from their first are multiples of ``align``."""
    runs: list[list[TensorEntry]] = []
    for entry in sorted(window.entries, key=lambda e: (e.offset, e.nbytes)):
        if runs and (entry.offset - runs[-1][0].offset) % align == 0:
            runs[-1].append(entry)
        else:
            runs.append([entry])
    return runs


@dataclass(frozen=True, slots=True)
class _Layout:
    windows: Sequence[Window]
    """The windows it was made from (the host buffer's layout, as `read_windows` fills it)."""
    copies: tuple[Copy, ...]
    """From the host buffer ``windows`` were read into to where the tensors go, in order."""
    places: tuple[tuple[TensorEntry, int], ...]
    """Each tensor and its offset in the buffer it is computed from."""

    def views(self, buffer: torch.Tensor) -> dict[str, torch.Tensor]:
        """Each tensor as a view into ``buffer`` (a 1-D uint8 buffer laid out by this layout)."""
        return {entry.name: buffer[at: at + entry.nbytes].view(entry.dtype).view(entry.shape)
                for entry, at in self.places}


@dataclass(frozen=True, slots=True)
class DeviceLayout(_Layout):
    """A unit's tensors in a device buffer of ``nbytes``, each run at a `DEVICE_ALIGN` boundary, packed
    from offset 0; filled from the host buffer by `copy_to_device` with ``copies``."""

    nbytes: int = 0

    @classmethod
    def of(cls, windows: Sequence[Window], *, align: int = DEVICE_ALIGN) -> "DeviceLayout":
        """The layout of the tensors of ``windows``."""
        copies: list[Copy] = []
        places: list[tuple[TensorEntry, int]] = []
        end = 0
        for window in windows:
            for run in _runs(window, align):
                first, last = run[0].offset, max(e.end for e in run)
                start = -(-end // align) * align
                copies.append((window.buffer_offset + first - window.offset, start, last - first))
                places.extend((entry, start + entry.offset - first) for entry in run)
                end = start + last - first
        return cls(windows, tuple(copies), tuple(places), end)


@dataclass(frozen=True, slots=True)
class HostLayout(_Layout):
    """A unit's tensors in its own host buffer after `apply`: each run moved down to the `HOST_ALIGN`
    boundary at or below where it was read, where that does not reach the run before it (else left
    where it is)."""

    @classmethod
    def of(cls, windows: Sequence[Window], *, align: int = HOST_ALIGN) -> "HostLayout":
        """The layout of the tensors of ``windows`` once moved in the buffer they were read into."""
        moves: list[Copy] = []
        places: list[tuple[TensorEntry, int]] = []
        end = 0
        for window in sorted(windows, key=lambda w: w.buffer_offset):
            for run in _runs(window, align):
                first, last = run[0].offset, max(e.end for e in run)
                read_at = window.buffer_offset + first - window.offset
                start = read_at // align * align
                if start < end:  # would overwrite the run before it
                    start = read_at
                if start != read_at:
                    moves.append((read_at, start, last - first))
                places.extend((entry, start + entry.offset - first) for entry in run)
                end = start + last - first
        return cls(windows, tuple(moves), tuple(places))

    def apply(self, buffer: torch.Tensor) -> None:
        """Move the tensors of ``buffer`` (just read, as `read_windows` fills it) to their places, in
        place: each move goes down, in buffer order, so none overwrites bytes still to be moved."""
        base = buffer.data_ptr()
        for source, target, nbytes in self.copies:
            ctypes.memmove(base + target, base + source, nbytes)


def copy_to_device(device: Device, target: torch.Tensor, host: torch.Tensor, copies: Sequence[Copy],
                   stream: Stream) -> Event:
    """Issue ``copies`` from pinned ``host`` into device buffer ``target`` on ``stream``; the event
    after the last (a recorded one where there is nothing to copy)."""
    event = None
    for host_at, target_at, nbytes in copies:
        event = device.to_device(target[target_at: target_at + nbytes], host[host_at: host_at + nbytes], stream=stream)
    return event if event is not None else stream.record()
