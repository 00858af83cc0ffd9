"""The device tier of experts read by the router's choice: where compute has memory of its own (a GPU), the
most used experts stay on the device and the others are copied there when picked.

An expert read from NVMe is made into its values on the host (offload/infer/experts/store.py: transformers'
slices of the fused parameters, or a `QuantExperts` child's packed tensors) and packed into one pinned host
buffer, each value at a `DEVICE_ALIGN`-aligned offset (`ExpertLayout`): its copy to the device is one
asynchronous copy of that buffer, and views of the device's copy are the values. The host tier's cache by
use keeps such pinned buffers (`PinnedBuffers` makes and reuses them). On the device an expert is kept in a
buffer of its own (`Device.empty`, counted against the budget) or copied into one of a few copy slots (a
`DeviceRing`), given back once it has computed.

For each expert a forward computes with, the store (offload/infer/experts/store.py) applies the rule of
its host cache, by the same use counts:

1. kept on the device: `values` (the compute stream waits for the copy that put it there);
2. else `victims`: the kept experts to take off the device so that it fits, each used less often than it and
   not computing in this forward (None: it is not kept); those go back to pinned host memory (`demote`,
   where the host tier's uses earn it) or are dropped (`drop`), then `admit` copies it to a buffer of its own;
3. else `stage`: into a copy slot (already there where `prefetch` copied it ahead: a picked expert held on
   the host while earlier ones compute, or the next layer's guessed ones), given back by `release`.

Every value bound for compute is a device tensor: an expert not copied cannot compute on the host (a GPU
refuses operands on two devices, and so does the simulated device).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, fields

import torch

from offload.device import Device, Event
from offload.infer.experts.split import ExpertLayer
from offload.infer.stream.device_layout import DEVICE_ALIGN, copy_to_device, whole
from offload.infer.stream.device_ring import DeviceRing

__all__ = ["DeviceCounts", "DeviceExperts", "ExpertLayout", "PinnedBuffers"]

Key = tuple[int, int]
"""(layer position, expert index)."""


@dataclass(frozen=True, slots=True)
class ExpertLayout:
    """One expert's values in a packed buffer (pinned host or device): (offset, shape, dtype) each, every
    offset a multiple of `DEVICE_ALIGN` (as a fresh device allocation is aligned). Built by `ExpertLayout.of`."""

    places: tuple[tuple[int, torch.Size, torch.dtype], ...]
    nbytes: int
    """Bytes of the packed buffer."""

    @classmethod
    def of(cls, layer: ExpertLayer, *, align: int = DEVICE_ALIGN) -> "ExpertLayout":
        """The layout of ``layer``'s experts (each of its experts has the same)."""
        places, end = [], 0
        for shape, dtype in layer.slice_shapes:
            start = -(-end // align) * align
            places.append((start, shape, dtype))
            end = start + shape.numel() * dtype.itemsize
        return cls(tuple(places), end)

    def views(self, buffer: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Each value as a view into ``buffer`` (1-D uint8, at least ``nbytes``)."""
        return tuple(buffer[at: at + shape.numel() * dtype.itemsize].view(dtype).view(shape)
                     for at, shape, dtype in self.places)

    def pack(self, values: Sequence[torch.Tensor], buffer: torch.Tensor) -> None:
        """Copy ``values`` (host tensors, one per place) into their places in host ``buffer``. Raises
        ValueError naming the value whose shape or dtype is not its place's."""
        if len(values) != len(self.places):
            raise ValueError(f"expert layout: {len(values)} values for {len(self.places)} places")
        for i, (value, view) in enumerate(zip(values, self.views(buffer))):
            if value.shape != view.shape or value.dtype != view.dtype:
                raise ValueError(f"expert layout: value {i} is {tuple(value.shape)} {value.dtype}, its place "
                                 f"{tuple(view.shape)} {view.dtype}")
            view.copy_(value)


class PinnedBuffers:
    """Pinned host buffers of ``nbytes`` each (`Device.pinned_empty`), for experts kept on the host or on
    their way to the device: `take` one (reused where one is spare, else made), `give` it back (up to
    ``spare`` are kept for reuse, the others freed). A buffer a copy may still read (`reading`) is waited
    for before it is refilled or freed."""

    def __init__(self, device: Device, nbytes: int, *, spare: int) -> None:
        self.device = device
        self.nbytes = nbytes
        self.spare = spare
        self._spare: list[torch.Tensor] = []
        self._reading: dict[int, list[Event]] = {}
        self.made = 0
        """Buffers made so far."""
        self.out = 0
        """Buffers taken and not given back."""

    def reading(self, buffer: torch.Tensor, event: Event) -> None:
        """A copy that reads ``buffer`` was issued: ``event`` is done once it has (those done before are let go)."""
        events = self._reading.get(buffer.data_ptr(), [])
        self._reading[buffer.data_ptr()] = [e for e in events if not e.query()] + [event]

    def take(self) -> torch.Tensor:
        """A buffer the host may fill now."""
        if self._spare:
            buffer = self._spare.pop()
        else:
            buffer = self.device.pinned_empty(self.nbytes, torch.uint8)
            self.made += 1
        self._settle(buffer)
        self.device.check_writable(buffer)
        self.out += 1
        return buffer

    def give(self, buffer: torch.Tensor) -> None:
        """``buffer`` is not needed any more (a copy may still read it: it is waited for when reused)."""
        self.out -= 1
        if len(self._spare) < self.spare:
            self._spare.append(buffer)
            return
        self._settle(buffer)
        self.device.free_pinned(buffer)

    def _settle(self, buffer: torch.Tensor) -> None:
        for event in self._reading.pop(buffer.data_ptr(), []):
            event.synchronize()  # sync point: the copies from it have read it

    def close(self) -> None:
        """Wait for the copies that read the spare buffers, and free them."""
        for buffer in self._spare:
            self._settle(buffer)
            self.device.free_pinned(buffer)
        self._spare = []
        for events in self._reading.values():
            for event in events:
                event.synchronize()
        self._reading.clear()


@dataclass(slots=True)
class DeviceCounts:
    """What the device tier has done since it was made (or `DeviceCounts.clear`)."""

    hits: int = 0
    """Picked experts found kept on the device."""
    copies: int = 0
    """Experts copied host -> device (into a copy slot, or a buffer of their own)."""
    bytes_copied: int = 0
    kept: int = 0
    """Experts given a device buffer of their own (the device's budget had room, or their uses earned it)."""
    demoted: int = 0
    """Kept experts taken off the device for more used ones, back to pinned host memory."""
    dropped: int = 0
    """Kept experts taken off the device that the host tier did not keep (read again when picked)."""
    staged_ahead: int = 0
    """Guessed experts of a next layer copied to a slot before that layer ran."""
    staged_ahead_used: int = 0
    """Of those, computed with from that slot."""

    def clear(self) -> None:
        """Start counting from zero."""
        for field in fields(self):
            setattr(self, field.name, 0)


@dataclass(eq=False, slots=True)
class _Kept:
    buffer: torch.Tensor
    values: tuple[torch.Tensor, ...]
    copied: Event


class DeviceExperts:
    """The experts of ``layers`` on ``device`` (see the module docstring): at most `capacity` bytes kept there
    by use, the others copied into ``slots`` copy slots when picked."""

    def __init__(self, device: Device, layers: list[ExpertLayer], *, slots: int) -> None:
        self.device = device
        self.names = [layer.name for layer in layers]
        self.layouts = [ExpertLayout.of(layer) for layer in layers]
        self.slot_nbytes = max(layout.nbytes for layout in self.layouts)
        """Bytes of a copy slot, and of a pinned buffer: the largest expert packed."""
        self.slot_count = max(1, slots)
        self.pinned = PinnedBuffers(device, self.slot_nbytes, spare=self.slot_count + 1)
        self.stream = device.new_stream("expert-copies")
        self.ring: DeviceRing | None = None
        """The copy slots, made at the first copy into one."""
        self.kept: dict[Key, _Kept] = {}
        self.kept_bytes = 0
        self.capacity = 0
        """Bytes of experts kept on the device at most (`set_capacity` of the store)."""
        self.counts = DeviceCounts()
        self._staged: list[Key] = []
        """Computing from a copy slot in this forward (given back by `release`)."""
        self._ahead: set[Key] = set()
        """Staged ahead on a guess, not computed with yet."""

    @property
    def ring_bytes(self) -> int:
        """The copy slots' bytes on the device."""
        return self.slot_count * self.slot_nbytes

    def nbytes(self, key: Key) -> int:
        """``key``'s packed bytes."""
        return self.layouts[key[0]].nbytes

    # ---- the host form ----------------------------------------------------------------------------

    def pack(self, position: int, values: Sequence[torch.Tensor]) -> torch.Tensor:
        """A pinned buffer holding ``values`` of an expert of the layer at ``position``."""
        buffer = self.pinned.take()
        try:
            self.layouts[position].pack(values, buffer)
        except BaseException:
            self.pinned.give(buffer)
            raise
        return buffer

    def give(self, host: torch.Tensor) -> None:
        """A pinned buffer from `pack` (or `demote`) is not needed any more."""
        self.pinned.give(host)

    # ---- the device's experts ---------------------------------------------------------------------

    def values(self, key: Key) -> tuple[torch.Tensor, ...]:
        """Kept ``key``'s values on the device, the compute stream ordered after their copy."""
        self.counts.hits += 1
        return self._ready(self.kept[key])

    def victims(self, key: Key, uses: Counter[Key], busy: Iterable[Key]) -> list[Key] | None:
        """The kept experts to take off the device for ``key`` to be kept, least used first, each used less
        often than it and not in ``busy`` ([] where there is room); None where it is not kept."""
        nbytes = self.nbytes(key)
        room = self.capacity - self.kept_bytes
        if room >= nbytes:
            return []
        busy = set(busy)
        chosen = []
        for victim in sorted((k for k in self.kept if k not in busy and uses[k] < uses[key]), key=uses.__getitem__):
            if room >= nbytes:
                break
            chosen.append(victim)
            room += self.nbytes(victim)
        return chosen if room >= nbytes else None

    def admit(self, key: Key, host: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Keep ``key`` on the device: a buffer of its own, copied from pinned ``host`` (`pack`); its values
        there. Raises DeviceMemoryError (nothing kept) where the device's budget cannot hold it."""
        layout = self.layouts[key[0]]
        if self.ring is not None:
            self.ring.discard(key)  # a copy of it in a slot, staged ahead: its own buffer replaces it
            self._ahead.discard(key)
        buffer = self.device.empty(layout.nbytes, torch.uint8, name=f"{self.names[key[0]]}.{key[1]} (kept)")
        # The copy waits for compute issued so far: it may have read the buffer's memory as a victim's.
        self.stream.wait_event(self.device.compute_stream.record())
        copied = copy_to_device(self.device, buffer, host, whole(layout.nbytes), self.stream)
        self._copied(host, copied, layout.nbytes)
        kept = self.kept[key] = _Kept(buffer, layout.views(buffer), copied)
        self.kept_bytes += layout.nbytes
        self.counts.kept += 1
        return self._ready(kept)

    def demote(self, key: Key) -> torch.Tensor:
        """Take kept ``key`` off the device into a pinned buffer (returned, for the host tier to keep)."""
        kept = self._take_off(key)
        host = self.pinned.take()
        self.stream.wait_event(kept.copied)
        event = self.device.to_host(host[: kept.buffer.numel()], kept.buffer, stream=self.stream)
        event.synchronize()  # sync point: its bytes are on the host before its device buffer goes
        self.device.free(kept.buffer)
        self.counts.demoted += 1
        return host

    def drop(self, key: Key) -> None:
        """Take kept ``key`` off the device without keeping it anywhere."""
        kept = self._take_off(key)
        kept.copied.synchronize()  # no copy still fills its buffer
        self.device.free(kept.buffer)
        self.counts.dropped += 1

    def _take_off(self, key: Key) -> _Kept:
        kept = self.kept.pop(key)
        self.kept_bytes -= kept.buffer.numel()
        return kept

    def _ready(self, kept: _Kept) -> tuple[torch.Tensor, ...]:
        self.device.compute_stream.wait_event(kept.copied)  # compute waits for the copy, the host does not
        self.device.check_ready(kept.buffer)
        return kept.values

    # ---- copy slots -------------------------------------------------------------------------------

    def prefetch(self, key: Key, host: torch.Tensor, *, guessed: bool = False) -> bool:
        """Copy ``key`` from pinned ``host`` into a free copy slot ahead of its use (``guessed``: for a next
        layer, on its router's guess); whether it is there (or kept) now. Never waits for a slot."""
        ring = self._ring()
        if key in self.kept or ring.holds(key):
            return True
        if not ring.free_count:
            return False
        ring.prefetch(key, host, whole(self.nbytes(key)))
        self._copied(host, ring.copied(key), self.nbytes(key))
        if guessed:
            self._ahead.add(key)
            self.counts.staged_ahead += 1
        return True

    def stage(self, key: Key, host: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """``key``'s values in a copy slot (copied from pinned ``host`` now where `prefetch` has not), the
        compute stream ordered after the copy; `release` gives the slot back once it has computed."""
        ring = self._ring()
        if key in self._ahead and ring.holds(key):
            self.counts.staged_ahead_used += 1
        self._ahead.discard(key)
        fresh = not ring.holds(key)
        buffer = ring.stage(key, host, whole(self.nbytes(key)))
        if fresh:
            self._copied(host, ring.copied(key), self.nbytes(key))
        self._staged.append(key)
        return self.layouts[key[0]].views(buffer)

    def release(self, key: Key) -> None:
        """After ``key`` has computed: its copy slot (if it used one) takes the next copy."""
        if key in self._staged:
            self._staged.remove(key)
            self.ring.release(key)

    def _ring(self) -> DeviceRing:
        if self.ring is None:
            self.ring = DeviceRing(self.device, self.slot_count, self.slot_nbytes, name="expert-slots")
        return self.ring

    def _copied(self, host: torch.Tensor, event: Event, nbytes: int) -> None:
        self.pinned.reading(host, event)
        self.counts.copies += 1
        self.counts.bytes_copied += nbytes

    # ---- lifetime ---------------------------------------------------------------------------------

    def reset(self) -> None:
        """No copy slot held (after an error, or before a change of plan); the kept experts stay."""
        if self.ring is not None:
            self.ring.reset()
        self._staged, self._ahead = [], set()

    def close(self) -> None:
        """Wait for the copies; free the kept experts, the copy slots and the spare pinned buffers (the host
        tier gives its own back first)."""
        self.reset()
        self.device.synchronize()
        for key in list(self.kept):
            self.device.free(self._take_off(key).buffer)
        if self.ring is not None:
            self.ring.close()
            self.ring = None
        self.pinned.close()
