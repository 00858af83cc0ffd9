"""benchmarks/infer_stream.py at a tiny scale: it writes its checkpoint, measures fio, runs every kind of
configuration in child processes and prints the targets (the figures themselves mean nothing here)."""

from __future__ import annotations

import importlib.util
import mmap
import shutil

import numpy as np
import pytest
import torch
import transformers
from test_infer_generate import scratch_dir

from benchmarks._common import RssSampler
from benchmarks.infer_stream import Spec, main, write_checkpoint


@pytest.mark.bench
@pytest.mark.fio
def test_tiny_run_end_to_end(capsys):
    """Each child kind of the table once: ours at batch 1, the first forward of a process whose weights are
    in, and Accelerate's dispatch. (The big batch is the same child at another batch and its compute floor
    the child test_infer_quant_bench runs for int4: their rows and targets are
    test_the_big_batch_and_its_floor_with_the_children_stood_in_for's.)"""
    accelerate = "dispatch" if importlib.util.find_spec("accelerate") else "none"
    root = scratch_dir("infer-bench-")
    try:
        figures = main(["--dir", str(root), "--scale", "0.025", "--layers", "4", "--shards", "5", "--budgets", "700KiB",
                        "--big-batch", "1", "--accelerate", accelerate, "--accelerate-budget", "700KiB",
                        "--fio-size", "16MiB", "--prompt-tokens", "8", "--new-tokens", "3", "--peer-rows", "none",
                        "--side-by-side", "--out", str(root / "figures.json")])
    finally:
        shutil.rmtree(root, ignore_errors=True)
    printed = capsys.readouterr().out
    kinds = [(r["kind"], r["batch"]) for r in figures["runs"]]
    assert kinds == [("ours", 1)] + ([("accelerate-dispatch", 1)] if accelerate != "none" else [])
    for run in figures["runs"]:
        assert run["s_per_token"] > 0 and run["peak_rss"] >= run["baseline_rss"] > 0
    ours = figures["runs"][0]
    assert ours["read_bytes_per_forward"] > 0 and ours["io_bytes"] >= 3 * ours["read_bytes_per_forward"]
    assert figures["fio_bps"] > 0 and "fio:" in printed and "targets:" in printed
    assert any("x the disk bound" in line for line in figures["targets"])
    assert ours["loaded_first_token_s"] > 0 and ours["first_forward_loaded_s"] > 0 and ours["full_load_s"] >= 0
    assert any(line.startswith("time to first token at") for line in figures["targets"])
    # --side-by-side: the floor measured in the run's process, its compute alone over the run's decode steps
    assert len(ours["compute_alone_steps"]) == 2 and ours["reads_alone_bps"] > 0
    loaded = ours["loaded_decode_steps"]  # the last steps: those that began once every resident weight was in
    assert loaded == ours["decode_steps"][len(ours["decode_steps"]) - len(loaded):]
    assert ours["loaded_s_per_token"] == (float(np.median(loaded)) if loaded else None)
    assert any(line.startswith("ours at 700.0 KiB batch 1: ") and "its ring's reads alone" in line
               for line in figures["targets"])
    assert any(line.startswith("page cache, ours") for line in figures["targets"])
    assert ours["checkpoint_cache_growth"] < 64e6
    assert figures["floor"] is None  # no big batch: no floor
    if accelerate != "none":
        assert figures["runs"][1]["memory_label"] == "page cache unbounded"
        assert any("accelerate-dispatch's tokens/s; target >= 1.6x" in line for line in figures["targets"])


def test_the_big_batch_and_its_floor_with_the_children_stood_in_for(tmp_path, monkeypatch):
    """The big batch's run and compute floor, and their targets, from figures the children would have
    printed (made from each payload): its row beside batch 1's at the same budget, the floor at its batch."""
    from benchmarks import infer_stream

    runs, floors = [], []

    def run_config(payload):
        runs.append((payload["kind"], payload["budget"], payload["batch"], bool(payload.get("first_forward_only"))))
        if payload.get("first_forward_only"):
            return {"first_forward_loaded_s": 0.05}
        batch = payload["batch"]
        s = {1: 0.1, 4: 0.15}[batch]  # a step of batch 4 takes 1.5x batch 1's: 2.67x the tokens/s
        return {"kind": payload["kind"], "budget": payload["budget"], "batch": batch, "load_s": 0.1, "load_kernel_s": 0.0,
                "load_user_s": 0.1, "first_token_s": 0.1, "ttft_s": 0.2, "s_per_token": s, "tokens_per_s": batch / s,
                "decode_steps": [s, s], "peak_rss": 2 << 20, "baseline_rss": 1 << 20, "cached_growth": 1e6,
                "checkpoint_cache_growth": 1e6, "read_bytes": 4e6, "read_bytes_per_forward": 2e7, "resident_bytes": 1e6,
                "full_load_s": 0.1, "loaded_first_token_s": 0.05 if batch == 1 else None}

    def compute_floor(spec, *, quantize, batch, prompt_tokens, new_tokens, floor_layers):
        floors.append((quantize, batch, floor_layers))
        return {"batch": batch, "steps": {2: 0.01, 2 + floor_layers: 0.02}, "per_layer_s": 0.01 / floor_layers,
                "floor_s": 0.03}

    monkeypatch.setattr(infer_stream, "run_config", run_config)
    monkeypatch.setattr(infer_stream, "compute_floor", compute_floor)
    monkeypatch.setattr(infer_stream, "fio_read_speed", lambda aio, directory, size: 1e9)
    figures = main(["--dir", str(tmp_path), "--scale", "0.0125", "--layers", "2", "--shards", "1", "--budgets", "1MiB",
                    "--big-batch", "4", "--big-batch-budget", "1MiB", "--big-batch-target", "2", "--floor-layers", "2",
                    "--accelerate", "none", "--peer-rows", "none"])
    assert runs == [("ours", 1 << 20, 1, False), ("ours", 1 << 20, 1, True), ("ours", 1 << 20, 4, False)]
    assert floors == [(None, 4, 2)] and figures["floor"]["batch"] == 4
    assert "batch 4 at 1.0 MiB: 2.7x the tokens/s of batch 1; target >= 2x: met" in figures["targets"]
    # its step against max(floor 0.03 s, 20 MB at 1 GB/s = 0.02 s); at that bound, 4 / 0.03 s / 10 tokens/s
    assert ("batch 4: 0.150 s/step = 5.00x max(compute floor 0.030 s, disk 0.020 s); at that bound batch 4 would be "
            "13.3x batch 1's tokens/s") in figures["targets"]
    assert any(line.startswith("page cache, ours at 1.0 MiB batch 4: +1 MB") for line in figures["targets"])


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
        # A fresh anonymous mapping, written so resident, unmapped at once: no sampler thread would be sure to
        # see it. (Not a bytes object: malloc may serve it from free heap pages already resident in this worker.)
        spike = mmap.mmap(-1, 128 << 20)
        for _ in range(128):
            spike.write(b"x" * (1 << 20))
        spike.close()
        rss.mark("after")
        rss.mark("end")
    assert rss.kernel_peak  # Linux with /proc/self/clear_refs, as this project's machines have
    spike, after = rss.phases()
    assert spike["peak_rss"] - after["peak_rss"] >= 100 << 20
    assert rss.peak == max(r for _, r in rss.samples) >= spike["peak_rss"]


def test_a_failed_configuration_is_reported_not_fatal():
    from benchmarks._common import ChildError
    from benchmarks._stream_targets import stream_targets

    assert ChildError("x", -9, "").one_line() == "killed by SIGKILL (the OOM killer?)"
    assert ChildError("x", 1, "Traceback\nMemoryError: no\n").one_line() == "exit status 1: MemoryError: no"
    failed = {"kind": "ours", "budget": 16 << 30, "batch": 1, "error": "killed by SIGKILL (the OOM killer?)"}
    lines = stream_targets([failed], 1e9, [16 << 30], 8 << 30, 16, 8 << 30)
    assert lines == ["ours at 16.00 GiB batch 1: not measured (killed by SIGKILL (the OOM killer?)); the targets that "
                     "need it are not checked"]


@pytest.mark.bench
def test_tiny_resident_run_beside_transformers(capsys):
    """benchmarks/infer_resident.py at a tiny scale: both sides in fresh processes, the same greedy tokens,
    every weight of ours in memory (nothing streamed), the ratio and its target printed."""
    from benchmarks.infer_resident import main as resident

    root = scratch_dir("infer-resident-")
    try:
        figures = resident(["--dir", str(root), "--scale", "0.025", "--layers", "2", "--shards", "1", "--rounds", "1",
                            "--new-tokens", "3"])
    finally:
        shutil.rmtree(root, ignore_errors=True)
    printed = capsys.readouterr().out
    assert [r["kind"] for rs in figures["runs"].values() for r in rs] == ["ours", "transformers"]
    assert figures["same_tokens"] and figures["runs"]["ours"][0]["streamed"] == 0
    assert figures["ratio"] == figures["medians"]["ours"] / figures["medians"]["transformers"] > 0
    assert figures["tensors"] == 21 and 0 <= figures["misaligned_tensors"] <= 21
    assert "ours / transformers" in printed and "(target <= 1.05)" in printed


@pytest.mark.bench
def test_tiny_revisions_run_alternates_two_trees_each_with_its_own_cache(capsys):
    """benchmarks/infer_revisions.py at a tiny scale against HEAD: both sides run from their own tree (the
    revision's worktree is gone afterwards), int4 through a quantized cache of each side's own (kept under
    --cache-dir), the same tokens, the ratio printed."""
    import subprocess

    from benchmarks.infer_revisions import main as revisions

    root = scratch_dir("infer-revisions-")
    try:
        figures = revisions(["--dir", str(root), "--rev", "HEAD", "--scale", "0.025", "--layers", "2", "--shards", "1",
                             "--budget", "1MiB", "--quantize", "int4", "--prompt-tokens", "4", "--new-tokens", "3",
                             "--repeats", "1", "--cache-dir", str(root / "caches")])
        assert not list(root.glob("revisions-*"))
        for side in ("revision", "this-tree"):  # each side's cache kept for the next comparison
            assert len(list((root / "caches" / side).glob("quantized-int4-*/model.safetensors"))) == 1
    finally:
        shutil.rmtree(root, ignore_errors=True)
    worktrees = subprocess.run(["git", "worktree", "list"], capture_output=True, text=True, check=True).stdout
    assert str(root) not in worktrees  # the revision's worktree is gone, and git forgot it
    assert set(figures["runs"]) == {"HEAD", "this tree"}
    assert figures["same_tokens"] and len(figures["runs"]["HEAD"][0]["tokens"]) >= 3
    assert figures["ratio_s_per_token"] > 0
    assert "this tree / HEAD: s/token" in capsys.readouterr().out
