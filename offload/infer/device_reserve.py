"""`reserve` where compute has memory of its own (a GPU): the activations and, while the budget holds it, the
KV cache on the device; else the cache on the host, each layer's copied to the device per token. A part of
`offload.infer.engine.InferenceEngine`, which it is mixed into (its methods use the engine's plan, settings and
sizes)."""

from __future__ import annotations

import dataclasses
import logging

import torch

from offload.device import host_memory
from offload.infer.plan.host import BudgetError, KVPlacement, Plan, format_bytes, place_kv

__all__ = ["DeviceReservation"]

log = logging.getLogger("offload.infer")


class DeviceReservation:
    """`InferenceEngine`'s reservation on a device with memory of its own."""

    def _reserve_on_device(self, batch: int, tokens: int, micro: int, logits: int | None, step: int,
                           keep: KVPlacement | None = None, *, apply: bool = True) -> Plan:
        """`reserve` where compute has memory of its own: the activations on the device, and the KV cache
        there while the budget holds it (``kv_offload.device`` "auto"); else, or with "cpu" / "nvme", the
        cache on the host (in memory or on NVMe, as `place_kv` places it there), each layer's copied to
        the device per token through two device buffers (offload/infer/kv/device.py). With ``keep`` (a
        cache a generate runs with) the cache stays where it is. With ``apply`` False the plan is only
        found: nothing is re-placed."""
        setting = self.settings.kv_offload
        layers = self._text_config().num_hidden_layers
        kv, shape, parts = self.kv_bytes(batch, tokens), (batch, tokens), batch // micro
        disk, activations = (self.plan.disk_bps, self.plan.disk_source), self.activation_bytes(micro, step, logits=logits,
                                                                                                context=tokens)
        plan = None
        if keep is not None and not keep.staged_nbytes:  # a cache on the device stays there
            plan = self._make_plan(kv, shape, disk=disk, activations=activations)
            plan = dataclasses.replace(plan, kv=keep)
        elif setting.device == "auto" and keep is None:
            try:
                plan = self._make_plan(kv, shape, disk=disk, activations=activations)
                plan = dataclasses.replace(plan, kv=KVPlacement(layers, kv // layers, micro_batches=parts))
            except BudgetError:
                if not kv:
                    raise
                if apply:  # not for each length `reserve` tries after a refusal
                    log.info("offload.infer: a KV cache of %s does not fit the device budget; it goes to the host",
                             format_bytes(kv))
        if plan is None:
            plan = self._plan_host_kv(layers, kv, shape, parts, disk, activations, keep)
        total = host_memory().total  # the cgroup's limit where smaller
        if plan.memory_bytes > total:
            raise BudgetError(f"the plan keeps {format_bytes(plan.memory_bytes)} in host memory, more than this machine's "
                              f"{format_bytes(total)}; lower max_in_cpu (max_memory['cpu'])")
        if not apply:
            return plan
        if plan.resident != self.plan.resident or plan.device.resident != self.plan.device.resident:
            log.info("offload.infer: re-placing for batch %d x %d tokens (KV cache %s on the %s)", batch, tokens,
                     format_bytes(kv), "host" if plan.kv.staged_nbytes else "device")
            self._apply(plan)
        self._fit_experts(plan)  # the KV cache's room on the device is the kept experts'
        self.plan = plan
        return plan

    def _plan_host_kv(self, layers: int, kv: int, shape: tuple[int, int], parts: int,
                      disk: tuple[float | None, str], activations: int, keep: KVPlacement | None = None) -> Plan:
        """The device plan with the KV cache on the host: two device buffers of one layer's cache (one
        micro-batch's, in the compute dtype) on the device, the cache placed by `place_kv` among the units
        the device does not keep (or as ``keep`` has it). Raises BudgetError naming the figures where even
        that does not fit."""
        setting = self.settings.kv_offload
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        decoded = self.kv_bytes(shape[0], shape[1], quantized=False)
        staged = -(-decoded // (layers * parts) // itemsize) * itemsize
        plan = self._make_plan(2 * staged, shape, disk=disk, activations=activations, kv_link_bytes=decoded)
        host_units = [u for u in self._sizes() if u.name not in plan.device.resident]
        budget = self._budget()  # less the pinned staging buffers (None or 0: no limit)
        budget = max(budget - 2 * staged, 1) if budget else budget
        placement = keep or dataclasses.replace(place_kv(
            host_units, budget=budget, layers=layers, layer_nbytes=kv // layers, device=setting.device,
            cpu_percent=setting.cpu_percent, buffer_count=setting.buffer_count, kv_shape=shape, micro_batches=parts),
            staged_nbytes=staged)
        plan = self._make_plan(2 * staged, shape, disk=disk, activations=activations, kv_link_bytes=decoded,
                               host_kv_bytes=placement.memory_bytes)
        return dataclasses.replace(plan, kv=placement)
