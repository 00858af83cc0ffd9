"""The engine's own traffic in the bench (bench/workload.py, fio_mix.py, diskstat.py, likeforlike.py,
compare.py): the workload's shape and figures, fio given the same workload, the disk's request sizes
read from a fake sysfs, the sweep choosing by the workload, and the compare verdict."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from bench.cli import main
from bench.compare import verdict
from bench.diskstat import device_facts, read_counters, traffic
from bench.fio_mix import fio_depth, fio_workload_command, parse_mix, workload_files
from bench.workload import Workload, latency_percentiles, measure_workload, slice_rates, workload_for
from tensorio import AioConfig, TensorIOError

MiB = 1 << 20
QUICK = dict(runtime_s=0.3, ramp_s=0.05, slices=3)


def test_percentiles_need_enough_samples_and_never_call_the_maximum_p99():
    few = latency_percentiles(list(range(1, 51)))
    assert few["samples"] == 50 and few["p50"] == 25 and few["p99"] is None and few["max"] == 50
    many = latency_percentiles(list(range(1, 2001)))
    assert many["p99"] == 1980 and many["p99.9"] == 1998 and many["max"] == 2000
    assert latency_percentiles([])["p50"] is None


def test_slice_rates_count_each_request_in_the_window_it_completed_in():
    events = [(0, 100), (499, 100), (500, 300), (999, 1), (1000, 999), (-1, 999)]
    assert slice_rates(events, 0, 1000, 2) == [round(200 * 1e9 / 500), round(301 * 1e9 / 500)]
    with pytest.raises(ValueError):
        slice_rates(events, 5, 5, 2)


@pytest.mark.parametrize("kwargs, message", [
    (dict(kind="mixed", request_bytes=MiB), "Workload.kind"),
    (dict(kind="training", request_bytes=4095), "multiple of 4096"),
    (dict(kind="training", request_bytes=MiB, files=1), "at least 2 swap files"),
    (dict(kind="inference", request_bytes=MiB, file_bytes=MiB + 4096), "Workload.file_bytes"),
    (dict(kind="read", request_bytes=MiB, runtime_s=0), "runtime_s"),
])
def test_bad_workloads_are_refused_naming_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Workload(**kwargs)


def test_the_partition_follows_the_users_config():
    assert workload_for("training").request_bytes == 48 * MiB
    assert workload_for("training", user_config={"zero_optimization": {"sub_group_size": 1 << 20}}).request_bytes \
        == 12 * MiB
    assert workload_for("inference").request_bytes == 64 * MiB
    assert workload_for("training", request_bytes=8 * MiB, ranks=2).buffer_bytes(AioConfig()) == 32 * MiB


@pytest.mark.parametrize("kind", ["training", "inference", "write"])
@pytest.mark.parametrize("huge_pages", [True, False])
def test_a_workload_moves_its_directions_and_leaves_no_files(disk_dir, kind, huge_pages):
    config = AioConfig(block_size=256 * 1024, queue_depth=4, thread_count=1)
    workload = Workload(kind=kind, request_bytes=MiB, files=3, ranks=2 if kind == "training" else 1,
                        huge_pages=huge_pages, **QUICK)
    result = measure_workload(config, disk_dir, workload)
    assert (result.read_bw_bytes > 0) == (kind != "write")
    assert (result.write_bw_bytes > 0) == (kind in ("training", "write"))
    assert len(result.total_samples) == 3
    assert result.goal_bw_bytes == (result.read_bw_bytes if kind == "inference" else result.total_bw_bytes)
    assert set(result.latency_ns) == {"training": {"read", "write"}, "inference": {"read"}, "write": {"write"}}[kind]
    assert all(lat["samples"] > 0 for lat in result.latency_ns.values())
    assert result.disk is None  # no disks named
    assert list(disk_dir.iterdir()) == []
    again = type(result).from_json(json.loads(json.dumps(result.to_json())))
    assert again.goal_bw_bytes == result.goal_bw_bytes and again.workload.kind == kind


def test_training_ranks_run_in_processes_of_their_own(disk_dir, capsys):
    assert main(["run", str(disk_dir), "--workload", "training", "--partition-size", "1M", "--bs", "256K",
                 "--ranks", "2", "--swap-files", "2", "--runtime", "0.3", "--ramp", "0.05", "--repeats", "1",
                 "--json"]) == 0
    run = json.loads(capsys.readouterr().out)["runs"][0]
    ranks = run["per_rank"]
    assert [r["rank"] for r in ranks] == [0, 1]
    assert len({r["pid"] for r in ranks} | {os.getpid()}) == 3  # two processes, neither this one
    assert all(r["read_bw_bytes"] > 0 and r["write_bw_bytes"] > 0 for r in ranks)
    for key in ("read_bw_bytes", "write_bw_bytes"):  # the per-rank figures sum to the total (each rounded)
        assert abs(sum(r[key] for r in ranks) - run[key]) <= 2
    assert list(disk_dir.iterdir()) == []
    one = measure_workload(AioConfig(), disk_dir, Workload(kind="training", request_bytes=MiB, files=2, **QUICK))
    assert [r["pid"] for r in one.per_rank] == [os.getpid()]  # one rank: in this process


def test_a_failing_rank_process_raises_its_error(tmp_path):
    workload = Workload(kind="training", request_bytes=MiB, files=2, ranks=2, **QUICK)
    with pytest.raises(TensorIOError):
        measure_workload(AioConfig(), tmp_path / "missing", workload)


def test_a_file_larger_than_the_buffers(disk_dir):
    workload = Workload(kind="inference", request_bytes=MiB, file_bytes=16 * MiB, window=2, **QUICK)
    assert workload.buffer_bytes(AioConfig()) == 2 * MiB < workload.disk_bytes()
    assert measure_workload(AioConfig(block_size=MiB), disk_dir, workload).read_bw_bytes > 0


def _fake_disk(root: Path, name: str, stat: str) -> None:
    queue = root / "block" / name / "queue"
    queue.mkdir(parents=True, exist_ok=True)
    (root / "block" / name / "stat").write_text(stat)
    (queue / "scheduler").write_text("none [mq-deadline] kyber\n")
    (queue / "rotational").write_text("0\n")
    (queue / "max_sectors_kb").write_text("1280\n")


def test_disk_counters_give_the_average_request_size(tmp_path):
    _fake_disk(tmp_path, "nvme0n1", "10 5 20480 0 4 0 8192 0 0 0 0\n")
    before = read_counters(["nvme0n1"], sys_root=tmp_path)
    _fake_disk(tmp_path, "nvme0n1", "20 9 40960 0 6 1 16384 0 0 0 0\n")
    seen = traffic(["nvme0n1"], before, read_counters(["nvme0n1"], sys_root=tmp_path))
    assert (seen.reads, seen.read_bytes, seen.read_merges) == (10, 20480 * 512, 4)
    assert seen.read_request_bytes == 1 * MiB and seen.write_request_bytes == 2 * MiB
    assert "reads of 1.0 MiB" in seen.describe()
    assert read_counters(["missing"], sys_root=tmp_path) is None and traffic([], None, None) is None
    facts = device_facts("nvme0n1", sys_root=tmp_path)
    assert facts == {"name": "nvme0n1", "scheduler": "mq-deadline", "rotational": 0, "max_sectors_kb": 1280}


def test_fio_gets_the_same_mixed_workload(tmp_path):
    config = AioConfig(block_size=MiB, queue_depth=8, thread_count=2)
    workload = Workload(kind="training", request_bytes=4 * MiB, files=3, ranks=2, runtime_s=2, ramp_s=0.5)
    files = workload_files(tmp_path, workload)
    cmd = fio_workload_command("fio", config, workload, files)
    assert fio_depth(config, workload) == 4  # one 4-block partition in flight per direction
    assert cmd.count("--rw=read") == 2 and cmd.count("--rw=write") == 2  # a reader and a writer per rank
    reads = [a for a in cmd if a.startswith("--filename=")][0].removeprefix("--filename=").split(":")
    assert reads == [str(p) for p in files[0][1:] + files[0][:1]]  # the reader one partition ahead
    assert "--time_based" in cmd and "--ramp_time=500ms" in cmd and "--iomem=malloc" in cmd
    with pytest.raises(ValueError, match="':'"):
        fio_workload_command("fio", config, workload, [[tmp_path / "a:b"]])


def test_fio_mix_json_sums_the_directions():
    stats = {"io_bytes": 10**9, "bw_bytes": 10**9, "total_ios": 1000,
             "clat_ns": {"mean": 5.0, "percentile": {"50.000000": 4, "99.000000": 9, "99.900000": 10}}}
    out = json.dumps({"fio version": "fio-3.33", "jobs": [{"read": stats, "write": {**stats, "bw_bytes": 5 * 10**8},
                                                          "usr_cpu": 10.0, "sys_cpu": 10.0, "job_runtime": 1000}]})
    mix = parse_mix("warning\n" + out, ["fio"])
    assert mix.goal_bw_bytes("training") == 15 * 10**8 and mix.goal_bw_bytes("inference") == 10**9
    assert mix.clat_ns["read"]["p99.9"] == 10 and mix.cpu_ms_per_gb == pytest.approx(100.0)


def test_compare_verdict_uses_the_noise_of_the_rounds():
    noise, ratio, text = verdict([10.0, 11.0], [10.8, 10.9])
    assert noise == pytest.approx(1 / 10.5) and "no slower" in text
    assert "slower than the default by more" in verdict([10.0, 10.1], [13.0, 13.1])[2]
    assert "one round" in verdict([10.0], [20.0])[2]


def test_compare_usage_errors(disk_dir, tmp_path, capsys):
    assert main(["compare", str(disk_dir), "--tuned", str(tmp_path / "none.json")]) == 2
    assert "none.json: no such file" in capsys.readouterr().err
    (tmp_path / "t.json").write_text(json.dumps({"aio": {"block_size": MiB}}))
    assert main(["compare", str(disk_dir), "--tuned", str(tmp_path / "t.json"), "--workload", "inference"]) == 2
    assert "--checkpoint" in capsys.readouterr().err


def test_run_workload_json(disk_dir, capsys):
    assert main(["run", str(disk_dir), "--workload", "training", "--partition-size", "1M", "--bs", "256K",
                 "--runtime", "0.3", "--ramp", "0.05", "--repeats", "1", "--json"]) == 0
    out, err = capsys.readouterr()
    record = json.loads(out)
    assert record["workload"]["kind"] == "training" and record["runs"][0]["read_bw_bytes"] > 0
    assert "slot A" in err
    assert main(["run", str(disk_dir), "--workload", "training", "--partition-size", "1M", "--bs", "768K"]) == 2
    assert "not a multiple of the block size" in capsys.readouterr().err


def test_sweep_with_the_training_workload_chooses_by_it(disk_dir, tmp_path, capsys):
    out_dir = tmp_path / "results"
    assert main(["sweep", str(disk_dir), "--quick", "--size", "2M", "--request-size", "1M", "--repeats", "1",
                 "--no-progress", "--no-fio", "--backend", "threads", "--workload", "training", "--partition-size",
                 "1M", "--runtime", "0.2", "--ramp", "0.05", "--out-dir", str(out_dir), "--config-out",
                 str(tmp_path / "aio.json")]) == 0
    out = capsys.readouterr().out
    assert "workload training" in out and "train GB/s" in out and "best training:" in out
    saved = json.loads((out_dir / "sweep.json").read_text())
    points = saved["disks"][0]["points"]
    assert all(p["workload"]["workload"]["kind"] == "training" for p in points)
    best = max(points, key=lambda p: p["workload"]["goal_bw_bytes"])
    assert saved["choice"]["best"]["both_bw_bytes"] == best["workload"]["goal_bw_bytes"]
    assert saved["settings"]["workload"]["request_bytes"] == MiB
    assert isinstance(saved["disks"][0]["devices"], list)  # the device facts (empty on tmpfs)
