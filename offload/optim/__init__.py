"""`OffloadAdam`: a `torch.optim.AdamW` whose state lives in memory or streams from NVMe.

`adam` holds the optimizer (the Adam math, the step's schedule, state dicts); `subgroups` plans the
sub-groups; `swapper` moves their state between the swap file and a few locked buffers; `overlap`
runs the updates during backward on a background thread; `spare` lends applied gradients' memory
to read-ahead.
"""

from offload.optim.adam import OffloadAdam

__all__ = ["OffloadAdam"]
