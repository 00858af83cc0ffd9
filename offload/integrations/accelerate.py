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

import os
from typing import Any, Mapping

import torch
from accelerate import Accelerator
from accelerate.utils.deepspeed import DeepSpeedOptimizerWrapper, DeepSpeedSchedulerWrapper
from torch import nn

from offload.integrations.config import trainer_config
from offload.integrations.schedulers import rebind_scheduler
from offload.train.engine import Engine, initialize

__all__ = ["OffloadAccelerator"]


class OffloadAccelerator(Accelerator):
    """An ``accelerate.Accelerator`` whose prepared model trains on the stage-3 engine.

    Args:
        offload_config: the DeepSpeed-format config (dict or JSON path); "auto" values are filled from
            the prepared data loader's batch size and ``gradient_accumulation_steps``. Clipping is the
            config's ``gradient_clipping`` (the engine clips inside ``backward()``'s step).
        everything else: as for ``accelerate.Accelerator``.

    Raises ValueError when ``offload_config`` is missing.
    """

    def __init__(self, *args: Any, offload_config: Mapping[str, Any] | str | os.PathLike | None = None,
                 **kwargs: Any) -> None:
        if offload_config is None:
            raise ValueError("offload_config: missing; pass the DeepSpeed-format config (dict or JSON path)")
        super().__init__(*args, **kwargs)
        self.offload_config = offload_config
        self.engine: Engine | None = None

    def prepare(self, *args: Any, device_placement: list[bool] | None = None) -> Any:
        """Prepare as Accelerate does; the model (one) and its optimizer (one, optional) go to the engine,
        a scheduler is moved onto the engine's optimizer and stepped by the engine. Returns the objects
        in the order given: the engine for the model, Accelerate's DeepSpeed wrappers for the others."""
        models = [a for a in args if isinstance(a, nn.Module)]
        optimizers = [a for a in args if isinstance(a, torch.optim.Optimizer)]
        schedulers = [a for a in args if hasattr(a, "step") and hasattr(a, "optimizer")
                      and not isinstance(a, torch.optim.Optimizer)]
        loaders = [a for a in args if isinstance(a, torch.utils.data.DataLoader)]
        if len(models) > 1 or len(optimizers) > 1 or len(schedulers) > 1:
            raise ValueError("prepare: one model, one optimizer and one scheduler at most with OffloadAccelerator")
        if models and self.engine is not None:
            raise ValueError("prepare: the model is already on the engine; prepare it once")
        prepared: dict[int, Any] = {id(a): super(OffloadAccelerator, self).prepare(a) for a in loaders}
        if models:
            micro = loaders[0].batch_size if loaders and loaders[0].batch_size else 1
            config = trainer_config(self.offload_config, model=models[0], micro_batch_size=micro,
                                    gradient_accumulation_steps=self.gradient_accumulation_steps, max_grad_norm=None)
            client = optimizers[0] if optimizers and "optimizer" not in config else None
            engine, optimizer, _, scheduler = initialize(model=models[0], optimizer=client, config=config)
            self.engine = engine
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
