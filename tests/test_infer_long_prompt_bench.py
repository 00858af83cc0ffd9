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
    assert sum("x the peak of live tensors" in line for line in figures["targets"]) == 2
    assert all(r["live_peak"] > 0 for (kind, _), r in runs.items() if kind == "ours")
    assert "transformers    512 tokens: peak RSS" in capsys.readouterr().out


@pytest.mark.bench
def test_tiny_run_in_a_memory_cgroup_without_transformers(capsys):
    """--cgroup-overhead runs ours in a memory cgroup of the budget + the overhead and reports its peak, limit
    hits and OOM kills; --transformers-tokens 0 skips transformers' side; the model's shape is chosen."""
    from benchmarks._cgroup import MemoryCgroup

    probe = MemoryCgroup.create("offload-test-probe")
    if isinstance(probe, str):
        pytest.skip(probe)
    probe.close()
    root = scratch_dir("infer-long-cgroup-")
    try:
        figures = main(["--dir", str(root), "--tokens", "256", "--transformers-tokens", "0", "--hidden", "256",
                        "--intermediate", "512", "--layers", "3", "--heads", "4", "--kv-heads", "2", "--vocab", "2000",
                        "--budget", "2MiB", "--cgroup-overhead", "2GiB"])
    finally:
        shutil.rmtree(root, ignore_errors=True)
    assert figures["spec"]["layers"] == 3 and figures["spec"]["kv_heads"] == 2
    (run,) = figures["runs"]
    assert run["kind"] == "ours" and "error" not in run
    group = run["cgroup"]
    assert group["limit"] == (2 << 20) + (2 << 30) and 0 < group["peak"] <= group["limit"] and group["oom_kills"] == 0
    assert "in a cgroup of 2.00 GiB: peak" in capsys.readouterr().out
