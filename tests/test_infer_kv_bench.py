"""benchmarks/infer_kv.py at a tiny scale: it writes its checkpoint, measures fio, runs the cache in memory
and on NVMe in child processes and prints the target (the timings themselves mean nothing here); and its
repeats' bookkeeping with the children stood in for."""

from __future__ import annotations

import json
import shutil

import pytest
from test_infer_generate import scratch_dir

from benchmarks import infer_kv
from benchmarks.infer_kv import main


@pytest.mark.bench
@pytest.mark.fio
def test_tiny_run_end_to_end(capsys):
    """The cache quantized to int8 (the unquantized cache is the same child with another setting; both are
    test_infer_kv's and test_infer_kv_quant's): its page holds 256 tokens of this model's rows (batch 1, 2
    heads of 32), so that the prompt spans two pages."""
    root = scratch_dir("infer-kv-bench-")
    try:
        figures = main(["--dir", str(root), "--scale", "0.0125", "--layers", "2", "--shards", "1", "--batch", "1",
                        "--prompt-tokens", "300", "--new-tokens", "4", "--fio-size", "16MiB", "--repeats", "1",
                        "--out", str(root / "figures.json"), "--kv-quantize", "int8"])
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
    assert "cache int8" in printed


def test_repeats_alternate_the_kinds_each_beside_its_own_fio(tmp_path, monkeypatch, capsys):
    """--repeats 2, the cache unquantized: memory then nvme in each repeat, fio measured before each pair,
    each nvme run against its pair's memory run and that fio, the medians over the repeats."""
    payloads, speeds = [], iter([1e9, 0.5e9])

    def child(module, args):
        payload = json.loads(args[1])
        payloads.append(payload)
        repeat = sum(p["kind"] == payload["kind"] for p in payloads)
        s = {"memory": 0.01, "nvme": 0.02}[payload["kind"]] * repeat
        nvme = payload["kind"] == "nvme"
        return {"kind": payload["kind"], "s_per_step": s, "decode_steps": [s], "tokens": [[5, 6, 7]],
                "weight_read_per_step": 4e6 if nvme else 0, "kv_read_per_step": 6e6 if nvme else 0, "kv_written": 1e6,
                "kv_read_wait_s": 0.0, "weight_read_wait_s": 0.0, "kv_total_bytes": 6e6, "kv_nvme_bytes": 6e6 if nvme else 0,
                "plan": "the plan", "plan_memory": 1 << 20, "activation_bytes": 1 << 20, "peak_rss": 3 << 20,
                "baseline_rss": 1 << 20, "cached_growth": 1 << 20, "checkpoint_cache_growth": 0}

    monkeypatch.setattr(infer_kv, "run_child", child)
    monkeypatch.setattr(infer_kv, "fio_read_speed", lambda aio, directory, size: next(speeds))
    figures = main(["--dir", str(tmp_path), "--scale", "0.0125", "--layers", "2", "--shards", "1", "--batch", "1",
                    "--prompt-tokens", "8", "--new-tokens", "4", "--repeats", "2"])
    printed = capsys.readouterr().out
    assert [p["kind"] for p in payloads] == ["memory", "nvme"] * 2
    assert all(p["kv_quantize"] is None for p in payloads) and "cache bf16" in printed
    assert [p["disk_gbps"] for p in payloads] == [1.0, 1.0, 0.5, 0.5]  # each pair beside its own fio
    # 10 MB a step: 0.01 s at 1 GB/s, then 0.02 s at 0.5 GB/s; the nvme steps 0.02 s and 0.04 s
    assert figures["disk_s"] == pytest.approx([0.01, 0.02]) and figures["ratios"] == pytest.approx([2.0, 2.0])
    assert figures["compute_s"] == pytest.approx(0.015) and figures["nvme_s"] == pytest.approx(0.03)
    assert figures["cache_share"] == pytest.approx(0.6) and figures["tokens_equal"]
    assert "median 2.00x (target <= 1.15: MISSED)" in printed
    assert "tokens with the cache on NVMe equal tokens with it in memory: yes" in printed
