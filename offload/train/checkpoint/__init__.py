"""The engine's checkpoints (the public command and DeepSpeed's ``zero_to_fp32`` surface: `offload.checkpoint`).

`files` is the on-disk layout of one tag (JSON plus tensors, nothing pickled); `rank_state` streams a
rank's partitions, optimizer state and counters to and from it; `save_load` runs the engine's save and
load around it; `reader` reads a checkpoint at any world size, and `consolidate` turns one into full
tensors offline.
"""
