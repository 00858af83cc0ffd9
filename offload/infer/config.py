"""`InferenceConfig`: the settings of `init_inference`, read from a DeepSpeed-style config and checked here.

A config is the JSON DeepSpeed's ZeRO-Inference takes (a dict or a file path)::

    {"bf16": {"enabled": true},
     "zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": 1e8,
                           "offload_param": {"device": "nvme", "max_in_cpu": "8GiB", "buffer_count": 2}},
     "aio": {"block_size": 1048576, "queue_depth": 16}}

and keyword overrides use the flat field names (``max_in_cpu="8GiB"``, ``buffer_count=3``, ...).
Unknown keys are refused naming the key; keys DeepSpeed has that change nothing here are listed in
`IGNORED_KEYS` and accepted.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field, fields
from typing import Any, Mapping

import torch

from offload.config.parse import did_you_mean
from offload.device import DEVICE_CHOICES
from tensorio import AioConfig, parse_size

__all__ = ["IGNORED_KEYS", "BlockScheduleConfig", "InferenceConfig", "KVOffload", "KVQuantization", "MaxMemory",
           "WeightQuantization", "parse_dtype"]

#: DeepSpeed keys accepted and without effect in inference (training-only or about the GPU).
IGNORED_KEYS = {
    "": {"train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "steps_per_print",
         "wall_clock_breakdown", "zero_allow_untested_optimizer"},
    "zero_optimization": {"stage", "stage3_param_persistence_threshold", "stage3_max_live_parameters",
                          "stage3_max_reuse_distance", "overlap_comm", "contiguous_gradients", "reduce_bucket_size"},
    "zero_optimization.offload_param": {"pin_memory"},
}

_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
}


def _bytes(key: str, text: str) -> int:
    """`tensorio.parse_size` of ``text``; its ValueError names ``key`` and says elements are a number."""
    try:
        return parse_size(text)
    except ValueError as exc:
        raise ValueError(f"{key}: {exc}; or elements of the model's dtype as a number, or \"auto\"") from None


def parse_dtype(key: str, value: Any) -> torch.dtype | None:
    """A torch floating dtype from "bf16", "bfloat16", "fp32", "float32", "fp16", a torch.dtype, or
    None / "auto" (the checkpoint's). Raises ValueError naming ``key``."""
    if value is None or value == "auto":
        return None
    if isinstance(value, torch.dtype) and value in _DTYPES.values():
        return value
    if isinstance(value, str) and value.lower().removeprefix("torch.") in _DTYPES:
        return _DTYPES[value.lower().removeprefix("torch.")]
    raise ValueError(f"{key}: {value!r} is not allowed; use \"auto\" (the checkpoint's), \"bfloat16\", "
                     f"\"float32\" or \"float16\"")


def _int(key: str, value: Any, minimum: int) -> int:
    if isinstance(value, float) and value.is_integer():
        value = int(value)  # JSON configs write 1e8
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{key}: {value!r} is not allowed; use an integer >= {minimum}")
    return value


@dataclass(frozen=True, slots=True)
class WeightQuantization:
    """``weight_quantization``: the decoder layers' linear weights stored and streamed as 8- or 4-bit
    integers (docs/inference.md, "Quantized weights"). DeepSpeed's keys, read from
    ``weight_quantization.quantized_initialization`` (or directly under ``weight_quantization``)."""

    num_bits: int = 4
    """8: one scale per output channel (``torch._weight_int8pack_mm``'s layout); 4: one scale (and
    zero) per ``group_size`` inputs of each output channel (``torch._weight_int4pack_mm_for_cpu``'s)."""

    group_size: int | None = None
    """4 bits: inputs per group, a power of two from 32 to 256 (None: 64, ZeRO-Inference's). 8 bits:
    must be left out (the int8 kernel takes one scale per output channel)."""

    symmetric: bool | None = None
    """Symmetric (scale only) or asymmetric (scale and zero point) ranges; None: symmetric for 8
    bits, asymmetric for 4 (ZeRO-Inference's)."""

    def __post_init__(self) -> None:
        key = "weight_quantization"
        if self.num_bits not in (4, 8) or isinstance(self.num_bits, bool):
            raise ValueError(f"{key}.num_bits: {self.num_bits!r} is not allowed; use 8 or 4")
        if self.num_bits == 8 and self.group_size is not None:
            raise ValueError(f"{key}.group_size: {self.group_size!r} is not allowed with num_bits 8: int8 weights get "
                             f"one scale per output channel (the layout torch._weight_int8pack_mm takes); leave "
                             f"group_size out")
        if self.num_bits == 4:
            group = 64 if self.group_size is None else _int(f"{key}.group_size", self.group_size, 32)
            if group not in (32, 64, 128, 256):
                raise ValueError(f"{key}.group_size: {group!r} is not allowed; use 32, 64, 128 or 256")
            object.__setattr__(self, "group_size", group)
        if self.symmetric is None:
            object.__setattr__(self, "symmetric", self.num_bits == 8)
        if not isinstance(self.symmetric, bool):
            raise ValueError(f"{key}.symmetric: expected true or false, got {self.symmetric!r}")

    @property
    def name(self) -> str:
        """ "int8 (per channel, symmetric)", "int4 (group 64, asymmetric)"."""
        layout = "per channel" if self.group_size is None else f"group {self.group_size}"
        return f"int{self.num_bits} ({layout}, {'symmetric' if self.symmetric else 'asymmetric'})"

    @classmethod
    def parse(cls, value: Any) -> "WeightQuantization | None":
        """From "int8" / "int4" (the command's ``--quantize``), "none" / None (no quantization), a
        DeepSpeed-style mapping, or a `WeightQuantization`. Raises ValueError naming the key."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, str):
            bits = _bits_named(value, "weight_quantization")
            return None if bits is None else cls(num_bits=bits)
        section = _section(value, "weight_quantization", {"quantized_initialization", "num_bits", "group_size",
                                                          "group_dim", "symmetric", "enabled"})
        if "quantized_initialization" in section:
            if len(section) > 1:
                raise ValueError("weight_quantization: give num_bits, group_size and symmetric either inside "
                                 "quantized_initialization (DeepSpeed's form) or directly, not both")
            section = _section(section["quantized_initialization"], "weight_quantization.quantized_initialization",
                               {"num_bits", "group_size", "group_dim", "symmetric"})
        if section.pop("enabled", True) is False:
            return None
        if section.pop("group_dim", 1) != 1:
            raise ValueError("weight_quantization.group_dim: only 1 (groups along the input dimension, DeepSpeed's "
                             "default) is supported")
        if "num_bits" not in section:
            raise ValueError("weight_quantization.num_bits: missing; use 8 or 4")
        return cls(**section)


@dataclass(frozen=True, slots=True)
class KVOffload:
    """``kv_offload``: where the KV cache lives (docs/inference.md, "KV cache offload"). FlexGen's
    placement by percentage: ``cpu_percent`` of the decoder layers keep their cache in memory, the
    others on NVMe, read ahead layer by layer and written behind."""

    device: str = "auto"
    """"auto": in memory while it fits the budget (beside the weights that must stay), the layers
    beyond it on NVMe; "cpu": all in memory (counted against the budget, as transformers'
    DynamicCache); "nvme": ``cpu_percent`` of the layers in memory, the rest on NVMe."""

    cpu_percent: float | None = None
    """With device "nvme": the share of layers (0 to 100) whose cache stays in memory; None: 0."""

    nvme_path: str | None = None
    """Directory for the cache's files (removed after each generate call); None:
    ``offload_param.nvme_path``, else the checkpoint's directory."""

    buffer_count: int = 2
    """Locked buffers in the cache's read-ahead ring, each one layer's cache at the full length. >= 1;
    two read the next layer's cache while one computes."""

    quantization: "KVQuantization | None" = None
    """Keys and values stored as 8- or 4-bit integers, in memory and on NVMe alike (FlexGen's
    ``compress_cache``); also "int8" / "int4" or a mapping (`KVQuantization.parse`). None: the compute dtype."""

    def __post_init__(self) -> None:
        key = "kv_offload"
        object.__setattr__(self, "quantization", KVQuantization.parse(self.quantization))
        if self.device not in ("auto", "cpu", "nvme"):
            raise ValueError(f"{key}.device: {self.device!r} is not allowed; use \"auto\", \"cpu\" or \"nvme\"")
        if self.cpu_percent is not None:
            if self.device != "nvme":
                raise ValueError(f"{key}.cpu_percent: only with device \"nvme\" (device {self.device!r} places the "
                                 f"cache itself); set device \"nvme\" or leave cpu_percent out")
            if (isinstance(self.cpu_percent, bool) or not isinstance(self.cpu_percent, (int, float))
                    or not 0 <= self.cpu_percent <= 100):
                raise ValueError(f"{key}.cpu_percent: {self.cpu_percent!r} is not allowed; use a number from 0 to 100")
        if self.nvme_path is not None and not (isinstance(self.nvme_path, (str, os.PathLike)) and str(self.nvme_path)):
            raise ValueError(f"{key}.nvme_path: expected a directory path, got {self.nvme_path!r}")
        object.__setattr__(self, "buffer_count", _int(f"{key}.buffer_count", self.buffer_count, 1))

    @classmethod
    def parse(cls, value: Any) -> "KVOffload":
        """From "auto" / "cpu" / "nvme" (the command's ``--kv-offload``), None (the default), a
        mapping of the fields, or a `KVOffload`. Raises ValueError naming the key."""
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            return cls(device=value)
        section = _section(value, "kv_offload", {"device", "cpu_percent", "nvme_path", "buffer_count", "quantization"})
        return cls(**section)


@dataclass(frozen=True, slots=True)
class KVQuantization:
    """``kv_offload.quantization``: the KV cache's keys and values quantized when stored and
    dequantized when read (docs/inference.md, "KV cache offload"), in groups of ``group_size`` along
    the head dimension, each token and head apart: FlexGen's cache compression (4 bits, group 64
    along the head dimension, asymmetric), with its keys ``num_bits``, ``group_size``, ``symmetric``."""

    num_bits: int = 4
    """8 or 4 bits per value."""

    group_size: int | None = None
    """Values per group (one scale, and one minimum when asymmetric, in fp32): a power of two from 16
    up, dividing the model's head dimension (checked when the cache is planned). None: 64 (FlexGen's),
    or the head dimension where that is smaller."""

    symmetric: bool = False
    """Symmetric ranges (a scale per group) or asymmetric (scale and minimum: FlexGen's default)."""

    def __post_init__(self) -> None:
        key = "kv_offload.quantization"
        if self.num_bits not in (4, 8) or isinstance(self.num_bits, bool):
            raise ValueError(f"{key}.num_bits: {self.num_bits!r} is not allowed; use 8 or 4")
        if self.group_size is not None:
            group = _int(f"{key}.group_size", self.group_size, 16)
            if group & (group - 1):
                raise ValueError(f"{key}.group_size: {group!r} is not allowed; use a power of two from 16 up (64: "
                                 f"FlexGen's)")
            object.__setattr__(self, "group_size", group)
        if not isinstance(self.symmetric, bool):
            raise ValueError(f"{key}.symmetric: expected true or false, got {self.symmetric!r}")

    @property
    def name(self) -> str:
        """ "int4 (group 64, asymmetric)"."""
        return f"int{self.num_bits} (group {self.group_size or 64}, {'symmetric' if self.symmetric else 'asymmetric'})"

    @classmethod
    def parse(cls, value: Any) -> "KVQuantization | None":
        """From "int8" / "int4" (the command's ``--kv-quantize``), "none" / None (not quantized), a
        mapping of the fields, or a `KVQuantization`. Raises ValueError naming the key."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, str):
            bits = _bits_named(value, "kv_offload.quantization")
            return None if bits is None else cls(num_bits=bits)
        section = _section(value, "kv_offload.quantization", {"num_bits", "group_size", "symmetric", "enabled"})
        if section.pop("enabled", True) is False:
            return None
        if "num_bits" not in section:
            raise ValueError("kv_offload.quantization.num_bits: missing; use 8 or 4")
        return cls(**section)


@dataclass(frozen=True, slots=True)
class BlockScheduleConfig:
    """``block_schedule``: a batch run through each decoder layer as several micro-batches that share
    the layer's read (docs/inference.md, "Block schedule")."""

    micro_batch_size: int | None = None
    """Sequences per micro-batch (lowered to a divisor of the batch); None ("auto"): the largest whose
    activations fit ``max_activation_bytes``."""

    max_activation_bytes: int = 1 << 30
    """With "auto": the most one micro-batch's activations may take (bytes, or a size string as
    "1GiB"); a stated buffer beside the budget."""

    def __post_init__(self) -> None:
        key = "block_schedule"
        if self.micro_batch_size == "auto":
            object.__setattr__(self, "micro_batch_size", None)
        if self.micro_batch_size is not None:
            object.__setattr__(self, "micro_batch_size", _int(f"{key}.micro_batch_size", self.micro_batch_size, 1))
        value = self.max_activation_bytes
        if isinstance(value, str):
            try:
                value = parse_size(value)
            except ValueError as exc:
                raise ValueError(f"{key}.max_activation_bytes: {exc}") from None
        object.__setattr__(self, "max_activation_bytes", _int(f"{key}.max_activation_bytes", value, 1))

    @classmethod
    def parse(cls, value: Any) -> "BlockScheduleConfig":
        """From None (the default), a mapping of the fields, or a `BlockScheduleConfig`. Raises
        ValueError naming the key."""
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        return cls(**_section(value, "block_schedule", {"micro_batch_size", "max_activation_bytes"}))


@dataclass(frozen=True, slots=True)
class MaxMemory:
    """``max_memory``: the budgets of the memory tiers, keyed as Accelerate's ``from_pretrained(max_memory=)``:
    ``{0: "6GiB", "cpu": "16GiB"}`` (in JSON ``{"0": "6GiB", "cpu": "16GiB"}``). A device index (one
    device per engine) is the compute device's budget: weights kept there, its copy ring, the KV cache
    and activations; "cpu" is the pinned host tier (the same budget as ``offload_param.max_in_cpu``,
    give one of the two). The NVMe tier is the checkpoint itself and has no budget here. Sizes are
    bytes or strings ("6GiB" binary, "6GB" decimal, as Accelerate reads them), or "auto": for "cpu" the
    host memory available when the engine starts less a margin (``max_in_cpu`` "auto"), for the device
    90% of its free memory (as without the key)."""

    device_index: int | None = None
    """The device the budget is for (its key), None without one."""
    device_bytes: int | str | None = None
    """The device tier's budget in bytes, or "auto" (90% of the device's free memory); None: no device key
    (compute on the CPU: the host is the device)."""
    host_bytes: int | str | None = None
    """The host tier's budget in bytes ("cpu"), or "auto"; None: ``offload_param.max_in_cpu`` says it."""

    @property
    def device_key(self) -> str:
        """How errors name the device budget: ``max_memory[0]``."""
        return f"max_memory[{self.device_index}]"

    @classmethod
    def parse(cls, value: Any) -> "MaxMemory | None":
        """From a mapping (device index as an int or a string of digits, or "cpu", to a size), None, or a
        `MaxMemory`. Raises ValueError naming the key for an unknown key, a second device or a bad size."""
        if value is None or isinstance(value, cls):
            return value
        if not isinstance(value, Mapping):
            raise ValueError(f"max_memory: expected a mapping such as {{0: \"6GiB\", \"cpu\": \"16GiB\"}}, got {value!r}")
        found: dict[str, Any] = {}
        for key, size in value.items():
            index = key if isinstance(key, int) and not isinstance(key, bool) else (
                int(key) if isinstance(key, str) and key.isdigit() else None)
            if key == "cpu":
                found["host_bytes"] = "auto" if size == "auto" else _size(f"max_memory[{key!r}]", size)
            elif index is not None and index >= 0:
                if "device_index" in found:
                    raise ValueError(f"max_memory[{key!r}]: a second device (max_memory[{found['device_index']}] is "
                                     f"given); one engine computes on one device, so give one device index")
                found.update(device_index=index,
                             device_bytes="auto" if size == "auto" else _size(f"max_memory[{index}]", size))
                if found["device_bytes"] == 0:
                    raise ValueError(f"max_memory[{index}]: 0 bytes leaves no room to compute; give the device's budget")
            else:
                raise ValueError(f"max_memory[{key!r}]: unknown key; use a device index (0) for the device's budget and "
                                 f"\"cpu\" for the host's (the NVMe tier is the checkpoint and has no budget here)")
        return cls(**found)


def _size(key: str, value: Any) -> int:
    """Bytes of ``value`` (an int or a size string); ValueError naming ``key``."""
    try:
        return parse_size(value)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"{key}: {exc}; or \"auto\"") from None


@dataclass(kw_only=True, slots=True)
class InferenceConfig:
    """Every setting of `init_inference`, checked; named as DeepSpeed names them where it has them."""

    device: str = "nvme"
    """``offload_param.device``: "nvme" streams from the checkpoint the weights that do not fit in
    ``max_in_cpu``; "cpu" keeps every weight in memory (still read with O_DIRECT, no streaming)."""

    max_in_cpu: int | str | None = None
    """``offload_param.max_in_cpu``: the memory budget for weights kept resident and the KV cache,
    as elements of the model's dtype (DeepSpeed's unit) or as bytes in a string
    (`tensorio.parse_size`: "8GiB", "8G", "8 GiB" binary, "20GB" decimal), or "auto": the host memory
    available when the engine starts (MemAvailable, or the cgroup's limit less its usage where smaller)
    less the ring buffers and a margin (`offload.device.auto_budget`; the plan prints the figures);
    None: ``max_memory["cpu"]``, else 1e9 elements (DeepSpeed's default)."""

    buffer_count: int = 2
    """``offload_param.buffer_count``: locked buffers in the prefetch ring, each one streamed layer. >= 1.
    Two keep the disk busy whether the disk or the compute is the slower (one layer computes while
    the next is read, and the freed buffer takes the read after that at once); a third only reads
    further ahead and costs a layer's memory more, faulted in beside the first forward."""

    buffer_size: int | None = None
    """``offload_param.buffer_size``: elements per buffer; None sizes them to the largest streamed
    layer (a value given must hold it)."""

    nvme_path: str | None = None
    """``offload_param.nvme_path``: where a converted copy of the checkpoint is written, once, when
    ``dtype`` differs from the checkpoint's and weights are streamed. Needed only then."""

    prefetch_bucket_size: int | None = None
    """``zero_optimization.stage3_prefetch_bucket_size``: elements read ahead of the layer computing
    (at least one layer); None: as many layers as the ring has buffers."""

    dtype: torch.dtype | None = None
    """``dtype`` (or ``bf16.enabled`` / ``fp16.enabled``): compute dtype; None is the checkpoint's."""

    aio: AioConfig = field(default_factory=lambda: AioConfig(block_size=8 << 20, queue_depth=8))
    """``aio``: the tensorio settings of the reads. Without an ``aio`` section: 8 MiB pieces, 8 in
    flight (whole layers are streamed; fewer, larger pieces cost the I/O thread less CPU). A section
    given fills its missing keys with DeepSpeed's defaults (1 MiB, 8)."""

    disk_gbps: float | None = None
    """The disk's read speed for the plan's figures, in GB/s; None measures a short O_DIRECT read of
    the checkpoint itself (only when something is streamed). Not a DeepSpeed key."""

    host_to_device_gbps: float | None = None
    """The host-to-device link's speed for the plan's figures (pinned copies), in GB/s; None: unknown
    (`python -m benchmarks.gpu` measures it). Only with a device tier. Not a DeepSpeed key."""

    compute_device: str = "auto"
    """Where the model computes: one of `offload.device.DEVICE_CHOICES` ("auto": a GPU where one is
    available, else the CPU; "simulated": the simulated GPU of the tests). Not a DeepSpeed key."""

    max_memory: MaxMemory | None = None
    """``max_memory``: the tiers' budgets as Accelerate names them, ``{0: "6GiB", "cpu": "16GiB"}``
    (`MaxMemory`); a device key needs compute on a device with memory of its own. Not a DeepSpeed key."""

    weight_quantization: WeightQuantization | None = None
    """``weight_quantization``: the decoder layers' linear weights as int8 or int4, quantized once
    into a cache under ``nvme_path`` (the checkpoint's directory without it) and streamed from there;
    None keeps them in the compute dtype. Also "int8" / "int4" (`WeightQuantization.parse`)."""

    kv_offload: KVOffload = field(default_factory=KVOffload)
    """``kv_offload``: where the KV cache lives; also "auto" / "cpu" / "nvme" or a mapping
    (`KVOffload.parse`). Not a DeepSpeed key (FlexGen's placement)."""

    block_schedule: BlockScheduleConfig = field(default_factory=BlockScheduleConfig)
    """``block_schedule``: micro-batches sharing each layer's read; a mapping or a
    `BlockScheduleConfig`. Not a DeepSpeed key (FlexGen's)."""

    experts: str = "routed"
    """``experts``: how a mixture-of-experts model's experts are read where its layers are streamed:
    "routed" reads each expert on its own, only those the router picks for some token of the batch (the
    most used kept in memory, the next layer's guessed and read ahead: offload/infer/experts/); "whole"
    streams them with their layer, every expert every forward (as Accelerate and ZeRO-Inference do). On a
    device with memory of its own "routed" keeps the most used experts there too, the others copied there
    when picked (offload/infer/experts/device.py). Not a DeepSpeed key."""

    def __post_init__(self) -> None:
        key = "zero_optimization.offload_param"
        if self.experts not in ("routed", "whole"):
            raise ValueError(f"experts: {self.experts!r} is not allowed; use \"routed\" (only the experts the router "
                             f"picks are read) or \"whole\" (every expert streamed with its layer)")
        if self.device not in ("nvme", "cpu"):
            raise ValueError(f"{key}.device: {self.device!r} is not allowed; use \"nvme\" or \"cpu\"")
        self.max_memory = MaxMemory.parse(self.max_memory)
        if self.max_memory is not None and self.max_memory.host_bytes is not None:
            if self.max_in_cpu is not None:
                raise ValueError(f"{key}.max_in_cpu, max_memory['cpu']: both set the host's budget; give one")
            host = self.max_memory.host_bytes
            self.max_in_cpu = host if host == "auto" else f"{host}B"
        if isinstance(self.max_in_cpu, str):
            if self.max_in_cpu != "auto":
                _bytes(f"{key}.max_in_cpu", self.max_in_cpu)
        elif self.max_in_cpu is not None:
            self.max_in_cpu = _int(f"{key}.max_in_cpu", self.max_in_cpu, 0)
        self.buffer_count = _int(f"{key}.buffer_count", self.buffer_count, 1)
        if self.buffer_size is not None:
            self.buffer_size = _int(f"{key}.buffer_size", self.buffer_size, 1)
        if self.nvme_path is not None and not (isinstance(self.nvme_path, (str, os.PathLike)) and str(self.nvme_path)):
            raise ValueError(f"{key}.nvme_path: expected a directory path, got {self.nvme_path!r}")
        if self.prefetch_bucket_size is not None:
            self.prefetch_bucket_size = _int("zero_optimization.stage3_prefetch_bucket_size",
                                             self.prefetch_bucket_size, 1)
        self.dtype = parse_dtype("dtype", self.dtype)
        if isinstance(self.aio, Mapping):
            self.aio = AioConfig.from_dict(self.aio)
        if not isinstance(self.aio, AioConfig):
            raise ValueError(f"aio: expected a JSON object or an AioConfig, got {type(self.aio).__name__}")
        for name in ("disk_gbps", "host_to_device_gbps"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                      or not math.isfinite(value) or value <= 0):
                raise ValueError(f"{name}: {value!r} is not allowed; use GB/s > 0")
        if self.compute_device not in DEVICE_CHOICES:
            raise ValueError(f"compute_device: {self.compute_device!r} is not allowed; use one of "
                             f"{', '.join(map(repr, DEVICE_CHOICES))}")
        self.weight_quantization = WeightQuantization.parse(self.weight_quantization)
        self.kv_offload = KVOffload.parse(self.kv_offload)
        self.block_schedule = BlockScheduleConfig.parse(self.block_schedule)

    def budget_bytes(self, itemsize: int) -> int:
        """``max_in_cpu`` in bytes, for a model whose weights have ``itemsize`` bytes per element. Raises
        ValueError for "auto", which the engine resolves (`offload.device.auto_budget`)."""
        if self.max_in_cpu == "auto":
            raise ValueError("zero_optimization.offload_param.max_in_cpu: \"auto\" is resolved by the engine from "
                             "the host's memory; read engine.plan.budget")
        if isinstance(self.max_in_cpu, str):
            return _bytes("zero_optimization.offload_param.max_in_cpu", self.max_in_cpu)
        return (1_000_000_000 if self.max_in_cpu is None else self.max_in_cpu) * itemsize

    @classmethod
    def from_dict(cls, config: Mapping[str, Any] | str | os.PathLike | None = None, **overrides: Any) -> "InferenceConfig":
        """Build from a DeepSpeed-style config (a mapping, a JSON file path, or None), then apply
        ``overrides`` (field names). Raises ValueError naming the dotted key for an unknown key, a
        wrong type or a value out of range; FileNotFoundError for a missing file."""
        if config is None:
            config = {}
        elif not isinstance(config, Mapping):
            with open(config, encoding="utf-8") as f:
                try:
                    config = json.load(f)
                except json.JSONDecodeError as exc:
                    raise ValueError(f"{os.fspath(config)}: not valid JSON: {exc}") from None
        values = _from_deepspeed(config)
        known = {f.name for f in fields(cls)}
        for name, value in overrides.items():
            if name not in known:
                raise ValueError(f"{name}: unknown setting; allowed are {', '.join(sorted(known))}"
                                 f"{did_you_mean(name, known)}")
            values[name] = value
        return cls(**values)


def _bits_named(value: str, key: str) -> int | None:
    """The bits of "int8" / "int4"; None for "none". Raises ValueError naming ``key`` for anything else."""
    choices = {"int8": 8, "int4": 4, "none": None}
    if value.lower() not in choices:
        raise ValueError(f"{key}: {value!r} is not allowed; use \"int8\", \"int4\" or \"none\"")
    return choices[value.lower()]


def _section(value: Any, key: str, allowed: set[str]) -> dict[str, Any]:
    if not isinstance(value, Mapping):
        raise ValueError(f"{key or 'config'}: expected a JSON object, got {value!r}")
    allowed = allowed | IGNORED_KEYS.get(key, set())
    for name in value:
        if name not in allowed:
            dotted = f"{key}.{name}" if key else name
            raise ValueError(f"{dotted}: unknown key; allowed keys are {', '.join(sorted(allowed))}"
                             f"{did_you_mean(name, allowed)}")
    return {k: v for k, v in value.items() if k not in IGNORED_KEYS.get(key, set())}


def _from_deepspeed(config: Mapping[str, Any]) -> dict[str, Any]:
    """The `InferenceConfig` fields a DeepSpeed-style config sets, its keys checked."""
    top = _section(config, "", {"zero_optimization", "aio", "dtype", "bf16", "bfloat16", "fp16", "weight_quantization",
                                 "kv_offload", "block_schedule", "max_memory", "compute_device", "experts"})
    values: dict[str, Any] = {}
    if "weight_quantization" in top:
        values["weight_quantization"] = WeightQuantization.parse(top["weight_quantization"])
    if "kv_offload" in top:
        values["kv_offload"] = KVOffload.parse(top["kv_offload"])
    if "block_schedule" in top:
        values["block_schedule"] = BlockScheduleConfig.parse(top["block_schedule"])
    for key in ("max_memory", "compute_device", "experts"):
        if key in top:
            values[key] = top[key]
    zero = _section(top.get("zero_optimization", {}), "zero_optimization",
                    {"offload_param", "stage3_prefetch_bucket_size", "aio"})
    param = _section(zero.get("offload_param", {}), "zero_optimization.offload_param",
                     {"device", "nvme_path", "buffer_count", "buffer_size", "max_in_cpu"})
    values.update(param)
    if "stage3_prefetch_bucket_size" in zero:
        values["prefetch_bucket_size"] = zero["stage3_prefetch_bucket_size"]
    if "aio" in top and "aio" in zero:
        raise ValueError("zero_optimization.aio: aio is given both at the top level and inside zero_optimization; keep one")
    if "aio" in top or "aio" in zero:
        values["aio"] = AioConfig.from_dict(top.get("aio", zero.get("aio")))
    enabled = []
    for key, dtype in (("bf16", "bfloat16"), ("bfloat16", "bfloat16"), ("fp16", "float16")):
        if key in top:
            section = _section(top[key], key, {"enabled"})
            if not isinstance(section.get("enabled", False), bool):
                raise ValueError(f"{key}.enabled: expected true or false, got {section['enabled']!r}")
            if section.get("enabled", False):
                enabled.append((key, dtype))
    if len(enabled) > 1 or (enabled and "dtype" in top):
        named = [k + ".enabled" for k, _ in enabled] + (["dtype"] if "dtype" in top else [])
        raise ValueError(f"{', '.join(named)}: more than one dtype is set; keep one")
    if enabled:
        values["dtype"] = enabled[0][1]
    if "dtype" in top:
        values["dtype"] = top["dtype"]
    return values
