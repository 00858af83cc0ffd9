"""benchmarks/infer_quant.py at a tiny scale: it writes its checkpoint and a quantized cache, measures fio,
runs bf16 and int4 in child processes, measures a compute floor and prints the targets (the figures
themselves mean nothing here); and the whole comparison's bookkeeping (every variant, Accelerate, the
floors, the targets) with the children stood in for."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from test_infer_generate import scratch_dir

from benchmarks import infer_quant
from benchmarks.infer_quant import main

TINY = ["--scale", "0.025", "--layers", "4", "--shards", "5", "--budget", "700KiB", "--prompt-tokens", "8",
        "--new-tokens", "3"]


@pytest.mark.bench
@pytest.mark.fio
def test_tiny_run_end_to_end(capsys):
    """A part of the comparison, each child kind once: int4's cache (int8's is the same child with another
    setting), bf16 and int4 each in its process, int4's compute floor (two processes; bf16's runs in
    test_infer_bench). An earlier run's file of a variant not run is not compared."""
    root = scratch_dir("infer-quant-bench-")
    try:
        (root / "log-probs-int8.npy").write_bytes(b"not an array")  # an earlier run's: not compared in this one
        figures = main(["--dir", str(root), *TINY, "--accelerate", "none", "--fio-size", "16MiB", "--floor-layers", "1",
                        "--variants", "int4,bf16", "--floors", "int4", "--out", str(root / "figures.json")])
        caches = sorted(p.name for p in (root / "quantized").iterdir())
    finally:
        shutil.rmtree(root, ignore_errors=True)
    printed = capsys.readouterr().out
    assert [c.split("-")[1] for c in caches] == ["int4"]  # only the variants asked for are quantized
    assert [r["variant"] for r in figures["runs"]] == ["bf16", "int4"] and not any("error" in r for r in figures["runs"])
    bf16, int4 = figures["runs"]  # the same budget's placement, unquantized, is bf16's; quantized it reads less
    assert int4["unquantized_read_bytes_per_forward"] == bf16["read_bytes_per_forward"]
    assert int4["read_bytes_per_forward"] < bf16["read_bytes_per_forward"]
    assert list(figures["floors"]) == ["int4"] and figures["floors"]["int4"]["floor_s"] > 0
    assert "quantized: int4 (group 64, asymmetric)" in printed and "targets:" in printed
    assert any(line.startswith("int4: ") and "x bf16's tokens/s" in line for line in figures["targets"])
    assert any(line.startswith("bf16: ") and "compute floor not measured in this run" in line
               for line in figures["targets"])
    divergence = figures["divergence"]  # the prompt's 8 next-token distributions against bf16's
    assert list(divergence) == ["int4"]
    assert divergence["int4"]["positions"] == 8 and 0 <= divergence["int4"]["kl_mean"] <= divergence["int4"]["kl_max"]
    assert "KL(bf16 || int4)" in printed
    with pytest.raises(SystemExit, match="--variants: 'int3' is not one of bf16, int8, int4"):
        main(["--dir", str(root), "--variants", "int4,int3"])


LOGITS = np.array([[2.0, 1.0, 0.0, -1.0], [0.0, 3.0, 1.0, 0.5]])
NOISE = {"bf16": 0.0, "int8": 0.05, "int4": 0.3}
TOKENS_PER_S = {"bf16": 1.0, "int8": 2.0, "int4": 2.5, "accelerate": 0.5}


def test_the_whole_comparison_with_its_children_stood_in_for(tmp_path, monkeypatch, capsys):
    """Every variant (the default): both caches written, each variant's run and compute floor, Accelerate's
    run, the KL of each quantized variant against bf16, and every target line, from figures the children
    would have printed (made from each payload)."""
    quantized, runs, floors = [], [], []

    def variant(quantize) -> str:
        return "bf16" if quantize is None else "int8" if quantize == "int8" else f"int{quantize['num_bits']}"

    def quantize_child(module, args):
        payload = json.loads(args[1])
        quantized.append(payload["quantize"])
        return {"seconds": 0.5, "peak_rss": 1 << 20, "cache_bytes": 1000, "cache": f"{payload['nvme_path']}/x"}

    def run_config(payload):
        name = variant(payload["quantize"])
        runs.append((payload["kind"], name))
        side = "accelerate" if payload["kind"] != "ours" else name
        figures = {"kind": payload["kind"], "load_s": 0.1, "ttft_s": 0.2, "s_per_token": 1 / TOKENS_PER_S[side],
                   "decode_steps": [1 / TOKENS_PER_S[side]] * 2, "tokens_per_s": TOKENS_PER_S[side], "peak_rss": 1 << 20,
                   "cached_growth": 10e6, "checkpoint_cache_growth": 1e6, "read_bytes": 1e6}
        if payload["kind"] == "ours":
            figures.update(read_bytes_per_forward={"bf16": 8e6, "int8": 4e6, "int4": 2e6}[name],
                           unquantized_read_bytes_per_forward=8e6, plan=f"plan of {name}")
            log_probs = LOGITS + NOISE[name] * np.arange(LOGITS.size).reshape(LOGITS.shape)
            np.save(payload["log_probs_path"], log_probs - np.log(np.exp(log_probs).sum(-1, keepdims=True)))
        return figures

    def compute_floor(spec, *, quantize, batch, prompt_tokens, new_tokens, floor_layers):
        floors.append(variant(quantize))
        return {"batch": batch, "steps": {2: 0.01, 2 + floor_layers: 0.02}, "per_layer_s": 0.01 / floor_layers,
                "floor_s": 0.001}

    monkeypatch.setattr(infer_quant, "run_child", quantize_child)
    monkeypatch.setattr(infer_quant, "run_config", run_config)
    monkeypatch.setattr(infer_quant, "compute_floor", compute_floor)
    monkeypatch.setattr(infer_quant, "fio_read_speed", lambda aio, directory, size: 1e9)
    figures = main(["--dir", str(tmp_path), *TINY])
    printed = capsys.readouterr().out
    assert quantized == ["int8", {"num_bits": 4, "group_size": 64}]
    assert runs == [("ours", "bf16"), ("ours", "int8"), ("ours", "int4"), ("accelerate-auto", "bf16")]
    assert floors == ["bf16", "int8", "int4"] and list(figures["floors"]) == ["bf16", "int8", "int4"]
    assert figures["runs"][-1]["memory_label"] == "page cache unbounded"
    divergence = figures["divergence"]
    assert list(divergence) == ["int8", "int4"] and all(d["positions"] == 2 for d in divergence.values())
    assert 0 < divergence["int8"]["kl_mean"] < divergence["int4"]["kl_mean"]
    assert divergence["int8"]["top1_agreement"] == 1.0
    assert "int8 against bf16, the prompt's 2 next-token distributions: KL(bf16 || int8)" in printed
    targets = figures["targets"]
    assert "int8: 2.00x bf16's tokens/s (2.000 against 1.000); target >= 1.8x: met" in targets
    assert "int4: 2.50x bf16's tokens/s (2.500 against 1.000); target >= 3.0x: NOT met" in targets
    for name, disk in (("bf16", "0.008"), ("int8", "0.004"), ("int4", "0.002")):  # the bound: bytes / fio here
        line = next(line for line in targets if line.startswith(f"{name}: ") and "max(disk" in line)
        assert f"max(disk {disk} s" in line and "compute floor 0.001 s), the disk bound; target <= 1.15x: NOT met" in line
        assert f"{name}: page cache +10 MB; target < 256 MB: met" in targets
    assert any(line.startswith("int4: 5.00x accelerate-auto's tokens/s") and line.endswith("target >= 6x: NOT met")
               for line in targets)
    assert "compute floor, int4: " in printed and "plan of int8" in printed
