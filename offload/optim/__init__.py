"""`OffloadAdam`: a `torch.optim.AdamW` whose state lives in memory or streams from NVMe.

By job: `adam` is the `torch.optim` facade; `kernel` the fused Adam/AdamW update and its checks;
`schedule` the swap schedule (read-ahead, eviction, the learnt order); `transaction` a step's commit
or abort; `state_io` state dicts and streamed state; `subgroups` plans the sub-groups; `swapper` moves
their state between the swap file and a few locked buffers; `overlap` runs the updates during
backward on a background thread; `spare` lends applied gradients' memory to read-ahead. `protocol`
declares what the training engine uses (`StepOptimizer`).
"""

from offload.optim.adam import OffloadAdam
from offload.optim.protocol import StepOptimizer

__all__ = ["OffloadAdam", "StepOptimizer"]
