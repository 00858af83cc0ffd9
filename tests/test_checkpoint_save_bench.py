"""benchmarks/checkpoint_save at a tiny size: every side measured on the same checkpoint, the ratios are
the medians' quotients, and the page cache's growth is reported as a share of the checkpoint; the floor of
the asynchronous save (fio's traffic, or tensorio's where fio is off); the large mode (train_large's build,
the synchronous save's peak RSS growth, its refusal where the disk lacks room)."""

from __future__ import annotations

import json

import pytest

from bench.fio import fio_path

pytestmark = pytest.mark.bench

TINY = {"n_layer": 2, "n_embd": 64, "n_head": 2, "vocab_size": 128, "n_positions": 32}


def _assert_floor(figures: dict, mover: str) -> None:
    assert figures["floor_mover"] == mover
    assert "8 MiB x 4 in flight" in figures["floor_shape"] and "1 MiB x 8 in flight" in figures["floor_shape"]
    assert figures["floor_gb"] * 1e9 % (8 << 20) == 0 and figures["floor_gb"] >= figures["checkpoint_gb"]
    assert len(figures["floor_span_runs_s"]) == len(figures["async_span_runs_s"]) == 2
    assert figures["steps_during_floor"] >= 2 and figures["floor_read_s"] > 0 and figures["floor_write_s"] > 0
    assert figures["step_during_floor_over_without"] == pytest.approx(figures["step_during_floor_s"] / figures["step_s"])
    assert figures["step_during_save_over_floor"] == pytest.approx(
        figures["step_during_save_s"] / figures["step_during_floor_s"])


def test_checkpoint_save_benchmark_reports_each_side(disk_dir, capsys):
    from benchmarks.checkpoint_save import main as checkpoint_save

    figures = checkpoint_save(["--dir", str(disk_dir), "--model-config", json.dumps(TINY), "--repeats", "2"]
                              + ([] if fio_path() else ["--no-fio"]))
    assert len(figures["ours_runs_s"]) == len(figures["torch_save_runs_s"]) == 2
    assert figures["checkpoint_gb"] > 0 and 0 <= figures["page_cache_share"]
    assert figures["ours_over_torch_save"] == pytest.approx(figures["ours_s"] / figures["torch_save_s"])
    if fio_path():
        assert figures["ours_over_fio"] == pytest.approx(figures["ours_s"] / figures["fio_write_read_s"])
    assert figures["steps_during_save"] >= 2 and figures["step_s"] > 0 and figures["async_wait_s"] >= figures["async_call_s"]
    assert figures["step_during_over_without"] == pytest.approx(figures["step_during_save_s"] / figures["step_s"])
    _assert_floor(figures, "fio" if fio_path() else "tensorio")
    out = capsys.readouterr().out
    assert "torch.save + fsync" in out and "asynchronous: a step" in out and "x the floor" in out
    assert list(disk_dir.iterdir()) == []  # every checkpoint and fio file removed


def test_the_floor_moves_the_bytes_with_tensorio_without_fio(disk_dir, capsys):
    from benchmarks.checkpoint_save import main as checkpoint_save

    figures = checkpoint_save(["--dir", str(disk_dir), "--model-config", json.dumps(TINY), "--repeats", "2", "--no-fio"])
    _assert_floor(figures, "tensorio")
    assert figures["floor_note"] == "fio off" and "fio_write_read_s" not in figures
    assert "the floor: tensorio reading" in capsys.readouterr().out
    assert list(disk_dir.iterdir()) == []


def test_save_traffic_reads_and_writes_its_bytes_with_tensorio(disk_dir):
    """The stand-in for fio on its own, with an awkward size: a whole number of 8 MiB requests each way,
    the written file removed by `finish`, the read one by `close`, and an independent look at the file read."""
    from benchmarks._save_traffic import WRITE_BLOCK, SaveTraffic

    with SaveTraffic(str(disk_dir), WRITE_BLOCK + 1, use_fio=False) as traffic:
        assert traffic.nbytes == 2 * WRITE_BLOCK and traffic.mover == "tensorio"
        with open(traffic.source, "rb") as file:
            assert len(file.read()) == 2 * WRITE_BLOCK
        traffic.start(0.05)
        moved = traffic.finish()
        assert not traffic.running() and moved["span_s"] >= max(moved["read_s"], moved["write_s"]) > 0
        assert [p.name for p in disk_dir.iterdir()] == [traffic.source.rsplit("/", 1)[1]]
    assert list(disk_dir.iterdir()) == []


def test_large_mode_measures_the_synchronous_save_of_train_large_s_build(disk_dir, capsys):
    from benchmarks.checkpoint_save import main as checkpoint_save

    figures = checkpoint_save(["--dir", str(disk_dir), "--model-config", json.dumps(TINY), "--large", "--repeats", "1"]
                              + ([] if fio_path() else ["--no-fio"]))
    assert figures["mode"] == "large" and len(figures["ours_runs_s"]) == len(figures["rss_growth_runs_gb"]) == 1
    assert figures["spec"]["layers"] == 2 and figures["spec"]["clipping"] == 0.0
    assert figures["checkpoint_gb"] * 1e9 >= 12 * figures["params"]  # the partitions and both moments
    assert figures["disk_needed_gb"] >= figures["checkpoint_gb"] + figures["swap_gb"] > figures["checkpoint_gb"]
    assert figures["rss_growth_gb"] >= 0 and figures["rss_growth_gb"] == pytest.approx(
        max(figures["rss_growth_runs_gb"]), abs=1e-4)  # the highest repeat's: a peak, not a median
    if fio_path():
        assert figures["ours_over_fio"] == pytest.approx(figures["ours_s"] / figures["fio_write_read_s"])
    out = capsys.readouterr().out
    assert "torch.save: skipped" in out and "asynchronous save: skipped" in out and "disk needed" in out
    assert "peak RSS growth during ours" in out
    assert list(disk_dir.iterdir()) == []  # swap files, checkpoint and fio's file removed


def test_large_mode_refuses_a_disk_without_the_room(disk_dir, monkeypatch, capsys):
    import benchmarks.checkpoint_save as checkpoint_save

    monkeypatch.setattr(checkpoint_save, "_free_bytes", lambda directory: 1 << 20)
    with pytest.raises(SystemExit) as refused:
        checkpoint_save.main(["--dir", str(disk_dir), "--model", "gpt2-3b", "--repeats", "1"])
    message = str(refused.value)
    assert "not enough disk space" in message and "0.00 GB free" in message
    assert "swap files 75.02 GB + one checkpoint 37.20 GB" in message and "--layers" in message
    assert "checkpoint: 37.20 GB" in capsys.readouterr().out  # said before refusing
    assert list(disk_dir.iterdir()) == []  # nothing built


def test_large_mode_arguments():
    from benchmarks.checkpoint_save import _large_spec, main as checkpoint_save

    assert _large_spec(None, 16)["layers"] == 16 and _large_spec(None, None)["layers"] == 26
    tiny = _large_spec(TINY, None, knobs="tiny")
    assert tiny["vocab"] == 128 and tiny["persistence"] == 0  # every parameter on NVMe
    assert _large_spec({"n_layer": 1}, None)["sub_group_size"] == 1 << 22  # train_large's "3b" settings by default
    for argv in (["--layers", "4"], ["--model", "gpt2-3b", "--layers", "0"], ["--repeats", "0"]):
        with pytest.raises(SystemExit) as refused:
            checkpoint_save(argv)
        assert refused.value.code == 2
