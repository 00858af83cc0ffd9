"""Mixture-of-experts layers read expert by expert, by the router's choice (split.py: the units; store.py:
the reads, the cache by use and the guess of the next layer's experts)."""

from __future__ import annotations

from torch import nn

from offload.infer.experts.split import Expert, ExpertLayer, split_experts
from offload.infer.experts.store import ExpertCounts, ExpertStore
from offload.infer.config import InferenceConfig
from offload.infer.plan.experts import ExpertPlan
from offload.infer.plan.host import Plan
from offload.infer.stream.unit import Unit
from offload.storage.safetensors_reader import SafetensorsCheckpoint
from tensorio import AioHandle

__all__ = ["Expert", "ExpertCounts", "ExpertLayer", "ExpertPlan", "ExpertStore", "expert_plan", "route_experts",
           "split_experts"]


def route_experts(units: list[Unit], module: nn.Module, checkpoint: SafetensorsCheckpoint, handle: AioHandle,
                  plan: Plan, settings: InferenceConfig, *, separate_memory: bool) -> tuple[list[Unit], ExpertStore | None]:
    """Where ``plan`` streams units that hold a mixture-of-experts layer, with ``settings.experts`` "routed" and
    compute on the host: the units with every layer's experts split out and the `ExpertStore` that reads them by
    the router's choice (a slot per top-k expert per ring buffer); else ``units`` unchanged and None."""
    if settings.experts != "routed" or separate_memory or not plan.streamed:
        return units, None
    split, layers = split_experts(units, module, checkpoint)
    streamed = {u.name for u in plan.streamed}
    if not any(layer.name.startswith(name + ".") for layer in layers for name in streamed):
        return units, None
    return split, ExpertStore(handle, layers, slots=settings.buffer_count * max(layer.top_k for layer in layers))


def expert_plan(store: ExpertStore, *, room: int | None, batch: int) -> ExpertPlan:
    """The plan's figures for ``store``, its cache given ``room`` bytes (None: no limit), for ``batch`` tokens."""
    layers = store.layers
    experts = [e for layer in layers for e in layer.experts]
    return ExpertPlan(layers=len(layers), count=max(layer.count for layer in layers),
                      top_k=max(layer.top_k for layer in layers),
                      expert_nbytes=sum(e.nbytes for e in experts) // len(experts),
                      expert_read_nbytes=sum(e.read_nbytes for e in experts) // len(experts),
                      slots=store.slot_count, slot_nbytes=store.slot_nbytes,
                      cache_bytes=None if room is None else max(0, room), batch=max(1, batch))
