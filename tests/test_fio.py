"""The fio wrapper against the real fio binary, at tiny sizes."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from bench.fio import (FILE_PREFIX, FioError, FioJob, FioLoad, FioNotFound, fio_load, fio_path, job_for_config,
                       run_fio)
from tensorio import AioConfig

MiB = 1 << 20
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def disk_dir(tmp_path) -> Path:
    """An empty directory for fio's file; TENSORIO_TEST_DIR moves it onto a chosen disk."""
    if "TENSORIO_TEST_DIR" not in os.environ:
        yield tmp_path
        return
    d = Path(os.environ["TENSORIO_TEST_DIR"]) / f"fio-{os.getpid()}-{time.monotonic_ns()}"
    d.mkdir(parents=True)
    yield d
    for p in d.iterdir():
        p.unlink()
    d.rmdir()


@pytest.mark.fio
@pytest.mark.parametrize("rw", ["read", "write"])
@pytest.mark.parametrize("engine", ["io_uring", "libaio", "psync"])
def test_run_fio_parses_real_output_and_removes_its_file(disk_dir, rw, engine):
    job = FioJob(directory=disk_dir, rw=rw, size=8 * MiB, block_size=128 * 1024, queue_depth=4, ioengine=engine)
    result = run_fio(job)
    assert result.rw == rw
    assert result.io_bytes == 8 * MiB
    assert result.bw_bytes > 0 and result.iops > 0
    assert 0 < result.clat_ns_p50 <= result.clat_ns_p99
    assert result.clat_ns_mean > 0
    assert result.fio_version.startswith("fio-")
    assert f"--rw={rw}" in result.command and f"--ioengine={engine}" in result.command
    # 8 MiB in 128 KiB blocks: fio counts 64 I/Os, and its IOPS agree with its bandwidth.
    assert result.job[rw]["total_ios"] == 64
    assert result.iops == pytest.approx(result.bw_bytes / (128 * 1024), rel=0.01)
    assert list(disk_dir.iterdir()) == []


@pytest.mark.fio
def test_read_job_does_not_time_the_layout(disk_dir):
    """fio writes the file before a read job; that pass must not show up in the read job's report."""
    result = run_fio(FioJob(directory=disk_dir, rw="read", size=8 * MiB, block_size=MiB))
    assert result.job["write"]["io_bytes"] == 0
    assert result.job["read"]["io_bytes"] == 8 * MiB


@pytest.mark.fio
def test_mixed_job_reads_and_writes_half_each_and_reports_both(disk_dir):
    """rw="rw": what a copy on one disk asks of it; the reads' figures, and the writes' beside them."""
    result = run_fio(FioJob(directory=disk_dir, rw="rw", size=16 * MiB, block_size=MiB, overwrite=True))
    assert "--rw=rw" in result.command and "--rwmixread=50" in result.command
    read, write = result.job["read"]["io_bytes"], result.job["write"]["io_bytes"]
    assert read + write == 16 * MiB and read > 0 and write > 0
    assert result.io_bytes == read and result.bw_bytes == result.job["read"]["bw_bytes"]
    assert result.mix_write_bw_bytes == result.job["write"]["bw_bytes"] > 0
    assert run_fio(FioJob(directory=disk_dir, rw="read", size=8 * MiB, block_size=MiB)).mix_write_bw_bytes is None
    assert list(disk_dir.iterdir()) == []


@pytest.mark.fio
def test_overwrite_lays_the_file_out_untimed(disk_dir):
    result = run_fio(FioJob(directory=disk_dir, rw="write", size=8 * MiB, block_size=MiB, overwrite=True))
    assert "--overwrite=1" in result.command
    assert result.job["write"]["io_bytes"] == 8 * MiB  # the layout pass is not counted
    assert list(disk_dir.iterdir()) == []


@pytest.mark.fio
def test_given_file_is_used_and_left_to_the_caller(disk_dir):
    path = disk_dir / "mine.dat"
    run_fio(FioJob(directory=disk_dir, rw="write", size=8 * MiB, block_size=MiB), filename=path)
    assert path.stat().st_size == 8 * MiB
    result = run_fio(FioJob(directory=disk_dir, rw="read", size=8 * MiB, block_size=MiB), filename=path)
    assert f"--filename={path}" in result.command and result.io_bytes == 8 * MiB
    assert list(disk_dir.iterdir()) == [path]
    with pytest.raises(ValueError, match="not in the job's directory"):
        run_fio(FioJob(directory=disk_dir, rw="read", size=MiB), filename=disk_dir.parent / "elsewhere.dat")
    path.unlink()


@pytest.mark.fio
def test_numjobs_split_one_file(disk_dir):
    result = run_fio(FioJob(directory=disk_dir, rw="write", size=8 * MiB, block_size=MiB, numjobs=2))
    assert result.io_bytes == 8 * MiB  # group_reporting sums both jobs; each moved half
    assert "--size=4194304" in result.command and "--offset_increment=4194304" in result.command


@pytest.mark.fio
def test_runtime_limit_stops_early(disk_dir):
    # 4 GiB in 4 KiB synchronous writes takes far longer than the limit on any disk; fio's own clock
    # stops the job, so a loaded machine only moves fewer bytes.
    job = FioJob(directory=disk_dir, rw="write", size=4096 * MiB, block_size=4096, queue_depth=1,
                 ioengine="psync", runtime_s=0.2)
    result = run_fio(job)
    assert "--runtime=200ms" in result.command
    assert 0 < result.io_bytes < 4096 * MiB and result.io_bytes % 4096 == 0


def test_command_maps_submit_and_completion_batching():
    base = dict(directory="/x", rw="read", size=8 * MiB, block_size=MiB, queue_depth=16)
    lockstep = FioJob(**base, single_submit=True, overlap_events=False).command("fio", "/x/f")
    assert "--iodepth_batch_submit=1" in lockstep and "--iodepth_batch_complete_min=16" in lockstep
    sliding = FioJob(**base).command("fio", "/x/f")
    assert "--iodepth_batch_submit=16" in sliding and "--iodepth_batch_complete_min=1" in sliding
    assert "--direct=1" in sliding
    assert "--direct=0" in FioJob(**base, direct=False).command("fio", "/x/f")


def test_job_for_config_matches_aio_settings():
    cfg = AioConfig(block_size=256 * 1024, queue_depth=32, thread_count=2, single_submit=True,
                    overlap_events=False, direct="auto")
    job = job_for_config(cfg, directory="/d", rw="write", size=10 * MiB + 5)
    assert (job.block_size, job.queue_depth, job.numjobs) == (256 * 1024, 32, 2)
    assert job.single_submit is True and job.overlap_events is False and job.direct is True
    assert job.size == 10 * MiB  # rounded down to a multiple of 2 * 256 KiB
    assert job_for_config(AioConfig(direct=False), directory="/d", rw="read", size=MiB).direct is False
    with pytest.raises(ValueError, match="smaller than thread_count"):
        job_for_config(cfg, directory="/d", rw="read", size=4096)


@pytest.mark.parametrize(
    ("change", "key"),
    [({"rw": "randread"}, "rw"), ({"ioengine": "spdk"}, "ioengine"), ({"size": 0}, "size"),
     ({"block_size": 1000}, "block_size"), ({"size": 3 * MiB, "numjobs": 2}, "size"),
     ({"queue_depth": True}, "queue_depth"), ({"direct": "yes"}, "direct"), ({"overwrite": 1}, "overwrite"), ({"runtime_s": 0}, "runtime_s")],
)
def test_job_validation_names_the_key(change, key):
    args = dict(directory="/d", rw="read", size=8 * MiB, block_size=MiB) | change
    with pytest.raises(ValueError, match=f"FioJob.{key}"):
        FioJob(**args)


def test_missing_fio_says_how_to_install(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    assert fio_path() is None
    with pytest.raises(FioNotFound, match="apt-get install fio"):
        run_fio(FioJob(directory=tmp_path, rw="read", size=MiB))


@pytest.mark.fio
def test_missing_directory_is_refused_not_created(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(FileNotFoundError, match="nope"):
        run_fio(FioJob(directory=missing, rw="write", size=MiB))
    assert not missing.exists()


def test_failing_fio_names_command_and_stderr(tmp_path):
    fake = tmp_path / "fio"
    fake.write_text("#!/bin/sh\necho 'fio: engine went away' >&2\nexit 1\n")
    fake.chmod(0o755)
    with pytest.raises(FioError, match="engine went away") as info:
        run_fio(FioJob(directory=tmp_path, rw="read", size=MiB), fio=str(fake))
    assert "--rw=read" in str(info.value)
    assert [p.name for p in tmp_path.iterdir()] == ["fio"]


@pytest.mark.fio
@pytest.mark.subprocess
def test_interrupted_run_stops_fio_and_removes_its_file(disk_dir):
    # A read of 2 GiB lays its file out first; interrupt it while the file exists. fio is paused
    # (SIGSTOP) while the test looks, so that it cannot finish first however loaded the machine is.
    script = (
        "from bench.fio import FioJob, run_fio\n"
        "started = []\n"
        "def on_start(fio):\n"
        "    started.append(fio)\n"
        "    print(fio.pid, flush=True)\n"
        "try:\n"
        f"    run_fio(FioJob(directory={str(disk_dir)!r}, rw='read', size={2048 * MiB}, block_size={MiB}),\n"
        "            on_start=on_start)\n"
        "finally:\n"
        "    print('fio exit status', started[0].returncode, flush=True)\n"
    )
    # A shell without job control starts background jobs with SIGINT ignored, and Python keeps it
    # ignored: give the child the default disposition, so that its interpreter handles Ctrl-C.
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    line = proc.stdout.readline()  # fio has started
    assert line.strip().isdigit(), (line, proc.communicate())
    fio = psutil.Process(int(line))
    try:
        while True:
            fio.suspend()
            assert fio.status() != psutil.STATUS_ZOMBIE, "fio finished before its file was seen"
            if any(p.name.startswith(FILE_PREFIX) for p in disk_dir.iterdir()):
                break
            fio.resume()
            time.sleep(0.01)  # let fio run on until its file exists
        proc.send_signal(signal.SIGINT)
    finally:
        with contextlib.suppress(psutil.NoSuchProcess):
            fio.resume()  # were run_fio to wait for fio instead of stopping it, fio would finish with status 0
    stdout, stderr = proc.communicate()
    assert "KeyboardInterrupt" in stderr
    assert stdout.splitlines()[-1] == f"fio exit status {-signal.SIGKILL}", "fio was not stopped"
    assert list(disk_dir.iterdir()) == []
    still_running = [p.pid for p in psutil.process_iter(["cmdline"]) if str(disk_dir) in " ".join(p.info["cmdline"] or [])]
    assert still_running == [], "fio kept running after the interrupt"


def _moved(process: subprocess.Popen, nbytes: int) -> bool:
    counters = psutil.Process(process.pid).io_counters()
    return counters.read_bytes >= nbytes and counters.write_bytes >= nbytes


@pytest.mark.fio
def test_fio_load_runs_beside_the_body_at_its_rates_and_removes_its_file(disk_dir):
    load = FioLoad(directory=disk_dir, read_rate=40_000_000, write_rate=20_000_000, size=8 * MiB, block_size=MiB)
    with fio_load(load) as run:
        assert run.process is not None and run.process.poll() is None
        for _ in range(6000):  # waits for fio's own counters (a hang guard, not a time limit on fio)
            if _moved(run.process, 2 * MiB):
                break
            time.sleep(0.01)
        assert _moved(run.process, 2 * MiB)
        assert run.read is None and run.write is None  # figures come once it has stopped
    assert run.process.returncode is not None
    assert run.read.io_bytes >= 2 * MiB and run.write.io_bytes >= 2 * MiB
    assert "--rate=40000000,20000000" in run.read.command and "--rwmixread=67" in run.read.command
    assert list(disk_dir.iterdir()) == []


@pytest.mark.fio
def test_fio_load_stops_fio_when_the_body_raises(disk_dir):
    with pytest.raises(KeyError):
        with fio_load(FioLoad(directory=disk_dir, read_rate=0, write_rate=10_000_000, size=4 * MiB)) as run:
            raise KeyError("body failed")
    assert run.process.returncode is not None and run.write is None
    assert list(disk_dir.iterdir()) == []


@pytest.mark.fio
def test_fio_load_that_stops_on_its_own_is_an_error(disk_dir, tmp_path):
    (tmp_path / "bin").mkdir()
    fake = tmp_path / "bin" / "fio"  # the real fio for the file's layout; the load itself fails at once
    fake.write_text(f"#!/bin/sh\ncase \"$*\" in *--name=tensorio-load*) echo 'fio: rate not reachable' >&2; exit 1;; esac\n"
                    f"exec {fio_path()} \"$@\"\n")
    fake.chmod(0o755)
    with pytest.raises(FioError, match="(?s)stopped before the workload ended.*rate not reachable"):
        with fio_load(FioLoad(directory=disk_dir, read_rate=MiB, write_rate=MiB, size=MiB), fio=str(fake)) as run:
            run.process.wait()
    assert [p for p in disk_dir.iterdir() if p.name != "bin"] == []


@pytest.mark.parametrize("change, message", [(dict(read_rate=0, write_rate=0), "both 0"),
                                             (dict(read_rate=-1), "read_rate"),
                                             (dict(size=MiB + 512), "multiple of block_size")])
def test_fio_load_validation_names_the_problem(tmp_path, change, message):
    with pytest.raises(ValueError, match=message):
        FioLoad(**{"directory": tmp_path, "read_rate": MiB, "write_rate": MiB, **change})
