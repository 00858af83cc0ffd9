"""``python -m benchmarks.gpu``: training and generation on a GPU (issue 25), against their bounds.

- ``infer.py``: generation at a GPU budget smaller than the model (GPU, pinned host and NVMe tiers),
  seconds per token against the tiers' bound, beside Accelerate with the same ``max_memory``;
- ``profile.py``: generation with each side's default (every weight on the GPU), ours beside Accelerate,
  traced with torch.profiler: per-token breakdowns and top-20 tables (``_trace.py``);
- ``train.py``: the training step on the GPU (parameters and optimizer state on NVMe), with a per-step
  breakdown (``_waits.py`` counts the NVMe waits);
- ``check.py``: all of them and the gpu tests in one command, summary.md with the targets (``_report.py``);
  with ``--parts moe`` benchmarks/infer_moe.py's device tier on the GPU (issue 48).

Each refuses to run without a GPU (nothing here fakes GPU figures); each also runs on
the simulated device (``--device simulated``) at a tiny size, as its smoke test does (``check --tiny``).
"""
