"""The large-model training benchmark runs end to end at a tiny size, so that it never rots (no timing
asserted; no DeepSpeed)."""

from __future__ import annotations

import json

import pytest


@pytest.mark.bench
@pytest.mark.fio
def test_train_large_benchmark_tiny(tmp_path, capsys):
    pytest.importorskip("transformers")
    from benchmarks import train_large

    swap = tmp_path / "swap"
    out = tmp_path / "result.json"
    result = train_large.main(["--scale", "tiny", "--nvme-dir", str(swap), "--out", str(out)])
    printed = capsys.readouterr().out
    config_line = printed.index("config: ")
    assert config_line < printed.index("[offload] batch 1 step 1:") < printed.index("summary:")  # config, steps, summary
    assert "target <= 2 GB: met" in printed and "loss down: met" in printed

    run = result["offload"]
    assert "error" not in run, run
    assert [(r["batch"], r["step"]) for r in run["steps"]] == [(1, 1), (1, 2), (1, 3), (2, 1), (2, 2), (2, 3)]
    # Parameters read from NVMe every step and, from the second on, the previous step's update written back
    # (with clipping it runs during the next forward). No comparison with the process's own counters:
    # a tiny model's requests are below the O_DIRECT alignment and partly served by the page cache.
    assert all(r["param_read"] > 0 and r["read"] > 0 for r in run["steps"])
    assert all(r["param_written"] > 0 and r["written"] > 0 for r in run["steps"][1:])
    # fio beside every step: before the first and after each, counted in the run's figures too.
    beside = [run["fio_before_steps"]] + [r["fio_after"] for r in run["steps"]]
    assert all(f["read"] > 0 and f["write"] > 0 for f in beside)
    assert len(result["fio"]["runs"]) == 2 + len(beside)
    # The disk's busy share, where the swap directory has a block device (not on tmpfs or overlay).
    if train_large.DiskBusy(str(tmp_path)).busy_ms() is not None:
        # (no upper bound: io_ticks advance by whole jiffies, which a tiny step's milliseconds may not span)
        assert all(r[k] >= 0 for r in run["steps"] for k in ("disk_busy", "disk_busy_forward", "disk_busy_backward"))
    summary = result["summary"]["offload"]
    assert set(summary["batches"]) == {1, 2}
    for batch in summary["batches"].values():
        assert batch["loss_met"] and batch["compute_s"] > 0 and batch["io_at_fio_s"] > 0
        assert batch["io_beside_s"] > 0 and batch["ratio"] > 0 and batch["ratio_strict"] > 0
    # The fastest fio figure of the run makes the stricter bound for every step.
    fastest = result["fio"]
    for row in run["steps"]:
        at_fastest = row["read"] / fastest["read"] + row["written"] / fastest["write"]
        assert train_large.io_seconds_beside(run, row) >= at_fastest
    assert result["swap_files_left"] == []  # the engine removed its swap files on close
    assert json.loads(out.read_text())["params"] == result["params"]
    assert list(swap.iterdir()) == []  # and the benchmark its directory


def test_parameter_count_matches_transformers():
    transformers = pytest.importorskip("transformers")
    from benchmarks.train_large import gpt2_parameters

    config = transformers.GPT2Config(n_layer=3, n_embd=48, n_head=4, vocab_size=300, n_positions=20)
    model = transformers.GPT2LMHeadModel(config)
    assert gpt2_parameters(3, 48, 300, 20) == sum(p.numel() for p in model.parameters())
    assert gpt2_parameters(26, 3072, 50257, 128) == 3_100_228_608  # the 3.1 B model


def test_disk_busy_share_is_the_busy_milliseconds_over_the_time():
    from benchmarks.train_large import DiskBusy

    assert DiskBusy.share(1_000, 1_500, 1.0) == 0.5
    assert DiskBusy.share(1_000, 3_000, 2.0) == 1.0
    assert DiskBusy.share(None, None, 1.0) is None  # no block device under the directory
    assert DiskBusy.share(1_000, 1_000, 0.0) is None  # no time elapsed: no share
