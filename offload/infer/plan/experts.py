"""The experts' part of a plan: how many bytes a forward reads when only the picked experts are read.

Pure arithmetic on sizes. A batch of ``b`` tokens, each picking ``k`` of a layer's ``E`` experts, picks
``E * (1 - (1 - k/E)^b)`` distinct experts a layer on average if the router spreads them evenly (real
routers favour some, which the cache, kept by use, turns into fewer reads than this figure).
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

    @property
    def total_bytes(self) -> int:
        return self.layers * self.count * self.expert_nbytes

    @property
    def kept_fraction(self) -> float:
        """The share of the experts the cache holds."""
        if self.cache_bytes is None or not self.total_bytes:
            return 1.0
        return min(1.0, self.cache_bytes / self.total_bytes)

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
        """The read slots and the cache (at most its capacity, or every expert)."""
        cache = self.total_bytes if self.cache_bytes is None else min(self.cache_bytes, self.total_bytes)
        return self.slots * self.slot_nbytes + cache

    def describe(self) -> str:
        """Two lines for the plan."""
        kept = ("every expert once read" if self.cache_bytes is None
                else f"{format_bytes(min(self.cache_bytes, self.total_bytes))} ({self.kept_fraction:.0%} of them)")
        return (f"  experts: {self.layers} layers x {self.count} of {format_bytes(self.expert_nbytes)}, read by the "
                f"router's choice (top {self.top_k}): batch {self.batch} picks {self.distinct:.1f} a layer on average, "
                f"{format_bytes(self.read_bytes_per_forward)} read per token (every expert: "
                f"{format_bytes(self.whole_read_bytes)})\n"
                f"    kept in memory by use: {kept}; slots {self.slots} x {format_bytes(self.slot_nbytes)}; the next "
                f"layer's guessed from this one's input and read ahead")
