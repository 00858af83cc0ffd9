"""`EngineConfig`: the stage-3 engine's settings, read from a DeepSpeed-format JSON config.

Loading is two explicit steps when the config holds "auto" values::

    raw = resolve_auto("ds_config.json", micro_batch_size=8, gradient_accumulation_steps=1, hidden_size=768, ...)
    config = EngineConfig.from_dict(raw, world_size=world_size_from_env())

and one (``EngineConfig.from_file``) when it does not. Checks that need the model or the disk are
separate functions the engine calls when it starts: `check_against_model` and `check_nvme_paths`.
"""

from __future__ import annotations

import copy
import errno
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, fields
from typing import Any

import torch

from tensorio import AioConfig, parse_size

from offload.config.auto import OWN_AUTO_KEYS, resolve_auto, unresolved_auto_error
from offload.config.batch import check_batch_sizes, derive_batch_sizes
from offload.config.checkpoint import CheckpointConfig
from offload.config.parse import boolean, build, integral, number, read_config, renamed, section_values
from offload.config.training import AdamParams, Bf16Config, Fp16Config, OptimizerConfig, SchedulerConfig, WarmupParams
from offload.config.zero import OffloadOptimizerConfig, OffloadParamConfig, ZeroConfig
from offload.params.partition import partition_numel

__all__ = ["EngineConfig", "check_against_model", "check_nvme_paths", "world_size_from_env"]

COMPUTE_DEVICES = ("auto", "cpu", "cuda")
"""What ``compute_device`` takes."""

COMMUNICATION_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
"""What ``communication_data_type`` takes, and the dtype each names."""

_BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
_JSON_KEYS = {
    *_BATCH_KEYS, "gradient_clipping", "fp16", "bf16", "bfloat16", "optimizer", "scheduler", "steps_per_print",
    "wall_clock_breakdown", "zero_optimization", "aio", "compute_device", "compute_device_budget", "checkpoint",
    "communication_data_type",
}
_ZERO_JSON_KEYS = {f.name for f in fields(ZeroConfig)} | {"aio"}


@dataclass(kw_only=True, slots=True)
class EngineConfig(Mapping):
    """Every setting of the stage-3 engine, checked; named as DeepSpeed's JSON config names them.

    It is also a read-only mapping over the JSON it was built from (``source``), as DeepSpeed's
    ``engine.config`` is a dict: ``config["zero_optimization"]["stage"]``, ``config.get("fp16", {})``.
    """

    world_size: int
    """Data-parallel ranks the batch sizes were checked against (not a JSON key; see from_dict)."""

    train_batch_size: int
    """Samples per optimizer step over all ranks: micro batch x accumulation steps x world size."""

    train_micro_batch_size_per_gpu: int
    """Samples per forward and backward pass on one rank."""

    gradient_accumulation_steps: int
    """Forward and backward passes per optimizer step."""

    gradient_clipping: float = 1.0
    """Clip the global gradient norm to this value; 0 turns clipping off (and lets the update run during
    backward, the fastest path: docs/engine.md). At least 0. Absent: 1.0, DeepSpeed's default
    (``GRADIENT_CLIPPING_DEFAULT``, deepspeedai/DeepSpeed#8068)."""

    fp16: Fp16Config = field(default_factory=Fp16Config)
    """fp16 mixed precision."""

    bf16: Bf16Config = field(default_factory=Bf16Config)
    """bf16 mixed precision (JSON key ``bf16`` or ``bfloat16``)."""

    communication_data_type: str | None = None
    """The dtype gradients are reduced across ranks in: "fp32", "fp16" or "bf16" (any case, as DeepSpeed
    reads it). None: the training dtype under fp16 / bf16 (half the bytes of fp32), else fp32, as
    DeepSpeed's default. The reduced partitions are cast back to fp32 before they are averaged and
    accumulated (`communication_dtype`)."""

    optimizer: OptimizerConfig | None = None
    """The optimizer; None when the config has no ``optimizer`` section and the caller supplies its settings."""

    scheduler: SchedulerConfig | None = None
    """The learning-rate schedule; None for a constant learning rate."""

    steps_per_print: int = 10
    """Log progress every this many optimizer steps. At least 1."""

    wall_clock_breakdown: bool = False
    """Time forward, backward and step and log the breakdown."""

    zero_optimization: ZeroConfig = field(default_factory=ZeroConfig)
    """ZeRO partitioning and offload."""

    aio: AioConfig = field(default_factory=AioConfig)
    """NVMe I/O settings (JSON key ``aio`` at the top or inside ``zero_optimization``, not both)."""

    compute_device: str = "auto"
    """Where forward and backward run: "auto" (CUDA where available, else the CPU), "cpu" or "cuda".
    The optimizer runs on the CPU either way (docs/gpu.md). Not a DeepSpeed key (DeepSpeed computes on
    the GPU its launcher assigns)."""

    compute_device_budget: int | None = None
    """Bytes of device memory the engine's device buffers (gathered parameters, gradient buckets) may
    hold; an integer or a size string ("6GiB"). None: no budget of our own. Must fit in the device's free
    memory. Not a DeepSpeed key."""

    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """How ``save_checkpoint`` saves when not told: ``{"async_save": true}`` saves in the background. Not a
    DeepSpeed key."""

    source: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)
    """The DeepSpeed-format dict this was built from ("auto" values resolved): what the mapping reads."""

    @property
    def communication_dtype(self) -> torch.dtype:
        """The torch dtype of ``communication_data_type``, its default resolved: fp16 / bf16 when training
        in it, else float32."""
        if self.communication_data_type is not None:
            return COMMUNICATION_DTYPES[self.communication_data_type]
        return torch.float16 if self.fp16.enabled else torch.bfloat16 if self.bf16.enabled else torch.float32

    def __getitem__(self, key: str) -> Any:
        return self.source[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.source)

    def __len__(self) -> int:
        return len(self.source)

    def __post_init__(self) -> None:
        self.world_size = integral("world_size", self.world_size, minimum=1)
        for key in _BATCH_KEYS:
            setattr(self, key, integral(key, getattr(self, key), minimum=1))
        check_batch_sizes(
            self.train_batch_size, self.train_micro_batch_size_per_gpu, self.gradient_accumulation_steps,
            self.world_size,
        )
        self.gradient_clipping = number("gradient_clipping", self.gradient_clipping, minimum=0)
        self.steps_per_print = integral("steps_per_print", self.steps_per_print, minimum=1)
        self.wall_clock_breakdown = boolean("wall_clock_breakdown", self.wall_clock_breakdown)
        if self.fp16.enabled and self.bf16.enabled:
            raise ValueError("fp16.enabled, bf16.enabled: both are true; enable at most one of them")
        if self.communication_data_type is not None:
            value = self.communication_data_type
            if not isinstance(value, str) or value.lower() not in COMMUNICATION_DTYPES:
                raise ValueError(f"communication_data_type: {value!r} is not allowed; use one of "
                                 f"{', '.join(map(repr, COMMUNICATION_DTYPES))}, or leave it out (the training dtype)")
            self.communication_data_type = value.lower()
        if self.compute_device not in COMPUTE_DEVICES:
            raise ValueError(f"compute_device: {self.compute_device!r} is not allowed; use one of "
                             f"{', '.join(map(repr, COMPUTE_DEVICES))}")
        if isinstance(self.compute_device_budget, str):
            try:
                self.compute_device_budget = parse_size(self.compute_device_budget)
            except ValueError as exc:
                raise ValueError(f"compute_device_budget: {exc}") from None
        if self.compute_device_budget is not None:
            self.compute_device_budget = integral("compute_device_budget", self.compute_device_budget, minimum=1)

    @classmethod
    def from_dict(cls, config: Mapping[str, Any], *, world_size: int) -> "EngineConfig":
        """Build from a DeepSpeed-format config whose "auto" values are resolved (see resolve_auto).

        ``world_size`` is the number of data-parallel ranks (`world_size_from_env()` before the process
        group exists). Missing batch sizes are derived as DeepSpeed derives them.
        Raises ValueError naming the type received when ``config`` is not a mapping, and naming the
        dotted key for an unknown key, a wrong type, an "auto" value, a value
        out of range or a contradiction (batch sizes that do not multiply out, "nvme" without nvme_path,
        NVMe offload below stage 3, ``aio`` given twice, ...).
        """
        if isinstance(config, (str, os.PathLike)):
            raise ValueError(f"config: from_dict takes a dict, got the path {os.fspath(config)!r}; "
                             f"use EngineConfig.from_file for a JSON file")
        if isinstance(config, Mapping) and (unresolved := unresolved_auto_error(config)) is not None:
            raise unresolved
        values = section_values(config, "", _JSON_KEYS, auto_is_a_value=OWN_AUTO_KEYS)
        world_size = integral("world_size", world_size, minimum=1)
        batch = [values.pop(key, None) for key in _BATCH_KEYS]
        batch = [None if value is None else integral(key, value, minimum=1) for key, value in zip(_BATCH_KEYS, batch)]
        train, micro, accum = derive_batch_sizes(*batch, world_size)

        if "bf16" in values and "bfloat16" in values:
            raise ValueError('bfloat16: given as both "bf16" and "bfloat16"; keep one')
        bf16_key = "bfloat16" if "bfloat16" in values else "bf16"
        if bf16_key in values:
            try:
                values["bf16"] = build(Bf16Config, values.pop(bf16_key), bf16_key)
            except ValueError as exc:
                raise renamed(bf16_key, "bf16", exc) from None
        if "fp16" in values:
            values["fp16"] = build(Fp16Config, values["fp16"])
        if "checkpoint" in values:
            values["checkpoint"] = build(CheckpointConfig, values["checkpoint"])
        if "optimizer" in values:
            values["optimizer"] = OptimizerConfig.from_dict(values["optimizer"])
        if "scheduler" in values:
            values["scheduler"] = SchedulerConfig.from_dict(values["scheduler"])
        zero = section_values(values.get("zero_optimization", {}), "zero_optimization", _ZERO_JSON_KEYS)
        half = any(getattr(values.get(key), "enabled", False) for key in ("bf16", "fp16"))
        _max_in_cpu_as_elements(zero, itemsize=2 if half else 4)
        values["aio"] = _read_aio(values.get("aio"), zero.pop("aio", None))
        values["zero_optimization"] = ZeroConfig.from_dict(zero)
        source = copy.deepcopy(dict(config))
        source.update(train_batch_size=train, train_micro_batch_size_per_gpu=micro, gradient_accumulation_steps=accum)
        return cls(
            world_size=world_size, train_batch_size=train, train_micro_batch_size_per_gpu=micro,
            gradient_accumulation_steps=accum, source=source, **values,
        )

    @classmethod
    def from_file(cls, path: str | os.PathLike, *, world_size: int) -> "EngineConfig":
        """Load a JSON config file that has no "auto" values (see ``from_dict``; else use resolve_auto).

        Raises ValueError for a ``path`` that is neither str nor os.PathLike (naming its type), OSError
        (FileNotFoundError, IsADirectoryError, PermissionError) naming the path for a file that cannot
        be read, and ValueError for bad JSON or a bad value.
        """
        return cls.from_dict(read_config(path), world_size=world_size)


def _max_in_cpu_as_elements(zero: dict[str, Any], *, itemsize: int) -> None:
    """``offload_param.max_in_cpu`` written as bytes ("8GiB", as inference configs take it) becomes
    DeepSpeed's unit, elements of the parameters' dtype (``itemsize`` bytes: 2 with bf16 / fp16)."""
    param = zero.get("offload_param")
    value = param.get("max_in_cpu") if isinstance(param, Mapping) else None
    if not isinstance(value, str) or value == "auto":
        return
    key = "zero_optimization.offload_param.max_in_cpu"
    try:
        nbytes = parse_size(value)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{key}: {value!r} is not allowed; use an integer >= 0 (elements) or \"auto\" (as many as "
                         f"the host's available memory holds), or bytes as a size such as \"8GiB\" ({exc})") from None
    zero["offload_param"] = {**param, "max_in_cpu": nbytes // itemsize}


def _read_aio(top: Any, in_zero: Any) -> AioConfig:
    # DeepSpeed reads `aio` only at the top level, so the Transformers guide's `aio` inside
    # zero_optimization is silently ignored there; here either place works, but not both.
    if top is not None and in_zero is not None:
        raise ValueError(
            "zero_optimization.aio: aio is given both at the top level and inside zero_optimization; keep one"
        )
    if in_zero is None:
        return AioConfig.from_dict({} if top is None else top)
    try:
        return AioConfig.from_dict(in_zero)
    except ValueError as exc:
        raise renamed("zero_optimization.aio", "aio", exc) from None


def world_size_from_env() -> int:
    """The data-parallel world size: ``WORLD_SIZE`` as torchrun sets it, or 1 when not launched by torchrun.

    Raises ValueError if WORLD_SIZE is set but not a positive integer.
    """
    value = os.environ.get("WORLD_SIZE", "1")
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"WORLD_SIZE: {value!r} is not a positive integer; unset it or launch with torchrun")
    return int(value)


def check_against_model(config: EngineConfig, param_numels: Mapping[str, int], *, alignment: int = 1) -> None:
    """Check the settings that depend on the model: the NVMe parameter staging buffer must hold the
    largest parameter partition (``param_numels`` maps parameter names to element counts; partitions
    are padded to ``alignment`` elements as in `offload.params.partition`).

    Raises ValueError naming ``zero_optimization.offload_param.buffer_size``, the largest parameter and
    the size to use instead.
    """
    offload = config.zero_optimization.offload_param
    if offload.device != "nvme" or not param_numels:
        return
    name, numel = max(param_numels.items(), key=lambda item: item[1])
    largest = partition_numel(numel, config.world_size, alignment)
    if offload.buffer_size < largest:
        raise ValueError(
            f"zero_optimization.offload_param.buffer_size: {offload.buffer_size} elements cannot hold the "
            f"partition of {name!r} ({numel} elements over {config.world_size} ranks: {largest} per rank); "
            f"set buffer_size to at least {largest}"
        )


def check_nvme_paths(config: EngineConfig) -> None:
    """Check that each ``nvme_path`` in use is an existing, writable directory. It is not created: a
    missing mount point would otherwise put the swap files on whatever disk holds its parent.

    Raises FileNotFoundError, NotADirectoryError or PermissionError naming the key and the path.
    """
    zero = config.zero_optimization
    for key, offload in (("offload_param", zero.offload_param), ("offload_optimizer", zero.offload_optimizer)):
        if offload.device != "nvme":
            continue
        for path in offload.nvme_paths or (offload.nvme_path,):  # every drive of a list, not only this rank's
            _check_nvme_path(f"zero_optimization.{key}.nvme_path: {path!r}", path)


def _check_nvme_path(where: str, path: str) -> None:
    try:
        os.stat(path)
    except PermissionError:
        raise PermissionError(errno.EACCES, f"{where}: permission denied (a directory on its path may not be "
                              f"searched by this process); fix its permissions or the path", path) from None
    except FileNotFoundError:
        raise FileNotFoundError(f"{where} does not exist; create the directory on the NVMe drive or fix the path") from None
    if not os.path.isdir(path):
        raise NotADirectoryError(f"{where} is not a directory; point it at a directory on the NVMe drive")
    if not os.access(path, os.W_OK | os.X_OK):
        raise PermissionError(errno.EACCES, f"{where}: permission denied (not writable by this process); fix its "
                              f"permissions or the path", path)
