"""benchmarks/infer_long_prompt.py at a tiny scale: it writes its checkpoint, runs ours at two prompt lengths
and transformers at one, each in a fresh process, and prints the targets (the figures mean little here:
at a few MiB the allocator's slack is as large as the activations)."""

from __future__ import annotations

import shutil

import pytest
from test_infer_generate import scratch_dir

from benchmarks.infer_long_prompt import main


@pytest.mark.bench
def test_tiny_run_end_to_end(capsys):
    root = scratch_dir("infer-long-bench-")
    try:
        figures = main(["--dir", str(root), "--tokens", "256,512", "--transformers-tokens", "512", "--hidden", "256",
                        "--intermediate", "512", "--vocab", "2000", "--budget", "2MiB"])
    finally:
        shutil.rmtree(root, ignore_errors=True)
    runs = {(r["kind"], r["tokens"]): r for r in figures["runs"]}
    assert set(runs) == {("ours", 256), ("ours", 512), ("transformers", 512)}
    assert all("error" not in r and r["peak_rss"] > 0 for r in runs.values())
    ours = runs[("ours", 512)]
    assert ours["estimate"] > 0 and ours["chunk"] == 512 and ours["forwards"] == 2  # the prefill, one new token
    assert any("bound 1.3 x transformers + budget" in line for line in figures["targets"])
    assert sum("x the measured growth" in line for line in figures["targets"]) == 2
    assert "transformers    512 tokens: peak RSS" in capsys.readouterr().out
