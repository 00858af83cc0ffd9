"""DeepSpeed's ``deepspeed.zero`` surface: build a model partition by partition (`Init`), gather
partitioned parameters to read or change them (`GatheredParameters`), and declare parameters a module
uses without owning them (`register_external_parameter`).

    with offload.zero.Init(config_dict_or_path="ds_config.json"):
        model = GPT2LMHeadModel(config)          # never whole in memory
    engine, *_ = offload.initialize(model=model, config="ds_config.json")

See docs/zero_init.md.
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Any, Iterable, Iterator, Mapping

import torch
import torch.distributed as dist
from torch import nn

from offload.config import EngineConfig, check_nvme_paths, world_size_from_env
from offload.device import Device, local_ranks, start_process_group
from offload.params import ParamStore, Placement, Prefetcher, SwapBudget
from offload.params.construct import BUILT, PartitionedBuild, built_store, discard_build, settle_for_gather
from offload.params.pretrained import load_pretrained
from offload.params.record import ParamRecord
from offload.params.store import EXTERNAL, find_record
from offload.storage import open_swap_file
from offload.train.heap import share_freed_memory
from offload.train.setup import compute_device_of
from offload.train.sizing import auto_max_in_cpu

__all__ = ["GatheredParameters", "Init", "from_pretrained", "register_external_parameter", "unregister_external_parameter"]

log = logging.getLogger("offload")

_DEEPSPEED_ONLY = {"module": None, "data_parallel_group": None, "mpu": None, "zero_param_parallel_group": None,
                   "zero_quantized_weights": False, "zero_quantized_nontrainable_weights": False,
                   "sequence_data_parallel_group": None, "param_swapper": None}
"""DeepSpeed arguments accepted at their default only (naming one otherwise)."""


class Init:
    """Partition and place each parameter as soon as its module has built it (``deepspeed.zero.Init``).

    Args:
        config_dict_or_path: a DeepSpeed config (dict or JSON path); its ``zero_optimization.
            offload_param`` says where partitions go (``nvme`` with ``nvme_path``, ``max_in_cpu``
            elements kept in memory first; ``cpu``/``none``: memory), ``aio`` how the swap file is
            written, ``fp16``/``bf16`` the parameters' dtype. ``config`` is DeepSpeed's other name.
        enabled: False makes the block do nothing (the model is built whole, as usual).
        dtype: the parameters' dtype (None: fp16/bf16 from the config, else as built).
        remote_device: "nvme" or "cpu" overrides ``offload_param.device`` (None: the config's).
        pin_memory, mem_efficient_linear: accepted as DeepSpeed accepts them; buffers are page-aligned
            and locked where that is possible, and linear layers need no special memory handling here.
        compute_device: where `offload.initialize` will compute (not DeepSpeed's: None takes the config's
            ``compute_device``; a `Device`, as tests pass the simulated one, or a choice). With several
            ranks the process group is started for it (NCCL for CUDA) and the build's gathers run their
            collectives there, on tensors where its backend needs them.

    Host memory holds at most ``offload_param.buffer_size`` elements of parameters (or the largest
    parameter, if larger) besides the one being built; random initialisation draws the same numbers
    in the same order as a plain construction, so the weights are the same. `offload.initialize`
    takes the model as it is (with compute on a GPU, moving the in-memory partitions into page-locked
    buffers one at a time). Raises ValueError for a bad config or argument (naming it),
    FileNotFoundError / PermissionError for a bad ``nvme_path``, TensorIOError for the swap file.
    """

    def __init__(self, config_dict_or_path: Mapping[str, Any] | str | os.PathLike | None = None, *,
                 config: Mapping[str, Any] | str | os.PathLike | None = None, enabled: bool = True,
                 dtype: torch.dtype | None = None, remote_device: str | None = None, pin_memory: bool = False,
                 mem_efficient_linear: bool = True, compute_device: Device | str | None = None,
                 **deepspeed_only: Any) -> None:
        for key, value in deepspeed_only.items():
            if key not in _DEEPSPEED_ONLY:
                raise TypeError(f"zero.Init: unexpected argument {key!r}")
            if value != _DEEPSPEED_ONLY[key]:
                raise ValueError(f"zero.Init: {key}={value!r} is not supported here; leave it at "
                                 f"{_DEEPSPEED_ONLY[key]!r}")
        self.enabled = bool(enabled)
        self._build: PartitionedBuild | None = None
        if not self.enabled:
            return
        source = config_dict_or_path if config_dict_or_path is not None else config
        if source is None:
            raise ValueError("zero.Init: config_dict_or_path is missing; pass the DeepSpeed config that "
                             "initialize() will get")
        self._world_size = world_size_from_env() if not (dist.is_available() and dist.is_initialized()) \
            else dist.get_world_size()
        self._rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        cfg = (EngineConfig.from_dict(source, world_size=self._world_size) if isinstance(source, Mapping)
               else EngineConfig.from_file(source, world_size=self._world_size))
        # The build's collectives run where the engine's will: the process group for that compute device
        # (NCCL for CUDA), their tensors where its backend needs them.
        self.compute = compute_device_of(cfg, compute_device)
        if self._world_size > 1 and not (dist.is_available() and dist.is_initialized()):
            start_process_group(self.compute)
            self._rank = dist.get_rank()
        if remote_device not in (None, "nvme", "cpu", "none"):
            raise ValueError(f"zero.Init: remote_device={remote_device!r}; use \"nvme\", \"cpu\" or None")
        self.config = cfg
        self.device = remote_device or cfg.zero_optimization.offload_param.device
        self.dtype = dtype or (torch.float16 if cfg.fp16.enabled else torch.bfloat16 if cfg.bf16.enabled else None)

    def __enter__(self) -> "Init":
        if not self.enabled:
            return self
        cfg, zero = self.config, self.config.zero_optimization
        offload_param = zero.offload_param
        heap = share_freed_memory(local_ranks())  # before the build: several ranks on the node share its memory
        if heap and self._rank == 0:
            log.info("zero.Init: %s", heap)
        swap = None
        if self.device == "nvme":
            check_nvme_paths(cfg)
            swap = open_swap_file(offload_param.rank_paths or offload_param.nvme_path, cfg.aio, kind="params",
                                  key="zero_optimization.offload_param.nvme_path",
                                  weights=offload_param.rank_weights or None)
        max_in_cpu = offload_param.max_in_cpu if swap is not None else 0
        if max_in_cpu == "auto":  # the model is not built yet: the engine's other shares at their most
            max_in_cpu, how = auto_max_in_cpu(cfg, None, 2 if self.dtype in (torch.float16, torch.bfloat16) else 4)
            log.info("zero.Init: offload_param.max_in_cpu \"auto\": %d elements = %s", max_in_cpu, how)
        placement = Placement(world_size=self._world_size, rank=self._rank, swap=swap, max_in_cpu=max_in_cpu,
                              persistence_threshold=zero.stage3_param_persistence_threshold, accumulators=False)
        store = ParamStore(records=[], world_size=self._world_size, rank=self._rank, swap=swap,
                           budget=SwapBudget(buffer_elements=offload_param.buffer_count * offload_param.buffer_size,
                                             max_live=zero.stage3_max_live_parameters),
                           prefetcher=Prefetcher(bucket_elements=0), shaped_placeholders=True,
                           collectives=self.compute)
        self._build = PartitionedBuild(store, placement, limit=offload_param.buffer_size, dtype=self.dtype)
        self._build.__enter__()
        return self

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        if self._build is None:
            return
        build, self._build = self._build, None
        try:
            build.__exit__(exc_type, *exc)
        except BaseException:
            discard_build(build.store)
            raise
        if exc_type is not None:
            discard_build(build.store)
            return
        BUILT[id(build.store)] = build.store
        log.info("zero.Init: %d parameters placed (%s)", len(build.store.records), self.device)


@contextlib.contextmanager
def GatheredParameters(params: nn.Parameter | Iterable[nn.Parameter], modifier_rank: int | None = None,
                       fwd_module: nn.Module | None = None, enabled: bool = True) -> Iterator[None]:
    """Gather partitioned parameters so that their ``.data`` is the whole tensor inside the block
    (``deepspeed.zero.GatheredParameters``).

    With ``modifier_rank`` (an int), changes made on that rank are kept: the values are broadcast
    from it and written back into every rank's partition (in memory or on NVMe) on exit; with None
    the parameters are only read and changes are dropped. Parameters that are not partitioned pass
    through. Every rank must enter (a collective). Raises TensorIOError for the swap file.
    """
    if not enabled:
        yield
        return
    if isinstance(params, torch.Tensor):
        params = [params]
    found = []
    for p in params:
        settle_for_gather(p)  # inside Init: a parameter still as built is partitioned first, like the others
        located = find_record(p)
        if located is not None:
            found.append(located)
    gathered = []
    try:
        for store, rec in found:
            kept = rec.full is not None
            full = store.gather(rec)
            if modifier_rank is None and not kept:
                full = full.clone()  # changes are dropped: never let them reach a buffer that is written back
                rec.param.data = full.view(rec.shape)
            gathered.append((store, rec, kept))
        yield
        if modifier_rank is not None:
            for store, rec, _ in gathered:
                if store.world_size > 1:
                    _broadcast(store, rec, _global_rank(store, modifier_rank))
                store.write_back(rec)
    finally:
        for store, rec, kept in gathered:
            if not kept:
                store.release(rec)


def _broadcast(store: ParamStore, rec: ParamRecord, source: int) -> None:
    """Broadcast the gathered ``rec.full`` from global rank ``source``, where the store's collectives run."""
    collectives = store.collectives or store.device
    values = collectives.collective_tensor(rec.full)
    collectives.check_collective(values, op=f"broadcast of {rec.name!r}")
    dist.broadcast(values, source, group=store.group)
    if values is not rec.full:
        rec.full.copy_(collectives.collective_to_host(values))


def _global_rank(store: ParamStore, rank: int) -> int:
    return rank if store.group is None else dist.get_global_rank(store.group, rank)


def register_external_parameter(module: nn.Module, parameter: nn.Parameter) -> None:
    """Declare that ``module``'s forward uses ``parameter``, which another module owns (for example a
    weight read by a later layer): it is gathered around ``module``'s forward too.

    Raises TypeError for a ``parameter`` that is not an ``nn.Parameter``."""
    if not isinstance(parameter, nn.Parameter):
        raise TypeError(f"register_external_parameter: expected an nn.Parameter, got {type(parameter).__name__}")
    users = EXTERNAL.setdefault(module, [])
    if any(p is parameter for p in users):
        return
    users.append(parameter)
    found = find_record(parameter)
    if found is not None:
        found[0].register_external(module, found[1])


def unregister_external_parameter(module: nn.Module, parameter: nn.Parameter) -> None:
    """Undo `register_external_parameter` (the hooks of an engine already running keep it)."""
    users = EXTERNAL.get(module, [])
    EXTERNAL[module] = [p for p in users if p is not parameter]


def from_pretrained(checkpoint: str | os.PathLike, config: Mapping[str, Any] | str | os.PathLike, *,
                    model_class: Any = None, **model_kwargs: Any) -> nn.Module:
    """A Hugging Face model built under `Init` with ``config`` and its weights read from ``checkpoint`` (a
    directory with config.json and safetensors, one file or sharded) into the partitions, tensor by tensor:
    never whole in memory. ``model_class`` defaults to ``transformers.AutoModelForCausalLM``; pass the
    result to `offload.initialize` with the same ``config``.

    Raises what `Init` and `offload.params.pretrained.load_pretrained` raise (a missing or broken
    checkpoint naming the file, a tensor of another shape naming it).
    """
    import transformers

    hf_config = transformers.AutoConfig.from_pretrained(os.fspath(checkpoint))
    cls = model_class or transformers.AutoModelForCausalLM
    init = Init(config_dict_or_path=config)
    with init:
        model = cls.from_config(hf_config, **model_kwargs) if hasattr(cls, "from_config") else cls(hf_config, **model_kwargs)
    try:
        load_pretrained(model, built_store(model), os.fspath(checkpoint), init.config.aio)
    except BaseException:
        store = built_store(model)
        if store is not None:
            discard_build(store)
        raise
    return model
