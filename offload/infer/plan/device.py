"""The device tier: which units a compute device with memory of its own (a GPU) keeps, within its budget.

Pure arithmetic on sizes, like offload/infer/plan/host.py, which places the rest between pinned host
memory and NVMe. A unit kept on the device is never copied again; every other unit crosses the
host-to-device link once per forward, through a ring of device buffers (``ring_slots`` of the
largest such unit). A unit on the device is counted as the buffer its windows are read into (its
weights and their alignment slack: what the device allocates). The device holds, in this order: the
units that must stay (embeddings, norms, tied weights: compute reads them where it runs), the
activations, the KV cache, the ring (and a mixture of experts' copy slots), then as many whole decoder
layers as fit, largest first, spread through the forward; what is left holds experts kept there by use
(offload/infer/plan/experts.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from offload.infer.plan.units import BudgetError, UnitSize, format_bytes, spread_order, unit_names

__all__ = ["DeviceTier", "place_device"]


@dataclass(frozen=True, slots=True)
class DeviceTier:
    """What the compute device holds (see the module docstring)."""

    budget: int
    """The device's budget in bytes."""
    setting: str
    """The setting that gave it (``max_memory[0]``), for messages."""
    resident: frozenset[str]
    """The units kept in device memory for good."""
    resident_bytes: int
    ring_slots: int
    """Device buffers the other units are copied into, ahead of use, on a side stream (0: none needed)."""
    slot_nbytes: int
    """Bytes per ring buffer: the largest unit not kept on the device."""
    kv_bytes: int
    """The KV cache reserved on the device."""
    activation_bytes: int
    """Activations reserved on the device (one micro-batch's forward)."""
    host_to_device_bps: float | None = None
    """The host-to-device link's speed in bytes per second (pinned copies), None when unknown."""
    kv_link_bytes: int = 0
    """KV cache bytes copied host -> device per token when the cache lives on the host (every layer's
    keys and values at the full length, the bound); ``kv_bytes`` is then its two device buffers."""
    expert_slot_bytes: int = 0
    """A mixture of experts' copy slots (offload/infer/experts/device.py): the picked experts the device does
    not keep are copied into them."""

    @property
    def ring_bytes(self) -> int:
        return self.ring_slots * self.slot_nbytes

    @property
    def used_bytes(self) -> int:
        """Everything reserved on the device: resident units, ring, expert copy slots, KV cache, activations."""
        return self.resident_bytes + self.ring_bytes + self.expert_slot_bytes + self.kv_bytes + self.activation_bytes


def place_device(units: Sequence[UnitSize], *, budget: int, setting: str, ring_slots: int, kv_bytes: int = 0,
                 kv_shape: tuple[int, int] = (0, 0), activation_bytes: int = 0,
                 host_to_device_bps: float | None = None, kv_link_bytes: int = 0,
                 expert_slot_bytes: int = 0) -> DeviceTier:
    """Place ``units`` (forward order) on a device of ``budget`` bytes (see the module docstring);
    the units left out go through a ring of ``ring_slots`` device buffers of the largest of them.
    ``expert_slot_bytes``: a mixture of experts' copy slots, held beside the activations.

    Raises BudgetError naming ``setting`` and the figures when the budget cannot hold the units that
    must stay, the activations, the KV cache of ``kv_shape`` and the ring of the largest unit. With
    ``kv_link_bytes`` (the cache on the host) ``kv_bytes`` is the two device buffers that carry it.
    """
    required = [u for u in units if not u.streamable]
    streamable = [u for u in units if u.streamable]
    must = sum(u.buffer_nbytes for u in required)
    fixed = must + activation_bytes + kv_bytes + expert_slot_bytes
    rank = {streamable[i].name: r for r, i in enumerate(spread_order(len(streamable)))}
    left = sorted(streamable, key=lambda u: (-u.buffer_nbytes, rank[u.name]))
    slot = max((u.buffer_nbytes for u in streamable), default=0)
    if left and fixed + ring_slots * slot > budget and fixed + sum(u.buffer_nbytes for u in left) > budget:
        kv = "" if not kv_bytes else (
            f" + KV cache {format_bytes(kv_bytes)} (batch {kv_shape[0]} x {kv_shape[1]} tokens)" if not kv_link_bytes else
            f" + KV cache buffers 2 x {format_bytes(kv_bytes // 2, up=True)} (one layer's cache for batch {kv_shape[0]} "
            f"x {kv_shape[1]} tokens; the cache itself is on the host)")
        raise BudgetError(
            f"{setting}: the device budget of {format_bytes(budget)} cannot hold the units that must stay on the "
            f"device ({format_bytes(must)}: {unit_names(required)}) + activations {format_bytes(activation_bytes)}"
            f"{kv}{_slots(expert_slot_bytes)} + a copy ring of {ring_slots} x {format_bytes(slot, up=True)} (the largest layer) = "
            f"{format_bytes(fixed + ring_slots * slot, up=True)}; raise {setting} to at least that"
            + (", or lower the batch size or the number of tokens" if kv_bytes else "")
            + (", or set offload_param.buffer_count 1 (one ring buffer)" if ring_slots > 1 else ""))
    if not left and fixed > budget:
        raise BudgetError(f"{setting}: the device budget of {format_bytes(budget)} cannot hold "
                          f"{format_bytes(fixed, up=True)} (units that must stay, activations, KV cache"
                          f"{', expert copy slots' if expert_slot_bytes else ''}); raise it")
    # Whole units while they fit beside the ring for the largest unit still left out.
    resident, room = {u.name for u in required}, budget - fixed
    held = 0
    for unit in left:
        rest = [u.buffer_nbytes for u in left if u.name not in resident and u is not unit]
        ring = ring_slots * max(rest, default=0)
        if held + unit.buffer_nbytes + ring <= room:
            resident.add(unit.name)
            held += unit.buffer_nbytes
    out = [u for u in streamable if u.name not in resident]
    slot = max((u.buffer_nbytes for u in out), default=0)
    return DeviceTier(budget, setting, frozenset(resident), must + held, ring_slots if out else 0, slot, kv_bytes,
                      activation_bytes, host_to_device_bps, kv_link_bytes, expert_slot_bytes)


def _slots(nbytes: int) -> str:
    """The experts' copy slots in a budget error ("" for none)."""
    return f" + expert copy slots {format_bytes(nbytes)} (offload_param.buffer_count x top-k)" if nbytes else ""
