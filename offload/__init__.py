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
from .partition import owned_numel, padded_numel, partition_bounds, partition_numel

__all__ = [
    "AdamParams",
    "Bf16Config",
    "EngineConfig",
    "Fp16Config",
    "OffloadAdam",
    "OffloadOptimizerConfig",
    "OffloadParamConfig",
    "OptimizerConfig",
    "SchedulerConfig",
    "WarmupParams",
    "ZeroConfig",
    "check_against_model",
    "check_nvme_paths",
    "owned_numel",
    "padded_numel",
    "partition_bounds",
    "partition_numel",
    "resolve_auto",
    "world_size_from_env",
]
