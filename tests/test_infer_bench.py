"""benchmarks/infer_stream.py at a tiny scale: it writes its checkpoint, measures fio, runs every kind of
configuration in child processes and prints the targets (the figures themselves mean nothing here)."""

from __future__ import annotations

import importlib.util
import shutil

import pytest
import torch
import transformers
from test_infer_generate import scratch_dir

from benchmarks._common import RssSampler
from benchmarks.infer_stream import Spec, main, write_checkpoint


@pytest.mark.bench
@pytest.mark.fio
def test_tiny_run_end_to_end(capsys):
    accelerate = "dispatch" if importlib.util.find_spec("accelerate") else "none"
    root = scratch_dir("infer-bench-")
    try:
        figures = main(["--dir", str(root), "--scale", "0.025", "--layers", "4", "--shards", "5", "--budgets", "700KiB",
                        "--big-batch", "4", "--big-batch-budget", "700KiB", "--accelerate", accelerate,
                        "--accelerate-budget", "700KiB", "--fio-size", "16MiB", "--prompt-tokens", "8",
                        "--new-tokens", "3", "--floor-layers", "1", "--peer-rows", "none", "--out",
                        str(root / "figures.json")])
    finally:
        shutil.rmtree(root, ignore_errors=True)
    printed = capsys.readouterr().out
    kinds = [(r["kind"], r["batch"]) for r in figures["runs"]]
    assert kinds[:2] == [("ours", 1), ("ours", 4)]
    assert ("accelerate-dispatch", 1) in kinds or accelerate == "none"
    for run in figures["runs"]:
        assert run["s_per_token"] > 0 and run["peak_rss"] >= run["baseline_rss"] > 0
    ours = figures["runs"][0]
    assert ours["read_bytes_per_forward"] > 0 and ours["io_bytes"] >= 3 * ours["read_bytes_per_forward"]
    assert figures["fio_bps"] > 0 and "fio:" in printed and "targets:" in printed
    assert any("x the disk bound" in line for line in figures["targets"])
    assert ours["loaded_first_token_s"] > 0 and ours["first_forward_loaded_s"] > 0 and ours["full_load_s"] >= 0
    assert any(line.startswith("time to first token at") for line in figures["targets"])
    assert any(line.startswith("page cache, ours") for line in figures["targets"])
    assert ours["checkpoint_cache_growth"] < 64e6
    assert figures["floor"]["batch"] == 4 and figures["floor"]["floor_s"] > 0  # the big batch's compute floor
    assert any("x max(compute floor" in line for line in figures["targets"])


@pytest.mark.bench
def test_tiny_peer_rows_in_memory_cgroups(capsys):
    """The equal-memory and bound rows (ours only: the peer's child is the same code path): ours "auto" in a
    cgroup of the budget + its overhead reads that cgroup's room; in a cgroup of its bound + 10% it runs."""
    root = scratch_dir("infer-peers-")
    try:
        figures = main(["--dir", str(root), "--scale", "0.025", "--layers", "4", "--shards", "5", "--budgets", "",
                        "--big-batch", "1", "--accelerate", "none", "--accelerate-budget", "1GiB", "--fio-size", "16MiB",
                        "--prompt-tokens", "8", "--new-tokens", "3", "--floor-layers", "0", "--peer-rows", "equal,bound",
                        "--sides", "ours"])
    finally:
        shutil.rmtree(root, ignore_errors=True)
    printed = capsys.readouterr().out
    rows = {r["row"]: r for r in figures["peer_runs"]}
    assert set(rows) == {"equal", "bound-free", "bound"}
    for row in rows.values():
        assert row["s_per_token"] > 0 and "error" not in row
    if "memory cgroups: not used" in printed:
        assert all(r["memory_label"] == "page cache unbounded" for r in rows.values())
        return
    equal = rows["equal"]
    assert equal["cgroup_limit"] > 1 << 30 and "cgroup v" in equal["budget_source"]  # "auto" read the cgroup
    assert equal["plan_budget"] < equal["cgroup_limit"] and equal["cgroup_oom_kills"] == 0
    assert rows["bound"]["cgroup_limit"] == int(1.1 * rows["bound"]["bound_bytes"]) and rows["bound"]["cgroup_oom_kills"] == 0
    assert any(line.startswith("ours in a cgroup of its bound") for line in figures["targets"])


def test_written_checkpoint_loads_in_transformers(tmp_path):
    spec = Spec.scaled(0.0125, layers=2, shards=3)
    assert (spec.hidden, spec.heads, spec.vocab) == (64, 2, 400)
    directory = write_checkpoint(tmp_path / "ckpt", spec)
    assert len(list(directory.glob("model-*.safetensors"))) == 3
    model, info = transformers.AutoModelForCausalLM.from_pretrained(directory, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and model.dtype == torch.bfloat16
    mtime = (directory / "bench-checkpoint.json").stat().st_mtime_ns
    write_checkpoint(tmp_path / "ckpt", spec)  # written once: the second call reuses it
    assert (directory / "bench-checkpoint.json").stat().st_mtime_ns == mtime
    assert Spec.scaled(1.0, 44, 46) == Spec(5120, 13824, 44, 40, 32000, 46)


def test_kernel_peak_sees_a_short_peak_in_its_phase():
    with RssSampler(kernel_peak=True) as rss:
        rss.mark("spike")
        spike = b"x" * (128 << 20)  # written, so resident; freed at once: no sampler thread would be sure to see it
        del spike
        rss.mark("after")
        rss.mark("end")
    assert rss.kernel_peak  # Linux with /proc/self/clear_refs, as this project's machines have
    spike, after = rss.phases()
    assert spike["peak_rss"] - after["peak_rss"] >= 100 << 20
    assert rss.peak == max(r for _, r in rss.samples) >= spike["peak_rss"]


def test_a_failed_configuration_is_reported_not_fatal():
    from benchmarks._common import ChildError
    from benchmarks.infer_stream import _targets

    assert ChildError("x", -9, "").one_line() == "killed by SIGKILL (the OOM killer?)"
    assert ChildError("x", 1, "Traceback\nMemoryError: no\n").one_line() == "exit status 1: MemoryError: no"
    failed = {"kind": "ours", "budget": 16 << 30, "batch": 1, "error": "killed by SIGKILL (the OOM killer?)"}
    lines = _targets([failed], 1e9, [16 << 30], 8 << 30, 16, 8 << 30)
    assert lines == ["ours at 16.00 GiB batch 1: not measured (killed by SIGKILL (the OOM killer?)); the targets that "
                     "need it are not checked"]
