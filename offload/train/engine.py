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
from torch import nn
from torch.utils._pytree import tree_map

from offload.config import EngineConfig
from offload.device import Device
from offload.params import ParamRecord, ParamStore
from offload.train.grads.norm import GlobalGradNorm
from offload.train.grads.reduce import GradReducer
from offload.train.plan import TrainingPlan
from offload.train.checkpoint.background import BackgroundSaves, SaveInFlight
from offload.train.checkpoint.save_load import (gathered_parameters, load_engine_checkpoint, load_pretrained_weights,
                                     save_engine_16bit_model, save_engine_checkpoint)
from offload.train.setup import engine_from_arguments
from offload.train.stats import EngineStats, collect_stats
from offload.train.step.failure import CounterAttribute
from offload.train.step.outside import StopOnError, hook_uncaught, stops_ranks
from offload.train.step.stop import RankStop, destroy_group
from offload.train.step.update_mode import StepContext, UpdatePath
from offload.train.surface import consolidated_state_dict, engine_call, guard_misuse, step_scheduler
from offload.train.timers import PhaseTimers

__all__ = ["Engine", "initialize"]

log = logging.getLogger("offload")


def initialize(args: Any = None, model: nn.Module | None = None, optimizer: Any = None,
               model_parameters: Iterable[Any] | None = None, training_data: Any = None, lr_scheduler: Any = None,
               distributed_port: int = 29500, mpu: Any = None, dist_init_required: bool | None = None,
               collate_fn: Callable | None = None, config: Mapping[str, Any] | str | os.PathLike | None = None,
               mesh_param: Any = None, config_params: Mapping[str, Any] | None = None,
               compute_device: Device | str | None = None,
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
        compute_device: where forward and backward run: None (the config's ``compute_device``,
            "auto" by default: CUDA where available), "cpu", "cuda", or an `offload.device.Device`
            (tests pass ``SimulatedDevice``). The optimizer runs on the CPU either way (docs/gpu.md).

    Returns ``(engine, optimizer, dataloader or None, lr_scheduler or None)``.
    Raises ValueError for a bad config (naming the key), a missing optimizer, or a parameter the
    engine cannot partition, "cuda" without CUDA (naming ``compute_device``) or a device budget over
    the device's free memory (``compute_device_budget``, with the figures); FileNotFoundError /
    PermissionError for a bad ``nvme_path``.
    """
    return engine_from_arguments(args=args, model=model, optimizer=optimizer, model_parameters=model_parameters,
                                 training_data=training_data, lr_scheduler=lr_scheduler, mpu=mpu,
                                 dist_init_required=dist_init_required, collate_fn=collate_fn, config=config,
                                 mesh_param=mesh_param, config_params=config_params, make_engine=Engine,
                                 compute_device=compute_device)


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
        self.counters = ctx.counters
        """The DeepSpeed counters below, in one object (a failed step's rollback restores them)."""
        self._path = path
        self._store: ParamStore = ctx.store
        self._reducer: GradReducer = ctx.reducer
        self._failure = ctx.failure
        self._stop = RankStop(world_size=world_size, rank=rank, group=ctx.group, failure=ctx.failure,
                              let_go=self._let_group_go)
        """Several ranks: an error of forward, backward or step not agreed stops every rank (`engine_call`)."""
        self._unhook = weakref.finalize(self, hook_uncaught(self.stop)) if world_size > 1 else None
        """Several ranks: an uncaught exception stops every rank (`stop`) before its process ends."""
        device = ctx.store.device
        self.timers = PhaseTimers.from_config(  # a phase's time includes the device work it queued
            self.config, log=log.info if rank == 0 else (lambda line: None),
            synchronize=device.synchronize if device.separate_memory else None)
        self._boundary: bool | None = None
        """`set_gradient_accumulation_boundary`'s override (None: count micro steps)."""
        self._norm = GlobalGradNorm(ctx, path)
        ctx.optimizer.overflow = False  # DeepSpeed's ZeRO optimizers' flag: whether the last step was skipped
        self._saves = BackgroundSaves()  # the asynchronous checkpoint save in flight, if any
        self._finalizer = weakref.finalize(self, ctx.close)
        guard_misuse(self)  # save_pretrained writes the real weights; calls around the engine are refused

    # ---- DeepSpeed's attributes ---------------------------------------------------------------------

    @property
    def device(self) -> Device:
        """Where forward and backward run (`offload.device.Device`); the optimizer runs on the CPU."""
        return self._store.device

    def _to_device(self, value: Any) -> Any:
        return value.to(self.device.torch_device) if isinstance(value, torch.Tensor) else value

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

    global_steps = CounterAttribute()
    """Optimizer steps taken (skipped fp16 steps included)."""
    micro_steps = CounterAttribute()
    """Micro-batches stepped."""
    skipped_steps = CounterAttribute()
    """Steps skipped for an fp16 overflow."""

    # ---- training ---------------------------------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Run the model's forward pass (parameters are gathered module by module)."""
        return self.forward(*args, **kwargs)

    @engine_call
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the model's forward pass (parameters are gathered module by module). After a step whose
        update runs in the next forward, this is it: each gather waits for, and uses, its updated partition.
        Raises the update's error (TensorIOError) when it failed; the step is then rolled back. Raises
        CheckpointSaveError, before anything changes, when an asynchronous save failed since the last call."""
        self._saves.raise_failure()  # once; the first call of a step (an update may run during backward)
        self._path.before_forward()
        self._store.begin_forward()
        self.forwarding += 1
        if self.device.separate_memory:  # the inputs go where compute runs
            args, kwargs = tree_map(self._to_device, (args, kwargs))
        try:
            with self.timers.phase("forward"), self._store.saved_tensor_hooks(), self._ctx.agreement.absorbing():
                output = self.module(*args, **kwargs)
            self._agree("a forward")  # several ranks: no rank returns a forward that read a failure
            return output
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
        self._norm.fresh = True
        boundary = self.is_gradient_accumulation_boundary()
        # Sync point: the last step's updates have run (raises after giving it up).
        self._path.before_backward(boundary)
        # The micro-batch that ends an accumulation hands its gradients to the optimizer (plus the kept ones).
        self._reducer.start_backward(boundary)
        try:
            # Saved-tensor hooks here too: reentrant activation checkpointing re-runs forward in backward.
            with self.timers.phase("backward"), self._store.saved_tensor_hooks(), self._ctx.agreement.absorbing():
                scaled.backward(retain_graph=retain_graph)
                self._reducer.flush()  # sync point: the last buckets' reductions
            self._agree(f"the backward of step {self.global_steps + 1}")
        except BaseException as error:
            self._reducer.abandon()
            self._path.backward_failed(error, boundary)
            raise
        finally:
            self._store.end_backward()  # sync point: every gathered parameter and unused prefetch is released
        return loss

    def _agree(self, what: str) -> None:
        """Several ranks: raise `RanksFailed` on every rank where any rank absorbed a failure in the pass
        (offload/train/step/agree.py; one all-reduce of a flag). The caller gives the step up."""
        if self._ctx.agreement.active:
            error = self._ctx.agreement.agreed(None, what)
            if error is not None:
                raise error

    def _let_group_go(self) -> None:
        """Before the engine's process group is destroyed (a stop, `close`): wait for the collectives in flight
        (gradient reductions, an all-gather issued ahead) and drop them, and every reference the engine's
        parts hold to the group (gloo closes its connections only once nothing holds it)."""
        try:
            self._reducer.abandon()
            self._store.release_all()
        finally:
            for part in (self, self._ctx, self._ctx.agreement, self._stop, self._store, self._store.gathers,
                         self._reducer):
                if getattr(part, "group", None) is not None:
                    part.group = None

    def stop(self, error: BaseException, where: str = "the training loop") -> BaseException:
        """Stop every rank for ``error``, raised by this rank's own code outside the engine's calls (its data
        loader, its loss), as an error inside forward, backward or step does: record ``rank R failed in
        <where> at step N: Type: message`` in the engine's process group's store and close the group, so that
        every other rank's collective fails at once and raises `RanksStopped` naming it; every call then
        refuses on every rank (a new engine resumes from the last checkpoint). Returns the exception to
        raise: ``error``, with a note, or `RanksStopped` where another rank failed first. Changes nothing
        (returns ``error``) at world size 1, after `close`, once the ranks stopped, for the errors every rank
        raises alike and for ``GeneratorExit`` or a clean ``SystemExit`` (offload/train/step/outside.py).
        Usually through `stop_on_error`; an uncaught exception calls it itself (docs/engine.md)."""
        if self.closed or not stops_ranks(error):
            return error
        return self._stop.after(error, where=where, step=self.global_steps + 1)

    def stop_on_error(self, where: str = "the training loop") -> StopOnError:
        """A context manager: an exception leaving its block stops every rank (`stop`, its record naming
        ``where``), then goes on as it is, or as `RanksStopped` where another rank failed first::

            with engine.stop_on_error():
                for batch in loader:
                    engine.backward(loss_fn(engine(batch)))
                    engine.step()
        """
        return StopOnError(self.stop, where)

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
        With several ranks a failure on any rank is agreed by all: every rank gives the step up and raises
        `RanksFailed` naming the rank and its error (forward and backward likewise; docs/engine.md,
        "Several GPUs and nodes").
        """
        self._failure.check_step()
        if self.is_gradient_accumulation_boundary():
            self._norm.take_for_step()
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

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop the accumulated gradient partitions (in memory and offloaded)."""
        self._failure.gradients_cleared()
        self._norm.fresh = False
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
        return self._norm.now()

    @property
    def records(self) -> list[ParamRecord]:
        """One record per (tied) parameter: partition, location, state (see offload/params/record.py, ParamRecord)."""
        return self._store.records

    @property
    def param_store(self) -> ParamStore:
        """The `offload.params.ParamStore` that gathers and releases the parameters around their use, for
        inspection (its records, ``gathers`` on a device with memory of its own, the swap file). Changing
        it outside the engine's calls breaks the step."""
        return self._store

    def io_bytes(self) -> dict[str, int]:
        """Bytes read from and written to the parameter swap file so far."""
        return self._store.io_bytes()

    def stats(self) -> EngineStats:
        """What the engine is doing and holds now: its update mode, bytes read and written per swap file,
        records by place, buffers held, the failure state (see `EngineStats`). Cheap; any thread."""
        return collect_stats(self._ctx, self._path)

    # ---- checkpoints ------------------------------------------------------------------------------------

    @engine_call  # settles: a pending update may step the optimizer
    def save_checkpoint(self, save_dir: str | os.PathLike, tag: str | None = None,
                        client_state: Mapping[str, Any] | None = None, save_latest: bool = True,
                        exclude_frozen_parameters: bool = False, async_save: bool | None = None,
                        wait: bool = True) -> str:
        """Save this rank's parameter partitions, optimizer state (offloaded included), loss scale,
        scheduler, counters and ``client_state`` under ``save_dir/tag`` (default tag
        ``global_step<N>``); return the path. Layout and guarantees: `offload.train.checkpoint.rank_state`.

        Streamed: two partitions and two optimizer sub-groups in memory at a time (one written, the next
        read ahead), whatever the model's size. Written atomically: until the new tag is complete the previous checkpoint and ``latest``
        are untouched. Nothing is pickled: ``client_state`` holds JSON values and tensors. Every rank
        must call it. ``save_latest`` False leaves ``latest`` as it was. ``exclude_frozen_parameters``
        leaves out the partitions of parameters with ``requires_grad=False`` (a load keeps the model's
        values for them). Returns the path (DeepSpeed returns True; a path is true too). Raises TypeError
        for a ``client_state`` entry that is neither, OSError naming the file (ENOSPC, ...), TensorIOError.

        ``async_save`` True (None: the config's ``checkpoint.async_save``) returns once the step's state is
        fixed and writes it on a background thread while training goes on: state on NVMe is pinned in its
        swap-file slot until read, state in memory copied (`offload.train.checkpoint.snapshot`). A save in
        flight is waited for first (``wait`` False: refused with CheckpointInUseError); its failure is raised
        as CheckpointSaveError, naming the file, at the next forward, save, load or close, with ``latest`` at
        the previous checkpoint. See docs/engine.md, "Asynchronous save".
        """
        return save_engine_checkpoint(self._ctx, self._path, self.module, rank=self.rank, world_size=self.world_size,
                                      save_dir=save_dir, tag=tag, client_state=client_state, save_latest=save_latest,
                                      exclude_frozen=exclude_frozen_parameters, saves=self._saves,
                                      async_save=async_save, wait=wait, owner=self)

    def checkpoint_in_flight(self) -> SaveInFlight | None:
        """The asynchronous checkpoint save running now (tag, path, bytes written of the total, seconds
        training waited for it), or None. Cheap; any thread."""
        return self._saves.in_flight()

    def wait_for_checkpoint(self) -> str | None:
        """Sync point: wait for the asynchronous save in flight; return the path of the last save that
        succeeded in the background (None if none). Raises CheckpointSaveError when it failed."""
        return self._saves.finish()

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
        error) refuses step() and save_checkpoint() until a load succeeds. After a failure that stopped every
        rank (`RanksStopped`) it refuses too: load into a new engine.
        """
        self._failure.check_stopped("load a checkpoint into this engine")
        return load_engine_checkpoint(self._ctx, self._path, rank=self.rank, world_size=self.world_size,
                                      load_dir=load_dir, tag=tag, load_optimizer_states=load_optimizer_states,
                                      load_lr_scheduler_states=load_lr_scheduler_states,
                                      load_module_only=load_module_only, custom_load_fn=custom_load_fn,
                                      zero_grad=self.zero_grad, saves=self._saves)

    def load_pretrained(self, checkpoint_dir: str | os.PathLike) -> list[str]:
        """Read a Hugging Face checkpoint (config.json beside model.safetensors, or shards with their
        index) into the partitions, tensor by tensor through tensorio: never whole in memory. Call it
        before the first step (the optimizer's state is not touched). Returns the checkpoint's tensors
        the model has no place for. Raises FileNotFoundError / SafetensorsError naming the file, and
        ValueError for missing parameters or a shape mismatch (before any partition changes)."""
        self._saves.finish()  # sync point: its writes would wait for the save's pinned slots
        return load_pretrained_weights(self._ctx, self._path, self.module, checkpoint_dir)

    @engine_call  # settles: a pending update may step the optimizer
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
        return save_engine_16bit_model(self._ctx, self._path, self.module, rank=self.rank, world_size=self.world_size,
                                       save_dir=save_dir, save_filename=save_filename)

    # ---- full parameters ----------------------------------------------------------------------------

    @engine_call  # settles: a pending update may step the optimizer
    def full_parameters(self) -> Iterable[tuple[str, torch.Tensor]]:
        """Yield (name, full tensor) for every parameter, gathered one at a time (a copy each)."""
        self._path.settle()  # every update handed over has landed, before the caller iterates

        def gathered(engine: Engine = self) -> Iterable[tuple[str, torch.Tensor]]:
            yield from gathered_parameters(engine._store)  # holds the engine: its swap files stay open

        return gathered()

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

        With more than one rank it also destroys the engine's own process group (over gloo: made at
        `initialize`) and collects garbage now: tensors a collective used, left in reference cycles, would
        otherwise be freed during interpreter shutdown, after ``destroy_process_group``, where gloo's
        teardown may abort the process (docs/engine.md), and puts back the ``sys.excepthook`` it chained
        (`stop`). An asynchronous save in flight is waited for first; its failure is raised once everything
        is closed.
        """
        if self._unhook is not None:
            self._unhook()  # the previous sys.excepthook again
        self._saves.close()  # sync point: the save reads the swap files closed below
        group = self.group
        if group is not None and not self.closed:  # its own (gloo): let go, then destroyed below
            self._let_group_go()
        self._finalizer()
        if self.world_size > 1:
            destroy_group(group)
            gc.collect()
        self._saves.raise_failure()


