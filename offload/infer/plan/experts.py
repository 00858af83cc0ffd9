"""The experts' part of a plan: how many bytes a forward reads when only the picked experts are read.

Pure arithmetic on sizes. A batch of ``b`` tokens, each picking ``k`` of a layer's ``E`` experts, picks
``E * (1 - (1 - k/E)^b)`` distinct experts a layer on average if the router spreads them evenly (real
routers favour some, which the cache, kept by use, turns into fewer reads than this figure).

Where compute has memory of its own (a GPU) the tiers apply per expert there too: the most used experts
are kept on the device, the next in pinned host memory, the rest read from NVMe when picked; every picked
expert not kept on the device crosses the host-to-device link (offload/infer/experts/device.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from offload.infer.plan.units import format_bytes

__all__ = ["ExpertPlan", "distinct_experts"]


def distinct_experts(count: int, top_k: int, batch: int) -> float:
    """Expected distinct experts of ``count`` that ``batch`` tokens pick, ``top_k`` each, spread evenly."""
    if count <= 0:
        return 0.0
    return count * (1.0 - (1.0 - min(top_k, count) / count) ** max(1, batch))


@dataclass(frozen=True, slots=True)
class ExpertPlan:
    """The expert layers' figures for one batch size."""

    layers: int
    count: int
    """Experts per layer."""
    top_k: int
    expert_nbytes: int
    """One expert's bytes in memory."""
    expert_read_nbytes: int
    """Bytes one read of an expert moves (its aligned windows), on average."""
    slots: int
    slot_nbytes: int
    cache_bytes: int | None
    """Bytes of experts kept in memory by use (None: every expert read stays)."""
    batch: int = 1
    """Tokens per decode step the figures are for."""
    device_cache_bytes: int | None = None
    """With compute on a device of its own: its bytes for experts kept there by use; None: no device tier
    (``cache_bytes`` is then host memory's, pinned)."""
    device_slots: int = 0
    """With a device tier: device buffers the picked experts not kept there are copied into (and the next
    layer's guessed ones staged ahead), as many pinned host buffers (and one more) carrying them."""
    packed_nbytes: int = 0
    """With a device tier: one expert as it is copied there (its values, each aligned), the bytes a kept
    expert takes on the device and in pinned host memory; 0 without one."""

    @property
    def total_bytes(self) -> int:
        return self.layers * self.count * self.expert_nbytes

    @property
    def experts(self) -> int:
        """Every expert of every layer."""
        return self.layers * self.count

    @property
    def kept_nbytes(self) -> int:
        """One kept expert's bytes (packed where there is a device tier)."""
        return self.packed_nbytes or self.expert_nbytes

    @property
    def on_device(self) -> int:
        """Experts the device's budget keeps (the most used), 0 without a device tier."""
        if self.device_cache_bytes is None or not self.kept_nbytes:
            return 0
        return min(self.experts, self.device_cache_bytes // self.kept_nbytes)

    @property
    def in_host_memory(self) -> int:
        """Experts host memory keeps (the next most used)."""
        left = self.experts - self.on_device
        return left if self.cache_bytes is None or not self.kept_nbytes else min(left, self.cache_bytes // self.kept_nbytes)

    @property
    def streamed(self) -> int:
        """Experts read from NVMe each time they are picked."""
        return self.experts - self.on_device - self.in_host_memory

    @property
    def kept_fraction(self) -> float:
        """The share of the experts the cache holds (with a device tier: the experts it and the device keep)."""
        if self.cache_bytes is None or not self.total_bytes:
            return 1.0
        if self.device_cache_bytes is not None:
            return (self.on_device + self.in_host_memory) / self.experts
        return min(1.0, self.cache_bytes / self.total_bytes)

    @property
    def device_fraction(self) -> float:
        """The share of the experts the device keeps."""
        return self.on_device / self.experts if self.experts else 0.0

    @property
    def host_to_device_bytes_per_forward(self) -> int:
        """Expert bytes copied to the device per decode step: the picked experts it does not keep."""
        if self.device_cache_bytes is None:
            return 0
        return int(self.layers * self.distinct * self.packed_nbytes * (1.0 - self.device_fraction))

    @property
    def transit_bytes(self) -> int:
        """With a device tier: the pinned host buffers that carry experts not kept on the host to the device."""
        return (self.device_slots + 1) * self.packed_nbytes if self.device_cache_bytes is not None else 0

    @property
    def distinct(self) -> float:
        """Distinct experts a layer computes with per decode step, on average (router spread evenly)."""
        return distinct_experts(self.count, self.top_k, self.batch)

    @property
    def read_bytes_per_forward(self) -> int:
        """Expert bytes read per decode step: the picked experts the cache does not hold."""
        return int(self.layers * self.distinct * self.expert_read_nbytes * (1.0 - self.kept_fraction))

    @property
    def whole_read_bytes(self) -> int:
        """What streaming every expert of every layer would read per decode step."""
        return self.layers * self.count * self.expert_read_nbytes

    @property
    def memory_bytes(self) -> int:
        """Host memory: the read slots, the cache (at most its capacity, or every expert) and, with a device
        tier, the pinned buffers in transit."""
        held = self.in_host_memory * self.kept_nbytes
        cache = held if self.cache_bytes is None else min(self.cache_bytes, held)
        return self.slots * self.slot_nbytes + cache + self.transit_bytes

    def describe(self) -> str:
        """Two lines for the plan (three with a device tier): the reads, and where the experts are kept by use
        (how many on the device, in host memory, streamed from NVMe when picked)."""
        lines = [f"  experts: {self.layers} layers x {self.count} of {format_bytes(self.expert_nbytes)}, read by the "
                 f"router's choice (top {self.top_k}): batch {self.batch} picks {self.distinct:.1f} a layer on average, "
                 f"{format_bytes(self.read_bytes_per_forward)} read per token (every expert: "
                 f"{format_bytes(self.whole_read_bytes)})"]
        host = self.in_host_memory * self.kept_nbytes if self.cache_bytes is None else min(
            self.cache_bytes, self.in_host_memory * self.kept_nbytes)
        guess = "the next layer's guessed from this one's input and read ahead"
        if self.device_cache_bytes is None:
            kept = ("every expert once read" if self.cache_bytes is None
                    else f"{format_bytes(host)} ({self.kept_fraction:.0%} of them)")
            lines.append(f"    kept in memory by use: {kept}: {self.in_host_memory} of {self.experts} experts, "
                         f"{self.streamed} streamed from NVMe when picked; slots {self.slots} x "
                         f"{format_bytes(self.slot_nbytes)}; {guess}")
            return "\n".join(lines)
        lines.append(f"    kept by use (of {self.experts} experts): {self.on_device} on the device "
                     f"({format_bytes(self.on_device * self.kept_nbytes)}), {self.in_host_memory} in pinned host memory "
                     f"({format_bytes(host)}), {self.streamed} streamed from NVMe when picked")
        lines.append(f"    slots: {self.slots} x {format_bytes(self.slot_nbytes)} read into, {self.device_slots} x "
                     f"{format_bytes(self.packed_nbytes)} on the device copied into (the picked experts it does not "
                     f"keep: {format_bytes(self.host_to_device_bytes_per_forward)} to the device per token); {guess}, "
                     f"staged ahead on the device where host memory holds them")
        return "\n".join(lines)
