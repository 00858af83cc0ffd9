"""The ``zero_optimization`` section: ZeRO stage, parameter and optimizer offload, bucket sizes."""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, Mapping

from tensorio import AioConfig

from offload.config.parse import boolean, build, choice, integral, number, section_values
from offload.config.swap import SwapConfig, prefixed

DEVICES = ("none", "cpu", "nvme")


def rank_path(key: str, nvme_path: Any) -> tuple[Any, tuple[str, ...], tuple[str, ...]]:
    """(this rank's directory, this rank's drives, every directory) of an ``nvme_path`` that is one directory
    or a list of them. The node's ``L`` ranks (``LOCAL_WORLD_SIZE``, at least ``LOCAL_RANK`` + 1) are spread
    over a list of ``n`` drives: with ``L >= n`` local rank ``r`` takes entry ``r`` modulo ``n`` (its swap files
    on one drive); with fewer ranks than drives it takes entries ``r, r + L, r + 2L, ...`` and stripes its swap
    files over them (`offload.storage.striped`). "This rank's drives" is empty unless there are several (then
    "this rank's directory" is the first). Raises ValueError naming ``key`` for an empty list or one holding
    anything but non-empty strings, and naming the variable for a bad ``LOCAL_RANK`` / ``LOCAL_WORLD_SIZE``."""
    if not isinstance(nvme_path, (list, tuple)):
        return nvme_path, (), (nvme_path,) if isinstance(nvme_path, str) and nvme_path else ()
    if not nvme_path or not all(isinstance(path, str) and path for path in nvme_path):
        raise ValueError(f"{key}.nvme_path: expected a directory path or a non-empty list of them, got {nvme_path!r}")
    local = os.environ.get("LOCAL_RANK", "0").strip() or "0"
    if not local.isdigit():
        raise ValueError(f"LOCAL_RANK: {local!r} is not a rank number (it spreads the ranks over {key}.nvme_path)")
    ranks = os.environ.get("LOCAL_WORLD_SIZE", "1").strip() or "1"
    if not ranks.isdigit() or int(ranks) < 1:
        raise ValueError(f"LOCAL_WORLD_SIZE: {ranks!r} is not a positive integer (the ranks on this node, spread "
                         f"over {key}.nvme_path)")
    share = tuple(nvme_path[i] for i in _rank_entries(len(nvme_path)))
    return share[0], share if len(share) > 1 else (), tuple(nvme_path)


def _rank_entries(count: int) -> range:
    """The entries of a list of ``count`` drives this rank takes (`rank_path`; the variables checked there)."""
    rank = int(os.environ.get("LOCAL_RANK", "0").strip() or "0")
    ranks = max(int(os.environ.get("LOCAL_WORLD_SIZE", "1").strip() or "1"), rank + 1)
    return range(rank, count, ranks) if ranks < count else range(rank % count, rank % count + 1)


MAX_STRIPE_WEIGHT = 16
"""The largest ``stripe_weights`` entry: a drive 16 times another's speed."""


def rank_weights(key: str, stripe_weights: Any, nvme_path: Any) -> tuple[int, ...]:
    """This rank's drives' ``stripe_weights`` (one integer per ``nvme_path`` entry, taken as `rank_path` takes
    the entries); empty where none are stated (they are measured) or the rank has one drive. Raises
    ValueError naming ``key.stripe_weights`` for weights without a list of directories, or not one integer
    from 1 to `MAX_STRIPE_WEIGHT` per entry."""
    if stripe_weights is None:
        return ()
    name = f"{key}.stripe_weights"
    if not isinstance(nvme_path, (list, tuple)):
        raise ValueError(f"{name}: {stripe_weights!r} needs nvme_path to be a list of directories (one per drive, "
                         f"one weight each); nvme_path is {nvme_path!r}")
    if not isinstance(stripe_weights, (list, tuple)) or len(stripe_weights) != len(nvme_path):
        raise ValueError(f"{name}: expected a list of {len(nvme_path)} integers from 1 to {MAX_STRIPE_WEIGHT}, one "
                         f"per nvme_path directory (each drive's relative speed, e.g. [3, 1]), got {stripe_weights!r}")
    weights = [integral(f"{name}[{i}]", w, minimum=1) for i, w in enumerate(stripe_weights)]
    for i, w in enumerate(weights):
        if w > MAX_STRIPE_WEIGHT:
            raise ValueError(f"{name}[{i}]: {w} is not allowed; use an integer from 1 to {MAX_STRIPE_WEIGHT} (the "
                             f"weights are ratios: [16, 1] puts 16 stripe units on the first drive per 1 on the "
                             f"second)")
    share = tuple(weights[i] for i in _rank_entries(len(nvme_path)))
    return share if len(share) > 1 else ()


def _check_device(key: str, device: Any, nvme_path: Any) -> None:
    choice(f"{key}.device", device, DEVICES)
    if nvme_path is not None and not (isinstance(nvme_path, str) and nvme_path):
        raise ValueError(f"{key}.nvme_path: expected a directory path as a non-empty string, got {nvme_path!r}")
    if device == "nvme" and nvme_path is None:
        raise ValueError(
            f'{key}.nvme_path: device is "nvme" but nvme_path is missing; add "nvme_path": "<a directory on '
            f'the NVMe drive>" to {key}'
        )


@dataclass(kw_only=True, slots=True)
class OffloadParamConfig:
    """Where the parameter partitions live between uses (``zero_optimization.offload_param``)."""

    _KEY: ClassVar[str] = "zero_optimization.offload_param"

    device: str = "none"
    """"none" keeps parameters in accelerator memory, "cpu" in host memory, "nvme" in files under nvme_path."""

    nvme_path: str | None = None
    """Directory for the swap files; required with device "nvme". It need not exist until the engine starts.
    A list of directories (one per NVMe drive) spreads the node's ranks over them (`rank_path`): this is then
    this rank's (the first of ``rank_paths`` where it has several), and ``nvme_paths`` holds them all."""

    nvme_paths: tuple[str, ...] = field(default=(), init=False)
    """Every directory ``nvme_path`` named (one, or the list given)."""

    rank_paths: tuple[str, ...] = field(default=(), init=False)
    """This rank's drives where it has several (fewer ranks on the node than drives listed): its swap files are
    striped over them; empty otherwise (`rank_path`)."""

    stripe_weights: list[int] | None = None
    """With a list ``nvme_path``: each drive's relative speed, one integer from 1 to 16 per entry; a rank
    striping over several drives puts that many stripe units on each per cycle (`StripeLayout`). Not set:
    measured when the swap files are made (`offload.storage.drive_speed`)."""

    rank_weights: tuple[int, ...] = field(default=(), init=False)
    """``stripe_weights`` of this rank's drives where it has several and they are stated; empty otherwise."""

    pin_memory: bool = False
    """Accepted as DeepSpeed takes it, and not read: with compute on a GPU the partitions held in host memory
    and the I/O buffers are page-locked whatever it says (the copies to the device need it); with compute
    on the CPU nothing is copied to a device, so nothing is pinned."""

    buffer_count: int = 5
    """Staging buffers for NVMe reads and writes. At least 1."""

    buffer_size: int = 100_000_000
    """Elements per staging buffer. Must hold the largest parameter partition (see check_against_model)."""

    max_in_cpu: int | str = 1_000_000_000
    """With device "nvme": elements kept in host memory before parameters are written to NVMe. At least 0.
    "auto": as many as the host's available memory holds beside the engine's other terms of its memory
    bound and a margin (`offload.train.sizing.auto_max_in_cpu`), found when the engine (or
    `offload.zero.Init`) starts; ``engine.plan`` prints the figures."""

    def __post_init__(self) -> None:
        listed = self.nvme_path
        self.nvme_path, self.rank_paths, self.nvme_paths = rank_path(self._KEY, listed)
        self.rank_weights = rank_weights(self._KEY, self.stripe_weights, listed)
        _check_device(self._KEY, self.device, self.nvme_path)
        self.pin_memory = boolean(f"{self._KEY}.pin_memory", self.pin_memory)
        self.buffer_count = integral(f"{self._KEY}.buffer_count", self.buffer_count, minimum=1)
        self.buffer_size = integral(f"{self._KEY}.buffer_size", self.buffer_size, minimum=1)
        if isinstance(self.max_in_cpu, str) and self.max_in_cpu != "auto":
            raise ValueError(f"{self._KEY}.max_in_cpu: {self.max_in_cpu!r} is not allowed; use an integer >= 0 "
                             f"(elements) or \"auto\" (as many as the host's available memory holds)")
        if self.max_in_cpu != "auto":
            self.max_in_cpu = integral(f"{self._KEY}.max_in_cpu", self.max_in_cpu, minimum=0)


@dataclass(kw_only=True, slots=True)
class OffloadOptimizerConfig:
    """Where the optimizer states and the fp32 master weights live (``zero_optimization.offload_optimizer``)."""

    _KEY: ClassVar[str] = "zero_optimization.offload_optimizer"

    device: str = "none"
    """"none" keeps optimizer states in accelerator memory, "cpu" in host memory, "nvme" in files under nvme_path."""

    nvme_path: str | None = None
    """Directory for the swap files; required with device "nvme". It need not exist until the engine starts.
    A list of directories spreads the node's ranks over them, as ``offload_param.nvme_path`` does."""

    nvme_paths: tuple[str, ...] = field(default=(), init=False)
    """Every directory ``nvme_path`` named (one, or the list given)."""

    rank_paths: tuple[str, ...] = field(default=(), init=False)
    """This rank's drives where it has several, as ``offload_param.rank_paths``."""

    stripe_weights: list[int] | None = None
    """Each drive's relative speed, as ``offload_param.stripe_weights``. Not set: measured."""

    rank_weights: tuple[int, ...] = field(default=(), init=False)
    """``stripe_weights`` of this rank's drives, as ``offload_param.rank_weights``."""

    pin_memory: bool = False
    """Stage optimizer states through page-locked host buffers."""

    buffer_count: int | None = None
    """Staging buffers, each the size of the largest sub-group, for NVMe swapping. At least 1. Not set:
    3 where the updates overlap the passes (read-ahead also goes into applied gradients' memory), else 4
    (DeepSpeed's default)."""

    pipeline_read: bool | None = None
    """With device "nvme": read the next sub-group's states while the current one is updated. Not
    set: on where ``buffer_count`` has room (DeepSpeed: off; here overlapping is the fast default)."""

    pipeline_write: bool | None = None
    """With device "nvme": write the previous sub-group's states while the current one is updated.
    Not set: on where ``buffer_count`` has room."""

    fast_init: bool = False
    """With device "nvme": create the swap files without writing initial states through the staging buffers."""

    ratio: float = 1.0
    """Fraction of the optimizer states offloaded, from 0 to 1."""

    def __post_init__(self) -> None:
        listed = self.nvme_path
        self.nvme_path, self.rank_paths, self.nvme_paths = rank_path(self._KEY, listed)
        self.rank_weights = rank_weights(self._KEY, self.stripe_weights, listed)
        _check_device(self._KEY, self.device, self.nvme_path)
        self.fast_init = boolean(f"{self._KEY}.fast_init", self.fast_init)
        self.ratio = number(f"{self._KEY}.ratio", self.ratio, minimum=0, maximum=1)
        for name in ("pipeline_read", "pipeline_write", "fast_init"):
            if getattr(self, name) and self.device != "nvme":
                raise ValueError(
                    f'{self._KEY}.{name}: true only applies to device "nvme" (device is {self.device!r}); '
                    f"remove it or set it to false"
                )
        if self.buffer_count is not None:
            self.buffer_count = integral(f"{self._KEY}.buffer_count", self.buffer_count, minimum=1)
        self.swap_config()  # the swap settings are checked there, once

    def swap_config(self, sub_group_size: int = 1 << 22, aio: AioConfig | None = None) -> SwapConfig:
        """The swap settings of this section for `OffloadAdam`. Raises ValueError naming the key."""
        count = self.buffer_count if self.buffer_count is not None else 3  # the fewest the engine chooses
        return prefixed(self._KEY, SwapConfig, buffer_count=count, pin_memory=self.pin_memory,
                        pipeline_read=self.pipeline_read, pipeline_write=self.pipeline_write,
                        sub_group_size=sub_group_size, aio=aio if aio is not None else AioConfig())


@dataclass(kw_only=True, slots=True)
class ZeroConfig:
    """ZeRO settings (``zero_optimization``). The engine always partitions as stage 3."""

    _KEY: ClassVar[str] = "zero_optimization"

    stage: int = 0
    """ZeRO stage as written: 0 to 3. Stages 0 to 2 run as stage 3 (with a warning): parameters,
    gradients and optimizer states are all partitioned, which changes memory use and communication but
    not the update."""

    offload_param: OffloadParamConfig = field(default_factory=OffloadParamConfig)
    """Parameter offload; stage 3 only."""

    offload_optimizer: OffloadOptimizerConfig = field(default_factory=OffloadOptimizerConfig)
    """Optimizer-state offload; "cpu" from stage 1, "nvme" at stage 3 only."""

    overlap_comm: bool = True
    """Overlap gradient reduction with the backward pass (DeepSpeed's default at stage 3)."""

    contiguous_gradients: bool = True
    """Copy reduced gradients into one contiguous buffer as they are produced."""

    sub_group_size: int = 1_000_000_000
    """Elements per optimizer sub-group: the unit of an optimizer step and of an NVMe swap. At least 1."""

    reduce_bucket_size: int = 500_000_000
    """Elements reduced together in one gradient reduce-scatter. At least 1."""

    stage3_prefetch_bucket_size: int = 50_000_000
    """Elements of upcoming parameters fetched ahead of use; 0 turns prefetching off."""

    stage3_param_persistence_threshold: int = 100_000
    """Parameters with at most this many elements are kept whole on every rank instead of partitioned."""

    stage3_max_live_parameters: int = 1_000_000_000
    """Most gathered parameter elements held at once before some are released. At least 0."""

    stage3_max_reuse_distance: int = 1_000_000_000
    """A parameter used again within this many elements of other parameters is kept gathered. At least 0."""

    stage3_gather_16bit_weights_on_model_save: bool = False
    """Gather the full 16-bit weights when the model is saved, instead of saving only partitions."""

    allgather_partitions: bool = True
    """Stage-2 key, accepted so stage-2 configs load: gather parameters with all-gather (always true at stage 3)."""

    allgather_bucket_size: int = 500_000_000
    """Stage-2 key, accepted so stage-2 configs load: elements per all-gather bucket. At least 1."""

    reduce_scatter: bool = True
    """Stage-2 key, accepted so stage-2 configs load: reduce gradients with reduce-scatter (always at stage 3)."""

    def __post_init__(self) -> None:
        key = self._KEY
        self.stage = integral(f"{key}.stage", self.stage, minimum=0)
        if self.stage > 3:
            raise ValueError(f"{key}.stage: {self.stage} is not allowed; use 0, 1, 2 or 3")
        for name in ("overlap_comm", "contiguous_gradients", "stage3_gather_16bit_weights_on_model_save",
                     "allgather_partitions", "reduce_scatter"):
            setattr(self, name, boolean(f"{key}.{name}", getattr(self, name)))
        for name, minimum in (("sub_group_size", 1), ("reduce_bucket_size", 1), ("allgather_bucket_size", 1),
                              ("stage3_prefetch_bucket_size", 0), ("stage3_param_persistence_threshold", 0),
                              ("stage3_max_live_parameters", 0), ("stage3_max_reuse_distance", 0)):
            setattr(self, name, integral(f"{key}.{name}", getattr(self, name), minimum=minimum))
        self._check_stage()

    def _check_stage(self) -> None:
        # DeepSpeed ignores offload_param below stage 3, ignores offload_optimizer at stage 0, and quietly
        # offloads to host memory instead of NVMe at stages 1 and 2; each of those is refused here.
        key = self._KEY
        if self.stage == 3:
            return
        if self.offload_param.device != "none":
            raise ValueError(
                f'{key}.offload_param.device: "{self.offload_param.device}" needs {key}.stage 3 (stage is '
                f'{self.stage}); set stage to 3 or the device to "none"'
            )
        if self.offload_optimizer.device == "nvme" or (self.stage == 0 and self.offload_optimizer.device != "none"):
            allowed = '"none"' if self.stage == 0 else '"cpu" or "none"'
            raise ValueError(
                f'{key}.offload_optimizer.device: "{self.offload_optimizer.device}" needs {key}.stage 3 (stage is '
                f"{self.stage}); set stage to 3 or the device to {allowed}"
            )
        warnings.warn(
            f"{key}.stage: {self.stage} runs as stage 3 here (parameters, gradients and optimizer states are all "
            f"partitioned: the update is the same, memory use and communication differ); set stage to 3 to "
            f"silence this warning",
            UserWarning,
            stacklevel=2,
        )

    @classmethod
    def from_dict(cls, section: Mapping[str, Any]) -> "ZeroConfig":
        """Build from a ``zero_optimization`` section without its ``aio`` entry (EngineConfig reads that).

        Raises ValueError naming the dotted key for an unknown key, a wrong type, a value out of range or
        a contradiction such as "nvme" without nvme_path or NVMe offload below stage 3.
        """
        values = section_values(section, cls._KEY, {f.name for f in fields(cls)})
        for name, sub in (("offload_param", OffloadParamConfig), ("offload_optimizer", OffloadOptimizerConfig)):
            if name in values:
                values[name] = build(sub, values[name])
        return cls(**values)
