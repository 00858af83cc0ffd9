"""Generation with models larger than memory: weights read from the checkpoint on NVMe with O_DIRECT,
the ones that fit in the budget once, the rest streamed layer by layer with prefetch. See docs/inference.md.

`init_inference` builds an `InferenceEngine`; `InferenceConfig` is its settings (DeepSpeed-style);
`make_plan` / `Plan` is the placement, pure arithmetic on sizes.
"""

from offload.infer.config import InferenceConfig
from offload.infer.engine import CheckpointMismatchError, InferenceEngine, init_inference
from offload.infer.plan.host import BudgetError, Plan, UnitSize, make_plan

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
