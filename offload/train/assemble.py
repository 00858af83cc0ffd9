"""Assembly: the engine built from a model and a validated config, in the order each part needs the one
before it (`assemble`), all or nothing.

1. swap space checked; parameters cast, partitioned and placed (or adopted from `offload.zero.Init`);
2. the parameter store (gather, release, prefetch);
3. the update mode (`choose_update_mode`) and the sizes for it on this host (`plan_sizes`);
4. gradient reduction (hooks on the parameters' gradient accumulators);
5. the optimizer (OffloadAdam plans its sub-groups from the partitions' sizes) and the scheduler;
6. the update path of the mode, wired to the reducer, the store and the optimizer;
7. the gather hooks, last, since they gather the partitions placed above.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import logging
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist
from torch import nn

from offload.config import EngineConfig, ZeroConfig, check_against_model, check_nvme_paths
from offload.device import CpuDevice, Device, local_ranks
from offload.optim import OffloadAdam
from offload.params import (ParamRecord, ParamStore, Placement, Prefetcher, SwapBudget, build_records,
                            partition_numel)
from offload.params.construct import BUILT, built_store
from offload.params.placement import attach_accumulator, parameter_names, pin_partition
from offload.storage import StripedSwapFile, SwapFile, open_swap_file
from offload.train.checkpoint.rank_state import sized_partitions
from offload.train.grads.loss_scaler import build_loss_scaler
from offload.train.grads.reduce import GradReducer
from offload.train.plan import training_plan
from offload.train.sizing import StepSizes, auto_max_in_cpu, plan_sizes
from offload.train.space import check_swap_space, swap_space_needed
from offload.train.step.after_backward import UpdateAfterBackward
from offload.train.cpu_threads import set_cpu_threads
from offload.train.heap import share_freed_memory
from offload.train.step.agree import StepAgreement
from offload.train.step.deferred import DeferredStep
from offload.train.step.failure import FailureState, StepCounters
from offload.train.step.in_backward import UpdateDuringBackward
from offload.train.step.in_forward import UpdateInNextForward
from offload.train.step.kept_buffers import KeptBuffers
from offload.train.step.rollback import StepRollback
from offload.train.step.update_mode import StepContext, UpdateMode, UpdatePath, choose_update_mode, fast_optimizer
from offload.train.step.writeback import PartitionWriteBack
from offload.train.surface import in_optimizer_order, optimizer_param_groups
from tensorio import BufferPool, locked_tensor

__all__ = ["assemble"]

log = logging.getLogger("offload")


_NO_EFFECT = ("contiguous_gradients", "allgather_partitions", "allgather_bucket_size", "reduce_scatter")

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


def assemble(model: nn.Module, cfg: EngineConfig, *, world_size: int, rank: int, group: Any,
             optimizer: Any, lr_scheduler: Any, make_engine: Callable[..., Any],
             model_parameters: Iterable[Any] | None = None, device: Device | None = None) -> Any:
    """Build the engine (``make_engine(model, ctx, path, world_size=, rank=)``, the `Engine` class) in the
    order each part needs the one before it (see the module docstring). Compute runs on ``device``
    (default: the CPU); where its memory is separate, partitions rest in page-locked host memory or on
    NVMe and are gathered onto it (docs/gpu.md).

    All or nothing: on any error the model's parameters get their original tensors back, and every
    swap file, hook and thread made so far is removed, before the error propagates.
    """
    cfg, auto_source = _auto_max_in_cpu(cfg, model, world_size, device)
    zero = cfg.zero_optimization
    check_nvme_paths(cfg)
    _warn_no_effect(zero)
    threads = set_cpu_threads()  # before the optimizer's worker starts: it takes half of them
    heap = share_freed_memory(local_ranks())  # several ranks on the node: freed blocks go back to it
    if heap and rank == 0:
        log.info("%s", heap)
    with contextlib.ExitStack() as undo:
        originals = [(p, p.data) for p in model.parameters()]  # references, not copies
        undo.callback(_restore, originals)
        engine = _build(model, cfg, undo, world_size=world_size, rank=rank, group=group, optimizer=optimizer,
                        lr_scheduler=lr_scheduler, make_engine=make_engine, model_parameters=model_parameters,
                        device=device or CpuDevice(), max_in_cpu_source=auto_source)
        undo.pop_all()  # success: nothing to undo
    engine.plan = dataclasses.replace(engine.plan, cpu_threads=threads)
    if rank == 0:
        log.info("CPU threads: %s", threads.describe())
    dtype = torch.float16 if cfg.fp16.enabled else torch.bfloat16 if cfg.bf16.enabled else None
    target = (device or CpuDevice()).torch_device
    # Buffers follow the parameters: floating ones cast as model.half() would, all of them where compute runs.
    for module in model.modules():
        for name, buffer in module._buffers.items():
            if buffer is not None:
                module._buffers[name] = buffer.to(dtype=dtype if dtype is not None and buffer.is_floating_point()
                                                  else buffer.dtype, device=target)
    return engine


def _partition(model: nn.Module, cfg: EngineConfig, undo: contextlib.ExitStack, *, world_size: int, rank: int,
               group: Any, device: Device) -> tuple[list[ParamRecord], SwapFile | StripedSwapFile | None]:
    """Step 1 of `_build` for a model built whole: cast, partition, place."""
    zero = cfg.zero_optimization
    offload_param = zero.offload_param
    dtype = torch.float16 if cfg.fp16.enabled else torch.bfloat16 if cfg.bf16.enabled else None
    if dtype is not None:  # parameter by parameter; the originals stay referenced until success
        for p in model.parameters():
            p.data = p.data.to(dtype)
    if world_size > 1:  # every rank starts from rank 0's weights
        for p in model.parameters():
            sent = device.collective_tensor(p.data)
            device.check_collective(sent, op="broadcast of the initial weights")
            dist.broadcast(sent, 0, group=group)
            if sent is not p.data:
                p.data.copy_(sent)
    nvme = offload_param.device == "nvme"
    if nvme:
        check_against_model(cfg, {n: p.numel() for n, p in model.named_parameters()
                                  if p.numel() > zero.stage3_param_persistence_threshold})
    swap = None
    if nvme:
        swap = open_swap_file(offload_param.rank_paths or offload_param.nvme_path, cfg.aio, kind="params",
                              key="zero_optimization.offload_param.nvme_path",  # striped over several drives
                              weights=offload_param.rank_weights or None)
        undo.callback(swap.close)
    placement = Placement(world_size=world_size, rank=rank, swap=swap, max_in_cpu=offload_param.max_in_cpu if nvme else 0,
                          persistence_threshold=zero.stage3_param_persistence_threshold,
                          pinned=device.pinned_empty if device.separate_memory else None)
    try:
        return build_records(model, placement), swap
    finally:
        placement.finish()  # on an error too: no write is left in flight


def _adopt(model: nn.Module, built: ParamStore, cfg: EngineConfig, *, world_size: int, device: Device
           ) -> tuple[list[ParamRecord], SwapFile | StripedSwapFile | None]:
    """Step 1 of `_build` for a model built under `offload.zero.Init`: take its records as they are,
    named and numbered as the model names its parameters (records of parameters the model dropped, such as
    a weight replaced by a tied one, are left out). For a ``device`` with its own memory, the in-memory
    partitions move into page-locked buffers one by one (`pin_partition`: one extra partition at most).
    Raises ValueError where the config disagrees with the build."""
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
        if device.separate_memory:
            pin_partition(rec, device.pinned_empty,
                          persistent=rec.numel <= cfg.zero_optimization.stage3_param_persistence_threshold)
        records.append(rec)
    for rec in records:
        if rec.full is None:
            rec.param.data = torch.empty(0, dtype=rec.param.dtype)
    BUILT.pop(id(built), None)  # the engine owns the swap file from here
    return records, built.swap


def _auto_max_in_cpu(cfg: EngineConfig, model: nn.Module, world_size: int,
                     device: Device | None) -> tuple[EngineConfig, str]:
    """``cfg`` with ``offload_param.max_in_cpu`` "auto" (device "nvme") resolved to elements from this host's
    available memory and the model's trainable partitions (`auto_max_in_cpu`), and how; else ``cfg`` and "".
    The compute device's runtime is loaded first (`Device.load_runtime`), so that its host memory counts."""
    param = cfg.zero_optimization.offload_param
    if param.max_in_cpu != "auto":
        return cfg, ""
    if param.device != "nvme":
        elements, how = 0, ""  # max_in_cpu applies to device "nvme" only
    else:
        distinct = list({id(p): p for p in model.parameters()}.values())
        size = _element_size(cfg, distinct[0]) if distinct else 4
        if device is not None:
            device.load_runtime(torch.float16 if cfg.fp16.enabled else torch.bfloat16 if cfg.bf16.enabled
                                else torch.float32)
        elements, how = auto_max_in_cpu(cfg, [partition_numel(p.numel(), world_size) for p in distinct
                                              if p.requires_grad], size)
        log.info("zero_optimization.offload_param.max_in_cpu \"auto\": %d elements = %s", elements, how)
    cfg = copy.deepcopy(cfg)
    cfg.zero_optimization.offload_param.max_in_cpu = elements
    return cfg, how


def _element_size(cfg: EngineConfig, p: nn.Parameter) -> int:
    """Bytes per element ``p`` will be trained in (fp16/bf16 configs cast it)."""
    return 2 if cfg.fp16.enabled or cfg.bf16.enabled else p.element_size()


def _restore(originals: list[tuple[nn.Parameter, torch.Tensor]]) -> None:
    for param, data in originals:
        param.data = data


def _build(model: nn.Module, cfg: EngineConfig, undo: contextlib.ExitStack, *, world_size: int, rank: int,
           group: Any, optimizer: Any, lr_scheduler: Any, make_engine: Callable[..., Any],
           model_parameters: Iterable[Any] | None, device: Device, max_in_cpu_source: str = "") -> Any:
    """`assemble`'s steps; each thing made is registered in ``undo`` for removal on failure."""
    zero = cfg.zero_optimization
    offload_param, offload_opt = zero.offload_param, zero.offload_optimizer
    built = built_store(model)
    # 1. Refuse now, with the figures, a run whose swap files cannot fit (not with ENOSPC hours later);
    #    then partition and place.
    distinct = {id(p): p for p in model.parameters()}.values()
    check_swap_space(cfg, swap_space_needed(
        cfg, [(p.numel(), _element_size(cfg, p), p.requires_grad, None if built is None else built.record_of(p).on_disk)
              for p in distinct], world_size=world_size, grads_on_disk=offload_opt.device == "nvme",
        grads_in_param_slots=fast_optimizer(cfg, optimizer) and offload_opt.ratio == 1.0))
    if built is not None:  # built under offload.zero.Init: partitioned and placed already
        records, swap = _adopt(model, built, cfg, world_size=world_size, device=device)
    else:
        records, swap = _partition(model, cfg, undo, world_size=world_size, rank=rank, group=group, device=device)
    # 2. The store.
    budget = SwapBudget(buffer_elements=offload_param.buffer_count * offload_param.buffer_size,
                        max_live=zero.stage3_max_live_parameters)
    store = ParamStore(records=records, world_size=world_size, rank=rank, swap=swap, budget=budget,
                       prefetcher=Prefetcher(bucket_elements=zero.stage3_prefetch_bucket_size), group=group,
                       reuse_distance=zero.stage3_max_reuse_distance, device=device,
                       resident=device.separate_memory and offload_param.device == "none")
    # 3. Where the update runs (docs/engine.md): during backward, each reduced gradient goes straight to
    #    the optimizer (earlier micro-batches' partitions kept and added to it); in the next forward, the
    #    gradients are kept, each one's norm taken as it is reduced; after backward, with the optimizer
    #    state on NVMe, the gradient partitions go there too.
    trainable = [rec for rec in records if rec.param.requires_grad]
    mode = choose_update_mode(cfg, optimizer, trainable)
    fast = mode is not UpdateMode.AFTER_BACKWARD  # the optimizer's thread runs the updates
    sizes = plan_sizes(cfg, trainable, mode, budget)
    grad_swap = (open_swap_file(offload_opt.rank_paths or offload_opt.nvme_path, cfg.aio, kind="grads",
                                key="zero_optimization.offload_optimizer.nvme_path",
                                weights=offload_opt.rank_weights or None)
                 if offload_opt.device == "nvme" and sizes.swap_grads else None)
    if grad_swap is not None:
        undo.callback(grad_swap.close)
    # The step's I/O buffers, faulted in once; page-locked where copies to the device read them.
    pool = BufferPool(sizes.pool_bytes, make=locked_tensor) if device.separate_memory else BufferPool(sizes.pool_bytes)
    for file in (swap, grad_swap):
        if file is not None:
            file.pool = pool
    # 4. Gradient reduction: hooks on the partitioned parameters' gradient accumulators. On the fast paths
    #    a step's on-disk partitions commit with the optimizer state, so until the next step writes its
    #    update there, a partition's other slot is free: an fp32 one holds its gradient.
    reducer = GradReducer(store, world_size=world_size, rank=rank, group=group, swap=grad_swap,
                          bucket_elements=sizes.bucket, overlap=zero.overlap_comm,
                          norms=mode is UpdateMode.IN_FORWARD, param_slots=fast, comm_dtype=cfg.communication_dtype)
    undo.callback(reducer.remove)
    for file in (swap, grad_swap):  # every extent is placed: a full disk is named now, not in a step
        if file is not None:
            file.preallocate()
    # 5. Optimizer offload: OffloadAdam over the partitions; it plans its sub-groups from their sizes,
    #    so it comes after the partitions exist and before anything runs.
    groups = optimizer_param_groups(trainable, optimizer, model_parameters)
    trainable = in_optimizer_order(trainable, groups)  # the optimizer's i-th parameter is trainable[i]'s partition
    with sized_partitions(trainable):
        opt = _build_optimizer(cfg, optimizer, groups, overlap_backward=fast,
                               spare_limit=sizes.spare_limit, sub_group_size=sizes.sub_group_size,
                               buffer_count=sizes.buffer_count)
    if hasattr(opt, "close"):
        undo.callback(opt.close)
    scheduler = _build_scheduler(cfg, lr_scheduler, opt)
    # 6. The update path.
    ctx = StepContext(config=cfg, store=store, reducer=reducer, optimizer=opt, lr_scheduler=scheduler,
                      loss_scaler=build_loss_scaler(cfg.fp16) if cfg.fp16.enabled else None, group=group,
                      counters=StepCounters(), failure=FailureState(), kept=KeptBuffers(store))
    path = _update_path(mode, ctx, trainable, sizes, grad_reads=reducer.start_read if grad_swap else None)
    if world_size > 1:  # a failure inside a step is agreed by every rank (offload/train/step/agree.py)
        ctx.agreement = StepAgreement(world_size=world_size, rank=rank, group=group)
        store.faults = reducer.faults = ctx.agreement
        if fast:  # no rank commits a step before every rank agreed
            opt.hold_commits()
    # 7. Gather hooks and prefetch: last, since they gather the partitions placed above.
    store.install(model)
    undo.callback(store.remove_hooks)
    engine = make_engine(model, ctx, path, world_size=world_size, rank=rank)
    engine.plan = training_plan(cfg, records, mode.value, world_size=world_size, rank=rank,
                                max_in_cpu_source=max_in_cpu_source)
    return engine


def _update_path(mode: UpdateMode, ctx: StepContext, trainable: list[ParamRecord], sizes: StepSizes, *,
                 grad_reads: Any) -> UpdatePath:
    """The update path of ``mode``, wired in: on the fast paths the parameters commit and roll back with
    the optimizer's state (docs/engine.md, "Failures"), and on-disk partitions go through the write-back."""
    if mode is UpdateMode.AFTER_BACKWARD:
        return UpdateAfterBackward(ctx)
    store, opt, offload_param = ctx.store, ctx.optimizer, ctx.config.zero_optimization.offload_param
    writeback = None
    if sizes.spare_limit is not None:
        writeback = PartitionWriteBack(store, ctx.kept, opt, limit=min(offload_param.buffer_size, sizes.window))
    rollback = StepRollback(store, limit=offload_param.buffer_size)
    opt.add_step_hooks(on_commit=rollback.committed, on_abort=rollback.aborted)
    if mode is UpdateMode.IN_BACKWARD:
        path = UpdateDuringBackward(ctx, writeback, rollback)
        ctx.reducer.consumer = path.gradient_final
        return path
    # The forward's gathers wait for, and take, the updated partitions.
    deferred = store.updates = DeferredStep(store, ctx.kept, opt, writeback, trainable, rollback, grad_reads=grad_reads,
                                            read_ahead=sizes.window)
    # Late in backward (most activations freed), the state of the first updates is read ahead, into memory
    # kept across steps while the gradients stay in memory too. Where they go to disk (a model large for
    # this host) that memory would raise the backward's peak, and faulting it in each step costs little
    # beside such a model's step (docs/engine.md, "Memory bound").
    ctx.reducer.on_half = functools.partial(opt.read_ahead, sizes.state_ahead, keep_memory=not sizes.swap_grads)
    return UpdateInNextForward(ctx, writeback, rollback, deferred)


def _build_optimizer(cfg: EngineConfig, client: Any, params: list[dict[str, Any]], *,
                     overlap_backward: bool = False, spare_limit: int | None = None,
                     sub_group_size: int, buffer_count: int) -> torch.optim.Optimizer:
    """OffloadAdam over the param groups ``params`` with the config's or the client optimizer's hyperparameters."""
    off = cfg.zero_optimization.offload_optimizer
    swap = dict(nvme_offload_fraction=off.ratio if off.device == "nvme" else 0.0,
                nvme_offload_dir=(off.rank_paths or off.nvme_path) if off.device == "nvme" else None,
                stripe_weights=off.rank_weights or None,
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
