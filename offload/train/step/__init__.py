"""The step: where a step's update runs and how it commits whole or not at all.

In the step's order: `update_mode` picks one of the three update modes once, at `initialize`
(`in_backward`: each partition updated as its gradient is final; `in_forward`: validated after backward,
updated during the next forward through `deferred`; `after_backward`: the chunked step in ``step()``);
`kept_buffers` keeps the backward's read buffers for the updates, `writeback` writes on-disk partitions
updated during backward; `rollback` commits or puts back what a step changes besides the optimizer
state, `failure` says whether training may go on after an error, `agree` makes every rank give up
a step that failed on any one of them, and `stop` stops every rank at once after a failure they could
not agree (the model raising on one rank).
"""
