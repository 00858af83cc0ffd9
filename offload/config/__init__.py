"""DeepSpeed-format JSON to validated dataclasses: the only place settings are checked.

`EngineConfig.from_dict` / `from_file` read a whole DeepSpeed config; each section has its own
dataclass (`ZeroConfig`, `OffloadParamConfig`, `OffloadOptimizerConfig`, `Fp16Config`, ...), whose
``__post_init__`` raises ValueError naming the key. See docs/engine_config.md.
"""

from offload.config.auto import resolve_auto
from offload.config.checkpoint import CheckpointConfig
from offload.config.engine import EngineConfig, check_against_model, check_nvme_paths, world_size_from_env
from offload.config.training import AdamParams, Bf16Config, Fp16Config, OptimizerConfig, SchedulerConfig, WarmupParams
from offload.config.zero import OffloadOptimizerConfig, OffloadParamConfig, ZeroConfig

__all__ = [
    "AdamParams",
    "Bf16Config",
    "CheckpointConfig",
    "EngineConfig",
    "Fp16Config",
    "OffloadOptimizerConfig",
    "OffloadParamConfig",
    "OptimizerConfig",
    "SchedulerConfig",
    "WarmupParams",
    "ZeroConfig",
    "check_against_model",
    "check_nvme_paths",
    "resolve_auto",
    "world_size_from_env",
]
