"""`init_inference`: a Hugging Face causal LM whose weights are read from its safetensors checkpoint
with O_DIRECT: what fits in the memory budget once, the rest streamed layer by layer every forward."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import time
from collections.abc import Iterator
from typing import Any, Mapping

import torch
from torch import nn

from offload.device import AUTO_MARGIN_SHARE, Device, auto_budget, host_memory
from offload.host_malloc import fix_mmap_threshold
from offload.infer.activations import (AUTO_ACTIVATION_TOKENS, AUTO_PROCESS_MARGIN_BYTES, activation_bytes, before_decode,
                                       head_dim, prefill_chunk)
from offload.infer.build import (CheckpointMismatchError, build_units, checkpoint_directory, compute_device_for,
                                  contiguous_head_input, decoder_blocks, device_budget, materialize_buffers,
                                  measure_disk, meta_skeleton)
from offload.infer.config import InferenceConfig
from offload.infer.device_reserve import DeviceReservation
from offload.infer.experts import ExpertStore, expert_plan, route_experts
from offload.infer.kv.cache import CACHE_KEYWORD, MicroBatchedLayer, NvmeKVLayer, OffloadedKVCache
from offload.infer.kv.device import KVStager, StagedKVLayer
from offload.infer.kv.quant import kv_cache_bytes
from offload.infer.plan.device import place_device
from offload.infer.plan.host import (BudgetError, KVPlacement, Plan, UnitSize, format_bytes, kv_in_memory,
                                     make_plan, place_kv, with_longest_fit)
from offload.infer.schedule import BlockSchedule, micro_batch_size
from offload.infer.stream.device_layout import copy_to_device
from offload.infer.stream.device_ring import DeviceRing
from offload.infer.stream.resident_load import ResidentLoad
from offload.infer.stream.streamer import LayerStreamer
from offload.infer.stream.unit import Unit
from offload.infer.weights.convert import checkpoint_in_dtype
from offload.infer.weights.qcache import quantized_cache
from offload.infer.weights.quant_experts import experts_targets, swap_experts
from offload.infer.weights.quantize import quantization_targets, swap_linears
from offload.storage.safetensors_reader import SafetensorsCheckpoint
from tensorio import AioHandle

__all__ = ["CheckpointMismatchError", "InferenceEngine", "init_inference"]

log = logging.getLogger("offload.infer")


def init_inference(model: str | os.PathLike | nn.Module, config: Mapping[str, Any] | str | os.PathLike | None = None,
                   **overrides: Any) -> "InferenceEngine":
    """Run a causal LM with its weights read from NVMe: resident where the budget allows, streamed otherwise.

    ``model``: a checkpoint directory (config.json and model.safetensors, or shards with
    model.safetensors.index.json), or a transformers model built on the meta device (then its
    checkpoint is ``checkpoint=DIR`` or the directory in ``model.config._name_or_path``).
    ``config``: a DeepSpeed-style dict or JSON path (``zero_optimization.offload_param`` with
    ``device``, ``max_in_cpu`` (elements, or bytes as "8GiB"), ``buffer_count``, ``buffer_size``,
    ``nvme_path``; ``stage3_prefetch_bucket_size``; ``aio``; ``dtype``; ``max_memory`` as
    Accelerate's, ``{0: "6GiB", "cpu": "16GiB"}``: the device's and the pinned host's budgets).
    ``overrides``: the same settings by their `InferenceConfig` field names, plus ``checkpoint``;
    ``compute_device`` may also be an `offload.device.Device` (a `SimulatedDevice` in tests, its
    ``budget_bytes`` the device tier's budget), which the caller closes.

    Raises ValueError naming the key for a bad setting (``compute_device`` asking for a device that
    is not there, ``max_memory[0]`` over the device's free memory or without a device); FileNotFoundError / SafetensorsError naming
    the file for a missing, truncated or invalid checkpoint file; CheckpointMismatchError naming the
    tensor for a missing or unexpected tensor or a shape mismatch; BudgetError with the figures when
    the budget, the buffers or the machine cannot hold the plan.
    """
    checkpoint = overrides.pop("checkpoint", None)
    compute = overrides.pop("compute_device") if isinstance(overrides.get("compute_device"), Device) else None
    return InferenceEngine(model, InferenceConfig.from_dict(config, **overrides), checkpoint=checkpoint, compute=compute)


class InferenceEngine(DeviceReservation):
    """A model ready to generate; see `init_inference`. ``module`` is the transformers model;
    ``plan`` says what is resident and what is streamed. Use as a context manager or call ``close``."""

    def __init__(self, model: str | os.PathLike | nn.Module, settings: InferenceConfig, *,
                 checkpoint: str | os.PathLike | None = None, compute: Device | None = None) -> None:
        self.settings = settings
        fix_mmap_threshold()  # activations freed go back to the system (offload/host_malloc.py)
        self.compute = compute or compute_device_for(settings)
        """Where the model computes (offload/device); ``device`` is its torch device."""
        self._owns_compute = compute is None
        try:
            self._device_budget = device_budget(self.compute, settings)
        except BaseException:
            if self._owns_compute:
                self.compute.close()
            raise
        """The device tier's (budget bytes, setting) where compute has memory of its own, else None."""
        self._copies = self.compute.new_stream("resident-copies")
        self._closed = False
        self._loads: list[ResidentLoad] = []
        self.experts: ExpertStore | None = None
        """A mixture-of-experts model's experts, read by the router's choice (offload/infer/experts/)."""
        self.kv_bytes_read = self.kv_bytes_written = 0
        """Bytes of KV cache read from and written to NVMe by `generate` calls so far."""
        self.kv_wait_seconds = 0.0
        """Seconds forwards waited for KV cache reads (the part not hidden behind compute)."""
        self._start = start = time.perf_counter()
        # 1. The reads' handle, and the checkpoint's headers (every file checked before any tensor is read).
        self.handle = AioHandle.from_config(settings.aio)
        try:
            directory = checkpoint_directory(model, checkpoint)
            self.checkpoint = SafetensorsCheckpoint(directory, self.handle)
            # 2. The model's skeleton on the meta device, in the compute dtype (the checkpoint's by default).
            self.dtype = settings.dtype or self.checkpoint.dominant_dtype() or torch.float32
            self.module = meta_skeleton(model, directory, self.dtype)
            contiguous_head_input(self.module)
            self.device = self.compute.torch_device
            # 3. One record per unit, its tensors matched to the checkpoint's (names, shapes).
            self.units = build_units(self.module, self.checkpoint)
            self._load_bytes = materialize_buffers(self.module, self.checkpoint, self.handle, self.device)
            self._unquantized_sizes: list[UnitSize] | None = None
            if settings.weight_quantization is not None:  # packed linear layers, read from the quantized cache
                self._quantize(directory)
            self._auto_budget = self._resolve_auto_budget()
            """(bytes, how they were found) of a ``max_in_cpu`` "auto", read once here; None for a number."""
            # 4. The placement; streamed tensors must be on the disk in the compute dtype. On a device whose ring
            # cannot take a whole layer of experts, the experts are split out first (each copied there alone).
            try:
                self.plan = self._make_plan(kv_bytes=0, kv_shape=(0, 0))
            except BudgetError:
                if not self.compute.separate_memory or settings.experts != "routed":
                    raise
                self.units, self.experts = route_experts(self.units, self.module, self.checkpoint, self.handle, None,
                                                         settings, compute=self.compute)
                if self.experts is None:
                    raise
                self.plan = self._make_plan(kv_bytes=0, kv_shape=(0, 0))
            if any(self._needs_conversion(u) for u in self._read_in_place()):
                self._use_converted_copy()
            if self.experts is None:
                self.units, self.experts = route_experts(self.units, self.module, self.checkpoint, self.handle,
                                                         self.plan, settings, compute=self.compute)
            if self.plan.streamed and settings.disk_gbps is None:
                self.plan = self._make_plan(0, (0, 0), disk=measure_disk(self.handle, self.checkpoint))
            elif self.experts is not None:
                self.plan = self._make_plan(0, (0, 0))
            # 5. Resident weights read once, in the background; the streamer's hooks on every unit not resident.
            self.streamer = LayerStreamer(self.handle, buffer_count=settings.buffer_count, experts=self.experts)
            self.schedule = BlockSchedule(self.module.get_submodule(decoder_blocks(self.module)))
            """Micro-batches through each decoder layer (`generate` runs them as the plan says)."""
            self._release_hook = self.module.register_forward_hook(lambda *_: self._release_loads())
            """Until the first forward is done (then None), loads hold their streamable units back."""
            self._apply(self.plan)
        except BaseException:
            if hasattr(self, "streamer"):
                self.streamer.close()  # the device ring's buffers too (and the experts')
            elif self.experts is not None:
                self.experts.close()
            for load in self._loads:
                load.close()
            self.compute.synchronize()
            for unit in getattr(self, "units", ()):
                self._drop_tiers(unit)  # a caller's device gets back what was taken from it
            self.handle.close()
            if self._owns_compute:
                self.compute.close()
            raise
        self.init_seconds = time.perf_counter() - start
        """Seconds `init_inference` took. The resident weights go on loading in the background (the
        first forward waits for each layer only when it gets there); `wait_loaded` waits for all."""

    # ---- the model's surface ---------------------------------------------------------------------

    def generate(self, inputs: torch.Tensor | None = None, **kwargs: Any) -> Any:
        """``module.generate(inputs, **kwargs)`` with streamed weights: greedy, sampling, attention
        masks, streamers all work as in transformers. The KV cache for the batch and the full length
        is reserved in the budget first (resident layers are demoted to streamed where needed).

        Raises BudgetError with the figures when the batch and length do not fit.
        """
        inputs, kwargs = self._on_device(inputs), {k: self._on_device(v) for k, v in kwargs.items()}
        ids = inputs if inputs is not None else kwargs.get("input_ids")
        batch, prompt = (ids.shape[0], ids.shape[-1]) if ids is not None else (1, 0)
        generation = kwargs.get("generation_config") or self.module.generation_config
        new = kwargs.get("max_new_tokens", generation.max_new_tokens)
        total = prompt + new if new is not None else kwargs.get("max_length", generation.max_length)
        beams = kwargs.get("num_beams", generation.num_beams) or 1
        returns = kwargs.get("num_return_sequences", generation.num_return_sequences) or 1
        chunk = kwargs.get("prefill_chunk_size", getattr(generation, "prefill_chunk_size", None)) or prefill_chunk(
            self.activation_bytes, prompt, self._activation_limit)
        kwargs.update({"prefill_chunk_size": chunk} if chunk else {})
        sequences = batch * max(beams, returns)
        plan = self.reserve(sequences, total, logits=1, chunk=chunk)  # the last position's logits
        cache = None
        placement = plan.kv
        decode = before_decode(self.module, prompt, lambda: self.reserve(sequences, total, logits=1, chunk=1,
                                                                         keep=placement))  # the cache stays
        if beams > 1 and (placement.nvme_layers or placement.micro_batches > 1):  # refused before the prefill's minutes
            raise (NvmeKVLayer if placement.nvme_layers else MicroBatchedLayer).beam_search_refusal()
        if beams > 1 and placement.staged_nbytes:
            raise StagedKVLayer.beam_search_refusal()
        if ((placement.nvme_layers or placement.micro_batches > 1 or placement.staged_nbytes
             or self.settings.kv_offload.quantization) and kwargs.get("cache", kwargs.get("past_key_values")) is None):
            cache = self.offloaded_cache(placement, total)
            kwargs[CACHE_KEYWORD] = cache  # "cache" is refused before transformers 5.24
        try:
            with self._running(), self.schedule.running(placement.micro_batches if cache is not None else 1):
                return self.module.generate(inputs, **kwargs)
        finally:
            if decode is not None:
                decode.remove()
            if cache is not None:
                self.kv_bytes_read += cache.ring.bytes_read
                self.kv_bytes_written += cache.ring.bytes_written
                self.kv_wait_seconds += cache.ring.wait_seconds
                cache.close()

    def offloaded_cache(self, placement: KVPlacement, max_tokens: int) -> OffloadedKVCache:
        """A transformers cache, ``placement``'s layers on NVMe, for up to ``max_tokens`` tokens, its files under
        ``kv_offload.nvme_path`` (else ``offload_param.nvme_path``, else the checkpoint's directory); the
        caller closes it (its files go then). `generate` makes one where the plan puts layers on NVMe."""
        self._check_open()
        setting = self.settings.kv_offload
        parent = setting.nvme_path or self.settings.nvme_path or self.checkpoint.directory
        stager = KVStager(self.compute, placement.staged_nbytes) if placement.staged_nbytes else None
        try:
            return OffloadedKVCache(placement.layers, placement.nvme_layers, self.handle, parent, max_tokens=max_tokens,
                                    buffer_count=setting.buffer_count, micro_batches=placement.micro_batches,
                                    quantization=setting.quantization, stager=stager)
        except BaseException:
            if stager is not None:
                stager.close()
            raise

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """``module(*args, **kwargs)`` with streamed weights, under ``torch.no_grad()``."""
        args, kwargs = tuple(self._on_device(a) for a in args), {k: self._on_device(v) for k, v in kwargs.items()}
        ids = args[0] if args else kwargs.get("input_ids")
        if ids is not None:
            cache = kwargs.get("past_key_values", kwargs.get("cache"))
            past = cache.get_seq_length() if hasattr(cache, "get_seq_length") else 0
            keep = kwargs.get("logits_to_keep")  # the logits of the last ones only: an int > 0
            self.reserve(ids.shape[0], past + ids.shape[-1], logits=keep if isinstance(keep, int) and keep else None)
        with self._running():
            return self.module(*args, **kwargs)

    def reserve(self, batch: int, tokens: int, *, logits: int | None = None, chunk: int | None = None,
                keep: KVPlacement | None = None) -> Plan:
        """Re-plan for a KV cache of ``batch`` sequences of ``tokens`` tokens: it counts against the
        budget, so resident layers become streamed where it needs their room (and come back when it
        shrinks again). Returns the plan. Raises BudgetError naming the figures when even the weights
        that must stay plus that cache exceed the budget, or the plan exceeds the machine's memory.
        ``logits``, ``chunk``: the positions whose logits, and the tokens, the largest forward keeps and takes;
        ``keep``: the placement of a KV cache a generate already runs with: its micro-batches and its place
        (device, host memory, NVMe) stay, only the activations' room changes (None: placed here). Where
        ``tokens`` do not fit, the error also gives the most that would at that batch."""
        self._check_open()
        try:
            return self._reserve(batch, tokens, logits, chunk, keep)
        except BudgetError as exc:
            if keep is not None:
                raise
            raise with_longest_fit(exc, lambda t: self._reserve(batch, t, logits, chunk, None, apply=False), batch,
                                   tokens) from None

    def _reserve(self, batch: int, tokens: int, logits: int | None, chunk: int | None, keep: KVPlacement | None,
                 *, apply: bool = True) -> Plan:
        """`reserve`'s plan; with ``apply`` False only found (nothing re-placed), or BudgetError raised."""
        setting, schedule = self.settings.kv_offload, self.settings.block_schedule
        step = tokens if chunk is None else min(chunk, tokens)
        micro = batch // keep.micro_batches if keep is not None else micro_batch_size(
            batch, lambda size: self.activation_bytes(size, step, logits=logits, context=tokens),
            self._activation_limit, schedule.micro_batch_size)
        layers = self._text_config().num_hidden_layers
        if self._device_budget is not None:
            return self._reserve_on_device(batch, tokens, micro, logits, step, keep, apply=apply)
        placement = keep or place_kv(self._sizes(), budget=self._budget(), layers=layers,
                             layer_nbytes=self.kv_bytes(batch, tokens) // layers, device=setting.device,
                             cpu_percent=setting.cpu_percent, buffer_count=setting.buffer_count,
                             kv_shape=(batch, tokens), micro_batches=batch // micro)
        kv = placement.memory_bytes
        plan = dataclasses.replace(self._make_plan(kv, (batch, tokens), disk=(self.plan.disk_bps, self.plan.disk_source),
                                                   kv_what=kv_in_memory(placement)), kv=placement)
        total = host_memory().total  # the cgroup's limit where smaller
        activations = self.activation_bytes(micro, step, logits=logits, context=tokens)
        need = plan.memory_bytes + activations
        if need > total:
            raise BudgetError(
                f"batch {batch} x {tokens} tokens needs {format_bytes(need)} of memory (resident weights "
                f"{format_bytes(plan.resident_bytes)} + buffers {format_bytes(plan.buffers_bytes)} + KV cache "
                f"{format_bytes(kv)} + activations {format_bytes(activations)}), more than this "
                f"machine's {format_bytes(total)}; lower max_in_cpu, the batch size or the number of tokens")
        if apply and plan.resident != self.plan.resident:
            log.info("offload.infer: re-placing for batch %d x %d tokens (KV cache %s)", batch, tokens, format_bytes(kv))
            self._apply(plan)
        if apply:
            self.plan = plan
        return plan

    # ---- figures ----------------------------------------------------------------------------------

    def wait_loaded(self) -> float:
        """Wait until every resident weight is in memory (and the ring's buffers are made); return the
        seconds the weights took from the start of `init_inference`. Forwards need not call it (each
        waits for, or streams, the layers it reaches); code that reads the weights outside a forward
        does. Raises the first read's error."""
        self._check_open()
        self._release_loads()
        if not all(load.done for load in self._loads):
            self.streamer.reset()  # gives back the layers it reads through the ring for their loads
        for load in self._loads:
            load.wait_all()
        self.streamer.wait_buffers()
        return max([load.finished_at for load in self._loads if load.finished_at] + [self._start]) - self._start

    def io_bytes(self) -> int:
        """Bytes read from the checkpoint so far: resident weights once (those loaded yet), plus every streamed read."""
        return (self._load_bytes + sum(load.nbytes for load in self._loads) + self.streamer.bytes_read
                + (self.experts.counts.bytes_read if self.experts is not None else 0))

    @property
    def read_wait_seconds(self) -> float:
        """Seconds forwards have waited for streamed reads (the I/O not hidden behind compute)."""
        return self.streamer.wait_seconds

    def kv_bytes(self, batch: int, tokens: int, *, quantized: bool = True) -> int:
        """Bytes of the KV cache of ``batch`` sequences of ``tokens`` tokens, quantized as ``kv_offload`` asks
        (``quantized`` False: in the compute dtype); see `offload.infer.kv.quant.kv_cache_bytes`."""
        codec = self.settings.kv_offload.quantization if quantized else None
        return kv_cache_bytes(self._text_config(), codec, self.dtype, batch, tokens)

    def activation_bytes(self, batch: int, tokens: int, *, logits: int | None = None, context: int | None = None) -> int:
        """One forward's activations over ``tokens`` tokens, an upper estimate (offload/infer/activations.py)."""
        attention = getattr(self.module.config, "_attn_implementation", None)
        return activation_bytes(self._text_config(), attention, self.dtype, batch, tokens, logits=logits, context=context)

    # ---- lifetime ---------------------------------------------------------------------------------

    def close(self) -> None:
        """Wait for reads in flight, free the buffers and the handle. The module is unusable afterwards."""
        if not self._closed:
            self._closed = True
            self.streamer.close()  # first: it gives back the units it has lent from a load
            for load in self._loads:
                load.close()
            self.compute.synchronize()  # nothing computes on the device buffers given back next
            for unit in self.units:
                self._drop_tiers(unit)
            self.handle.close()
            if self._owns_compute:
                self.compute.close()

    def __enter__(self) -> "InferenceEngine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- internals --------------------------------------------------------------------------------

    def _release_loads(self) -> None:
        """The first forward is done (or every weight is wanted now): the loads read what they hold back."""
        if self._release_hook is not None:
            self._release_hook.remove()
            self._release_hook = None
            for load in self._loads:
                load.release()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this inference engine is closed")

    @contextlib.contextmanager
    def _running(self) -> Iterator[None]:
        self._check_open()
        try:
            with torch.no_grad():
                yield
        except BaseException:
            self.streamer.reset()  # no read left in flight, no layer left bound: the next call starts clean
            raise

    def _text_config(self) -> Any:
        config = self.module.config
        return config.get_text_config() if hasattr(config, "get_text_config") else config

    def _budget(self) -> int | None:
        """``max_in_cpu`` in bytes ("auto": as `_resolve_auto_budget` found it); None with device "cpu" (no limit)."""
        if self.settings.device == "cpu":
            return None
        if self._auto_budget is not None:
            return self._auto_budget[0]
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return self.settings.budget_bytes(itemsize)

    def _resolve_auto_budget(self) -> tuple[int, str] | None:
        """``max_in_cpu`` "auto": the host memory available now (`offload.device.host_memory`: MemAvailable,
        or the cgroup's room) less the ring buffers at their largest (buffer_count x the largest streamable
        unit) and `offload.device.auto_budget`'s margin. Once, before anything is loaded. None for a number."""
        if self.settings.max_in_cpu != "auto" or self.settings.device == "cpu":
            return None
        self.compute.load_runtime(self.dtype)  # its host memory in use before the room is read
        largest = max((u.buffer_nbytes for u in self._sizes() if u.streamable), default=0)
        where = "pinned ring buffers" if self.compute.separate_memory else "ring buffers"
        tokens = min(AUTO_ACTIVATION_TOKENS, getattr(self._text_config(), "max_position_embeddings", None) or 1 << 30)
        activations, memory = self.activation_bytes(1, tokens, logits=1), host_memory()
        self._auto_activations = activations + int(AUTO_MARGIN_SHARE * memory.available)  # with the margin's share
        return auto_budget(memory, {f"{where} ({self.settings.buffer_count} x {format_bytes(largest)})":
                                    self.settings.buffer_count * largest, f"activations (1 x {tokens} tokens)": activations},
                           margin_bytes=AUTO_PROCESS_MARGIN_BYTES)

    @property
    def _activation_limit(self) -> int:
        """``block_schedule.max_activation_bytes``, and with "auto" at most the room it kept for activations (one
        2048-token sequence's, and the margin's share of the memory available: a larger batch is micro-batched,
        a longer prompt prefilled in chunks, only where the host is small)."""
        limit = self.settings.block_schedule.max_activation_bytes
        return min(limit, self._auto_activations) if self._auto_budget is not None else limit

    def _sizes(self) -> list[UnitSize]:
        return [UnitSize(u.name, u.nbytes, u.read_nbytes, u.buffer_nbytes, u.streamable, u.copy_nbytes) for u in self.units]

    def _make_plan(self, kv_bytes: int, kv_shape: tuple[int, int],
                   disk: tuple[float | None, str] | None = None, activations: int | None = None,
                   kv_link_bytes: int = 0, host_kv_bytes: int = 0, kv_what: str = "") -> Plan:
        """The placement; where compute has memory of its own, first what the device keeps (the KV cache,
        or with ``kv_link_bytes`` its buffers, and ``activations`` with it: default one token's), then the
        rest between host memory and NVMe (beside ``host_kv_bytes`` of cache there). With quantized
        weights, also the bytes per link of the same budgets' placement of the unquantized weights.
        ``kv_what`` names the ``kv_bytes`` in the errors when they are not the whole cache (`make_plan`)."""
        args = (kv_bytes, kv_shape, disk, activations, kv_link_bytes, host_kv_bytes, kv_what)
        plan = self._placement(self._sizes(), *args)
        if self.experts is not None:  # what the budgets leave after resident weights and the KV cache
            room = None if plan.budget < 0 else plan.budget - plan.resident_bytes - plan.kv_bytes
            device = None if plan.device is None else plan.device.budget - plan.device.used_bytes
            plan = dataclasses.replace(plan, experts=expert_plan(self.experts, room=room, batch=kv_shape[0],
                                                                 device_room=device))
        kv_quant = self.settings.kv_offload.quantization
        if kv_quant is not None:
            group = kv_quant.group_size or min(64, head_dim(self._text_config()))  # as KVCodec takes it
            plan = dataclasses.replace(plan, kv_quantization=f"int{kv_quant.num_bits} (group {group}, "
                                                             f"{'symmetric' if kv_quant.symmetric else 'asymmetric'})")
        if self._unquantized_sizes is None:
            return plan
        try:
            before = self._placement(self._unquantized_sizes, *args)
        except BudgetError:  # the budgets hold the model only quantized: nothing to compare with
            before = None
        return dataclasses.replace(
            plan, quantization=self.settings.weight_quantization.name,
            unquantized_read_bytes=before.read_bytes_per_forward if before else None,
            unquantized_host_to_device_bytes=before.host_to_device_bytes_per_forward if before and plan.device else None)

    def _placement(self, sizes: list[UnitSize], kv_bytes: int, kv_shape: tuple[int, int],
                   disk: tuple[float | None, str] | None, activations: int | None, kv_link_bytes: int,
                   host_kv_bytes: int, kv_what: str = "") -> Plan:
        """`_make_plan` for units of ``sizes``."""
        if self._device_budget is not None:
            budget, setting = self._device_budget
            speed, experts = self.settings.host_to_device_gbps, self.experts.device if self.experts else None
            tier = place_device(sizes, budget=budget, setting=setting, ring_slots=self.settings.buffer_count,
                                kv_bytes=kv_bytes, kv_shape=kv_shape,
                                activation_bytes=self.activation_bytes(1, 1) if activations is None else activations,
                                host_to_device_bps=speed * 1e9 if speed else None, kv_link_bytes=kv_link_bytes,
                                expert_slot_bytes=experts.ring_bytes if experts is not None else 0)
            host = self._host_plan([u for u in sizes if u.name not in tier.resident], host_kv_bytes, kv_shape, disk)
            return dataclasses.replace(host, units=tuple(sizes), resident=host.resident | tier.resident, device=tier)
        return self._host_plan(sizes, kv_bytes, kv_shape, disk, kv_what)

    def _host_plan(self, sizes: list[UnitSize], kv_bytes: int, kv_shape: tuple[int, int],
                   disk: tuple[float | None, str] | None, kv_what: str = "") -> Plan:
        settings = self.settings
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        buffer_nbytes = None if settings.buffer_size is None else settings.buffer_size * itemsize
        if disk is None:
            disk = (settings.disk_gbps * 1e9, "given") if settings.disk_gbps else (None, "")
        return make_plan(sizes, budget=self._budget(), buffer_count=settings.buffer_count, buffer_nbytes=buffer_nbytes,
                         kv_bytes=kv_bytes, kv_shape=kv_shape, disk_bps=disk[0], disk_source=disk[1],
                         budget_source=self._auto_budget[1] if self._auto_budget else "", kv_what=kv_what)

    def _lookahead_units(self, plan: Plan) -> int | None:
        """Reads in flight that ``stage3_prefetch_bucket_size`` allows (at least one), None for no limit."""
        bucket = self.settings.prefetch_bucket_size
        if bucket is None or not plan.buffer_nbytes:
            return None
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return max(1, bucket * itemsize // plan.buffer_nbytes)

    def _quantize(self, directory: str) -> None:
        """Swap the decoder layers' linear layers for packed ones (`QuantLinear`, the device's kernels) and read
        every weight from the quantized cache (written once under ``nvme_path``, else in the checkpoint's
        directory). Raises ValueError naming ``weight_quantization`` where the device cannot run it."""
        spec, kernels = self.settings.weight_quantization, self.compute.packed_kernels
        targets = quantization_targets(self.module, decoder_blocks(self.module), spec, kernels, self.dtype, self.compute.name)
        experts = experts_targets(self.module, decoder_blocks(self.module), spec)  # quantized expert by expert
        self._unquantized_sizes = self._sizes()
        settings = self.settings  # before the cache is written (minutes): the units that must stay in memory fit
        if settings.device != "cpu" and settings.max_in_cpu != "auto" and self._device_budget is None:
            budget = settings.budget_bytes(torch.empty((), dtype=self.dtype).element_size())  # 0: all streams
            if budget:  # quantizing does not shrink what must stay (it packs the decoder layers' linears)
                make_plan([u for u in self._sizes() if not u.streamable], budget=budget, buffer_count=settings.buffer_count)
        cache = quantized_cache(self.checkpoint, self.units, {**targets, **experts}, spec, self.dtype,
                                self.settings.nvme_path or directory, self.handle, kernels=kernels)
        swap_linears(self.module, list(targets), spec, self.dtype, kernels)
        swap_experts(self.module, list(experts), spec, self.dtype, kernels)
        self.checkpoint = SafetensorsCheckpoint(cache, self.handle)
        self.units = build_units(self.module, self.checkpoint)

    def _needs_conversion(self, unit: Unit) -> bool:
        """A tensor stored in another dtype than it computes in (a router kept in fp32 is converted as bound)."""
        return any(self.checkpoint[name].dtype != ref.placeholder.dtype for ref in unit.params
                   if ref.placeholder.dtype == self.dtype for name in ref.tensors)

    def _use_converted_copy(self) -> None:
        """Streamed tensors in another dtype than they compute in: read them from a converted copy."""
        names = [u.name for u in self._read_in_place() if self._needs_conversion(u)]
        self.checkpoint = checkpoint_in_dtype(self.checkpoint, self.dtype, self.settings.nvme_path, self.handle,
                                              units=names, to_device=self.compute.separate_memory)
        for unit in self.units:
            unit.windows = self.checkpoint.windows([name for ref in unit.params for name in ref.tensors])
        self.plan = self._make_plan(0, (0, 0))

    def _apply(self, plan: Plan) -> None:
        """Make the model match ``plan``: drop demoted units, start reading promoted ones (in the
        background), re-aim the streamer (its ring is made in the background too)."""
        self.streamer.reset()
        self.compute.synchronize()  # nothing computes on a device buffer given back below
        with contextlib.ExitStack() as paused:  # the loads' threads place units by the plan: none while it changes
            for load in self._loads:
                paused.enter_context(load.paused())
            self._placing = plan.device  # the device tier the loads place their units by (`_place`)
            on_device = plan.device.resident if plan.device is not None else frozenset()
            for unit in self.units:  # 1. demote first, so that memory is freed before more is taken
                placed = "device" if unit.device_buffer is not None else "host" if unit.host_buffer is not None else None
                wanted = "device" if unit.name in on_device else "host" if unit.name in plan.resident else None
                if unit.loading is not None and (unit.name not in plan.resident or placed not in (None, wanted)):
                    unit.loading.drop(unit)  # not wanted, or placed by the last plan where this one does not keep it
                    self._drop_tiers(unit)
                elif (unit.name not in plan.resident and unit.state in ("resident", "host")
                      or unit.state == "host" and unit.name in on_device
                      or unit.device_buffer is not None and unit.name not in on_device):  # to another tier: read again
                    unit.unbind()
                    self._drop_tiers(unit)
                    unit.state = "on disk"
        # 2. Then start reading what becomes resident. With a ring, the forwards read the layers the load
        # has not taken on yet through it, from the first, while the load takes them on from the last.
        promoted = [u for u in self.units if u.state not in ("resident", "loading", "host") and u.name in plan.resident]
        streamed = [u for u in self.units if u.name not in plan.resident]
        if streamed:
            promoted = [u for u in promoted if not u.streamable] + [u for u in reversed(promoted) if u.streamable]
        if promoted:  # before the first forward is done, with a ring, it holds reads back (`ResidentLoad`)
            self._loads.append(ResidentLoad(self.handle, promoted, place=self._place if plan.device else None,
                                            held=bool(streamed) and self._release_hook is not None))
        ring = self.streamer.stager  # the device's ring, where it has memory of its own
        slots, slot_nbytes = (plan.device.ring_slots, plan.device.slot_nbytes) if plan.device else (0, 0)
        if ring is not None and (len(ring.buffers), ring.buffer_nbytes) != (slots, slot_nbytes):
            ring.close()
            self.streamer.stager = ring = None
        if slots and ring is None:
            self.streamer.stager = DeviceRing(self.compute, slots, slot_nbytes)
        self.streamer.set_units([u for u in self.units if u.streamable], plan.buffer_nbytes if streamed else 0,
                                self._lookahead_units(plan))
        self._fit_experts(plan)
        # 3. transformers takes the model's device and dtype from its first parameter: bind it now.
        first = next(self.module.parameters(), None)
        for unit in self.units:
            if unit.loading is not None and any(ref.placeholder is first for ref in unit.params):
                unit.loading.wait(unit)

    def _fit_experts(self, plan: Plan) -> None:
        """The experts kept by use within what ``plan`` leaves them (host memory, and the device's)."""
        if self.experts is not None:
            self.experts.set_capacity(plan.experts.cache_bytes, plan.experts.device_cache_bytes)

    def _place(self, unit: Unit, host: torch.Tensor) -> torch.Tensor | None:
        """A unit read into pinned ``host`` memory (`ResidentLoad`): copied to a device buffer of its own,
        returned, where the plan keeps it on the device; else kept there (None). On the load's thread."""
        if unit.name not in self._placing.resident:
            unit.host_buffer = host
            return None
        layout = unit.device_layout  # each tensor aligned (offload/infer/stream/device_layout.py)
        buffer = self.compute.empty(layout.nbytes, torch.uint8, name=unit.name)
        copied = copy_to_device(self.compute, buffer, host, layout.copies, self._copies)
        self.compute.compute_stream.wait_event(copied)
        copied.synchronize()  # the host buffer goes on return
        self.compute.check_ready(buffer)
        unit.device_buffer = buffer
        return buffer

    def _drop_tiers(self, unit: Unit) -> None:
        """Give back what ``unit`` holds in device or pinned host memory (the device synchronized)."""
        if unit.device_buffer is not None:
            self.compute.free(unit.device_buffer)
        unit.device_buffer = unit.host_buffer = None

    def _read_in_place(self) -> list[Unit]:
        """The units whose bytes are used as read (no conversion): the streamed ones, and on a device all."""
        return [u for u in self.units if u.name not in self.plan.resident or self.compute.separate_memory]

    def _on_device(self, value: Any) -> Any:  # a tensor argument moved to where compute runs
        return value.to(self.device) if isinstance(value, torch.Tensor) else value
