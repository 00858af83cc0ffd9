"""Lightning on the stage-3 engine: `OffloadStrategy` and its precision plugin (docs/lightning.md).

    import offload.integrations.lightning               # registers "offload_stage_3", "offload_stage_3_nvme"
    trainer = lightning.Trainer(strategy=OffloadStrategy(nvme_path="/nvme/swap"), accelerator="cpu",
                                gradient_clip_val=1.0, accumulate_grad_batches=2)
    trainer.fit(module, loader)

Built as Lightning's own ``DeepSpeedStrategy`` is (a ``DDPStrategy`` that hands the model to an engine
instead of DDP): ``configure_optimizers``' optimizer is taken over by the engine (param groups included)
and its scheduler keeps being stepped by Lightning, now on the engine's optimizer; the engine does the
backward, accumulation (``accumulate_grad_batches``), clipping (``gradient_clip_val``) and the step.
Checkpoints are the engine's (a directory per ``.ckpt`` path) with Lightning's state as ``client_state``.
Importing this module imports Lightning.
"""

from __future__ import annotations

import inspect
import os
from contextlib import AbstractContextManager, nullcontext
from typing import Any, Callable, Mapping

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.types import LRSchedulerConfig
from lightning_utilities.core.apply_func import apply_to_collection
from torch import nn

from offload.integrations.config import (AutoSources, check_keywords, half_dtype, optimizer_hyperparameters,
                                       read_argument, trainer_config)
from offload.integrations.schedulers import rebind_scheduler
from offload.train.engine import Engine, initialize

__all__ = ["OffloadPrecision", "OffloadStrategy"]

_DEVICES = ("none", "cpu", "nvme")
_DDP_KEYWORDS = {name for name, p in inspect.signature(DDPStrategy.__init__).parameters.items()
                 if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL) and name != "self"}
"""What DDPStrategy takes by name; its ``**kwargs`` go to DistributedDataParallel, which never runs here."""

_SOURCES = AutoSources(
    hints={"micro_batch_size": "give the Trainer a train DataLoader with a batch_size",
           "gradient_accumulation_steps": "set Trainer(accumulate_grad_batches=...)",
           "max_grad_norm": "set Trainer(gradient_clip_val=...)",
           "fp16": "set Trainer(precision=...)", "bf16": "set Trainer(precision=...)",
           **{name: f"return an optimizer with {name} from configure_optimizers"
              for name in ("lr", "betas", "eps", "weight_decay")},
           "total_steps": "set Trainer(max_steps=...) or max_epochs",
           "hidden_size": "the model has no config.hidden_size to size it from"},
    names={"micro_batch_size": "the train DataLoader's batch_size",
           "gradient_accumulation_steps": "Trainer(accumulate_grad_batches={})",
           "max_grad_norm": "Trainer(gradient_clip_val={})", "fp16": "Trainer(precision) fp16",
           "bf16": "Trainer(precision) bf16", "total_steps": "Trainer's estimated_stepping_batches",
           **{name: f"configure_optimizers' {name}" for name in ("lr", "betas", "eps", "weight_decay")}})
"""Each "auto" value's source in Lightning's terms, for the messages."""

_PRECISIONS = {"32-true": None, "32": None, "bf16-true": "bf16", "bf16-mixed": "bf16", "16-true": "fp16",
               "16-mixed": "fp16"}


class OffloadPrecision(Precision):
    """Precision for `OffloadStrategy`: the engine casts (fp16 / bf16 from ``precision``), runs the
    backward and the step, and clips; Lightning's own clipping is then a no-op. Once the engine trains
    in 16 bits, the floating-point tensors of each batch are cast to its dtype (``convert_input``), as
    Lightning's DeepSpeed precision casts them; integer tensors (token ids) are left as they are."""

    def __init__(self, precision: str = "32-true") -> None:
        if str(precision) not in _PRECISIONS:
            raise ValueError(f"precision: {precision!r} is not supported by OffloadStrategy; use one of "
                             f"{sorted(_PRECISIONS)}")
        self.precision = str(precision)
        self.input_dtype: torch.dtype | None = None
        """The engine's 16-bit dtype, set by the strategy when it starts the engine; None: inputs as they are."""

    def convert_module(self, module: nn.Module) -> nn.Module:
        return module  # the engine casts the parameters it partitions

    def convert_input(self, data: Any) -> Any:
        """The batch with its floating-point tensors in the engine's dtype (``input_dtype``)."""
        dtype = self.input_dtype
        if dtype is None:
            return data
        return apply_to_collection(data, function=lambda t: t.to(dtype) if t.is_floating_point() else t,
                                   dtype=torch.Tensor)

    def backward(self, tensor: torch.Tensor, model: LightningModule, optimizer: Any, *args: Any, **kwargs: Any) -> None:
        """The engine's backward; Lightning has already divided the loss by accumulate_grad_batches."""
        model.trainer.strategy.engine.backward(tensor, scale_wrt_gas=False)

    def optimizer_step(self, optimizer: Any, model: LightningModule, closure: Callable[[], Any], **kwargs: Any) -> Any:
        """Forward and backward (the closure), then the engine's step (an update at accumulation boundaries)."""
        result = closure()
        self._after_closure(model, optimizer)
        if model.automatic_optimization and result is None:
            raise MisconfigurationException("training_step returned None: skipping the backward is not supported "
                                            "by OffloadStrategy (the engine counts every micro batch)")
        return model.trainer.strategy.engine.step()

    def clip_gradients(self, optimizer: Any, clip_val: float = 0.0, gradient_clip_algorithm: Any = None) -> None:
        """The engine clips in its step (gradient_clip_val -> gradient_clipping)."""

    def tensor_init_context(self) -> AbstractContextManager:
        return nullcontext()


class OffloadStrategy(DDPStrategy):
    """Train a LightningModule with its parameters, gradients and optimizer state partitioned over the
    ranks, in memory or on NVMe.

    Args:
        config: a DeepSpeed-format config (dict or JSON path); "auto" values are filled from Lightning's
            settings (the loader's batch size, ``accumulate_grad_batches``, ``gradient_clip_val``, precision,
            ``configure_optimizers``' hyperparameters; docs/lightning.md). None: built from the others.
        offload_params, offload_optimizer: "none", "cpu" or "nvme" (without ``config``).
        nvme_path: the swap directory with "nvme" (default ``./offload_nvme``, created).

    Raises, when constructed: TypeError for an unknown keyword (naming the closest), ValueError naming
    the argument for a bad device, an nvme_path without NVMe, config together with the keywords, or a
    config that cannot be read or holds a bad value. When fitting: ValueError for a config that disagrees
    with the Trainer (naming the key), several optimizers, clipping by value, or an unsupported precision.
    """

    strategy_name = "offload"

    def __init__(self, config: Mapping[str, Any] | str | os.PathLike | None = None, *,
                 offload_params: str | None = None, offload_optimizer: str | None = None,
                 nvme_path: str | os.PathLike | None = None, precision_plugin: Precision | None = None,
                 **kwargs: Any) -> None:
        check_keywords("OffloadStrategy", kwargs, _DDP_KEYWORDS | {"config", "offload_params", "offload_optimizer",
                                                                   "nvme_path", "precision_plugin"})
        for name, value in (("offload_params", offload_params), ("offload_optimizer", offload_optimizer)):
            if value is not None and value not in _DEVICES:
                raise ValueError(f"OffloadStrategy({name}={value!r}): not a device; use one of "
                                 f"{', '.join(map(repr, _DEVICES))}")
        if nvme_path is not None and not isinstance(nvme_path, (str, os.PathLike)):
            raise ValueError(f"OffloadStrategy(nvme_path={nvme_path!r}): expected a directory path (str)")
        if config is not None:
            given = [n for n, v in (("offload_params", offload_params), ("offload_optimizer", offload_optimizer),
                                    ("nvme_path", nvme_path)) if v is not None]
            if given:
                raise ValueError(f"OffloadStrategy(config=..., {given[0]}=...): the config's zero_optimization says "
                                 f"where things go; pass either config or {', '.join(given)}, not both")
            self.config = read_argument("OffloadStrategy(config=...)", config)
        else:
            offload_params, offload_optimizer = offload_params or "none", offload_optimizer or "none"
            if nvme_path is not None and "nvme" not in (offload_params, offload_optimizer):
                raise ValueError(f"OffloadStrategy(nvme_path={os.fspath(nvme_path)!r}): nothing goes to NVMe; add "
                                 f"offload_params=\"nvme\" and/or offload_optimizer=\"nvme\", or leave nvme_path out")
            path = os.fspath(nvme_path) if nvme_path is not None else os.path.join(os.getcwd(), "offload_nvme")
            self.config = {"zero_optimization": {
                "stage": 3,
                "offload_param": {"device": offload_params, **({"nvme_path": path} if offload_params == "nvme" else {})},
                "offload_optimizer": {"device": offload_optimizer,
                                      **({"nvme_path": path} if offload_optimizer == "nvme" else {})}}}
            if "nvme" in (offload_params, offload_optimizer):
                os.makedirs(path, exist_ok=True)
        super().__init__(precision_plugin=precision_plugin, **kwargs)
        self.engine: Engine | None = None

    # ---- setup ------------------------------------------------------------------------------------

    def setup(self, trainer: Trainer) -> None:
        """Start the engine when fitting (once); validation, testing and prediction use it when it exists."""
        self.accelerator.setup(trainer)
        if not isinstance(self.precision_plugin, OffloadPrecision):
            self.precision_plugin = OffloadPrecision(trainer.precision)
        if self.engine is None and trainer.state.fn == TrainerFn.FITTING:
            self._start_engine(trainer)
        if self.engine is not None:
            self.model = self.engine

    def _setup_model(self, model: nn.Module) -> nn.Module:
        return model  # no DDP wrapper: the engine reduces the gradients

    def _start_engine(self, trainer: Trainer) -> None:
        module = self.lightning_module
        algorithm = trainer.gradient_clip_algorithm
        if algorithm is not None and str(getattr(algorithm, "value", algorithm)) == "value":
            raise MisconfigurationException("gradient_clip_algorithm='value': the engine clips by the global norm only")
        from lightning.pytorch.core.optimizer import _init_optimizers_and_lr_schedulers

        optimizers, schedulers = _init_optimizers_and_lr_schedulers(module)
        if len(optimizers) > 1 or len(schedulers) > 1:
            raise MisconfigurationException("OffloadStrategy supports one optimizer and at most one scheduler")
        dtype = _PRECISIONS[self.precision_plugin.precision]
        hyper = optimizer_hyperparameters(optimizers[0] if optimizers else None)
        # Lightning counts the steps by loading the train data: only when the schedule asks for them.
        wants_total = self.config.get("scheduler", {}).get("params", {}).get("total_num_steps") == "auto"
        total = trainer.estimated_stepping_batches if wants_total else float("inf")
        # As Lightning's DeepSpeedStrategy: a micro batch the config writes out is kept, else the loader's.
        written = self.config.get("train_micro_batch_size_per_gpu", "auto")
        micro = self._loader_batch_size(trainer) if written == "auto" else None
        config = trainer_config(self.config, model=module, micro_batch_size=micro,
                                gradient_accumulation_steps=trainer.accumulate_grad_batches,
                                max_grad_norm=trainer.gradient_clip_val or 0.0, fp16=dtype == "fp16",
                                bf16=dtype == "bf16", warmup_steps=0,
                                total_steps=int(total) if total != float("inf") else None, sources=_SOURCES,
                                auto_only=("lr", "betas", "eps", "weight_decay", "warmup_steps", "total_steps",
                                           "fp16", "bf16"), **hyper)
        client = None if "optimizer" in config else optimizers[0] if optimizers else None
        engine, optimizer, _, engine_scheduler = initialize(model=module, optimizer=client, config=config,
                                                            dist_init_required=False)
        self.engine = engine
        self.precision_plugin.input_dtype = half_dtype(engine.config)
        self.optimizers = [optimizer]
        if schedulers and "scheduler" not in config:
            rebind_scheduler(schedulers[0].scheduler, client, optimizer)
            self.lr_scheduler_configs = [schedulers[0]]
        elif engine_scheduler is not None:  # the config's schedule, stepped by Lightning as DeepSpeedStrategy does
            engine.lr_scheduler = None
            self.lr_scheduler_configs = [LRSchedulerConfig(engine_scheduler, interval="step")]

    @staticmethod
    def _loader_batch_size(trainer: Trainer) -> int:
        """The train loader's batch size, as Lightning's DeepSpeedStrategy reads it (1 when it has none)."""
        source = trainer.fit_loop._data_source
        if source.is_defined():
            loader = source.dataloader()
            size = getattr(getattr(loader, "batch_sampler", None), "batch_size", None)
            if isinstance(size, int) and size >= 1:
                return size
        return 1

    @property
    def handles_gradient_accumulation(self) -> bool:
        """The engine accumulates: Lightning calls the step on every micro batch."""
        return True

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True

    @property
    def lightning_restore_optimizer(self) -> bool:
        return False  # the engine's checkpoint holds the optimizer state

    def model_to_device(self) -> None:
        """Nothing: the parameters stay where the engine placed them."""

    # ---- checkpoints ------------------------------------------------------------------------------

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        """Nothing for Lightning's dict: the engine's checkpoint holds the optimizer state (streamed)."""
        return {}

    def lightning_module_state_dict(self) -> dict[str, Any]:
        """Nothing for Lightning's dict: the engine's checkpoint holds the partitions."""
        return {}

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: str | os.PathLike,
                        storage_options: Any = None) -> None:
        """The engine's checkpoint in the directory ``filepath`` (tag "checkpoint"), Lightning's state
        (epoch, loops, callbacks, schedulers) as its client state. Every rank must call it."""
        if storage_options is not None:
            raise TypeError("storage_options: not supported by OffloadStrategy (the engine writes the checkpoint)")
        if self.engine is None:
            raise RuntimeError("save_checkpoint: no engine yet; fit first")
        filepath = self.broadcast(filepath)
        state = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
        self.engine.save_checkpoint(filepath, client_state=state, tag="checkpoint")

    def load_checkpoint(self, checkpoint_path: str | os.PathLike, weights_only: bool | None = None) -> dict[str, Any]:
        """Load the engine's checkpoint (parameters, optimizer state, counters); return Lightning's state.
        Raises FileNotFoundError when ``checkpoint_path`` is not a checkpoint this strategy saved."""
        if self.engine is None:
            raise RuntimeError("load_checkpoint: no engine yet; resume with Trainer.fit(..., ckpt_path=...)")
        path, client_state = self.engine.load_checkpoint(checkpoint_path, tag="checkpoint")
        return client_state

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        """Nothing: `load_checkpoint` loaded the partitions."""

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """Nothing: `load_checkpoint` loaded the optimizer state."""

    def teardown(self) -> None:
        """Lightning's teardown, without moving the (partitioned) model between devices."""
        self.precision_plugin.teardown()
        if self.accelerator is not None:
            self.accelerator.teardown()
        self.checkpoint_io.teardown()

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register("offload_stage_3", cls, description="ZeRO stage 3 on the offload engine, in memory",
                                   offload_params="cpu", offload_optimizer="cpu")
        strategy_registry.register("offload_stage_3_nvme", cls,
                                   description="ZeRO stage 3 on the offload engine, parameters and optimizer on NVMe "
                                               "(./offload_nvme)", offload_params="nvme", offload_optimizer="nvme")


OffloadStrategy.register_strategies(StrategyRegistry)
