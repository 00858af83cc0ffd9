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

import gc
import logging
import os
import weakref
from typing import Any, Callable, Iterable, Mapping

import torch
import torch.distributed as dist
from torch import nn

from offload.config import EngineConfig, world_size_from_env
from offload.params import ParamRecord, ParamStore
from offload.train import checkpoint
from offload.train.assemble import assemble
from offload.train.grads import GradReducer
from offload.train.plan import TrainingPlan
from offload.train.stats import EngineStats, collect_stats
from offload.train.surface import (consolidated_state_dict, engine_call, refuse_backward_outside,
                                   refuse_forward_outside, refuse_optimizer_step_outside, save_pretrained_gathered,
                                   step_scheduler)
from offload.train.timers import PhaseTimers
from offload.train.update_mode import StepContext, UpdatePath

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
    engine = assemble(model, cfg, world_size=world_size, rank=rank, group=group, optimizer=optimizer,
                      lr_scheduler=lr_scheduler, model_parameters=model_parameters, make_engine=Engine)
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


class _Counter:
    """An engine attribute kept in the step context's `StepCounters` (a failed step's rollback restores them)."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, engine: Any, owner: type | None = None) -> Any:
        return self if engine is None else getattr(engine._ctx.counters, self.name)

    def __set__(self, engine: Any, value: int) -> None:
        setattr(engine._ctx.counters, self.name, value)


class Engine:
    """A model trained with partitioned, offloaded parameters and optimizer state. Made by `initialize`.

    The DeepSpeed facade: every moment of a step that depends on where the update runs is delegated to
    its update path (`UpdatePath`, chosen once at `initialize`; docs/engine.md).
    """

    plan: TrainingPlan
    """Where this rank's partitions and optimizer state live and where the update runs (``print(engine.plan)``)."""

    def __init__(self, module: nn.Module, ctx: StepContext, path: UpdatePath, *, world_size: int, rank: int) -> None:
        self.module = module
        self.config: EngineConfig = ctx.config
        self.world_size, self.rank, self.group = world_size, rank, ctx.group
        self._ctx = ctx
        self._path = path
        self._store: ParamStore = ctx.store
        self._reducer: GradReducer = ctx.reducer
        self._failure = ctx.failure
        self.timers = PhaseTimers.from_config(self.config, log=log.info if rank == 0 else (lambda line: None))
        self._boundary: bool | None = None
        """`set_gradient_accumulation_boundary`'s override (None: count micro steps)."""
        self._fresh_grads = False
        """Gradients accumulated since the last step or zero_grad (`get_global_grad_norm` reads them)."""
        self._last_grad_norm: float | None = None
        """The global gradient norm of the last step (before clipping, unscaled), None before the first."""
        ctx.optimizer.overflow = False  # DeepSpeed's ZeRO optimizers' flag: whether the last step was skipped
        self._finalizer = weakref.finalize(self, _close, ctx.store, ctx.reducer, ctx.optimizer)
        save_pretrained_gathered(self)  # engine.module.save_pretrained() writes the real weights
        self.forwarding = 0
        """Forwards running through the engine (a forward with gradients of ``module`` alone is refused)."""
        refuse_forward_outside(self)
        self._calls = 0
        """The engine's own calls under way (`engine_call`): a backward or an optimizer step outside them is refused."""
        refuse_backward_outside(self)
        refuse_optimizer_step_outside(self)

    # ---- DeepSpeed's attributes ---------------------------------------------------------------------

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The optimizer (OffloadAdam unless a callable built another)."""
        return self._ctx.optimizer

    @property
    def lr_scheduler(self) -> Any:
        """The learning-rate scheduler, or None."""
        return self._ctx.lr_scheduler

    @lr_scheduler.setter
    def lr_scheduler(self, value: Any) -> None:
        self._ctx.lr_scheduler = value

    @property
    def loss_scaler(self) -> Any:
        """The fp16 loss scaler, or None without fp16."""
        return self._ctx.loss_scaler

    global_steps = _Counter()
    """Optimizer steps taken (skipped fp16 steps included)."""
    micro_steps = _Counter()
    """Micro-batches stepped."""
    skipped_steps = _Counter()
    """Steps skipped for an fp16 overflow."""

    # ---- training ---------------------------------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Run the model's forward pass (parameters are gathered module by module)."""
        return self.forward(*args, **kwargs)

    @engine_call
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the model's forward pass (parameters are gathered module by module). After a step whose
        update runs in the next forward, this is it: each gather waits for, and uses, its updated partition.
        Raises the update's error (TensorIOError) when it failed; the step is then rolled back."""
        self._path.before_forward()
        self._store.begin_forward()
        self.forwarding += 1
        try:
            with self.timers.phase("forward"), self._store.saved_tensor_hooks():
                return self.module(*args, **kwargs)
        except BaseException as error:
            self._path.forward_failed(error)
            raise
        finally:
            self.forwarding -= 1

    @engine_call
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
        boundary = self.is_gradient_accumulation_boundary()
        # Sync point: the last step's updates have run (raises after giving it up).
        self._path.before_backward(boundary)
        # The micro-batch that ends an accumulation hands its gradients to the optimizer (plus the kept ones).
        self._reducer.start_backward(boundary)
        try:
            # Saved-tensor hooks here too: reentrant activation checkpointing re-runs forward in backward.
            with self.timers.phase("backward"), self._store.saved_tensor_hooks():
                scaled.backward(retain_graph=retain_graph)
                self._reducer.flush()  # sync point: the last buckets' reductions
        except BaseException as error:
            self._reducer.abandon()
            self._path.backward_failed(error, boundary)
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

    @engine_call
    def step(self, lr_kwargs: Mapping[str, Any] | None = None) -> None:
        """End a micro step; at a gradient-accumulation boundary, update the parameters. ``lr_kwargs``
        are passed to the scheduler's ``step`` (as DeepSpeed does).

        Raises tensorio.TensorIOError when the swap files fail, RuntimeError when fp16 overflows at
        the minimum loss scale, or when an earlier failure left nothing to step from (saying how to resume).
        """
        self._failure.check_step()
        if self.is_gradient_accumulation_boundary():
            self._last_grad_norm = self._step_norm()
            with self.timers.phase("step"):
                if self._path.step():
                    if self.lr_scheduler is not None:
                        step_scheduler(self.lr_scheduler, lr_kwargs or {})
                    self.zero_grad()
                    self._path.after_step()
                    self.optimizer.overflow = False
                else:  # fp16 overflow: the step is skipped
                    self.skipped_steps += 1
                    self.optimizer.overflow = True
                    self.zero_grad()
            self.global_steps += 1
            if self.global_steps % self.config.steps_per_print == 0:
                self._report()
            self.timers.step_done()  # wall_clock_breakdown: its own line every steps_per_print steps
        self.micro_steps += 1

    def _report(self) -> None:  # every steps_per_print steps
        scale = f", loss scale {self.loss_scaler.loss_scale:g}" if self.loss_scaler is not None else ""
        if self.rank == 0:
            log.info(f"step {self.global_steps}: lr {self.get_lr()}, skipped {self.skipped_steps}{scale}")

    def _check_not_failed(self, what: str) -> None:
        self._failure.check(what)

    @engine_call
    def _settle(self) -> None:
        """Before partitions are read outside the passes (a save, `full_parameters`): see `UpdatePath.settle`."""
        self._path.settle()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop the accumulated gradient partitions (in memory and offloaded)."""
        self._failure.gradients_cleared()
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

    def to(self, *args: Any, **kwargs: Any) -> "Engine":
        """Refused with a RuntimeError saying what to use: the engine places its partitions itself
        (``offload_param``), and a trainer that moves the model it is given (``transformers.Trainer(model=
        engine)``) does not drive the engine's backward and step."""
        raise RuntimeError("engine.to(...): the engine places its partitions itself (zero_optimization.offload_param); "
                           "to train it with a trainer use offload.integrations: OffloadTrainer (Hugging Face), "
                           "OffloadStrategy (Lightning) or OffloadAccelerator (Accelerate)")

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
            if self._path.counts().uncommitted:  # updates ran during backward: give the step up whole
                self._path.give_up(error, gradients_lost=True)
            else:  # nothing is updated yet: the parameters are whole
                self._ctx.gradients_lost_before_update(error)
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
        """One record per (tied) parameter: partition, location, state (see offload/params/store.py, ParamRecord)."""
        return self._store.records

    def io_bytes(self) -> dict[str, int]:
        """Bytes read from and written to the parameter swap file so far."""
        return self._store.io_bytes()

    def stats(self) -> EngineStats:
        """What the engine is doing and holds now: its update mode, bytes read and written per swap file,
        records by place, buffers held, the failure state (see `EngineStats`). Cheap; any thread."""
        return collect_stats(self._ctx, self._path)

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
                                          optimizer=self.optimizer, state=state, model=self.module,
                                          update_latest=save_latest, exclude_frozen=exclude_frozen_parameters)
        self._failure.saved(path)
        return path

    def load_checkpoint(self, load_dir: str | os.PathLike, tag: str | None = None, load_module_strict: bool = True,
                        load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                        load_module_only: bool = False, custom_load_fn: Callable | None = None
                        ) -> tuple[str | None, dict[str, Any] | None]:
        """Load a checkpoint written by ``save_checkpoint`` (tag None: the one ``latest`` names).

        Streamed like the save; never unpickles; any world size (partitions, fp32 masters and
        moments are repartitioned). Returns ``(path, client_state)``, or ``(None, None)`` with a
        warning when ``tag`` is None and ``load_dir`` has no ``latest`` (as DeepSpeed does).
        ``load_optimizer_states`` False keeps the optimizer's state (fp32 training only: under
        fp16/bf16 the master weights are optimizer state); ``load_lr_scheduler_states`` False keeps the
        schedule; ``load_module_only`` loads the parameters alone (no optimizer, schedule, loss scale or
        counters). ``load_module_strict`` False is accepted: the checkpoint's parameters must still be
        the model's. Raises FileNotFoundError for a missing checkpoint or file, SafetensorsError for a
        truncated one and ValueError for one of another model or for ``custom_load_fn``, each naming
        the file, with the engine as it was before the call. An error after the load began (an I/O
        error) refuses step() and save_checkpoint() until a load succeeds.
        """
        from offload.train.surface import check_load_arguments

        if tag is None and not os.path.isfile(os.path.join(os.fspath(load_dir), "latest")):
            log.warning("load_checkpoint: %s has no 'latest' file; nothing loaded (pass tag= to load a given "
                        "checkpoint)", os.fspath(load_dir))
            return None, None
        load_optimizer = check_load_arguments(self.config, load_optimizer_states=load_optimizer_states,
                                              load_module_only=load_module_only, custom_load_fn=custom_load_fn)
        with checkpoint.CheckpointLoad(load_dir, tag, rank=self.rank, world_size=self.world_size,
                                       store=self._store, optimizer=self.optimizer if load_optimizer else None
                                       ) as source:  # checked; nothing changed
            self._path.abandon()  # updates still running would write over the loaded values
            self._store.release_all()  # partitions read ahead would hold the values from before the load
            try:
                path, state = source.path, source.apply()
            except BaseException as error:
                self._failure.partly_updated(f"load_checkpoint of {source.path} failed part way "
                                             f"({type(error).__name__}: {error})")
                raise
        self.zero_grad()
        if not load_module_only:
            if self.loss_scaler is not None and state["loss_scaler"] is not None:
                self.loss_scaler.load_state_dict(state["loss_scaler"])
            if self.lr_scheduler is not None and state["lr_scheduler"] is not None and load_lr_scheduler_states:
                self.lr_scheduler.load_state_dict(state["lr_scheduler"])
            self.global_steps, self.micro_steps = state["global_steps"], state["micro_steps"]
            self.skipped_steps = state["skipped_steps"]
        self._failure.loaded(path)  # every partition holds the checkpoint's values
        return path, state["client_state"]

    def load_pretrained(self, checkpoint_dir: str | os.PathLike) -> list[str]:
        """Read a Hugging Face checkpoint (config.json beside model.safetensors, or shards with their
        index) into the partitions, tensor by tensor through tensorio: never whole in memory. Call it
        before the first step (the optimizer's state is not touched). Returns the checkpoint's tensors
        the model has no place for. Raises FileNotFoundError / SafetensorsError naming the file, and
        ValueError for missing parameters or a shape mismatch (before any partition changes)."""
        from offload.params.pretrained import load_pretrained

        self._path.abandon()
        self._store.release_all()
        return load_pretrained(self.module, self._store, os.fspath(checkpoint_dir), self.config.aio)

    def save_16bit_model(self, save_dir: str | os.PathLike, save_filename: str = "model.safetensors") -> bool:
        """Write the whole model's weights (in the training dtype: 16-bit under fp16/bf16) to
        ``save_dir/save_filename`` as safetensors (format "pt") with the model's config.json, so that
        ``from_pretrained(save_dir)`` loads it; gathered across ranks; rank 0 writes them.

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
                                    group=self.group, store=self._store, model=self.module)
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
        reference cycles, would otherwise be freed during interpreter shutdown, after
        ``destroy_process_group``, where gloo's teardown may abort the process (docs/engine.md).
        """
        self._finalizer()
        if self.world_size > 1:
            gc.collect()


def _close(store: ParamStore, reducer: GradReducer, optimizer: Any) -> None:
    reducer.remove()
    if hasattr(optimizer, "close"):
        optimizer.close()
    store.close()

