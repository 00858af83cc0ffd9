"""The engine's checkpoint save and load around what `offload.train.checkpoint.rank_state` streams: the update path
settled or abandoned first, the engine's own state (counters, loss scale, schedule, client state) saved
and restored, and the failure state told what the checkpoint now is (`FailureState.saved`, `loaded`)."""

from __future__ import annotations

import logging
import os
from typing import Any, Callable, Iterator, Mapping

import torch
from torch import nn

from offload.params import ParamStore
from offload.params.pretrained import load_pretrained
from offload.train.checkpoint.background import BackgroundSaves
from offload.train.checkpoint.rank_state import CheckpointLoad, CheckpointSave, save_16bit_model, save_checkpoint
from offload.train.step.update_mode import StepContext, UpdatePath
from offload.train.surface import check_load_arguments

log = logging.getLogger("offload")


def save_engine_checkpoint(ctx: StepContext, path: UpdatePath, module: nn.Module, *, rank: int, world_size: int,
                           save_dir: str | os.PathLike, tag: str | None, client_state: Mapping[str, Any] | None,
                           save_latest: bool, exclude_frozen: bool, saves: BackgroundSaves | None = None,
                           async_save: bool | None = None, wait: bool = True, owner: Any = None) -> str:
    """`Engine.save_checkpoint` (see it for the layout, the guarantees and what it raises). ``saves``: the
    engine's background saves; a save in flight is waited for first (``wait`` False: refused) and a failed
    one raised. ``async_save`` None takes the config's ``checkpoint.async_save``."""
    if saves is not None:
        saves.finish(refuse=not wait)  # sync point: one save at a time, and a failed one reported
    ctx.failure.check_all_ranks("save a checkpoint", group=ctx.group, world_size=world_size, rank=rank)
    counters = ctx.counters
    tag = tag if tag is not None else f"global_step{counters.global_steps}"
    path.settle()
    state = {"global_steps": counters.global_steps, "micro_steps": counters.micro_steps,
             "skipped_steps": counters.skipped_steps, "world_size": world_size,
             "loss_scaler": ctx.loss_scaler.state_dict() if ctx.loss_scaler is not None else None,
             "lr_scheduler": ctx.lr_scheduler.state_dict() if ctx.lr_scheduler is not None else None,
             "client_state": dict(client_state or {})}
    if async_save is None:
        async_save = ctx.config.checkpoint.async_save
    if async_save and saves is not None:
        job = CheckpointSave(ctx.store, ctx.optimizer, state, exclude_frozen=exclude_frozen, snapshot=True,
                             aio=ctx.config.aio)
        target = os.path.join(os.fspath(save_dir), tag)
        try:
            group = saves.group_for(ctx.group, world_size)  # the background's collectives, apart from training's
            saves.start(job, lambda: job.run(save_dir, tag, rank=rank, group=group, model=module,
                                             update_latest=save_latest),
                        tag=tag, path=target, done=ctx.failure.saved, keep_alive=owner)
        except BaseException:
            job.close()
            raise
        return target
    saved = save_checkpoint(save_dir, tag, rank=rank, group=ctx.group, store=ctx.store,
                            optimizer=ctx.optimizer, state=state, model=module,
                            update_latest=save_latest, exclude_frozen=exclude_frozen, aio=ctx.config.aio)
    ctx.failure.saved(saved)
    return saved


def load_engine_checkpoint(ctx: StepContext, path: UpdatePath, *, rank: int, world_size: int,
                           load_dir: str | os.PathLike, tag: str | None, load_optimizer_states: bool,
                           load_lr_scheduler_states: bool, load_module_only: bool, custom_load_fn: Callable | None,
                           zero_grad: Callable[[], None], saves: BackgroundSaves | None = None
                           ) -> tuple[str | None, dict[str, Any] | None]:
    """`Engine.load_checkpoint` (see it for what it raises); ``zero_grad`` drops the gradients accumulated
    before the load. ``(None, None)``, with a warning, when ``tag`` is None and ``load_dir`` has no ``latest``.
    ``saves``: a save in flight is waited for first, and a failed one raised (nothing loaded then)."""
    if saves is not None:
        saves.finish()  # sync point: the load may read what it writes, and overwrites the slots it reads
    if tag is None and not os.path.isfile(os.path.join(os.fspath(load_dir), "latest")):
        log.warning("load_checkpoint: %s has no 'latest' file; nothing loaded (pass tag= to load a given "
                    "checkpoint)", os.fspath(load_dir))
        return None, None
    load_optimizer = check_load_arguments(ctx.config, load_optimizer_states=load_optimizer_states,
                                          load_module_only=load_module_only, custom_load_fn=custom_load_fn)
    with CheckpointLoad(load_dir, tag, rank=rank, world_size=world_size, store=ctx.store,
                        optimizer=ctx.optimizer if load_optimizer else None, backend=ctx.config.aio.backend,
                        group=ctx.group) as source:  # opened and matched to the model; nothing changed
        path.abandon()  # updates still running would write over the loaded values
        ctx.store.release_all()  # partitions read ahead would hold the values from before the load
        if ctx.store.region is not None and ctx.store.region.staged:  # a step that failed part way left its
            ctx.store.region.rollback()  # writes staged (all landed): the load stages its own there instead
        try:
            loaded, state = source.given, source.apply()  # one pass: all or nothing (CheckpointLoad.apply)
        except BaseException as error:
            if source.committed:  # past the commit: not expected, but then the state is part way
                ctx.failure.partly_updated(f"load_checkpoint of {source.path} failed part way "
                                           f"({type(error).__name__}: {error})")
            raise
        if source.verified_bytes:
            log.info("load_checkpoint: %.1f MB of %s checked against their checksums in %.3f s, read once as they "
                     "were loaded", source.verified_bytes / 1e6, source.path, source.verify_seconds)
    zero_grad()
    if not load_module_only:
        if ctx.loss_scaler is not None and state["loss_scaler"] is not None:
            ctx.loss_scaler.load_state_dict(state["loss_scaler"])
        if ctx.lr_scheduler is not None and state["lr_scheduler"] is not None and load_lr_scheduler_states:
            ctx.lr_scheduler.load_state_dict(state["lr_scheduler"])
        counters = ctx.counters
        counters.global_steps, counters.micro_steps = state["global_steps"], state["micro_steps"]
        counters.skipped_steps = state["skipped_steps"]
    ctx.failure.loaded(loaded)  # every partition holds the checkpoint's values
    return loaded, state["client_state"]


def gathered_parameters(store: ParamStore) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, full tensor) for every parameter of ``store``, gathered one at a time (a copy each, in host
    memory wherever compute runs; a parameter not gathered before is released again). Every rank
    iterates it (all-gathers)."""
    for rec in store.records:
        kept = rec.full is not None
        full = store.gather(rec).view(rec.shape).to("cpu", copy=True)
        if not kept:
            store.release(rec)
        for name in rec.names:
            yield name, full


def save_engine_16bit_model(ctx: StepContext, path: UpdatePath, module: nn.Module, *, rank: int, world_size: int,
                            save_dir: str | os.PathLike, save_filename: str) -> bool:
    """`Engine.save_16bit_model` (see it): False, logging why, unless the config gathers the weights on save."""
    if not ctx.config.zero_optimization.stage3_gather_16bit_weights_on_model_save:
        log.warning("save_16bit_model: nothing saved; set zero_optimization."
                    "stage3_gather_16bit_weights_on_model_save to true to gather the weights")
        return False
    path.settle()  # every update handed over has landed
    save_16bit_model(save_dir, save_filename, rank=rank, world_size=world_size, group=ctx.group,
                                store=ctx.store, model=module)
    return True


def load_pretrained_weights(ctx: StepContext, path: UpdatePath, module: nn.Module,
                            checkpoint_dir: str | os.PathLike) -> list[str]:
    """`Engine.load_pretrained` (see it): updates handed over are forgotten and read-ahead dropped first."""
    path.abandon()
    ctx.store.release_all()
    return load_pretrained(module, ctx.store, os.fspath(checkpoint_dir), ctx.config.aio)
