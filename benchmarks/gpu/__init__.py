"""``python -m benchmarks.gpu``: training and generation on a GPU (issue 25), against their bounds.

- ``infer.py``: generation at a GPU budget smaller than the model (GPU, pinned host and NVMe tiers),
  seconds per token against the tiers' bound, beside Accelerate with the same ``max_memory``;
- ``train.py``: the training step on the GPU (parameters and optimizer state on NVMe).

Both refuse to run without a GPU (nothing here fakes GPU figures); the inference part also runs on
the simulated device (``--device simulated``) at a tiny size, as its smoke test does.
"""
