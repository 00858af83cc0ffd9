"""benchmarks/infer_quant.py at a tiny scale: it writes its checkpoint and both quantized caches, measures
fio, runs bf16, int8 and int4 in child processes, measures the compute floors and prints the targets
(the figures themselves mean nothing here)."""

from __future__ import annotations

import shutil

import pytest
from test_infer_generate import scratch_dir

from benchmarks.infer_quant import main

pytestmark = [pytest.mark.bench, pytest.mark.fio]


def test_tiny_run_end_to_end(capsys):
    root = scratch_dir("infer-quant-bench-")
    try:
        figures = main(["--dir", str(root), "--scale", "0.025", "--layers", "4", "--shards", "5", "--budget", "700KiB",
                        "--accelerate", "none", "--fio-size", "16MiB", "--prompt-tokens", "8", "--new-tokens", "3",
                        "--floor-layers", "1", "--floors", "int4", "--out", str(root / "figures.json")])
        caches = sorted(p.name for p in (root / "quantized").iterdir())
    finally:
        shutil.rmtree(root, ignore_errors=True)
    printed = capsys.readouterr().out
    assert [c.split("-")[1] for c in caches] == ["int4", "int8"]
    runs = {r["variant"]: r for r in figures["runs"]}
    assert set(runs) == {"bf16", "int8", "int4"} and not any("error" in r for r in runs.values())
    for name in ("int8", "int4"):  # the same budget's placement, unquantized, is bf16's; quantized it reads less
        assert runs[name]["unquantized_read_bytes_per_forward"] == runs["bf16"]["read_bytes_per_forward"]
        assert runs[name]["read_bytes_per_forward"] < runs["bf16"]["read_bytes_per_forward"]
    # One quantized variant's compute floor (two child processes each; bf16's runs in test_infer_bench).
    assert list(figures["floors"]) == ["int4"] and figures["floors"]["int4"]["floor_s"] > 0
    assert "quantized: int4 (group 64, asymmetric)" in printed and "targets:" in printed
    assert any("x bf16's tokens/s" in line for line in figures["targets"])
    divergence = figures["divergence"]  # the prompt's 8 next-token distributions, each variant against bf16
    assert set(divergence) == {"int8", "int4"}
    assert all(d["positions"] == 8 and 0 <= d["kl_mean"] <= d["kl_max"] for d in divergence.values())
    assert "KL(bf16 || int4)" in printed


def test_a_part_runs_only_the_variants_and_floors_asked_for(capsys):
    root = scratch_dir("infer-quant-bench-")
    try:
        stale = root / "log-probs-int8.npy"  # an earlier run's: not compared in this one
        stale.write_bytes(b"not an array")
        figures = main(["--dir", str(root), "--scale", "0.025", "--layers", "4", "--shards", "5", "--budget", "700KiB",
                        "--accelerate", "none", "--fio-size", "16MiB", "--prompt-tokens", "8", "--new-tokens", "3",
                        "--variants", "int4,bf16", "--floors", "none"])
        caches = sorted(p.name for p in (root / "quantized").iterdir())
    finally:
        shutil.rmtree(root, ignore_errors=True)
    assert [c.split("-")[1] for c in caches] == ["int4"]
    assert [r["variant"] for r in figures["runs"]] == ["bf16", "int4"] and figures["floors"] == {}
    assert set(figures["divergence"]) == {"int4"}
    assert any("compute floor not measured in this run" in line for line in figures["targets"])
    with pytest.raises(SystemExit, match="--variants: 'int3' is not one of bf16, int8, int4"):
        main(["--dir", str(root), "--variants", "int4,int3"])
