"""An interrupted sweep's saved measurements (bench/journal.py): what --resume reads back, and what it refuses."""

from __future__ import annotations

import json

import pytest

from bench.journal import SweepJournal, load_partial
from bench.measure import Measurement, PointResult
from bench.report import point_json
from bench.sweep import GRIDS, sweep_plan
from tensorio import AioConfig

MiB = 1 << 20
SETTINGS = {"grid": "quick", "block_sizes": [128 << 10, MiB], "queue_depths": [8, 32], "thread_counts": [1, 2],
            "single_submit": [False], "overlap_events": [True], "backends": ["threads"], "size": 8 * MiB,
            "request_size": 2 * MiB, "repeats": 2, "direct": "auto", "references": 5}


def _result(config: AioConfig, gbs: float) -> PointResult:
    def m(rw: str) -> Measurement:
        samples = [int(gbs * 1e9), int(gbs * 1.1e9)]
        return Measurement(rw=rw, bw_bytes=samples[0], iops=samples[0] / config.block_size, clat_ns_p50=10,
                           clat_ns_p99=20, clat_ns_mean=12.5, bw_bytes_samples=samples, io_bytes=8 * MiB,
                           request_bytes=2 * MiB, cpu_us_per_io=3.25)

    return PointResult(config=config, backend=config.backend, direct=True, write=m("write"), read=m("read"))


@pytest.fixture
def saved(tmp_path):
    """A journal of two directories with the first three steps of the plan measured on the first."""
    plan = sweep_plan(GRIDS["quick"].configs(backends=["threads"]))
    journal = SweepJournal(tmp_path / "r" / "sweep.json", SETTINGS, [tmp_path / "a", tmp_path / "b"])
    for i, step in enumerate(plan[:3]):
        journal.record(0, step, _result(step.config, 1.0 + i))
    journal.save()
    return journal, plan


def test_the_saved_steps_come_back_as_measured(saved, tmp_path):
    journal, plan = saved
    doc = json.loads(journal.path.read_text())
    assert doc["complete"] is False and [len(d["points"]) for d in doc["disks"]] == [2, 0]
    assert [r["slot"] for r in doc["disks"][0]["reference_points"]] == [0]
    loaded = load_partial(journal.path, SETTINGS, [tmp_path / "a", tmp_path / "b"])
    resumed = SweepJournal(journal.path, SETTINGS, [tmp_path / "a", tmp_path / "b"], loaded)
    assert resumed.measured == 3
    done = resumed.done(0)
    assert set(done) == {step.key for step in plan[:3]} and resumed.done(1) == {}
    for step in plan[:3]:
        assert point_json(done[step.key]) == point_json(journal.done(0)[step.key])  # every figure reported


@pytest.mark.parametrize(("change", "message"), [
    ({"size": 16 * MiB}, "ran with size 8388608, this one with 16777216"),
    ({"repeats": 3}, "ran with repeats 2"),
    ({"backends": ["io_uring", "threads"]}, "ran with backends"),
])
def test_resume_refuses_other_settings(saved, tmp_path, change, message):
    journal, _ = saved
    with pytest.raises(ValueError, match=message):
        load_partial(journal.path, {**SETTINGS, **change}, [tmp_path / "a", tmp_path / "b"])


def test_resume_refuses_other_directories_a_missing_file_and_a_complete_sweep(saved, tmp_path):
    journal, _ = saved
    with pytest.raises(ValueError, match="measured .*/a, .*/b, this one .*/b, .*/a; name the same directories"):
        load_partial(journal.path, SETTINGS, [tmp_path / "b", tmp_path / "a"])
    with pytest.raises(ValueError, match="no sweep to resume in"):
        load_partial(tmp_path / "elsewhere.json", SETTINGS, [tmp_path / "a"])
    journal.path.write_text(json.dumps({**json.loads(journal.path.read_text()), "complete": True}))
    with pytest.raises(ValueError, match="is complete, nothing to resume"):
        load_partial(journal.path, SETTINGS, [tmp_path / "a", tmp_path / "b"])
