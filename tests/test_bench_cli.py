"""`tensorio-bench` end to end at tiny sizes: validate, run, sweep, fio, and cleanup on interrupt."""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench.cli import main
from bench.scratch import PREFIX
from tensorio import AioConfig, filesystem_type

REPO = Path(__file__).resolve().parents[1]
TINY_SWEEP = ["--quick", "--size", "4M", "--request-size", "1M", "--repeats", "1", "--no-progress"]


@pytest.fixture
def disk_dir(tmp_path) -> Path:
    """A directory on a disk file system (O_DIRECT): tmp_path, unless that is memory."""
    d = tmp_path / "disk"
    d.mkdir()
    if filesystem_type(d) in ("tmpfs", "ramfs"):
        pytest.skip(f"{tmp_path} is on {filesystem_type(d)}; set --basetemp to a directory on a disk")
    return d


@pytest.fixture
def shm_dir(tmp_path) -> Path:
    base = Path("/dev/shm")
    if not base.is_dir() or filesystem_type(base) != "tmpfs":
        pytest.skip("no tmpfs at /dev/shm")
    d = base / f"tensorio-test-{os.getpid()}-{tmp_path.name}"
    d.mkdir()
    yield d
    for p in d.iterdir():
        p.unlink()
    d.rmdir()


def test_sweep_writes_json_csv_png_and_an_aio_section_that_loads_unchanged(disk_dir, tmp_path, capsys):
    out, aio = tmp_path / "results", tmp_path / "cfg" / "aio_tuned.json"
    # (fio's side, which takes most of a tiny sweep's time, is test_sweep_compares_its_best_with_fio's)
    status = main(["sweep", str(disk_dir), *TINY_SWEEP, "--no-fio", "--out-dir", str(out), "--config-out", str(aio)])
    printed = capsys.readouterr().out
    assert status == 0, printed
    assert printed.startswith("tensorio-bench sweep (quick grid)")  # the configuration comes first
    assert "best read" in printed and "best write" in printed and "best both" in printed

    doc = json.loads((out / "sweep.json").read_text())
    (disk,) = doc["disks"]
    assert disk["direct"] is True and disk["note"] is None
    backends = {p["backend"] for p in disk["points"]}
    assert len(disk["points"]) == 8 * len(backends)  # 2 blocks x 2 depths x 2 thread counts per backend
    for point in disk["points"]:
        AioConfig.from_dict(point["aio"])
        for rw in ("write", "read"):
            stats = point[rw]
            assert stats["io_bytes"] == 4 << 20 and stats["bw_bytes"] > 0 and stats["iops"] > 0
            pct = stats["clat_ns"]["percentile"]
            assert 0 < pct["50.000000"] <= pct["99.000000"]
    assert set(disk["best"]) == {"read", "write", "both"}
    assert max(p["read"]["bw_bytes"] for p in disk["points"]) == disk["best"]["read"]["read"]["bw_bytes"]

    with open(out / "sweep.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == len(disk["points"])
    assert {int(r["block_size"]) for r in rows} == {128 << 10, 1 << 20}
    assert all(int(r["read_bw_bytes"]) > 0 and int(r["write_clat_ns_p99"]) > 0 for r in rows)

    png = (out / "sweep.png").read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n")
    import matplotlib.image

    height, width, _ = matplotlib.image.imread(out / "sweep.png").shape
    assert width > 400 and height > 300

    written = json.loads(aio.read_text())
    assert list(written) == ["aio"]
    loaded = AioConfig.from_file(aio)
    assert loaded.to_dict() == written["aio"] == doc["chosen"]["aio"]
    assert list(disk_dir.iterdir()) == []  # every benchmark file removed


def test_sweep_reports_spread_noise_ties_and_why_it_chose(disk_dir, tmp_path, capsys):
    """One quick real sweep at a small size, end to end: each point's spread and interval, the noise
    from the reference point measured through the sweep, the tied configurations and the reason."""
    out = tmp_path / "results"
    args = ["--quick", "--size", "8M", "--request-size", "2M", "--repeats", "3", "--no-progress", "--no-fio"]
    assert main(["sweep", str(disk_dir), *args, "--out-dir", str(out), "--config-out", str(tmp_path / "a.json")]) == 0
    printed = capsys.readouterr().out
    doc = json.loads((out / "sweep.json").read_text())
    assert doc["complete"] is True and doc["settings"]["references"] == 5
    (disk,) = doc["disks"]
    refs = disk["reference_points"]
    assert [r["slot"] for r in refs] == list(range(5))
    assert all(AioConfig.from_dict(r["aio"]) == AioConfig.from_dict(refs[0]["aio"]) for r in refs)
    noise = disk["noise"]
    assert noise["reference_bw_bytes"] == [r["both_bw_bytes"] for r in refs]
    assert noise["relative"] == max(noise["reference_difference"], noise["repeat_spread"]) >= 0
    for p in disk["points"]:
        low, high = p["both_ci95"]
        assert 0 <= low <= high and p["both_spread"] >= 0 and p["cpu_ms_per_gb"] > 0
        pooled = p["aio"] == refs[0]["aio"]  # the reference's configuration: all six measurements
        assert len(p["write"]["bw_bytes_samples"]) == (18 if pooled else 3) and len(p["write"]["bw_bytes_ci95"]) == 2
    assert sum(p["aio"] == refs[0]["aio"] for p in disk["points"]) == 1

    choice = doc["choice"]
    best = max(disk["points"], key=lambda p: p["both_bw_bytes"])
    assert choice["best"]["aio"] == best["aio"] and choice["aio"] == doc["chosen"]["aio"]
    tied = [p for p in disk["points"] if p["tied"]]
    assert {json.dumps(p["aio"]) for p in tied} == {json.dumps(t["aio"]) for t in choice["tied"]}
    assert all(p["both_bw_bytes"] >= best["both_bw_bytes"] * (1 - noise["relative"]) - 1 for p in tied)
    chosen = next(p for p in tied if p["aio"] == choice["aio"])
    assert chosen["aio"]["thread_count"] == min(p["aio"]["thread_count"] for p in tied)  # the lightest

    assert f"noise {noise['relative']:.0%}: " in printed and "measured 5 times through the sweep" in printed
    assert choice["reason"] in printed
    assert choice["reason"].startswith(f"tied within {noise['relative']:.0%}: chose" if len(tied) > 1
                                       else f"none within {noise['relative']:.0%}")
    table = printed[printed.index("95% CI"):].splitlines()
    assert sum(line.endswith(" chosen") for line in table) == 1
    with open(out / "sweep.csv", newline="") as f:
        assert sum(row["tied"] == "True" for row in csv.DictReader(f)) == len(tied)


@pytest.mark.fio
def test_sweep_compares_its_best_with_fio(disk_dir, tmp_path, capsys):
    assert main(["sweep", str(disk_dir), *TINY_SWEEP, "--backend", "threads", "--out-dir", str(tmp_path / "r"),
                 "--config-out", str(tmp_path / "a.json")]) == 0
    printed = capsys.readouterr().out
    assert "of fio" in printed
    fio = json.loads((tmp_path / "r" / "sweep.json").read_text())["disks"][0]["fio"]
    assert {(c["role"], c["rw"]) for c in fio} == {("read", "read"), ("write", "write"), ("both", "read"),
                                                   ("both", "write")}
    assert all(c["fio_bw_bytes"] > 0 and c["ratio"] > 0 and "--overwrite=1" in c["fio_command"] for c in fio)
    assert all(c["ours_cpu_us_per_io"] >= 0 and c["fio_cpu_us_per_io"] >= 0 for c in fio)  # CPU per I/O, each
    # ours and fio side by side at each block size, with the CPU per I/O of each
    table = printed[printed.index("at each block size"):].splitlines()[2:]
    rows = [line.split() for line in table if line.strip() and line.split()[0] in ("128K", "1M")]
    assert {(r[0], r[2]) for r in rows} == {(bs, rw) for bs in ("128K", "1M") for rw in ("write", "read")}
    assert all(float(r[3]) > 0 and float(r[4]) > 0 and float(r[6]) >= 0 and float(r[7]) >= 0 for r in rows)
    assert list(disk_dir.iterdir()) == []


def test_sweep_without_fio_still_runs_and_says_how_to_install(disk_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no fio on PATH
    assert main(["sweep", str(disk_dir), *TINY_SWEEP, "--backend", "threads", "--out-dir", str(tmp_path / "r"),
                 "--config-out", str(tmp_path / "a.json")]) == 0
    printed = capsys.readouterr().out
    assert "fio column missing" in printed and "apt-get install fio" in printed
    assert json.loads((tmp_path / "r" / "sweep.json").read_text())["disks"][0]["fio"] == []


def test_sweep_refuses_without_room_and_says_how_much_it_needs(disk_dir, tmp_path, capsys):
    status = main(["sweep", str(disk_dir), "--quick", "--size", "64T", "--out-dir", str(tmp_path / "r")])
    err = capsys.readouterr().err
    assert status == 1
    assert "needs 70.4 TiB" in err and "free" in err
    assert list(disk_dir.iterdir()) == [] and not (tmp_path / "r").exists()


def test_sweep_on_tmpfs_says_the_figures_are_buffered(shm_dir, tmp_path, capsys):
    assert main(["sweep", str(shm_dir), *TINY_SWEEP, "--backend", "threads", "--no-fio",
                 "--out-dir", str(tmp_path / "r"), "--config-out", str(tmp_path / "a.json")]) == 0
    printed = capsys.readouterr().out
    assert "buffered I/O (no O_DIRECT)" in printed and "page cache" in printed
    disk = json.loads((tmp_path / "r" / "sweep.json").read_text())["disks"][0]
    assert disk["direct"] is False and "page cache" in disk["note"]
    assert all(p["direct"] is False for p in disk["points"])


@pytest.mark.subprocess
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_interrupted_sweep_leaves_no_files(disk_dir, tmp_path, sig):
    cmd = [sys.executable, "-m", "bench.cli", "sweep", str(disk_dir), "--quick", "--size", "256M", "--no-fio",
           "--no-progress", "--out-dir", str(tmp_path / "r"), "--config-out", str(tmp_path / "a.json")]
    # A shell without job control starts background jobs with SIGINT ignored, and Python then keeps it
    # ignored: give the child the default disposition, so that its interpreter handles Ctrl-C.
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    # Wait, however long start-up takes on a loaded machine, until a benchmark file exists; the
    # sweep (7 passes of 256M for each point) is then far from its end.
    while not any(p.is_file() for s in disk_dir.glob(PREFIX + "*") for p in s.iterdir()):
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.01)
    proc.send_signal(sig)
    _, err = proc.communicate()
    assert proc.returncode == 130, err
    assert "interrupted; benchmark files removed" in err
    assert list(disk_dir.iterdir()) == []
    assert not (tmp_path / "a.json").exists()


@pytest.mark.subprocess
def test_an_interrupted_sweep_keeps_its_points_and_resume_finishes_it(disk_dir, tmp_path, capsys):
    out, aio = tmp_path / "r", tmp_path / "a.json"
    args = ["sweep", str(disk_dir), "--quick", "--size", "64M", "--request-size", "16M", "--repeats", "2", "--no-fio",
            "--out-dir", str(out), "--config-out", str(aio)]
    proc = subprocess.Popen([sys.executable, "-m", "bench.cli", *args], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    # Not on a terminal: progress comes as whole lines, a tenth of the sweep at a time. The first one
    # says some points are measured; most are still to come.
    first = proc.stderr.readline()
    assert first.startswith("sweep: 3/21 points"), (first, proc.communicate())
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate()
    err = first + err
    assert proc.returncode == 130, err
    assert "\r" not in err  # no progress bar redrawn into a log
    assert "run the same command with --resume to go on" in err and "interrupted; benchmark files removed" in err
    saved = json.loads((out / "sweep.json").read_text())
    assert saved["complete"] is False
    (disk,) = saved["disks"]
    kept = len(disk["points"]) + len(disk["reference_points"])
    assert 3 <= kept < 21 and f"kept {kept} of 21 measurements" in err
    assert not aio.exists() and list(disk_dir.iterdir()) == []

    assert main([*args, "--resume", "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert f"resuming: {kept} of 21 measurements kept in {out / 'sweep.json'}" in printed
    done = json.loads((out / "sweep.json").read_text())
    assert done["complete"] is True and len(done["disks"][0]["points"]) == 16
    assert len(done["disks"][0]["reference_points"]) == 5
    before = {json.dumps(p["aio"]): p["write"]["bw_bytes_samples"] for p in disk["points"]}
    after = {json.dumps(p["aio"]): p["write"]["bw_bytes_samples"] for p in done["disks"][0]["points"]}
    assert all(after[key] == samples for key, samples in before.items())  # kept, not measured again
    assert AioConfig.from_file(aio).to_dict() == done["chosen"]["aio"]

    assert main([*args, "--resume"]) == 2  # nothing left to resume
    assert "is complete, nothing to resume" in capsys.readouterr().err


def test_run_and_fio_print_json_on_stdout_and_their_settings_on_stderr(disk_dir, capsys):
    assert main(["run", str(disk_dir), "--size", "4M", "--request-size", "1M", "--repeats", "2", "--bs", "256K",
                 "--backend", "threads", "--json"]) == 0
    captured = capsys.readouterr()
    doc = json.loads(captured.out)
    assert doc["tool"] == "tensorio-bench run" and doc["aio"]["block_size"] == 256 << 10
    assert doc["backend"] == "threads" and doc["direct"] is True and doc["size"] == 4 << 20
    for rw in ("write", "read"):
        assert doc[rw]["bw_bytes"] > 0 and len(doc[rw]["bw_bytes_samples"]) == 2
        assert doc[rw]["clat_ns"]["percentile"]["99.000000"] > 0
    assert doc["both_bw_bytes"] > 0 and captured.err.startswith(f"tensorio-bench run {disk_dir}: both 4M")
    assert main(["run", str(disk_dir), "--size", "1M", "--rw", "read", "--repeats", "1", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["write"] is None and doc["read"]["bw_bytes"] > 0 and "both_bw_bytes" not in doc


@pytest.mark.fio
def test_fio_json(disk_dir, capsys):
    assert main(["fio", str(disk_dir), "--rw", "read", "--size", "8M", "--bs", "1M", "--qd", "4", "--json"]) == 0
    captured = capsys.readouterr()
    doc = json.loads(captured.out)
    assert doc["tool"] == "tensorio-bench fio" and doc["rw"] == "read" and doc["bw_bytes"] > 0
    assert doc["io_bytes"] == 8 << 20 and "--iodepth=4" in doc["command"] and doc["fio_version"].startswith("fio-")
    assert doc["clat_ns"]["percentile"]["50.000000"] > 0 and doc["aio"]["queue_depth"] == 4
    assert captured.err.startswith(f"tensorio-bench fio {disk_dir}: read 8M")
    assert list(disk_dir.iterdir()) == []


def test_validate_tells_tmpfs_from_a_disk(disk_dir, shm_dir, capsys):
    assert main(["validate", str(disk_dir)]) == 0
    disk = capsys.readouterr().out
    assert main(["validate", str(shm_dir)]) == 0  # tmpfs holds files; it is memory and has no O_DIRECT
    shm = capsys.readouterr().out
    assert "O_DIRECT     ok" in disk and "file system  ok" in disk
    assert "O_DIRECT     warn" in shm and "tmpfs: memory, not a disk" in shm
    for out in (disk, shm):
        for name in ("io_uring", "memlock", "free space", "CUDA", "fio"):
            assert f"  {name}" in out


def test_validate_fails_for_missing_file_and_unwritable(tmp_path, capsys, monkeypatch):
    assert main(["validate", str(tmp_path / "missing")]) == 1
    assert "does not exist; create it with `mkdir -p" in capsys.readouterr().out
    (tmp_path / "file").write_text("x")
    assert main(["validate", str(tmp_path / "file")]) == 1
    assert "is not a directory" in capsys.readouterr().out

    def refuse(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr("bench.validate.tempfile.mkstemp", refuse)
    assert main(["validate", str(tmp_path)]) == 1
    assert "cannot create files in" in capsys.readouterr().out


def test_run_prints_configuration_then_figures(disk_dir, capsys):
    status = main(["run", str(disk_dir), "--size", "4M", "--request-size", "1M", "--repeats", "2",
                   "--bs", "256K", "--qd", "4", "--threads", "2", "--backend", "threads"])
    out = capsys.readouterr().out
    assert status == 0, out
    lines = out.splitlines()
    assert lines[0].startswith(f"tensorio-bench run {disk_dir}: both 4M")
    assert json.loads(lines[1].removeprefix("aio: "))["thread_count"] == 2
    assert "backend: threads" in out
    assert out.count("GB/s") == 2 and "clat p50" in out and "p99" in out and "IOPS (256K)" in out
    assert list(disk_dir.iterdir()) == []


def test_run_read_only_and_config_file(disk_dir, tmp_path, capsys):
    cfg = tmp_path / "aio.json"
    cfg.write_text(json.dumps({"aio": {"block_size": 131072, "queue_depth": 2, "backend": "threads"}}))
    assert main(["run", str(disk_dir), "--rw", "read", "--size", "1M", "--repeats", "1", "--config", str(cfg)]) == 0
    out = capsys.readouterr().out
    assert '"block_size": 131072' in out and "read " in out and "write " not in out.split("backend:")[1]


@pytest.mark.parametrize(
    ("args", "message"),
    [(["--bs", "1000"], "aio.block_size"), (["--size", "3M", "--request-size", "2M"], "not a multiple"),
     (["--config", "/nonexistent.json"], "no such file")],
)
def test_run_usage_errors_exit_2_with_a_message(disk_dir, capsys, args, message):
    assert main(["run", str(disk_dir), *args]) == 2
    assert message in capsys.readouterr().err


def test_bad_size_is_an_argparse_error(capsys):
    with pytest.raises(SystemExit) as info:
        main(["run", "/tmp", "--size", "12X"])
    assert info.value.code == 2
    assert "is not a size" in capsys.readouterr().err


def test_run_in_a_missing_directory_fails_cleanly(tmp_path, capsys):
    assert main(["run", str(tmp_path / "nope"), "--size", "1M"]) == 1
    err = capsys.readouterr().err
    assert "does not exist" in err and "Traceback" not in err
    assert not (tmp_path / "nope").exists()


@pytest.mark.fio
def test_fio_subcommand_runs_the_matching_job(disk_dir, capsys):
    assert main(["fio", str(disk_dir), "--rw", "write", "--size", "8M", "--bs", "1M", "--qd", "4", "--threads", "2"]) == 0
    out = capsys.readouterr().out
    assert "--numjobs=2" in out and "--iodepth=4" in out and "--overwrite=1" in out
    assert "fio-" in out and "GB/s" in out and "per 1M I/O" in out
    assert list(disk_dir.iterdir()) == []


def test_fio_subcommand_without_fio(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    assert main(["fio", str(tmp_path), "--size", "1M"]) == 1
    assert "apt-get install fio" in capsys.readouterr().err
