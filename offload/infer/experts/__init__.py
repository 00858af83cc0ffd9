"""Mixture-of-experts layers read expert by expert, by the router's choice (split.py: the units; store.py:
the reads, the cache by use and the guess of the next layer's experts; device.py: with compute on a device
of its own, the most used kept there and the others copied there when picked)."""

from __future__ import annotations

import dataclasses

from torch import nn

from offload.device import Device
from offload.infer.experts.device import DeviceCounts, DeviceExperts
from offload.infer.experts.split import Expert, ExpertLayer, split_experts
from offload.infer.experts.store import ExpertCounts, ExpertStore
from offload.infer.config import InferenceConfig
from offload.infer.plan.experts import ExpertPlan
from offload.infer.plan.host import Plan
from offload.infer.stream.unit import Unit
from offload.storage.safetensors_reader import SafetensorsCheckpoint
from tensorio import AioHandle

__all__ = ["DeviceCounts", "DeviceExperts", "Expert", "ExpertCounts", "ExpertLayer", "ExpertPlan", "ExpertStore",
           "expert_plan", "route_experts", "split_experts"]


def route_experts(units: list[Unit], module: nn.Module, checkpoint: SafetensorsCheckpoint, handle: AioHandle,
                  plan: Plan | None, settings: InferenceConfig, *, compute: Device
                  ) -> tuple[list[Unit], ExpertStore | None]:
    """Where ``plan`` leaves units that hold a mixture-of-experts layer away from where ``compute`` runs
    (streamed from NVMe; on a device of its own, also those kept in pinned host memory; None: no plan holds
    them whole), with ``settings.experts`` "routed": the units with every layer's experts split out and the
    `ExpertStore` that reads them by the router's choice (a slot per top-k expert per ring buffer; on a device
    as many copy slots there, `DeviceExperts`); else ``units`` unchanged and None."""
    if settings.experts != "routed":
        return units, None
    if plan is None:
        away = {u.name for u in units}
    elif compute.separate_memory:
        on_device = plan.device.resident if plan.device is not None else frozenset()
        away = {u.name for u in plan.units if u.name not in on_device}
    else:
        away = {u.name for u in plan.streamed}
    if not away:
        return units, None
    split, layers = split_experts(units, module, checkpoint)
    if not any(layer.name.startswith(name + ".") for layer in layers for name in away):
        return units, None
    slots = settings.buffer_count * max(layer.top_k for layer in layers)
    device = DeviceExperts(compute, layers, slots=slots) if compute.separate_memory else None
    return split, ExpertStore(handle, layers, slots=slots, device=device)


def expert_plan(store: ExpertStore, *, room: int | None, batch: int, device_room: int | None = None) -> ExpertPlan:
    """The plan's figures for ``store``, its cache given ``room`` bytes of host memory (None: no limit), with a
    device tier ``device_room`` bytes of the device's, for ``batch`` tokens."""
    layers = store.layers
    experts = [e for layer in layers for e in layer.experts]
    device = store.device
    plan = ExpertPlan(layers=len(layers), count=max(layer.count for layer in layers),
                      top_k=max(layer.top_k for layer in layers),
                      expert_nbytes=sum(e.nbytes for e in experts) // len(experts),
                      expert_read_nbytes=sum(e.read_nbytes for e in experts) // len(experts),
                      slots=store.slot_count, slot_nbytes=store.slot_nbytes,
                      cache_bytes=None if room is None else max(0, room), batch=max(1, batch))
    if device is None:
        return plan
    plan = dataclasses.replace(plan, device_cache_bytes=max(0, device_room or 0), device_slots=device.slot_count,
                               packed_nbytes=device.slot_nbytes)
    return plan if room is None else dataclasses.replace(plan, cache_bytes=max(0, room - plan.transit_bytes))
