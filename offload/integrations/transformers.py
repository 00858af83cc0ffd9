"""Hugging Face ``Trainer`` on the stage-3 engine: `OffloadTrainer` (docs/trainer_hf.md).

    trainer = OffloadTrainer(model=model, args=TrainingArguments(...), train_dataset=data,
                             offload_config="ds_config.json")
    trainer.train()
    trainer.save_model("out")            # model.safetensors + config.json: from_pretrained("out") reloads it

The DeepSpeed JSON is the one ``TrainingArguments(deepspeed=...)`` takes (transformers itself refuses that
argument without the DeepSpeed package, hence the keyword). Training runs as Trainer runs DeepSpeed
through Accelerate: the engine's ``backward`` and, on the last micro batch of an accumulation, its
``step`` (which clips, steps the optimizer and the schedule); Trainer's own ``optimizer.step()`` and
``lr_scheduler.step()`` are then no-ops (Accelerate's DeepSpeed wrappers). Importing this module
imports transformers' Trainer.
"""

from __future__ import annotations

import inspect
import json
import logging
import os
import re
from typing import Any, Mapping

import torch
from accelerate.utils.deepspeed import DeepSpeedOptimizerWrapper, DeepSpeedSchedulerWrapper
from torch import nn
from transformers import Trainer

from offload.integrations.config import (AutoSources, cast_floating, check_keywords, half_dtype, read_argument,
                                       trainer_config)
from offload.train.engine import Engine, initialize

__all__ = ["OffloadTrainer"]

log = logging.getLogger("offload")

_ARGUMENTS = {"micro_batch_size": "per_device_train_batch_size", "gradient_accumulation_steps": "gradient_accumulation_steps",
              "max_grad_norm": "max_grad_norm", "lr": "learning_rate", "betas": "adam_beta1",
              "eps": "adam_epsilon", "weight_decay": "weight_decay", "warmup_steps": "warmup_steps",
              "total_steps": "max_steps", "fp16": "fp16", "bf16": "bf16"}
_SOURCES = AutoSources(
    hints={**{name: f"set TrainingArguments({arg}=...)" for name, arg in _ARGUMENTS.items()},
           "betas": "set TrainingArguments(adam_beta1=..., adam_beta2=...)",
           "hidden_size": "use a model with config.hidden_size"},
    names={**{name: f"TrainingArguments({arg}={{}})" for name, arg in _ARGUMENTS.items()},
           "betas": "TrainingArguments(adam_beta1, adam_beta2) = {}"})
"""Each "auto" value's source in TrainingArguments' terms, for the messages."""

_TRAINER_KEYWORDS = {name for name, p in inspect.signature(Trainer.__init__).parameters.items()
                     if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL) and name != "self"}

_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")
"""A Trainer checkpoint folder's name (transformers' ``PREFIX_CHECKPOINT_DIR``-<step>)."""


def _missing_from_checkpoint(folder: str | os.PathLike) -> list[str]:
    """What a Trainer checkpoint folder of OffloadTrainer lacks to be resumed from: the engine's
    checkpoint (its ``latest`` file, written once the engine's tag is whole) and ``trainer_state.json``
    (Trainer writes it last; unreadable counts as missing). Empty when the folder is complete. A save
    interrupted part way (Ctrl-C while the engine writes) leaves the model files without these."""
    missing = []
    if not os.path.isfile(os.path.join(folder, "latest")):
        missing.append("the engine's checkpoint ('latest')")
    try:
        with open(os.path.join(folder, "trainer_state.json"), encoding="utf-8") as file:
            json.load(file)
    except (OSError, ValueError):
        missing.append("trainer_state.json")
    return missing


def _last_complete_checkpoint(output_dir: str | os.PathLike) -> str | None:
    """The checkpoint-<step> folder of ``output_dir`` with the highest step that is complete
    (`_missing_from_checkpoint`), or None; each newer, incomplete one is skipped with a warning naming it."""
    if not os.path.isdir(output_dir):
        return None
    found = sorted(((int(match.group(1)), entry) for entry in os.listdir(output_dir)
                    if (match := _CHECKPOINT.match(entry)) and os.path.isdir(os.path.join(output_dir, entry))),
                   reverse=True)
    for _, entry in found:
        folder = os.path.join(output_dir, entry)
        missing = _missing_from_checkpoint(folder)
        if not missing:
            return folder
        log.warning("resume_from_checkpoint=True: skipping %s, an incomplete checkpoint (it lacks %s: its save "
                    "was interrupted); delete it when you no longer need its files", folder, " and ".join(missing))
    return None


class OffloadTrainer(Trainer):
    """A ``transformers.Trainer`` whose model trains on the stage-3 engine (parameters, gradients and
    optimizer state partitioned, in memory or on NVMe).

    Args:
        offload_config: the DeepSpeed-format config (dict or JSON path), "auto" values allowed: they
            are filled from ``args`` as Trainer fills them for DeepSpeed (batch sizes, accumulation,
            ``max_grad_norm`` -> gradient_clipping, lr / betas / eps / weight decay, warmup and total
            steps, fp16 / bf16, bucket sizes from the model's hidden size).
        everything else: as for ``transformers.Trainer``.

    Optimizer and schedule: the config's ``optimizer`` / ``scheduler`` sections when present, else
    Trainer's own (``args.optim`` AdamW with its decay / no-decay groups, taken over by the engine's
    OffloadAdam; ``args.lr_scheduler_type`` built on the engine's optimizer). With the config's
    optimizer, the groups are still Trainer's: no weight decay on biases and norms.

    Raises TypeError for a keyword argument Trainer does not take (naming the closest), ValueError or
    OSError naming ``offload_config`` when it is missing, cannot be read or holds a bad value, and the
    engine's errors (naming the config key) when training starts.
    """

    def __init__(self, *args: Any, offload_config: Mapping[str, Any] | str | os.PathLike | None = None,
                 **kwargs: Any) -> None:
        check_keywords("OffloadTrainer", kwargs, _TRAINER_KEYWORDS | {"offload_config"})
        if offload_config is None:
            raise ValueError("OffloadTrainer(offload_config=None): missing; pass the DeepSpeed-format config (dict "
                             "or JSON path) the engine trains with")
        config = read_argument("OffloadTrainer(offload_config=...)", offload_config)
        super().__init__(*args, **kwargs)
        self.offload_config = config
        self.engine: Engine | None = None
        self._step_lr: float | None = None

    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any) -> Any:
        """Trainer's ``train``; ``resume_from_checkpoint=True`` takes the newest *complete* checkpoint-<step>
        folder of ``output_dir``, skipping (with a warning naming it) one whose save was interrupted.
        Raises ValueError naming the folder and what it lacks when the path given is such a folder, or
        when True finds no complete checkpoint."""
        if resume_from_checkpoint is True:
            found = _last_complete_checkpoint(self.args.output_dir)
            if found is None:
                raise ValueError(f"resume_from_checkpoint=True: no complete checkpoint-<step> folder in "
                                 f"{self.args.output_dir}; train without resuming or pass a checkpoint's path")
            resume_from_checkpoint = found
        elif isinstance(resume_from_checkpoint, (str, os.PathLike)) and os.path.isdir(resume_from_checkpoint):
            missing = _missing_from_checkpoint(resume_from_checkpoint)
            if missing:
                raise ValueError(f"resume_from_checkpoint: {os.fspath(resume_from_checkpoint)} is incomplete (it "
                                 f"lacks {' and '.join(missing)}: its save was interrupted); pass an earlier "
                                 f"checkpoint-<step> folder, or resume_from_checkpoint=True, which skips it")
        return super().train(resume_from_checkpoint, *args, **kwargs)

    # ---- the engine ---------------------------------------------------------------------------------

    def _start_engine(self, max_steps: int) -> Engine:
        """Build the engine over ``self.model`` with the config filled from the arguments."""
        args = self.args
        config = trainer_config(
            self.offload_config, model=self.model, micro_batch_size=args.per_device_train_batch_size,
            gradient_accumulation_steps=args.gradient_accumulation_steps, max_grad_norm=args.max_grad_norm,
            lr=args.learning_rate, betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_epsilon,
            weight_decay=args.weight_decay, warmup_steps=args.get_warmup_steps(max_steps), total_steps=max_steps,
            fp16=args.fp16, bf16=args.bf16, sources=_SOURCES)
        decay = set(self.get_decay_parameter_names(self.model))
        trainable = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        client = groups = None
        if "optimizer" in config:  # the config's hyperparameters, Trainer's groups
            groups = [{"params": [p for n, p in trainable if n in decay]},
                      {"params": [p for n, p in trainable if n not in decay], "weight_decay": 0.0}]
        else:
            client = self.optimizer if self.optimizer is not None else self.create_optimizer()
        schedule = None
        if "scheduler" not in config:
            if self.lr_scheduler is not None:
                raise ValueError("optimizers=(..., lr_scheduler): a scheduler built on the model's optimizer cannot "
                                 "drive the engine's; leave it out (args.lr_scheduler_type builds one) or add a "
                                 "scheduler section to offload_config")

            def schedule(optimizer: torch.optim.Optimizer) -> Any:
                return self.create_scheduler(num_training_steps=max_steps, optimizer=optimizer)
        engine, optimizer, _, scheduler = initialize(model=self.model, optimizer=client, model_parameters=groups,
                                                     lr_scheduler=schedule, config=config)
        self.engine = engine
        self.optimizer = DeepSpeedOptimizerWrapper(optimizer)
        self.lr_scheduler = DeepSpeedSchedulerWrapper(scheduler, self.optimizer) if scheduler is not None else None
        return engine

    def _prepare_for_training(self, max_steps: int, train_dataloader: Any, resume_from_checkpoint: str | None
                              ) -> tuple[nn.Module, Any]:
        """Start the engine (once: its partitions are the model's from then on), resume its checkpoint."""
        if self.engine is None:
            self._start_engine(max_steps)
        self.model_wrapped = self.engine
        if resume_from_checkpoint is not None:
            path, _ = self.engine.load_checkpoint(resume_from_checkpoint)
            if path is None:
                raise ValueError(f"resume_from_checkpoint: {resume_from_checkpoint} holds no engine checkpoint "
                                 f"(no 'latest' file); pass a checkpoint-<step> folder OffloadTrainer saved")
        for attr in ("model", "optimizer", "lr_scheduler"):
            setattr(self.callback_handler, attr, getattr(self, attr))
        self.callback_handler.train_dataloader = train_dataloader
        return self.engine, train_dataloader

    def _prepare_input(self, data: Any) -> Any:
        """Trainer's, then, once the engine trains in 16 bits, floating-point tensors in its dtype: as
        Trainer casts them under DeepSpeed (integer tensors such as token ids are left as they are)."""
        data = super()._prepare_input(data)
        if self.engine is not None and isinstance(data, torch.Tensor):
            return cast_floating(data, half_dtype(self.engine.config))
        return data

    def _wrap_model(self, model: nn.Module, training: bool = True, dataloader: Any = None) -> nn.Module:
        """Evaluation and prediction run through the engine once it exists."""
        return self.engine if self.engine is not None else super()._wrap_model(model, training, dataloader)

    # ---- a training step, as Trainer runs DeepSpeed ------------------------------------------------

    def training_step(self, model: nn.Module, inputs: dict[str, Any], num_items_in_batch: Any = None
                      ) -> torch.Tensor:
        """Forward, the engine's backward and, on the last micro batch of an accumulation, its step."""
        engine = self.engine
        engine.train()
        inputs = self._prepare_inputs(inputs)
        with self.compute_loss_context_manager():
            loss = self.compute_loss(engine, inputs, num_items_in_batch=num_items_in_batch)
        del inputs
        scaled = getattr(self, "loss_is_scaled_for_ga", None)  # an attribute of Trainer from transformers 5.18
        if scaled is None:  # Trainer's rule: the loss is already divided when normalised by the batch's items
            scaled = (self.model_accepts_loss_kwargs and num_items_in_batch is not None) or self.compute_loss_func is not None
        if not scaled:
            loss = loss / self.current_gradient_accumulation_steps
        sync = self.accelerator.sync_gradients
        engine.set_gradient_accumulation_boundary(sync)
        engine.backward(loss, scale_wrt_gas=False)
        if sync:
            self._step_lr = engine.get_lr()[0]  # the rate this step uses: Trainer logs it
            engine.step()
        return loss.detach()

    def _clip_grad_norm(self, model: nn.Module) -> float | None:
        """The engine clipped in its step (gradient_clipping); the norm it measured before clipping."""
        return self.engine.get_global_grad_norm()

    def _get_grad_norm(self, model: nn.Module, grad_norm: Any = None) -> float | None:
        return grad_norm if grad_norm is not None else self.engine.get_global_grad_norm()

    def _get_learning_rate(self) -> float:
        if self.engine is None or self._step_lr is None:
            return super()._get_learning_rate()
        return self._step_lr

    # ---- checkpoints and the saved model ----------------------------------------------------------

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        """The engine's checkpoint (partitions, optimizer state, schedule, counters) in ``output_dir``."""
        self.engine.save_checkpoint(output_dir)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: nn.Module | None = None) -> None:
        """Nothing: the weights come back with the engine's checkpoint (`_prepare_for_training`)."""

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        """Nothing: the engine's checkpoint holds them."""

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Save the trained weights with ``save_pretrained`` (safetensors and config.json): gathered from
        the partitions by the engine's ``_zero3_consolidated_16bit_state_dict`` (the whole model in rank
        0's memory), then written by rank 0; every rank must call it."""
        if self.engine is None:  # not trained yet: the model is whole
            super().save_model(output_dir, _internal_call)
            return
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        state_dict = self.engine._zero3_consolidated_16bit_state_dict()
        self._save(output_dir, state_dict=state_dict)
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)
