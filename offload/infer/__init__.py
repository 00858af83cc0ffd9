"""Generation with models larger than memory: weights read from the checkpoint on NVMe with O_DIRECT,
the ones that fit in the budget once, the rest streamed layer by layer with prefetch. See docs/inference.md.

`init_inference` builds an `InferenceEngine`; `InferenceConfig` is its settings (DeepSpeed-style);
`make_plan` / `Plan` is the placement, pure arithmetic on sizes.
"""

from offload.infer.config import InferenceConfig
from offload.infer.plan.host import BudgetError, Plan, UnitSize, make_plan

_ENGINE = ("CheckpointMismatchError", "InferenceEngine", "init_inference")


def __getattr__(name: str):
    """The engine's names, imported on first use: the engine needs transformers (its KV cache is a
    transformers `Cache`), the config and the planner do not."""
    if name in _ENGINE:
        from offload.infer import engine

        return getattr(engine, name)
    raise AttributeError(f"module 'offload.infer' has no attribute {name!r}")

__all__ = [
    "BudgetError",
    "CheckpointMismatchError",
    "InferenceConfig",
    "InferenceEngine",
    "Plan",
    "UnitSize",
    "init_inference",
    "make_plan",
]
