"""benchmarks/checkpoint_save at a tiny size: every side measured on the same checkpoint, the ratios are
the medians' quotients, and the page cache's growth is reported as a share of the checkpoint."""

from __future__ import annotations

import json

import pytest

from bench.fio import fio_path

pytestmark = pytest.mark.bench


def test_checkpoint_save_benchmark_reports_each_side(disk_dir, capsys):
    from benchmarks.checkpoint_save import main as checkpoint_save

    tiny = {"n_layer": 2, "n_embd": 64, "n_head": 2, "vocab_size": 128, "n_positions": 32}
    figures = checkpoint_save(["--dir", str(disk_dir), "--model-config", json.dumps(tiny), "--repeats", "2"]
                              + ([] if fio_path() else ["--no-fio"]))
    assert len(figures["ours_runs_s"]) == len(figures["torch_save_runs_s"]) == 2
    assert figures["checkpoint_gb"] > 0 and 0 <= figures["page_cache_share"]
    assert figures["ours_over_torch_save"] == pytest.approx(figures["ours_s"] / figures["torch_save_s"])
    if fio_path():
        assert figures["ours_over_fio"] == pytest.approx(figures["ours_s"] / figures["fio_write_read_s"])
    assert figures["steps_during_save"] >= 2 and figures["step_s"] > 0 and figures["async_wait_s"] >= figures["async_call_s"]
    assert figures["step_during_over_without"] == pytest.approx(figures["step_during_save_s"] / figures["step_s"])
    out = capsys.readouterr().out
    assert "torch.save + fsync" in out and "asynchronous: a step" in out
    assert list(disk_dir.iterdir()) == []  # every checkpoint and fio file removed
