"""ZeRO-3 parameter partitions, with nothing training-specific.

`partition` is the pure arithmetic (bounds, padding); `placement` partitions a model's parameters
and places each partition in memory or in the swap file; `store` holds one record per parameter
and gathers/releases it around its use (module hooks, saved-tensor hooks, prefetch within a
budget). An inference engine can use it read-only.
"""

from offload.params.partition import owned_numel, padded_numel, partition_bounds, partition_numel
from offload.params.placement import Placement, build_records
from offload.params.prefetch import Prefetcher, SwapBudget
from offload.params.record import ParamRecord
from offload.params.store import ParamStore

__all__ = [
    "ParamRecord",
    "ParamStore",
    "Placement",
    "Prefetcher",
    "SwapBudget",
    "build_records",
    "owned_numel",
    "padded_numel",
    "partition_bounds",
    "partition_numel",
]
