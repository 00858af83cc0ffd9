"""The ZeRO stage-3 engine: `initialize` and `Engine`, used as DeepSpeed's are.

    engine, optimizer, _, scheduler = offload.initialize(model=model, config="ds_config.json")
    for batch in data:
        loss = engine(batch)
        engine.backward(loss)
        engine.step()

Every parameter is partitioned over the data-parallel ranks; partitions live in memory or on NVMe
(``zero_optimization.offload_param``); module hooks gather a module's parameters around its forward
and autograd's saved-tensor hooks gather them again for its backward; gradients are reduced to their
partition; `OffloadAdam` steps the partitions with its state in memory or on NVMe
(``offload_optimizer``). See docs/engine.md.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import gc
import logging
import os
import weakref
from typing import Any, Callable, Iterable, Mapping

import torch
import torch.distributed as dist
from torch import nn

from offload.config import EngineConfig, ZeroConfig, check_against_model, check_nvme_paths, world_size_from_env
from offload.optim import OffloadAdam
from offload.optim.subgroups import choose_buffer_count, choose_sub_group_size, host_memory_bytes
from offload.params import ParamRecord, ParamStore, Placement, Prefetcher, SwapBudget, build_records
from offload.params.construct import BUILT, built_store
from offload.params.placement import attach_accumulator, parameter_names
from offload.storage import SwapFile
from offload.train import checkpoint
from offload.train.grads import GradReducer
from offload.train.space import check_swap_space, swap_space_needed
from offload.train.loss_scaler import build_loss_scaler
from offload.train.timers import PhaseTimers
from offload.train.deferred import DeferredStep
from offload.train.rollback import StepRollback
from offload.train.surface import (consolidated_state_dict, in_optimizer_order, optimizer_param_groups,
                                   refuse_forward_outside, save_pretrained_gathered, step_scheduler)
from offload.train.writeback import PartitionWriteBack
from tensorio import BufferPool

__all__ = ["Engine", "initialize"]

log = logging.getLogger("offload")


def initialize(args: Any = None, model: nn.Module | None = None, optimizer: Any = None,
               model_parameters: Iterable[Any] | None = None, training_data: Any = None, lr_scheduler: Any = None,
               distributed_port: int = 29500, mpu: Any = None, dist_init_required: bool | None = None,
               collate_fn: Callable | None = None, config: Mapping[str, Any] | str | os.PathLike | None = None,
               mesh_param: Any = None, config_params: Mapping[str, Any] | None = None,
               ) -> tuple["Engine", torch.optim.Optimizer, Any, Any]:
    """Wrap ``model`` in a stage-3 engine, as ``deepspeed.initialize`` does (same arguments, same order).

    Args:
        args: optional; its ``deepspeed_config`` (a path) is the config when ``config`` is not given.
        model: any torch.nn.Module on the CPU. Its parameters are partitioned in place: between uses
            their ``.data`` is empty; use the engine to run it.
        optimizer: None (the config's ``optimizer`` section), a ``torch.optim.Adam``/``AdamW`` whose
            param groups and hyperparameters are taken over, or a callable ``f(params) -> optimizer``.
        model_parameters: None (every trainable parameter), or param group dicts (``{"params": [...],
            "weight_decay": 0.0}``, ...) giving the config's optimizer several groups, each with its own
            lr / betas / eps / weight_decay. A trainable parameter must be in a group.
        training_data: a dataset; when given, a DataLoader of ``train_micro_batch_size_per_gpu`` is returned.
        lr_scheduler: None (the config's ``scheduler``), a scheduler object, or ``f(optimizer)``.
        distributed_port: accepted (torchrun's MASTER_PORT sets the port).
        mpu, mesh_param: must be None (data parallel only).
        dist_init_required: None starts a process group when torchrun launched several ranks; True
            starts one whenever none exists; False never does.
        config: a DeepSpeed-format dict or JSON path without "auto" values (see `resolve_auto`).
            ``config_params`` is DeepSpeed's older name for it.

    Returns ``(engine, optimizer, dataloader or None, lr_scheduler or None)``.
    Raises ValueError for a bad config (naming the key), a missing optimizer, or a parameter the
    engine cannot partition; FileNotFoundError / PermissionError for a bad ``nvme_path``.
    """
    from offload.train.surface import check_distributed_arguments, config_from_arguments

    if model is None and isinstance(args, nn.Module):
        raise ValueError("model: missing; the first positional argument of initialize is args, as in "
                         "deepspeed.initialize: pass model=...")
    if model is None:
        raise ValueError("model: missing; pass model=<the torch.nn.Module to train>")
    config = config_from_arguments(args, config, config_params)
    check_distributed_arguments(dist_init_required, mpu, mesh_param, world_size_from_env())
    if dist_init_required and not (dist.is_available() and dist.is_initialized()):
        dist.init_process_group(backend="nccl" if torch.cuda.is_available() else "gloo")
    world_size, rank, group = _process_group()
    if isinstance(config, EngineConfig):
        cfg = config
    elif isinstance(config, Mapping):
        cfg = EngineConfig.from_dict(config, world_size=world_size)
    else:
        cfg = EngineConfig.from_file(config, world_size=world_size)
    engine = _assemble(model, cfg, world_size=world_size, rank=rank, group=group, optimizer=optimizer,
                       lr_scheduler=lr_scheduler, model_parameters=model_parameters)
    loader = None
    if training_data is not None:
        loader = torch.utils.data.DataLoader(training_data, batch_size=cfg.train_micro_batch_size_per_gpu,
                                             collate_fn=collate_fn, shuffle=world_size == 1,
                                             sampler=None if world_size == 1 else
                                             torch.utils.data.DistributedSampler(training_data, world_size, rank))
    return engine, engine.optimizer, loader, engine.lr_scheduler


def _process_group() -> tuple[int, int, Any]:
    """World size and rank; starts the default process group when launched by torchrun."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), dist.get_rank(), None
    world_size = world_size_from_env()
    if world_size == 1:
        return 1, 0, None  # no process group needed
    dist.init_process_group(backend="nccl" if torch.cuda.is_available() else "gloo")
    return dist.get_world_size(), dist.get_rank(), None


_NO_EFFECT = ("contiguous_gradients", "allgather_partitions", "allgather_bucket_size", "reduce_scatter")

_DEEPSPEED_BUCKET = 500_000_000
"""DeepSpeed's default ``reduce_bucket_size`` (2 GB of fp32 per bucket): in a config it counts as not chosen."""

_BUCKET = 1 << 23
"""Elements of a gradient bucket when the config does not choose: 32 MiB of fp32, about PyTorch DDP's 25 MB."""


def _warn_no_effect(zero: Any) -> None:
    """Say so, rather than silently ignore, when a key this engine does not use is set to a non-default value."""
    defaults = {f.name: f.default for f in dataclasses.fields(ZeroConfig)}
    changed = [key for key in _NO_EFFECT if getattr(zero, key) != defaults[key]]
    if zero.offload_optimizer.fast_init:
        changed.append("offload_optimizer.fast_init")
    if changed:
        log.warning("zero_optimization: %s set but without effect in this engine (gradients are reduced in buckets "
                    "as produced, parameters released after each use); see docs/engine.md",
                    ", ".join(changed))


def _assemble(model: nn.Module, cfg: EngineConfig, *, world_size: int, rank: int, group: Any,
              optimizer: Any, lr_scheduler: Any, model_parameters: Iterable[Any] | None = None) -> "Engine":
    """Build the engine in the order each part needs the one before it.

    All or nothing: on any error the model's parameters get their original tensors back, and every
    swap file, hook and thread made so far is removed, before the error propagates.
    """
    zero = cfg.zero_optimization
    check_nvme_paths(cfg)
    _warn_no_effect(zero)
    with contextlib.ExitStack() as undo:
        originals = [(p, p.data) for p in model.parameters()]  # references, not copies
        undo.callback(_restore, originals)
        engine = _build(model, cfg, undo, world_size=world_size, rank=rank, group=group, optimizer=optimizer,
                        lr_scheduler=lr_scheduler, model_parameters=model_parameters)
        undo.pop_all()  # success: nothing to undo
    dtype = torch.float16 if cfg.fp16.enabled else torch.bfloat16 if cfg.bf16.enabled else None
    if dtype is not None:  # floating buffers follow the parameters, as model.half() would cast them
        for module in model.modules():
            for name, buffer in module._buffers.items():
                if buffer is not None and buffer.is_floating_point():
                    module._buffers[name] = buffer.to(dtype)
    return engine


def _partition(model: nn.Module, cfg: EngineConfig, undo: contextlib.ExitStack, *, world_size: int, rank: int,
               group: Any) -> tuple[list[ParamRecord], SwapFile | None]:
    """Steps 1 and 2 of `_build` for a model built whole: cast, partition, place."""
    zero = cfg.zero_optimization
    offload_param = zero.offload_param
    dtype = torch.float16 if cfg.fp16.enabled else torch.bfloat16 if cfg.bf16.enabled else None
    if dtype is not None:  # parameter by parameter; the originals stay referenced until success
        for p in model.parameters():
            p.data = p.data.to(dtype)
    if world_size > 1:  # every rank starts from rank 0's weights
        for p in model.parameters():
            dist.broadcast(p.data, 0, group=group)
    nvme = offload_param.device == "nvme"
    if nvme:
        check_against_model(cfg, {n: p.numel() for n, p in model.named_parameters()
                                  if p.numel() > zero.stage3_param_persistence_threshold})
    swap = None
    if nvme:
        swap = SwapFile(offload_param.nvme_path, cfg.aio, kind="params", key="zero_optimization.offload_param.nvme_path")
        undo.callback(swap.close)
    placement = Placement(world_size=world_size, rank=rank, swap=swap, max_in_cpu=offload_param.max_in_cpu if nvme else 0,
                          persistence_threshold=zero.stage3_param_persistence_threshold)
    try:
        return build_records(model, placement), swap
    finally:
        placement.finish()  # on an error too: no write is left in flight


def _adopt(model: nn.Module, built: ParamStore, cfg: EngineConfig, *, world_size: int
           ) -> tuple[list[ParamRecord], SwapFile | None]:
    """Steps 1 and 2 of `_build` for a model built under `offload.zero.Init`: take its records as they are,
    named and numbered as the model names its parameters (records of parameters the model dropped, such as
    a weight replaced by a tied one, are left out). Raises ValueError where the config disagrees with the build."""
    key = "zero_optimization.offload_param.device"
    if (built.swap is not None) != (cfg.zero_optimization.offload_param.device == "nvme"):
        raise ValueError(f"{key}: {cfg.zero_optimization.offload_param.device!r}, but the model was built under "
                         f"zero.Init with its parameters {'on NVMe' if built.swap is not None else 'in memory'}; "
                         f"pass initialize() the config zero.Init got")
    if built.world_size != world_size:
        raise ValueError(f"the model was built under zero.Init with {built.world_size} ranks, initialize() runs with "
                         f"{world_size}")
    dtype = torch.float16 if cfg.fp16.enabled else torch.bfloat16 if cfg.bf16.enabled else None
    names = parameter_names(model)
    records = []
    for index, (name, p) in enumerate(model.named_parameters()):
        if dtype is not None and p.dtype != dtype:
            raise ValueError(f"parameter {name!r} is {p.dtype}, the config trains in {dtype}; build the model under "
                             f"zero.Init with the same fp16/bf16 config (or dtype=)")
        rec = built.record_of(p)
        rec.index, rec.names = index, names[id(p)]
        attach_accumulator(rec)
        records.append(rec)
    for rec in records:
        if rec.full is None:
            rec.param.data = torch.empty(0, dtype=rec.param.dtype)
    BUILT.pop(id(built), None)  # the engine owns the swap file from here
    return records, built.swap


def _element_size(cfg: EngineConfig, p: nn.Parameter) -> int:
    """Bytes per element ``p`` will be trained in (fp16/bf16 configs cast it)."""
    return 2 if cfg.fp16.enabled or cfg.bf16.enabled else p.element_size()


def _restore(originals: list[tuple[nn.Parameter, torch.Tensor]]) -> None:
    for param, data in originals:
        param.data = data


def _build(model: nn.Module, cfg: EngineConfig, undo: contextlib.ExitStack, *, world_size: int, rank: int,
           group: Any, optimizer: Any, lr_scheduler: Any, model_parameters: Iterable[Any] | None = None) -> "Engine":
    """`_assemble`'s steps; each thing made is registered in ``undo`` for removal on failure."""
    zero = cfg.zero_optimization
    offload_param, offload_opt = zero.offload_param, zero.offload_optimizer
    built = built_store(model)
    # 0. Refuse now, with the figures, a run whose swap files cannot fit (not with ENOSPC hours later).
    distinct = {id(p): p for p in model.parameters()}.values()
    check_swap_space(cfg, swap_space_needed(
        cfg, [(p.numel(), _element_size(cfg, p), p.requires_grad, None if built is None else built.record_of(p).on_disk)
              for p in distinct], world_size=world_size, grads_on_disk=offload_opt.device == "nvme",
        grads_in_param_slots=_fast_optimizer(cfg, optimizer) and offload_opt.ratio == 1.0))
    if built is not None:  # built under offload.zero.Init: partitioned and placed already
        records, swap = _adopt(model, built, cfg, world_size=world_size)
    else:
        records, swap = _partition(model, cfg, undo, world_size=world_size, rank=rank, group=group)
    budget = SwapBudget(buffer_elements=offload_param.buffer_count * offload_param.buffer_size,
                        max_live=zero.stage3_max_live_parameters)
    store = ParamStore(records=records, world_size=world_size, rank=rank, swap=swap, budget=budget,
                       prefetcher=Prefetcher(bucket_elements=zero.stage3_prefetch_bucket_size), group=group,
                       reuse_distance=zero.stage3_max_reuse_distance)
    # 3. Gradient reduction: hooks on the partitioned parameters' gradient accumulators. Where the
    #    update runs is chosen here (see _update_mode): during backward, each reduced gradient goes
    #    straight to the optimizer (earlier micro-batches' partitions kept in memory and added to it);
    #    in the next forward, the gradients are kept in memory, each one's norm taken as it is reduced;
    #    after backward, with the optimizer state on NVMe, the gradient partitions go there too.
    trainable = [rec for rec in records if rec.param.requires_grad]
    mode = _update_mode(cfg, optimizer, trainable)
    in_backward = mode != AFTER_BACKWARD  # the optimizer's thread runs the updates
    grad_bytes = 4 * sum(rec.partition_numel for rec in trainable)
    keep_grads = grad_bytes <= host_memory_bytes() // _GRADS_SHARE  # kept: across micro-batches, into the next forward
    swap_grads = not in_backward or (not keep_grads and (mode == IN_FORWARD or cfg.gradient_accumulation_steps > 1))
    if in_backward and swap_grads:
        log.info("gradient partitions (%.1f GB in fp32) are kept on disk, not in memory (more than 1/%d of this "
                 "host's): each on-disk fp32 partition's in its free parameter slot, the rest in the gradient swap "
                 "file", grad_bytes / 1e9, _GRADS_SHARE)
    grad_swap = (SwapFile(offload_opt.nvme_path, cfg.aio, kind="grads", key="zero_optimization.offload_optimizer.nvme_path")
                 if offload_opt.device == "nvme" and swap_grads else None)
    if grad_swap is not None:
        undo.callback(grad_swap.close)
    pool = BufferPool(host_memory_bytes() // _POOL_SHARE)  # the step's I/O buffers, faulted in once
    for file in (swap, grad_swap):
        if file is not None:
            file.pool = pool
    bucket = zero.reduce_bucket_size if zero.reduce_bucket_size != _DEEPSPEED_BUCKET else _BUCKET
    # On the fast paths a step's on-disk partitions commit with the optimizer state, so until the next
    # step writes its update there, a partition's other slot is free: an fp32 one holds its gradient.
    reducer = GradReducer(store, world_size=world_size, rank=rank, group=group, swap=grad_swap,
                          bucket_elements=bucket, overlap=zero.overlap_comm,
                          norms=mode == IN_FORWARD, param_slots=in_backward)
    undo.callback(reducer.remove)
    # 4. Optimizer offload: OffloadAdam over the partitions; it plans its sub-groups from their sizes,
    #    so it comes after the partitions exist and before anything runs.
    #    With on-disk partitions updated during backward, applied gradients lent to the optimizer's
    #    read-ahead are capped at the swap budget, so that host memory does not grow with the model.
    #    A sub-group is updated once all its parameters' gradients are in, so until then their
    #    partitions wait in memory: on that path sub-groups are at most one swap buffer.
    writeback = None
    sub_group_size, buffer_count = _swap_sizes(cfg, [rec.partition_numel for rec in trainable], overlap=in_backward)
    spare_limit = None
    window = min(budget.buffer_elements, host_memory_bytes() // (_WINDOW_SHARE * 4))
    if in_backward and any(rec.on_disk for rec in trainable):
        # In the next forward's step, this memory first holds the state read ahead in backward (below).
        spare_limit = window * (_STATE_AHEAD if mode == IN_FORWARD else 4)
        if sub_group_size > offload_param.buffer_size:
            log.info("zero_optimization.sub_group_size %d is cut to offload_param.buffer_size %d: parameters on "
                     "NVMe wait in memory until their whole sub-group is updated", sub_group_size,
                     offload_param.buffer_size)
            sub_group_size = max(1024, offload_param.buffer_size)
    groups = optimizer_param_groups(trainable, optimizer, model_parameters)
    trainable = in_optimizer_order(trainable, groups)  # the optimizer's i-th parameter is trainable[i]'s partition
    with checkpoint.sized_partitions(trainable):
        opt = _build_optimizer(cfg, optimizer, groups, overlap_backward=in_backward,
                               spare_limit=spare_limit, sub_group_size=sub_group_size, buffer_count=buffer_count)
    if hasattr(opt, "close"):
        undo.callback(opt.close)
    rollback = deferred = None
    if in_backward:
        if spare_limit is not None:
            writeback = PartitionWriteBack(store, opt, limit=min(offload_param.buffer_size, window))
        # The parameters commit and roll back with the optimizer's state (docs/engine.md, "Failures").
        rollback = StepRollback(store, limit=offload_param.buffer_size)
        opt.add_step_hooks(on_commit=rollback.committed, on_abort=rollback.aborted)
        if mode == IN_BACKWARD:
            reducer.consumer = functools.partial(_hand_over, opt, writeback, rollback)
        else:  # the forward's gathers wait for, and take, the updated partitions
            deferred = store.updates = DeferredStep(
                store, opt, writeback, trainable, rollback, grad_reads=reducer.start_read if grad_swap else None,
                read_ahead=window)
            # Late in backward (most activations freed), the state of the first updates is read ahead.
            reducer.on_half = functools.partial(opt.read_ahead, window * _STATE_AHEAD)
    scheduler = _build_scheduler(cfg, lr_scheduler, opt)
    # 5. Gather hooks and prefetch: last, since they gather the partitions placed above.
    store.install(model)
    undo.callback(store.remove_hooks)
    return Engine(model, cfg, store, reducer, opt, scheduler, world_size=world_size, rank=rank, group=group,
                  writeback=writeback, rollback=rollback, deferred=deferred)


_SWAP_BUFFER_SHARE = 16
"""OffloadAdam's swap buffers may take at most 1/16 of the host's memory."""

_STATE_AHEAD = 8
"""Bytes per read-ahead window element of optimizer state read ahead during backward for the updates that
the next forward runs first: the fp32 moments of as many elements as the window holds."""

_WINDOW_SHARE = 64
"""The fast paths' read-ahead windows (gradients read back, state read ahead, applied gradients lent to
it, partitions waiting for their update or write-back) hold the swap budget's elements, but at most
1/64 of the host's memory in fp32 bytes each: the budget follows ``offload_param.buffer_size``, which
configs set to the largest parameter (DeepSpeed requires it), and a 3 B GPT-2's embedding made those
windows 1.2-2.5 GB each, far more than the one layer of look-ahead that keeps the disk busy."""

_GRADS_SHARE = 4
"""Gradient partitions kept between backward and the update (accumulation, the step in the next forward)
stay in memory while they take at most 1/4 of the host's; beyond that, in the gradient swap file."""

_POOL_SHARE = 16
"""The step's I/O buffers (partitions read, gradients written) are kept for reuse up to 1/16 of the host's
memory (`tensorio.BufferPool`): faulted in once, not in every step."""


_DEEPSPEED_SUB_GROUP_SIZE = 1_000_000_000
"""DeepSpeed's default ``sub_group_size``: in a config it counts as not chosen."""


def _swap_sizes(cfg: EngineConfig, partition_numels: list[int], *, overlap: bool) -> tuple[int, int]:
    """``(sub_group_size, buffer_count)`` for OffloadAdam. With the optimizer state on NVMe, what the user
    did not choose (``sub_group_size`` absent or DeepSpeed's 1e9, ``buffer_count`` absent) is chosen from the
    parameter sizes and the host's memory (`choose_sub_group_size`, `choose_buffer_count`); a size the config
    sets is cut (with a warning) where ``buffer_count`` x the largest sub-group's state (12 bytes an
    element at most) would take more than 1/16 of host memory.

    DeepSpeed allocates its buffers from the configured size, and its default of 1e9 elements is its
    most reported cause of host OOMs; the update is the same for any sub-group size.
    """
    zero = cfg.zero_optimization
    size = max(1024, zero.sub_group_size)
    count = zero.offload_optimizer.buffer_count
    if count is None:
        count = choose_buffer_count(overlap_backward=overlap)
    if zero.offload_optimizer.device != "nvme":
        return size, count
    host = host_memory_bytes()
    if zero.sub_group_size == _DEEPSPEED_SUB_GROUP_SIZE:
        chosen = choose_sub_group_size(partition_numels, buffer_count=count, host_bytes=host)
        wanted = count * min(size, sum(partition_numels)) * 12
        (log.warning if wanted > host // _SWAP_BUFFER_SHARE else log.info)(
            "zero_optimization.sub_group_size %d (DeepSpeed's default) would make offload_optimizer's %d swap "
            "buffers %.1f GB; using %d, chosen from the parameter sizes and this host's memory (docs/engine.md); set "
            "sub_group_size to choose", size, count, wanted / 1e9, chosen)
        return chosen, count
    allowed = host // _SWAP_BUFFER_SHARE // (count * 12)
    if min(size, sum(partition_numels)) <= allowed:
        return size, count
    bounded = max(1024, allowed // 1024 * 1024)
    log.warning("zero_optimization.sub_group_size %d would make offload_optimizer's %d swap buffers %.1f GB; "
                "using %d (buffers at most 1/%d of this host's memory); set sub_group_size to choose",
                size, count, count * min(size, sum(partition_numels)) * 12 / 1e9, bounded, _SWAP_BUFFER_SHARE)
    return bounded, count


IN_BACKWARD, IN_FORWARD, AFTER_BACKWARD = "during backward", "in the next forward", "after backward"
"""Where a step's update runs (`_update_mode`; docs/engine.md)."""


def _fast_optimizer(cfg: EngineConfig, client: Any) -> bool:
    """Whether the optimizer is ours (`OffloadAdam`, built or taking over a torch Adam/AdamW) with
    state on NVMe: the fast paths' first condition (`_update_mode`)."""
    offload_opt = cfg.zero_optimization.offload_optimizer
    return (offload_opt.device == "nvme" and offload_opt.ratio > 0
            and (client is None or isinstance(client, (torch.optim.Adam, torch.optim.AdamW))))


def _update_mode(cfg: EngineConfig, client: Any, trainable: list[ParamRecord]) -> str:
    """Where each step's update runs, so that the optimizer state's NVMe traffic overlaps compute.

    The fast paths need the optimizer we build (OffloadAdam) with its state on NVMe, and, for on-disk
    partitions (updated from the buffer a pass read and written back by `PartitionWriteBack`), all of
    that state (``ratio`` 1.0):

    - IN_BACKWARD: each partition is updated as soon as its gradient is final, when nothing has to see
      every gradient first: no clipping, no fp16 overflow check. With accumulation, the earlier
      micro-batches' gradient partitions are kept and added to the last one's as it arrives.
    - IN_FORWARD: with gradient clipping or fp16, the step validates (global norm, overflow) after
      backward and the updates run during the next forward, in its order (`DeferredStep`); this needs
      the whole state offloaded.
    - AFTER_BACKWARD otherwise: the chunked step.
    """
    offload_opt = cfg.zero_optimization.offload_optimizer
    if not _fast_optimizer(cfg, client) or (offload_opt.ratio < 1.0 and any(rec.on_disk for rec in trainable)):
        return AFTER_BACKWARD
    if cfg.gradient_clipping == 0 and not cfg.fp16.enabled:
        return IN_BACKWARD
    return IN_FORWARD if offload_opt.ratio == 1.0 else AFTER_BACKWARD


def _hand_over(opt: OffloadAdam, writeback: PartitionWriteBack | None, rollback: StepRollback, rec: ParamRecord,
               grad: torch.Tensor) -> None:
    """Give a reduced gradient partition to the optimizer, which updates it in the background."""
    rollback.before_update(rec)
    if rec.on_disk:
        writeback.hand_over(rec, grad)
        return
    opt.grad_ready(rec.partition, grad=grad.view(rec.partition.shape))


def _build_optimizer(cfg: EngineConfig, client: Any, params: list[dict[str, Any]], *,
                     overlap_backward: bool = False, spare_limit: int | None = None,
                     sub_group_size: int, buffer_count: int) -> torch.optim.Optimizer:
    """OffloadAdam over the param groups ``params`` with the config's or the client optimizer's hyperparameters."""
    off = cfg.zero_optimization.offload_optimizer
    swap = dict(nvme_offload_fraction=off.ratio if off.device == "nvme" else 0.0,
                nvme_offload_dir=off.nvme_path if off.device == "nvme" else None,
                buffer_count=buffer_count, pin_memory=off.pin_memory, pipeline_read=off.pipeline_read,
                pipeline_write=off.pipeline_write, sub_group_size=sub_group_size,
                aio=cfg.aio, overlap_backward=overlap_backward, spare_limit=spare_limit)
    if client is None:
        if cfg.optimizer is None:
            raise ValueError('optimizer: the config has no "optimizer" section and no optimizer was passed; add '
                             '"optimizer": {"type": "AdamW", "params": {"lr": ...}} or pass optimizer=')
        hp = cfg.optimizer.params
        return OffloadAdam(params, lr=hp.lr, betas=hp.betas, eps=hp.eps, weight_decay=hp.weight_decay,
                           adamw_mode=cfg.optimizer.decoupled_weight_decay, **swap)
    if cfg.optimizer is not None:
        raise ValueError('optimizer: given both in the config and as optimizer=; keep one')
    if isinstance(client, (torch.optim.Adam, torch.optim.AdamW)):
        d = client.defaults  # each group's own lr, betas, eps and weight_decay are in ``params``
        if d.get("amsgrad"):
            raise ValueError("optimizer=: amsgrad=True is not supported; use amsgrad=False")
        adamw = isinstance(client, torch.optim.AdamW) or bool(d.get("decoupled_weight_decay", False))
        return OffloadAdam(params, lr=d["lr"], betas=d["betas"], eps=d["eps"], weight_decay=d["weight_decay"],
                           adamw_mode=adamw, **swap)
    if callable(client):
        return client(params if len(params) > 1 else params[0]["params"])
    raise ValueError(f"optimizer=: a {type(client).__name__} cannot be taken over; pass a torch.optim.Adam or "
                     f"AdamW, a callable f(params) -> optimizer, or None with an optimizer section in the config")


def _build_scheduler(cfg: EngineConfig, client: Any, opt: torch.optim.Optimizer) -> Any:
    if client is not None:
        if cfg.scheduler is not None:
            raise ValueError('scheduler: given both in the config and as lr_scheduler=; keep one')
        return client(opt) if callable(client) and not hasattr(client, "step") else client
    if cfg.scheduler is None:
        return None
    from offload.train.schedulers import build_scheduler  # the config's schedule
    return build_scheduler(cfg.scheduler, opt)


class Engine:
    """A model trained with partitioned, offloaded parameters and optimizer state. Made by `initialize`."""

    def __init__(self, module: nn.Module, config: EngineConfig, store: ParamStore, reducer: GradReducer,
                 optimizer: torch.optim.Optimizer, lr_scheduler: Any, *, world_size: int, rank: int,
                 group: Any, writeback: PartitionWriteBack | None = None, rollback: StepRollback | None = None,
                 deferred: DeferredStep | None = None) -> None:
        self.module = module
        self.config = config
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self.world_size, self.rank, self.group = world_size, rank, group
        self.global_steps = 0
        self.micro_steps = 0
        self.skipped_steps = 0
        self.loss_scaler = build_loss_scaler(config.fp16) if config.fp16.enabled else None
        self._store = store
        self._reducer = reducer
        self._writeback = writeback
        self._rollback = rollback
        """The fast paths' commit rule for parameters (None: the chunked step after backward)."""
        self._deferred = deferred
        """The step that runs in the next forward (None: the update runs during or after backward)."""
        self._chunks = _step_chunks(store.records, config)
        self._failure: str | None = None
        """Why the model's parameters may be partly updated (a step failed part way); None: they are whole."""
        self._last_checkpoint: str | None = None
        self._grads_failure: str | None = None
        """Why the accumulated gradients are incomplete (a backward failed); cleared by zero_grad."""
        self._rolled_back: str | None = None
        """The last step that failed and was rolled back entirely (training may go on)."""
        self.timers = PhaseTimers.from_config(config, log=log.info if rank == 0 else (lambda line: None))
        self._boundary: bool | None = None
        """`set_gradient_accumulation_boundary`'s override (None: count micro steps)."""
        self._fresh_grads = False
        """Gradients accumulated since the last step or zero_grad (`get_global_grad_norm` reads them)."""
        self._lr_kwargs: Mapping[str, Any] = {}
        self._last_grad_norm: float | None = None
        """The global gradient norm of the last step (before clipping, unscaled), None before the first."""
        optimizer.overflow = False  # DeepSpeed's ZeRO optimizers' flag: whether the last step was skipped
        self._finalizer = weakref.finalize(self, _close, store, reducer, optimizer)
        save_pretrained_gathered(self)  # engine.module.save_pretrained() writes the real weights
        self.forwarding = 0
        """Forwards running through the engine (a forward with gradients of ``module`` alone is refused)."""
        refuse_forward_outside(self)

    # ---- training ---------------------------------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Run the model's forward pass (parameters are gathered module by module)."""
        return self.forward(*args, **kwargs)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the model's forward pass (parameters are gathered module by module). After a step whose
        update runs in the next forward, this is it: each gather waits for, and uses, its updated partition.
        Raises the update's error (TensorIOError) when it failed; the step is then rolled back."""
        if self._deferred is None:
            self._settle()
        self._store.begin_forward()
        self.forwarding += 1
        try:
            with self.timers.phase("forward"), self._store.saved_tensor_hooks():
                return self.module(*args, **kwargs)
        except BaseException as error:
            if self._deferred is not None and self._deferred.failed:
                self._give_up(error, gradients_lost=False)  # the update of the last step failed
            raise
        finally:
            self.forwarding -= 1

    def backward(self, loss: torch.Tensor, release_loss: bool = False, retain_graph: bool = False,
                 scale_wrt_gas: bool = True) -> torch.Tensor:
        """Backpropagate ``loss`` (divided by gradient_accumulation_steps unless ``scale_wrt_gas`` is
        False, times the fp16 loss scale); return the loss backpropagated before the loss scale, as
        DeepSpeed does. ``release_loss`` is accepted (DeepSpeed ignores it too).

        Gradients are reduced to this rank's partitions as they are produced.
        """
        if self.config.gradient_accumulation_steps > 1 and scale_wrt_gas:
            loss = loss / self.config.gradient_accumulation_steps
        scaled = self.loss_scaler.scale_loss(loss) if self.loss_scaler is not None else loss
        self._fresh_grads = True
        # Sync point: the last step's updates have run, and, where this backward's gradients go to the
        # partitions' free slots, the step has committed (raises after giving it up).
        self._finish_last_step(commit=self._reducer.param_slots)
        boundary = self.is_gradient_accumulation_boundary()
        # The micro-batch that ends an accumulation hands its gradients to the optimizer (plus the kept ones).
        self._reducer.start_backward(boundary)
        if self._deferred is not None and boundary:  # the next forward's first updates find their partitions
            self._deferred.prepare(self._store.budget.buffer_elements // 2)
        # On-disk partitions updated during backward keep the buffer their backward read (see _writeback.py).
        updating = self._reducer.consumer is not None and boundary
        self._store.begin_backward(keep_for_update=updating and self._writeback is not None)
        try:
            if updating:
                self._rollback.begin_step()
            # Saved-tensor hooks here too: reentrant activation checkpointing re-runs forward in backward.
            with self.timers.phase("backward"), self._store.saved_tensor_hooks():
                scaled.backward(retain_graph=retain_graph)
                self._reducer.flush()  # sync point: the last buckets' reductions
        except BaseException as error:
            self._reducer.abandon()
            if updating:  # this backward's updates are given up (the last step committed before they began)
                self._give_up(error, gradients_lost=True)
            else:
                self._grads_failure = (f"the backward of step {self.global_steps + 1} failed ({type(error).__name__}: "
                                       f"{error}), so the accumulated gradients are incomplete")
            raise
        finally:
            self._store.end_backward()  # sync point: every gathered parameter and unused prefetch is released
        return loss

    def is_gradient_accumulation_boundary(self) -> bool:
        """True when the next ``step()`` updates the parameters: every gradient_accumulation_steps micro
        steps, or as `set_gradient_accumulation_boundary` said."""
        if self._boundary is not None:
            return self._boundary
        return (self.micro_steps + 1) % self.config.gradient_accumulation_steps == 0

    def set_gradient_accumulation_boundary(self, is_boundary: bool | None) -> None:
        """Say, before each micro batch's backward, whether the next ``step()`` updates (DeepSpeed's
        override, which Accelerate sets from its ``sync_gradients``); None: count micro steps again."""
        self._boundary = is_boundary

    def step(self, lr_kwargs: Mapping[str, Any] | None = None) -> None:
        """End a micro step; at a gradient-accumulation boundary, update the parameters. ``lr_kwargs``
        are passed to the scheduler's ``step`` (as DeepSpeed does).

        Raises tensorio.TensorIOError when the swap files fail, RuntimeError when fp16 overflows at
        the minimum loss scale.
        """
        self._check_not_failed("step")
        if self._grads_failure is not None:
            raise RuntimeError(f"cannot step: {self._grads_failure}; call zero_grad() and run the accumulation "
                               f"again, or load_checkpoint(...)")
        if self.is_gradient_accumulation_boundary():
            self._last_grad_norm = self._step_norm()
            snapshot = self._counters() if self._rollback is not None else None
            skipped = self.skipped_steps
            self._lr_kwargs = lr_kwargs or {}
            with self.timers.phase("step"):
                self._optimizer_step(snapshot)
            self.optimizer.overflow = self.skipped_steps > skipped
            self.global_steps += 1
            if self.global_steps % self.config.steps_per_print == 0:
                self._report()
            self.timers.step_done()  # wall_clock_breakdown: its own line every steps_per_print steps
        self.micro_steps += 1

    def _report(self) -> None:
        """Every steps_per_print steps: log the step, learning rates, skipped steps and loss scale."""
        scale = f", loss scale {self.loss_scaler.loss_scale:g}" if self.loss_scaler is not None else ""
        if self.rank == 0:
            log.info(f"step {self.global_steps}: lr {self.get_lr()}, skipped {self.skipped_steps}{scale}")

    def _failed(self, error: BaseException) -> None:
        """A step failed after it began to change parameters: refuse to step or save until a load."""
        self._failure = f"step {self.global_steps + 1} failed part way ({type(error).__name__}: {error})"

    def _give_up(self, error: BaseException, *, gradients_lost: bool) -> None:
        """A step on a fast path failed: join the optimizer's thread and give up every uncommitted step
        (`StepRollback`). When that undid everything, the counters, schedule and loss scale go back to
        the last committed step and training may go on (with ``gradients_lost``, from a new backward);
        otherwise refuse to step or save until a load."""
        self._abandon_updates()
        self._store.release_all()  # reads in flight or failed (a failed prefetch would fail its next gather)
        total, snapshot, uncopied = self._rollback.take_aborts()
        if not total:
            self._failed(error)
            self._failure += (f"; the in-memory partitions {', '.join(uncopied[:3])}{' ...' if len(uncopied) > 3 else ''} "
                              f"were updated without a copy to undo it (beyond offload_param.buffer_size elements)")
            return
        failed_step = self.global_steps + 1
        if snapshot is not None:
            self._restore_counters(snapshot)
            failed_step = self.global_steps + 1
        self._rolled_back = (f"step {failed_step} failed ({type(error).__name__}: {error}) and was rolled back "
                             f"entirely: parameters and optimizer state are those after step {self.global_steps}")
        log.warning("%s", self._rolled_back)
        if gradients_lost:
            self._grads_failure = f"{self._rolled_back}, and the gradients of this accumulation are lost"

    def _counters(self) -> dict[str, Any]:
        """What a step changes besides parameters and optimizer state, to undo it (`_give_up`)."""
        return {"global_steps": self.global_steps, "skipped_steps": self.skipped_steps,
                "micro_steps": self.micro_steps + 1 - self.config.gradient_accumulation_steps,
                "lr": [group["lr"] for group in self.optimizer.param_groups],
                "lr_scheduler": copy.deepcopy(self.lr_scheduler.state_dict()) if self.lr_scheduler is not None else None,
                "loss_scaler": self.loss_scaler.state_dict() if self.loss_scaler is not None else None}

    def _restore_counters(self, snapshot: dict[str, Any]) -> None:
        self.global_steps, self.skipped_steps = snapshot["global_steps"], snapshot["skipped_steps"]
        self.micro_steps = snapshot["micro_steps"]
        for group, lr in zip(self.optimizer.param_groups, snapshot["lr"]):
            group["lr"] = lr
        if snapshot["lr_scheduler"] is not None:
            self.lr_scheduler.load_state_dict(snapshot["lr_scheduler"])
        if snapshot["loss_scaler"] is not None:
            self.loss_scaler.load_state_dict(snapshot["loss_scaler"])

    def _check_not_failed(self, what: str) -> None:
        if self._failure is not None:
            resume = (f"load_checkpoint({os.path.dirname(self._last_checkpoint)!r}, "
                      f"tag={os.path.basename(self._last_checkpoint)!r})" if self._last_checkpoint else
                      "load_checkpoint(...) with your last checkpoint")
            raise RuntimeError(f"cannot {what}: {self._failure}, so some parameters may carry its update and others "
                               f"not; {what} would go on from a mixed model. Resume with {resume}")

    def _optimizer_step(self, snapshot: dict[str, Any] | None) -> None:
        records = [rec for rec in self._store.records if rec.param.requires_grad]
        if self._reducer.consumer is not None:  # partitions were updated during backward
            self._rollback.counted(snapshot)
            try:
                self.optimizer.step()  # sync point: waits for those updates; steps any partition left
                if self._writeback is not None:
                    self._writeback.finish()  # sync point: on-disk partitions written back
            except BaseException as error:
                self._give_up(error, gradients_lost=True)
                raise
            self._finish_step(records)
            return
        if self._deferred is not None:
            self._step_in_next_forward(records, snapshot)
            return
        try:
            factor = self._unscale_and_clip(records)
        except BaseException as error:  # nothing is updated yet: the parameters are whole
            self._grads_failure = (f"step {self.global_steps + 1} failed before its update ({type(error).__name__}: "
                                   f"{error}): its gradients are lost, the parameters are whole")
            raise
        if factor is None:  # fp16 overflow: the step is skipped
            self.skipped_steps += 1
            self.zero_grad()
            return
        # 3. The update, chunk by chunk: NVMe partitions (and offloaded gradients) are read in,
        #    stepped and written back. Three chunks are in memory at most: the next one being read,
        #    this one being stepped, the previous one being written (each a third of the swap budget).
        try:
            self._update_in_chunks(factor)
        except BaseException as error:
            self._failed(error)
            raise
        self._store.commit_slots()  # every partition's write has landed
        self._finish_step(records)

    def _step_in_next_forward(self, records: list[ParamRecord], snapshot: dict[str, Any]) -> None:
        """A step whose update runs in the next forward (`DeferredStep`): check the gradients (fp16
        overflow, global norm) from each partition's norm, taken as it was reduced, then hand the step
        over with the clip coefficient times the inverse loss scale; the schedule steps now (the update
        uses the hyperparameters of this moment)."""
        try:
            self._reducer.drain()  # sync point: every offloaded gradient is on disk
            factor = self._step_factor([rec.grad_norm for rec in records if rec.grad_norm is not None])
            if factor is not None:
                grads = {rec.index: rec.grad for rec in records if rec.grad is not None}
                grads.update({rec.index: None for rec in records if rec.grad_on_disk})  # read back in the forward
                self._rollback.begin_step()
                self._rollback.counted(snapshot)
                self._deferred.begin(grads, factor)  # prefetches the forward's first partitions
                del grads
        except BaseException as error:
            if self._rollback.uncommitted:
                self._give_up(error, gradients_lost=True)
            else:  # nothing is updated yet: the parameters are whole
                self._grads_failure = (f"step {self.global_steps + 1} failed before its update ({type(error).__name__}: "
                                       f"{error}): its gradients are lost, the parameters are whole")
            raise
        if factor is None:  # fp16 overflow: the step is skipped
            self._store.keep_next = set()  # the buffers kept for its updates are prefetched ones now
            self.skipped_steps += 1
            self.zero_grad()
            return
        if self.lr_scheduler is not None:
            step_scheduler(self.lr_scheduler, self._lr_kwargs)
        self.zero_grad()  # the step holds the gradients now

    def _finish_last_step(self, *, commit: bool = False) -> None:
        """Let the step handed to the next forward finish and, with ``commit``, wait until the last step
        has committed, so that gradients written to the partitions' free slots overwrite nothing a
        rollback needs (sync points); give the step up if it failed."""
        try:
            if self._deferred is not None:
                self._deferred.finish()
            if commit and self._rollback.uncommitted:
                self.optimizer.synchronize()
        except BaseException as error:
            self._give_up(error, gradients_lost=False)
            raise

    def _update_in_chunks(self, factor: float) -> None:
        """Phase 3 of a step without updates during backward (see `_optimizer_step`)."""
        chunks = self._chunks
        grad_reads = self._start_chunk(chunks[0]) if chunks else {}
        writing: tuple[list[ParamRecord], list] = ([], [])
        for i, chunk in enumerate(chunks):
            next_reads = self._start_chunk(chunks[i + 1]) if i + 1 < len(chunks) else {}
            # Sync point: this chunk's partitions and gradients have arrived.
            self._store.finish_loads(chunk)
            for rec in chunk:
                grad = rec.grad
                if rec.index in grad_reads:
                    buffer, future = grad_reads[rec.index]
                    future.result()
                    grad = buffer
                if grad is not None:
                    rec.partition.grad = (grad if factor == 1.0 else grad.mul_(factor)).to(rec.partition.dtype)
            self.optimizer.step()
            for rec in chunk:
                rec.partition.grad = None
            self._store.finish_stores(*writing)  # sync point: the previous chunk is on disk
            writing = (chunk, self._store.start_stores(chunk))
            grad_reads = next_reads
        self._store.finish_stores(*writing)

    def _abandon_updates(self) -> None:
        """After a failure on a fast path (or before a load): the optimizer's thread is joined and its
        uncommitted steps forgotten first (nothing commits; the parameters roll back with them), then
        every partition handed over is let go."""
        self.optimizer.abandon_step()
        if self._writeback is not None:
            self._writeback.abort()
        if self._deferred is not None:
            self._deferred.abandon()

    def _settle(self) -> None:
        """Before partitions are read between backward and step, or between a step and the forward that
        runs its update (a save, `full_parameters`): every update handed over so far has run and its
        write-back landed, so the swap file holds what it says."""
        self._finish_last_step()
        if self._writeback is not None:
            self._writeback.settle()

    def _finish_step(self, records: list[ParamRecord]) -> None:
        """After the update: regather kept parameters whose partition is not the parameter itself,
        step the learning-rate schedule, drop the gradients, and start reading the partitions the next
        forward needs first."""
        for rec in records:
            self._store.refresh(rec)
        if self.lr_scheduler is not None:
            step_scheduler(self.lr_scheduler, self._lr_kwargs)
        self.zero_grad()
        self._store.prefetch_from_start()

    def _start_chunk(self, chunk: list[ParamRecord]) -> dict:
        """Start the reads of a chunk's on-disk partitions and offloaded gradients."""
        self._store.start_loads(chunk)
        return {rec.index: self._reducer.start_read(rec) for rec in chunk if rec.grad_on_disk}

    def _unscale_and_clip(self, records: list[ParamRecord]) -> float | None:
        """Phases 1 and 2 of a step after backward: the factor every gradient is multiplied by as it
        is applied (`_step_factor`), or None when fp16 overflowed."""
        self._reducer.drain()  # sync point: every offloaded gradient is on disk
        # Offloaded gradients are summarised by their partition's norm: the global norm and the
        # overflow check need nothing else.
        norms = [torch.linalg.vector_norm(rec.grad) for rec in records if rec.grad is not None]
        norms += [rec.grad_norm for rec in records if rec.grad_on_disk]
        return self._step_factor(norms)

    def _step_factor(self, norms: list[torch.Tensor]) -> float | None:
        """From the gradient partitions' norms (this rank's; every rank calls this): the factor each
        gradient is multiplied by in the update, the clip coefficient times the inverse loss scale, or
        None when fp16 overflowed (the step is skipped; the loss scale is updated either way).

        As ``torch.nn.utils.clip_grad_norm_`` (bit for bit at world size 1): multiplied by ``max_norm /
        (norm + 1e-6)`` when that is below 1, ``norm`` the global norm of the unscaled gradients; with fp16,
        one multiply for both (DeepSpeed's combined scale), unscaled by the loss scale of their backward
        (the scale before this step's update of it)."""
        from offload.train.clip import clip_coefficient, total_norm

        factor = 1.0
        # 1. fp16: a step with an inf/NaN gradient on any rank is skipped and the scale lowered.
        if self.loss_scaler is not None:
            scale = self.loss_scaler.loss_scale
            overflow = self.loss_scaler.has_overflow(norms, group=self.group)
            self.loss_scaler.update(overflow)
            if overflow:
                return None
            factor = 1.0 / scale
        # 2. Clip by the global norm over all ranks' partitions.
        if self.config.gradient_clipping > 0:
            norm = total_norm(norms, group=self.group)
            factor *= clip_coefficient(norm * factor if factor != 1.0 else norm, self.config.gradient_clipping)
        return factor

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop the accumulated gradient partitions (in memory and offloaded)."""
        self._grads_failure = None
        self._fresh_grads = False
        self._reducer.clear()
        for rec in self._store.records:
            rec.partition.grad = None

    def train(self, mode: bool = True) -> "Engine":
        """Put the model in training mode."""
        self.module.train(mode)
        return self

    def eval(self) -> "Engine":
        """Put the model in evaluation mode."""
        self.module.eval()
        return self

    def parameters(self, recurse: bool = True) -> Iterable[nn.Parameter]:
        """The model's parameters (DeepSpeed's engine is a module; trainers count and iterate them).
        Between uses their ``.data`` is empty: their shapes are in `records`."""
        return self.module.parameters(recurse)

    def named_parameters(self, prefix: str = "", recurse: bool = True) -> Iterable[tuple[str, nn.Parameter]]:
        """The model's named parameters (see `parameters`)."""
        return self.module.named_parameters(prefix, recurse)

    def get_lr(self) -> list[float]:
        """The learning rate of each param group."""
        return [group["lr"] for group in self.optimizer.param_groups]

    def get_global_grad_norm(self) -> float | None:
        """The global L2 norm of the gradients over all ranks, before clipping: of those accumulated
        since the last step (between backward and step), else of the last step's, as DeepSpeed keeps
        it (None before the first step). Under fp16 the last step's is unscaled."""
        if not self._fresh_grads:
            return self._last_grad_norm
        return self._accumulated_norm()

    def _step_norm(self) -> float:
        """The norm `get_global_grad_norm` keeps for the step about to run (fp16: unscaled). Its wait for
        the gradients' writes may raise their error: handled as the step's own check would handle it."""
        try:
            norm = self._accumulated_norm()
        except BaseException as error:
            if self._rollback is not None and self._rollback.uncommitted:  # updates ran during backward
                self._give_up(error, gradients_lost=True)
            else:  # nothing is updated yet: the parameters are whole
                self._grads_failure = (f"step {self.global_steps + 1} failed before its update ({type(error).__name__}: "
                                       f"{error}): its gradients are lost, the parameters are whole")
            raise
        return norm / self.loss_scaler.loss_scale if self.loss_scaler is not None else norm

    def _accumulated_norm(self) -> float:
        total = torch.zeros((), dtype=torch.float64)
        self._reducer.drain()
        for rec in self._store.records:
            if rec.grad_norm is not None:  # taken as it was reduced (offloaded, applied during backward, or kept)
                total += rec.grad_norm.double() ** 2
            elif rec.grad is not None:
                total += torch.linalg.vector_norm(rec.grad).double() ** 2
        if self.world_size > 1:
            dist.all_reduce(total, group=self.group)
        return float(total.sqrt())

    @property
    def records(self) -> list[ParamRecord]:
        """One record per (tied) parameter: partition, location, state (see offload/_params.py)."""
        return self._store.records

    def io_bytes(self) -> dict[str, int]:
        """Bytes read from and written to the parameter swap file so far."""
        return self._store.io_bytes()

    # ---- checkpoints ------------------------------------------------------------------------------------

    def save_checkpoint(self, save_dir: str | os.PathLike, tag: str | None = None,
                        client_state: Mapping[str, Any] | None = None, save_latest: bool = True,
                        exclude_frozen_parameters: bool = False) -> str:
        """Save this rank's parameter partitions, optimizer state (offloaded included), loss scale,
        scheduler, counters and ``client_state`` under ``save_dir/tag`` (default tag
        ``global_step<N>``); return the path. Layout and guarantees: `offload.train.checkpoint`.

        Streamed: one partition and one optimizer sub-group in memory at a time, whatever the model's
        size. Written atomically: until the new tag is complete the previous checkpoint and ``latest``
        are untouched. Nothing is pickled: ``client_state`` holds JSON values and tensors. Every rank
        must call it. ``save_latest`` False leaves ``latest`` as it was. ``exclude_frozen_parameters``
        leaves out the partitions of parameters with ``requires_grad=False`` (a load keeps the model's
        values for them). Returns the path (DeepSpeed returns True; a path is true too). Raises TypeError
        for a ``client_state`` entry that is neither, OSError naming the file (ENOSPC, ...), TensorIOError.
        """
        self._check_not_failed("save a checkpoint")
        tag = tag if tag is not None else f"global_step{self.global_steps}"
        self._settle()
        state = {"global_steps": self.global_steps, "micro_steps": self.micro_steps,
                 "skipped_steps": self.skipped_steps, "world_size": self.world_size,
                 "loss_scaler": self.loss_scaler.state_dict() if self.loss_scaler is not None else None,
                 "lr_scheduler": self.lr_scheduler.state_dict() if self.lr_scheduler is not None else None,
                 "client_state": dict(client_state or {})}
        path = checkpoint.save_checkpoint(save_dir, tag, rank=self.rank, group=self.group, store=self._store,
                                          optimizer=self.optimizer, state=state, update_latest=save_latest,
                                          exclude_frozen=exclude_frozen_parameters)
        self._last_checkpoint = path
        return path

    def load_checkpoint(self, load_dir: str | os.PathLike, tag: str | None = None, load_module_strict: bool = True,
                        load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                        load_module_only: bool = False, custom_load_fn: Callable | None = None
                        ) -> tuple[str | None, dict[str, Any] | None]:
        """Load a checkpoint written by ``save_checkpoint`` (tag None: the one ``latest`` names).

        Streamed like the save; never unpickles. Returns ``(path, client_state)``, or ``(None, None)``
        with a warning when ``tag`` is None and ``load_dir`` has no ``latest`` (as DeepSpeed does).
        ``load_optimizer_states`` False keeps the optimizer's state (fp32 training only: under fp16/bf16
        the master weights are optimizer state); ``load_lr_scheduler_states`` False keeps the schedule;
        ``load_module_only`` loads the parameters alone (no optimizer, schedule, loss scale or counters).
        ``load_module_strict`` False is accepted: the checkpoint's parameters must still be the model's.
        Raises FileNotFoundError for a missing tag and ValueError when it was saved with another
        world size or for another model (before any parameter changes), or for ``custom_load_fn``.
        """
        from offload.train.surface import check_load_arguments

        if tag is None and not os.path.isfile(os.path.join(os.fspath(load_dir), "latest")):
            log.warning("load_checkpoint: %s has no 'latest' file; nothing loaded (pass tag= to load a given "
                        "checkpoint)", os.fspath(load_dir))
            return None, None
        load_optimizer = check_load_arguments(self.config, load_optimizer_states=load_optimizer_states,
                                              load_module_only=load_module_only, custom_load_fn=custom_load_fn)
        if self._rollback is not None:
            self._abandon_updates()  # updates still running would write over the loaded values
            self._rollback.take_aborts()
        self._store.release_all()  # partitions read ahead would hold the values from before the load
        path, state = checkpoint.load_checkpoint(load_dir, tag, rank=self.rank, world_size=self.world_size,
                                                 store=self._store, optimizer=self.optimizer if load_optimizer else None)
        self.zero_grad()
        if not load_module_only:
            if self.loss_scaler is not None and state["loss_scaler"] is not None:
                self.loss_scaler.load_state_dict(state["loss_scaler"])
            if self.lr_scheduler is not None and state["lr_scheduler"] is not None and load_lr_scheduler_states:
                self.lr_scheduler.load_state_dict(state["lr_scheduler"])
            self.global_steps, self.micro_steps = state["global_steps"], state["micro_steps"]
            self.skipped_steps = state["skipped_steps"]
        self._failure, self._last_checkpoint = None, path  # every partition holds the checkpoint's values
        self._rolled_back = None
        return path, state["client_state"]

    def load_pretrained(self, checkpoint_dir: str | os.PathLike) -> list[str]:
        """Read a Hugging Face checkpoint (config.json beside model.safetensors, or shards with their
        index) into the partitions, tensor by tensor through tensorio: never whole in memory. Call it
        before the first step (the optimizer's state is not touched). Returns the checkpoint's tensors
        the model has no place for. Raises FileNotFoundError / SafetensorsError naming the file, and
        ValueError for missing parameters or a shape mismatch (before any partition changes)."""
        from offload.params.pretrained import load_pretrained

        if self._rollback is not None:
            self._abandon_updates()
            self._rollback.take_aborts()
        self._store.release_all()
        return load_pretrained(self.module, self._store, os.fspath(checkpoint_dir), self.config.aio)

    def save_16bit_model(self, save_dir: str | os.PathLike, save_filename: str = "model.safetensors") -> bool:
        """Write the whole model's weights (in the training dtype: 16-bit under fp16/bf16) to
        ``save_dir/save_filename`` as safetensors, gathered across ranks; rank 0 writes it.

        Tied parameters are saved once, under their first name. Returns False (and logs why) when
        zero_optimization.stage3_gather_16bit_weights_on_model_save is false, as DeepSpeed does.
        Every rank must call it. Streamed: one gathered parameter in memory at a time; the file
        appears whole or not at all. Raises ValueError for a ``save_filename`` with a directory part,
        OSError naming the file when it cannot be written.
        """
        if not self.config.zero_optimization.stage3_gather_16bit_weights_on_model_save:
            log.warning("save_16bit_model: nothing saved; set zero_optimization."
                        "stage3_gather_16bit_weights_on_model_save to true to gather the weights")
            return False
        self._settle()
        checkpoint.save_16bit_model(save_dir, save_filename, rank=self.rank, world_size=self.world_size,
                                    group=self.group, store=self._store)
        return True

    # ---- full parameters ----------------------------------------------------------------------------

    def full_parameters(self) -> Iterable[tuple[str, torch.Tensor]]:
        """Yield (name, full tensor) for every parameter, gathered one at a time (a copy each)."""
        self._settle()
        for rec in self._store.records:
            kept = rec.full is not None
            full = self._store.gather(rec).view(rec.shape).clone()
            if not kept:
                self._store.release(rec)
            for name in rec.names:
                yield name, full

    def zero_gather_16bit_weights_on_model_save(self) -> bool:
        """zero_optimization.stage3_gather_16bit_weights_on_model_save: whether `save_16bit_model` writes."""
        return self.config.zero_optimization.stage3_gather_16bit_weights_on_model_save

    def _zero3_consolidated_16bit_state_dict(self, exclude_frozen_parameters: bool = False) -> dict[str, torch.Tensor] | None:
        """The whole model's state dict (parameters in the training dtype, gathered one at a time, and
        persistent buffers) on rank 0, None on the other ranks, as DeepSpeed's: what Hugging Face's
        Trainer saves with ``save_pretrained``. Every rank must call it. The whole model is in rank 0's
        memory: for a model larger than memory use `save_16bit_model`, which streams."""
        return consolidated_state_dict(self.module, self.full_parameters(), rank=self.rank,
                                       exclude_frozen_parameters=exclude_frozen_parameters)

    @property
    def closed(self) -> bool:
        """Whether `close` ran (the swap files are gone; the parameters cannot be gathered any more)."""
        return not self._finalizer.alive

    def destroy(self) -> None:
        """DeepSpeed's name for releasing the engine's resources: `close`."""
        self.close()

    def close(self) -> None:
        """Remove the hooks, the parameter swap file and the optimizer's swap file.

        With more than one rank it also collects garbage now: tensors a collective used, left in
        reference cycles, were otherwise freed during interpreter shutdown, after
        ``destroy_process_group``, where gloo's teardown then aborted the process ("terminate called
        without an active exception": 2 of 24 two-rank runs of benchmarks/engine_dist.py here, none of
        124 with the collection).
        """
        self._finalizer()
        if self.world_size > 1:
            gc.collect()


def _step_chunks(records: list[ParamRecord], cfg: EngineConfig) -> list[list[ParamRecord]]:
    """Trainable records in order, cut so that the on-disk partitions of a chunk fit a third of the swap
    budget (three chunks are in memory during the step); a partition larger than that is a chunk alone."""
    limit = cfg.zero_optimization.offload_param.buffer_count * cfg.zero_optimization.offload_param.buffer_size // 3
    chunks, current, held = [], [], 0
    for rec in records:
        if not rec.param.requires_grad:
            continue
        size = rec.partition_numel if rec.on_disk else 0
        if current and held + size > limit:
            chunks.append(current)
            current, held = [], 0
        current.append(rec)
        held += size
    if current:
        chunks.append(current)
    return chunks


def _close(store: ParamStore, reducer: GradReducer, optimizer: Any) -> None:
    reducer.remove()
    if hasattr(optimizer, "close"):
        optimizer.close()
    store.close()

