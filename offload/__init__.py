"""Offload of parameters, gradients and optimizer states to host memory or NVMe, built on tensorio.

It knows parameters, gradients and optimizer states, and reaches the disk only through tensorio.
One subpackage per concern, each using only those listed before it:

- `offload.config`: DeepSpeed JSON to validated dataclasses (the only place settings are checked);
- `offload.storage`: the swap file, checkpoint directories, safetensors files;
- `offload.params`: ZeRO-3 partitions: partition arithmetic, placement, the record store (gather,
  release, hooks, prefetch); nothing training-specific;
- `offload.optim`: `OffloadAdam`, its state swapper, sub-group planner and overlap worker;
- `offload.train`: the stage-3 engine (`initialize`), gradient reduction, write-back, loss scaling,
  schedulers, clipping, timers, engine checkpoints;
- `offload.infer`: generation with weights streamed from NVMe.
- `offload.serve`: ``python -m offload.serve``, an OpenAI-compatible server on `offload.infer`'s batch.
"""

from offload.config import (
    AdamParams,
    Bf16Config,
    EngineConfig,
    Fp16Config,
    OffloadOptimizerConfig,
    OffloadParamConfig,
    OptimizerConfig,
    SchedulerConfig,
    WarmupParams,
    ZeroConfig,
    check_against_model,
    check_nvme_paths,
    resolve_auto,
    world_size_from_env,
)
from offload.optim import OffloadAdam
from offload.params import owned_numel, padded_numel, partition_bounds, partition_numel
from offload.storage import atomic_checkpoint, resolve_tag, save_tensors_safetensors
from offload.train import (
    DynamicLossScaler,
    LossScaler,
    PhaseTimers,
    StaticLossScaler,
    WarmupDecayLR,
    WarmupLR,
    build_loss_scaler,
    build_scheduler,
    clip_grad_norm_,
    grad_norm,
    initialize,
)
from offload import zero  # noqa: E402  (deepspeed.zero's surface: Init, GatheredParameters, ...)
from offload import checkpoint  # noqa: E402  (deepspeed.utils.zero_to_fp32's surface, and its command)


def __getattr__(name: str):
    """``init_inference``, imported on first use: generation needs transformers (its KV cache is a
    transformers `Cache`), training and the commands do not, and importing it costs 2 s."""
    if name == "init_inference":
        from offload.infer import init_inference

        return init_inference
    raise AttributeError(f"module 'offload' has no attribute {name!r}")

__all__ = [
    "AdamParams",
    "Bf16Config",
    "DynamicLossScaler",
    "EngineConfig",
    "Fp16Config",
    "LossScaler",
    "OffloadAdam",
    "OffloadOptimizerConfig",
    "OffloadParamConfig",
    "OptimizerConfig",
    "PhaseTimers",
    "SchedulerConfig",
    "StaticLossScaler",
    "WarmupDecayLR",
    "WarmupLR",
    "WarmupParams",
    "ZeroConfig",
    "atomic_checkpoint",
    "build_loss_scaler",
    "build_scheduler",
    "check_against_model",
    "check_nvme_paths",
    "clip_grad_norm_",
    "grad_norm",
    "init_inference",
    "initialize",
    "owned_numel",
    "padded_numel",
    "partition_bounds",
    "partition_numel",
    "resolve_auto",
    "resolve_tag",
    "save_tensors_safetensors",
    "world_size_from_env",
    "zero",
]
