"""The device path of the layer streamer: units the device does not keep copied from pinned host memory
(a locked ring buffer for a streamed layer, the unit's own pinned buffer for a host-resident one)
into a ring of device buffers on a side stream, ahead of use, through the device seam
(offload/device; docs/device.md).

Used where the compute device has memory of its own (a GPU; the simulated device in tests). The
streamer calls, per unit (any hashable key):

- ``prefetch`` once the unit's host bytes are ready and a device buffer is free: on the side stream,
  wait until compute is done with that buffer's previous unit, then copy (asynchronous: the host
  memory is locked; a unit's tensors each go to an aligned place, offload/infer/stream/device_layout.py).
  The copy overlaps the compute of the units before it.
- ``stage`` before the unit's forward: prefetch it if that has not happened, make the compute stream
  wait for the copy, and return the device buffer its views are made in.
- ``release`` after its forward: mark where compute is done with the buffer, and wait for the copy
  to have read the host buffer (which the streamer may refill with the next read right after).
- ``discard`` for a prefetched unit that will not compute (a read that failed, a reset).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from offload.device import Device, Event
from offload.infer.stream.device_layout import Copy, copy_to_device

__all__ = ["DeviceRing"]


@dataclass(slots=True)
class _Copy:
    slot: int
    copied: Event
    end: int
    """Bytes of the device buffer the copies fill, from its start."""
    in_use: bool = False


class DeviceRing:
    """``buffer_count`` device buffers of ``buffer_nbytes``, filled on a side stream (see the module
    docstring); ``name`` names the buffers (``name[0]``, ...) and the stream (``name-copies``) in errors.

    Raises DeviceMemoryError when the buffers exceed the device's budget (nothing is held then).
    """

    def __init__(self, device: Device, buffer_count: int, buffer_nbytes: int, *, name: str = "ring") -> None:
        self.device = device
        self.buffer_nbytes = buffer_nbytes
        self.stream = device.new_stream(f"{name}-copies")
        self.buffers: list[torch.Tensor] = []
        self._computed: list[Event | None] = [None] * buffer_count
        self._free: deque[int] = deque(range(buffer_count))
        self._copies: dict[object, _Copy] = {}
        self.bytes_copied = 0
        """Bytes copied to the device so far."""
        try:
            for slot in range(buffer_count):
                self.buffers.append(device.empty(buffer_nbytes, torch.uint8, name=f"{name}[{slot}]"))
        except BaseException:
            self.close()
            raise

    @property
    def free_count(self) -> int:
        """Device buffers that can take a prefetch now."""
        return len(self._free)

    def holds(self, key: object) -> bool:
        """Whether ``key`` has been copied (or its copy issued) into a device buffer."""
        return key in self._copies

    def copied(self, key: object) -> Event | None:
        """The event of ``key``'s copy into its device buffer (None where it holds none): done once the copy
        has read its host buffer."""
        copy = self._copies.get(key)
        return copy.copied if copy is not None else None

    def prefetch(self, key: object, host: torch.Tensor, copies: Sequence[Copy]) -> bool:
        """Start ``copies`` from ``host`` into a free device buffer for ``key`` (`device_layout.whole`: the
        first bytes as they are); False when none is free."""
        if key in self._copies:
            return True
        if not self._free:
            return False
        slot = self._free.popleft()
        if self._computed[slot] is not None:
            self.stream.wait_event(self._computed[slot])  # compute is done with the buffer's previous unit
        # No copies (an empty cache layer): an event after the wait above.
        copied = copy_to_device(self.device, self.buffers[slot], host, copies, self.stream)
        self._copies[key] = _Copy(slot, copied, max((at + n for _, at, n in copies), default=0))
        self.bytes_copied += sum(n for _, _, n in copies)
        return True

    def stage(self, key: object, host: torch.Tensor, copies: Sequence[Copy]) -> torch.Tensor:
        """Before ``key``'s forward: its device buffer (``copies`` from ``host`` as in `prefetch`), with the
        compute stream ordered after its copy."""
        if not self.prefetch(key, host, copies):
            for other in [k for k, c in self._copies.items() if not c.in_use]:
                self.discard(other)  # prefetched ahead of a unit this forward skipped: give them back
            if not self.prefetch(key, host, copies):
                raise RuntimeError(f"device ring: all {len(self.buffers)} buffers are in use by units still "
                                   f"computing; raise offload_param.buffer_count")
        copy = self._copies[key]
        copy.in_use = True
        self.device.compute_stream.wait_event(copy.copied)  # compute waits for the copy, the host does not
        buffer = self.buffers[copy.slot]
        self.device.check_ready(buffer[:copy.end])  # the unit's compute reads it next
        return buffer

    def release(self, key: object) -> None:
        """``key`` has computed: its device buffer takes the next copy, its host buffer the next read."""
        copy = self._copies.pop(key)
        self._computed[copy.slot] = self.device.compute_stream.record()
        copy.copied.synchronize()  # the host buffer may be refilled on return
        self._free.append(copy.slot)

    def discard(self, key: object) -> None:
        """Give back ``key``'s device buffer without computing (nothing to do when it holds none)."""
        copy = self._copies.pop(key, None)
        if copy is not None:
            copy.copied.synchronize()  # the copy has read the host buffer, and is done with the device one
            self._free.append(copy.slot)

    def reset(self) -> None:
        """Give back every device buffer (after an error or before a change of plan)."""
        for key, copy in list(self._copies.items()):
            if copy.in_use:
                self.release(key)
            else:
                self.discard(key)

    def check_refill(self, host: torch.Tensor) -> None:
        """Before a read into ring buffer ``host``: raises (simulated device) where a copy still reads it."""
        self.device.check_writable(host)

    def close(self) -> None:
        """Wait for the copies, then give the device buffers back."""
        self.reset()
        self.device.synchronize()
        for buffer in self.buffers:
            self.device.free(buffer)
        self.buffers = []
