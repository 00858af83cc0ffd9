"""Accelerate on the stage-3 engine: `OffloadAccelerator` (docs/accelerate.md).

    accelerator = OffloadAccelerator(offload_config="ds_config.json", gradient_accumulation_steps=2)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    for batch in loader:
        with accelerator.accumulate(model):
            loss = model(**batch).loss
            accelerator.backward(loss)            # the engine's backward; its step on sync steps
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 1.0)   # returns the norm; the engine clipped
            optimizer.step()                      # no-ops, as with Accelerate's DeepSpeed plugin
            scheduler.step()
            optimizer.zero_grad()

Accelerate's ``DistributedType`` is closed, so this is an ``Accelerator`` subclass (the pattern of
optimum-habana's ``GaudiAccelerator``): ``prepare`` hands the model and optimizer to the engine
and returns Accelerate's own DeepSpeed wrappers around its optimizer and scheduler; the training loop
stays as it is. One process (``python script.py``) or several (``accelerate launch --num_processes N``,
``torchrun``): each rank holds one partition of every parameter. As with plain Accelerate, a scheduler
is stepped once per process at each update unless ``split_batches`` (the batch grows with the ranks).
Importing this module imports Accelerate.
"""

from __future__ import annotations

import inspect
import os
from typing import Any, Mapping

import torch
from accelerate import Accelerator
from accelerate.utils.deepspeed import DeepSpeedOptimizerWrapper, DeepSpeedSchedulerWrapper, DummyOptim, DummyScheduler
from torch import nn

from offload.integrations.config import (AutoSources, cast_floating, check_keywords, half_dtype,
                                       optimizer_hyperparameters, read_argument, trainer_config)
from offload.integrations.schedulers import rebind_scheduler
from offload.train.engine import Engine, initialize

__all__ = ["OffloadAccelerator"]

_ACCELERATOR_KEYWORDS = {name for name, p in inspect.signature(Accelerator.__init__).parameters.items()
                         if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL) and name != "self"}

ACCELERATE_CLIPPING = 1.0
"""What Accelerate's DeepSpeed integration writes for gradient_clipping "auto" (``_prepare_deepspeed``)."""

_ADAMW_DEFAULTS = {"betas": (0.9, 0.999), "eps": 1e-8}
"""torch's AdamW defaults, for a DummyOptim that does not give them (DeepSpeed's optimizer is AdamW)."""

_SOURCES = AutoSources(
    hints={"micro_batch_size": "prepare a DataLoader with a batch_size together with the model",
           "gradient_accumulation_steps": "set OffloadAccelerator(gradient_accumulation_steps=...)",
           "fp16": "set OffloadAccelerator(mixed_precision=...)", "bf16": "set OffloadAccelerator(mixed_precision=...)",
           **{name: f"prepare an optimizer (or accelerate.utils.DummyOptim) with {name} together with the model"
              for name in ("lr", "betas", "eps", "weight_decay")},
           "warmup_steps": "prepare accelerate.utils.DummyScheduler(optimizer, warmup_num_steps=...)",
           "total_steps": "prepare accelerate.utils.DummyScheduler(optimizer, total_num_steps=...)",
           "hidden_size": "use a model with config.hidden_size"},
    names={"micro_batch_size": "the DataLoader's batch_size",
           "gradient_accumulation_steps": "OffloadAccelerator(gradient_accumulation_steps={})",
           "max_grad_norm": "Accelerate's DeepSpeed default", "fp16": "OffloadAccelerator(mixed_precision) fp16",
           "bf16": "OffloadAccelerator(mixed_precision) bf16",
           **{name: f"the prepared optimizer's {name}" for name in ("lr", "betas", "eps", "weight_decay")}})
"""Each "auto" value's source in Accelerate's terms, for the messages."""


class OffloadAccelerator(Accelerator):
    """An ``accelerate.Accelerator`` whose prepared model trains on the stage-3 engine.

    Args:
        offload_config: the DeepSpeed-format config (dict or JSON path); "auto" values are filled as
            Accelerate's DeepSpeed integration fills them: the prepared data loader's batch size,
            ``gradient_accumulation_steps``, ``mixed_precision`` (fp16 / bf16 "enabled"), gradient_clipping
            1.0, the prepared optimizer's (or ``DummyOptim``'s) lr / betas / eps / weight decay, and a
            ``DummyScheduler``'s warm-up and total steps (warm-up 0 without one). Clipping is the config's
            ``gradient_clipping`` (the engine clips inside ``backward()``'s step).
        everything else: as for ``accelerate.Accelerator``.

    Raises TypeError for a keyword argument Accelerator does not take (naming the closest), ValueError
    or OSError naming ``offload_config`` when it is missing, cannot be read or holds a bad value.
    """

    def __init__(self, *args: Any, offload_config: Mapping[str, Any] | str | os.PathLike | None = None,
                 **kwargs: Any) -> None:
        check_keywords("OffloadAccelerator", kwargs, _ACCELERATOR_KEYWORDS | {"offload_config"})
        if offload_config is None:
            raise ValueError("OffloadAccelerator(offload_config=None): missing; pass the DeepSpeed-format config "
                             "(dict or JSON path)")
        config = read_argument("OffloadAccelerator(offload_config=...)", offload_config)
        super().__init__(*args, **kwargs)
        self.offload_config = config
        self.engine: Engine | None = None

    def prepare(self, *args: Any, device_placement: list[bool] | None = None) -> Any:
        """Prepare as Accelerate does; the model (one) and its optimizer (one, optional; or Accelerate's
        ``DummyOptim`` for the config's optimizer) go to the engine, a scheduler is moved onto the engine's
        optimizer and stepped by the engine (a ``DummyScheduler`` stands for the config's scheduler).
        Returns the objects in the order given: the engine for the model, Accelerate's DeepSpeed wrappers
        for the others. "auto" values are filled from these objects and the accelerator's settings. With
        fp16 / bf16, the model's floating-point inputs are cast to that dtype (integer ones, such as token
        ids, are not), as Lightning's DeepSpeed strategy and transformers' Trainer cast them."""
        models = [a for a in args if isinstance(a, nn.Module)]
        optimizers = [a for a in args if isinstance(a, (torch.optim.Optimizer, DummyOptim))]
        schedulers = [a for a in args if isinstance(a, DummyScheduler) or (
            hasattr(a, "step") and hasattr(a, "optimizer") and not isinstance(a, torch.optim.Optimizer))]
        loaders = [a for a in args if isinstance(a, torch.utils.data.DataLoader)]
        if len(models) > 1 or len(optimizers) > 1 or len(schedulers) > 1:
            raise ValueError("prepare: one model, one optimizer and one scheduler at most with OffloadAccelerator")
        if models and self.engine is not None:
            raise ValueError("prepare: the model is already on the engine; prepare it once")
        prepared: dict[int, Any] = {id(a): super(OffloadAccelerator, self).prepare(a) for a in loaders}
        if models:
            optimizer_in = optimizers[0] if optimizers else None
            schedule_in = schedulers[0] if schedulers else None
            config = self._config(models[0], loaders, optimizer_in, schedule_in)
            groups = client = None
            if "optimizer" in config:  # the config's hyperparameters, the prepared optimizer's groups
                if isinstance(optimizer_in, torch.optim.Optimizer):
                    groups = [{"params": g["params"], "weight_decay": g["weight_decay"]} if "weight_decay" in g
                              else {"params": g["params"]} for g in optimizer_in.param_groups]
            elif isinstance(optimizer_in, DummyOptim):
                raise ValueError("prepare(DummyOptim): offload_config has no optimizer section for it to stand for; "
                                 "add one or prepare a torch optimizer")
            else:
                client = optimizer_in
            if isinstance(schedule_in, DummyScheduler) and "scheduler" not in config:
                raise ValueError("prepare(DummyScheduler): offload_config has no scheduler section for it to stand "
                                 "for; add one or prepare a torch scheduler")
            engine, optimizer, _, scheduler = initialize(model=models[0], optimizer=client, model_parameters=groups,
                                                         config=config)
            self.engine = engine
            dtype = half_dtype(engine.config)
            if dtype is not None:  # floating inputs meet 16-bit weights: cast them as Lightning and Trainer do
                engine.module.register_forward_pre_hook(
                    lambda module, args, kwargs: cast_floating((args, kwargs), dtype), with_kwargs=True)
            prepared[id(models[0])] = engine
            wrapped = DeepSpeedOptimizerWrapper(optimizer)
            if optimizers:
                prepared[id(optimizers[0])] = wrapped
            if schedulers:
                if scheduler is None:
                    rebind_scheduler(schedulers[0], client, optimizer)
                    scheduler = schedulers[0]
                    steps = 1 if self.split_batches else self.num_processes
                    engine.lr_scheduler = scheduler if steps == 1 else StepsPerUpdate(scheduler, steps)
                prepared[id(schedulers[0])] = DeepSpeedSchedulerWrapper(scheduler, wrapped)
        out = tuple(prepared.get(id(a), a) for a in args)
        return out[0] if len(out) == 1 else out

    def _config(self, model: nn.Module, loaders: list[Any], optimizer: Any, scheduler: Any) -> dict[str, Any]:
        """The config with its "auto" values filled as Accelerate's DeepSpeed integration fills them: the
        loader's batch size, the accumulation steps, mixed_precision, clipping 1.0, the optimizer's (or
        DummyOptim's) hyperparameters, DummyScheduler's steps (warm-up 0 by default, as DummyScheduler's)."""
        micro = loaders[0].batch_size if loaders and loaders[0].batch_size else 1
        hyper = optimizer_hyperparameters(optimizer)
        if isinstance(optimizer, DummyOptim):
            hyper = {**_ADAMW_DEFAULTS, **hyper}
        config = dict(self.offload_config)
        if config.get("gradient_clipping") == "auto":
            config["gradient_clipping"] = ACCELERATE_CLIPPING
        precision = str(getattr(self.mixed_precision, "value", self.mixed_precision))
        dummy = scheduler if isinstance(scheduler, DummyScheduler) else None
        return trainer_config(config, model=model, micro_batch_size=micro,
                              gradient_accumulation_steps=self.gradient_accumulation_steps, max_grad_norm=None,
                              fp16=precision == "fp16", bf16=precision == "bf16",
                              warmup_steps=dummy.warmup_num_steps if dummy is not None else 0,
                              total_steps=dummy.total_num_steps if dummy is not None else None,
                              auto_only=("lr", "betas", "eps", "weight_decay", "warmup_steps", "total_steps",
                                         "fp16", "bf16"), sources=_SOURCES, **hyper)

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """The engine's backward (divided by the accumulation steps there) and, on a sync step, its step."""
        if self.engine is None:
            super().backward(loss, **kwargs)
            return
        self.engine.set_gradient_accumulation_boundary(self.sync_gradients)
        self.engine.backward(loss, **kwargs)
        if self.sync_gradients:
            self.engine.step()

    def clip_grad_norm_(self, parameters: Any, max_norm: float, norm_type: float = 2) -> float | None:
        """The global norm of the step that ran in ``backward()``, before the engine clipped it by the
        config's gradient_clipping. Raises ValueError when ``max_norm`` is not that value."""
        if self.engine is None:
            return super().clip_grad_norm_(parameters, max_norm, norm_type)
        configured = self.engine.config.gradient_clipping
        if float(max_norm) != configured or norm_type != 2:
            raise ValueError(f"clip_grad_norm_(max_norm={max_norm}, norm_type={norm_type}): the engine clips the L2 "
                             f"norm at gradient_clipping={configured} in its step; set gradient_clipping to {max_norm} "
                             f"in offload_config")
        return self.engine.get_global_grad_norm()

    def unwrap_model(self, model: Any, keep_fp32_wrapper: bool = True, keep_torch_compile: bool = True) -> nn.Module:
        if isinstance(model, Engine):
            return model.module
        return super().unwrap_model(model, keep_fp32_wrapper, keep_torch_compile)

    def get_state_dict(self, model: Any, unwrap: bool = True) -> dict[str, torch.Tensor] | None:
        """The whole model's weights from the partitions (`Engine._zero3_consolidated_16bit_state_dict`)."""
        if isinstance(model, Engine):
            return model._zero3_consolidated_16bit_state_dict()
        return super().get_state_dict(model, unwrap)

    def save_state(self, output_dir: str | os.PathLike, **kwargs: Any) -> str:
        """The engine's checkpoint (partitions, optimizer state, schedule, counters) in ``output_dir``."""
        if self.engine is None:
            return super().save_state(output_dir, **kwargs)
        self.engine.save_checkpoint(output_dir)
        return os.fspath(output_dir)

    def load_state(self, input_dir: str | os.PathLike, **kwargs: Any) -> None:
        """Load the engine's checkpoint that `save_state` wrote. Raises FileNotFoundError when there is none."""
        if self.engine is None:
            super().load_state(input_dir, **kwargs)
            return
        path, _ = self.engine.load_checkpoint(input_dir)
        if path is None:
            raise FileNotFoundError(f"{input_dir}: no engine checkpoint ('latest' missing); pass a save_state folder")


class StepsPerUpdate:
    """A scheduler the engine steps ``steps`` times per update, as Accelerate's ``AcceleratedScheduler``
    steps a scheduler once per process when the batch is not split (a ``OneCycleLR`` no further than its
    ``total_steps``); its state is the scheduler's."""

    def __init__(self, scheduler: Any, steps: int) -> None:
        self.scheduler, self.steps = scheduler, steps

    def step(self, *args: Any, **kwargs: Any) -> None:
        """Step the scheduler ``steps`` times."""
        for _ in range(self.steps):
            if getattr(self.scheduler, "total_steps", None) is None or self.scheduler._step_count <= self.scheduler.total_steps:
                self.scheduler.step(*args, **kwargs)

    def get_last_lr(self) -> list[float]:
        """The scheduler's last learning rates."""
        return self.scheduler.get_last_lr()

    def state_dict(self) -> dict[str, Any]:
        """The scheduler's state."""
        return self.scheduler.state_dict()

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load the scheduler's state."""
        self.scheduler.load_state_dict(state_dict)
