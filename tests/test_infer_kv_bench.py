"""benchmarks/infer_kv.py at a tiny scale: it writes its checkpoint, measures fio, runs the cache in memory
and on NVMe in child processes and prints the target (the timings themselves mean nothing here)."""

from __future__ import annotations

import shutil

import pytest
from test_infer_generate import scratch_dir

from benchmarks.infer_kv import main

pytestmark = [pytest.mark.bench, pytest.mark.fio]


@pytest.mark.parametrize("quantize, prompt", [(None, 96), ("int8", 300)], ids=["bf16", "int8"])
def test_tiny_run_end_to_end(capsys, quantize, prompt):
    """The int8 cache's page holds 256 tokens of this model's rows (batch 1, 2 heads of 32): a longer prompt."""
    root = scratch_dir("infer-kv-bench-")
    try:
        figures = main(["--dir", str(root), "--scale", "0.0125", "--layers", "2", "--shards", "1", "--batch", "1",
                        "--prompt-tokens", str(prompt), "--new-tokens", "4", "--fio-size", "16MiB", "--repeats", "1",
                        "--out", str(root / "figures.json")] + (["--kv-quantize", quantize] if quantize else []))
        left = [p.name for p in (root / "kv").iterdir()]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    printed = capsys.readouterr().out
    assert left == []  # the cache's files are removed after each run
    assert figures["tokens_equal"]
    nvme, memory = figures["runs"]["nvme"][0], figures["runs"]["memory"][0]
    assert nvme["kv_read_per_step"] > 0 and nvme["kv_written"] > 0 and memory["kv_read_per_step"] == 0
    assert nvme["kv_nvme_bytes"] == nvme["kv_total_bytes"] > 0
    assert "KV on NVMe" in printed and "x max(compute, disk)" in printed
    assert f"cache {quantize or 'bf16'}" in printed
