"""Offload of parameters, gradients and optimizer states to host memory or NVMe, built on tensorio.

It knows parameters, gradients and optimizer states, and reaches the disk only through tensorio.
"""

from .adam import OffloadAdam
from .config import (
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
from .checkpoint import atomic_checkpoint, resolve_tag, save_tensors_safetensors
from .clip import clip_grad_norm_, grad_norm
from .engine import initialize
from .loss_scaler import DynamicLossScaler, LossScaler, StaticLossScaler, build_loss_scaler
from .partition import owned_numel, padded_numel, partition_bounds, partition_numel
from .schedulers import WarmupDecayLR, WarmupLR, build_scheduler
from .timers import PhaseTimers

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
    "initialize",
    "owned_numel",
    "padded_numel",
    "partition_bounds",
    "partition_numel",
    "resolve_auto",
    "resolve_tag",
    "save_tensors_safetensors",
    "world_size_from_env",
]
