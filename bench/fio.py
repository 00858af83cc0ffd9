"""Run the real `fio` binary for one job and parse its JSON output.

This is our own wrapper (the PyPI package named ``fio-wrapper`` is unrelated; never install it).
Other benchmarks import it to put our figures next to fio's on the same disk::

    from bench.fio import FioJob, run_fio
    result = run_fio(FioJob(directory="/nvme/swap", rw="read", size=256 << 20,
                            block_size=1 << 20, queue_depth=32))
    print(result.bw_bytes / 1e9, "GB/s")

or to run a workload beside disk traffic of a given rate (what the I/O alone costs it)::

    from bench.fio import FioLoad, fio_load
    with fio_load(FioLoad(directory="/nvme/swap", read_rate=400_000_000, write_rate=400_000_000)) as load:
        train()
    print(load.read.gb_per_s, load.write.gb_per_s)

How settings map onto fio (see ``FioJob.command``):

- ``numjobs`` jobs share one file, job *i* moving the *i*-th slice (``offset_increment``), as our
  ``thread_count`` workers split one request; ``--group_reporting`` sums them.
- ``single_submit`` → ``iodepth_batch_submit=1`` (one submission per I/O), else ``=queue_depth``.
- ``overlap_events`` → ``iodepth_batch_complete_min=1`` (refill as each completion arrives), else
  ``=queue_depth`` (lock-step batches that drain the queue).
- For reads, and for writes with ``overwrite``, fio lays the file out (writes it) before the job
  starts; that pass is not part of the timed run, the job's runtime and bytes cover its I/O only.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "ENGINES",
    "FioError",
    "FioJob",
    "FioLoad",
    "FioLoadRun",
    "FioNotFound",
    "FioResult",
    "fio_load",
    "fio_path",
    "job_for_config",
    "run_fio",
]

#: fio engines we drive: io_uring first, libaio where io_uring is disabled, psync as the plain baseline.
ENGINES = ("io_uring", "libaio", "psync")

INSTALL_HINT = "install it with `apt-get install fio` (Debian/Ubuntu) or `dnf install fio`"

# Data files get this prefix so that cleanup removes exactly ours.
FILE_PREFIX = "tensorio-fio-"


class FioError(RuntimeError):
    """fio ran but failed, or its output could not be understood."""


class FioNotFound(FioError):
    """The fio binary is not on PATH."""


def fio_path() -> str | None:
    """Return the path of the fio binary on PATH, or None when fio is not installed."""
    return shutil.which("fio")


@dataclass(kw_only=True, slots=True)
class FioJob:
    """One sequential fio job: read or write ``size`` bytes in one file under ``directory``."""

    directory: str | os.PathLike
    """Existing directory on the disk to measure; fio's data file is created and removed there."""

    rw: str
    """"read" or "write" (sequential), or "rw": sequential reads and writes mixed half and half, the
    disk reading while it writes as much (what copying a file on one disk asks of it)."""

    size: int
    """Total bytes moved, over all jobs. A positive multiple of ``numjobs * block_size``."""

    block_size: int = 1 << 20
    """Bytes per I/O (fio ``bs``). A positive multiple of 512."""

    queue_depth: int = 8
    """I/Os in flight per job (fio ``iodepth``). At least 1."""

    numjobs: int = 1
    """Jobs splitting the file between them, like our ``thread_count``. At least 1."""

    single_submit: bool = False
    """One submission per I/O instead of one per batch."""

    overlap_events: bool = True
    """Refill the queue as each I/O completes instead of waiting for the whole batch."""

    direct: bool = True
    """O_DIRECT; False measures the page cache as well as the disk."""

    ioengine: str = "io_uring"
    """One of ``ENGINES``."""

    overwrite: bool = False
    """Writes: lay the file out before the timed job, so the job overwrites allocated blocks (as swap
    files are rewritten in place) rather than allocating fresh ones, which is much slower on ext4."""

    runtime_s: float | None = None
    """Stop after this many seconds even if ``size`` has not been moved (None: no limit)."""

    def __post_init__(self) -> None:
        if self.rw not in ("read", "write", "rw"):
            raise ValueError(f"FioJob.rw: {self.rw!r} is not allowed; use 'read', 'write' or 'rw'")
        if self.ioengine not in ENGINES:
            raise ValueError(f"FioJob.ioengine: {self.ioengine!r} is not allowed; use one of {', '.join(ENGINES)}")
        for key in ("size", "block_size", "queue_depth", "numjobs"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"FioJob.{key}: {value!r} is not allowed; use an integer >= 1")
        if self.block_size % 512:
            raise ValueError(f"FioJob.block_size: {self.block_size} is not a multiple of 512")
        if self.size % (self.numjobs * self.block_size):
            raise ValueError(
                f"FioJob.size: {self.size} is not a multiple of numjobs * block_size "
                f"({self.numjobs} * {self.block_size}); round it to one"
            )
        for key in ("single_submit", "overlap_events", "direct", "overwrite"):
            if not isinstance(getattr(self, key), bool):
                raise ValueError(f"FioJob.{key}: expected True or False, got {getattr(self, key)!r}")
        if self.runtime_s is not None and not self.runtime_s > 0:
            raise ValueError(f"FioJob.runtime_s: {self.runtime_s!r} is not allowed; use None or seconds > 0")

    def command(self, fio: str, filename: str | os.PathLike) -> list[str]:
        """The fio command line that runs this job on ``filename``."""
        batch_submit = 1 if self.single_submit else self.queue_depth
        batch_complete = 1 if self.overlap_events else self.queue_depth
        slice_bytes = self.size // self.numjobs
        cmd = [
            fio,
            "--output-format=json",
            "--name=tensorio",
            f"--filename={filename}",
            f"--rw={self.rw}",
            f"--filesize={self.size}",
            f"--size={slice_bytes}",
            f"--offset_increment={slice_bytes}",
            f"--numjobs={self.numjobs}",
            f"--bs={self.block_size}",
            f"--iodepth={self.queue_depth}",
            f"--iodepth_batch_submit={batch_submit}",
            f"--iodepth_batch_complete_min={batch_complete}",
            f"--ioengine={self.ioengine}",
            f"--direct={int(self.direct)}",
            "--thread",  # jobs as threads of one process, so that killing fio stops them all
            "--group_reporting",
        ]
        if self.rw == "rw":
            cmd.append("--rwmixread=50")
        if self.overwrite:
            cmd.append("--overwrite=1")
        if self.runtime_s is not None:
            cmd.append(f"--runtime={max(1, round(self.runtime_s * 1000))}ms")
        return cmd


@dataclass(kw_only=True, slots=True)
class FioResult:
    """What one fio job measured, with fio's own field names where it has them."""

    rw: str
    bw_bytes: int
    """Bytes per second over the job's runtime (fio ``bw_bytes``)."""
    iops: float
    io_bytes: int
    """Bytes actually moved (less than the job's size only when ``runtime_s`` cut it short)."""
    runtime_s: float
    """Time the I/O took, without fio's start-up and file layout."""
    clat_ns_p50: int
    """Median completion latency of one I/O, in nanoseconds (from submission to completion)."""
    clat_ns_p99: int
    clat_ns_mean: float
    command: list[str]
    fio_version: str
    job: dict[str, Any] = field(repr=False)
    """fio's whole JSON record of the (group-reported) job, for fields not copied above."""
    mix_write_bw_bytes: int | None = None
    """For an "rw" job: the writes' bytes per second, beside the reads' (the fields above are the
    reads' figures). None for "read" and "write"."""

    @property
    def gb_per_s(self) -> float:
        """Bandwidth in GB/s (10**9 bytes per second)."""
        return self.bw_bytes / 1e9

    @property
    def cpu_us_per_io(self) -> float | None:
        """CPU time (user + system) of fio per I/O, in microseconds: fio's ``usr_cpu`` + ``sys_cpu``
        (percentages of the job's runtime) times ``job_runtime``, over the I/Os of both directions.
        None where fio's JSON lacks those fields."""
        try:
            ios = sum(int(self.job[rw]["total_ios"]) for rw in ("read", "write") if rw in self.job)
            busy = (float(self.job["usr_cpu"]) + float(self.job["sys_cpu"])) / 100
            return busy * float(self.job["job_runtime"]) * 1000 / ios if ios else None
        except (KeyError, TypeError, ValueError):
            return None

    def to_json(self) -> dict[str, Any]:
        """The figures in fio's own field names (clat per I/O), the command and fio's version."""
        cpu = self.cpu_us_per_io
        record: dict[str, Any] = {
            "rw": self.rw, "io_bytes": self.io_bytes, "bw_bytes": self.bw_bytes, "iops": round(self.iops, 3),
            "runtime_s": self.runtime_s,
            "clat_ns": {"mean": round(self.clat_ns_mean, 1),
                        "percentile": {"50.000000": self.clat_ns_p50, "99.000000": self.clat_ns_p99}},
            "cpu_us_per_io": None if cpu is None else round(cpu, 3),
            "fio_version": self.fio_version, "command": self.command,
        }
        if self.mix_write_bw_bytes is not None:
            record["mix_write_bw_bytes"] = self.mix_write_bw_bytes
        return record


def job_for_config(config: Any, *, directory: str | os.PathLike, rw: str, size: int,
                   ioengine: str = "io_uring") -> FioJob:
    """The fio job matching an ``AioConfig`` (anything with its attributes) for ``size`` bytes.

    ``thread_count`` becomes ``numjobs``; ``direct="auto"`` becomes O_DIRECT. ``size`` is rounded down
    to a multiple of ``thread_count * block_size``. Raises ValueError when that leaves nothing to move.
    """
    unit = config.thread_count * config.block_size
    rounded = size // unit * unit
    if rounded == 0:
        raise ValueError(f"size {size} is smaller than thread_count * block_size ({unit}); use a larger size")
    return FioJob(
        directory=directory,
        rw=rw,
        size=rounded,
        block_size=config.block_size,
        queue_depth=config.queue_depth,
        numjobs=config.thread_count,
        single_submit=config.single_submit,
        overlap_events=config.overlap_events,
        direct=config.direct is not False,
        ioengine=ioengine,
    )


def run_fio(job: FioJob, *, fio: str | None = None, timeout_s: float | None = None,
            filename: str | os.PathLike | None = None,
            on_start: Callable[[subprocess.Popen[str]], None] | None = None) -> FioResult:
    """Run ``job`` with the fio binary (``fio`` or the one on PATH) and parse its JSON output.

    fio's data file is created in ``job.directory`` and removed afterwards, also when fio fails, the
    call times out or the caller is interrupted (KeyboardInterrupt stops fio first). With
    ``filename`` (inside ``job.directory``) fio uses that file and leaves it for the caller to
    remove: a warm-up run lays it out, and the timed runs after it skip the layout.
    ``on_start(process)`` is called once fio has been started, before waiting for it (tests use it
    to interrupt a run at a known point and to see how fio ended).

    Raises FioNotFound when fio is not installed, FileNotFoundError / NotADirectoryError for a bad
    directory (checked first: fio would silently create it), and FioError, naming the command and
    fio's error output, when fio fails, times out or reports no I/O.
    """
    fio = fio or fio_path()
    if fio is None:
        raise FioNotFound(f"fio is not installed (not found on PATH); {INSTALL_HINT}")
    directory = Path(job.directory)
    if not directory.exists():
        raise FileNotFoundError(f"{directory}: no such directory; create it or pick one on the disk to measure")
    if not directory.is_dir():
        raise NotADirectoryError(f"{directory}: not a directory; pass the directory to put fio's file in")
    owned = filename is None
    if owned:
        filename = directory / f"{FILE_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:8]}.dat"
    elif Path(filename).resolve().parent != directory.resolve():
        raise ValueError(f"filename {filename} is not in the job's directory {directory}")
    cmd = job.command(fio, filename)
    try:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            if on_start is not None:
                on_start(proc)
            stdout, stderr = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            raise FioError(f"fio did not finish within {timeout_s} s: {' '.join(cmd)}") from None
        except BaseException:
            proc.kill()  # KeyboardInterrupt and the like: stop fio before removing its file
            proc.communicate()
            raise
    finally:
        if owned:
            Path(filename).unlink(missing_ok=True)
    if proc.returncode != 0:
        raise FioError(
            f"fio failed with exit status {proc.returncode}: {' '.join(cmd)}\n{_tail(stderr or stdout)}"
        )
    return _parse(job.rw, stdout, cmd, stderr)


@dataclass(kw_only=True, slots=True)
class FioLoad:
    """Disk traffic at a fixed rate for as long as a workload runs: fio reading and writing one file
    side by side (sequential, O_DIRECT, io_uring), over and over until stopped."""

    directory: str | os.PathLike
    """Existing directory on the disk; fio's file is created and removed there."""

    read_rate: int
    """Bytes per second read (0: none). At least one of the two rates is positive."""

    write_rate: int
    """Bytes per second written (0: none)."""

    size: int = 1 << 30
    """Bytes in the file the traffic cycles over. A positive multiple of ``block_size``."""

    block_size: int = 1 << 20
    """Bytes per I/O. A positive multiple of 512."""

    queue_depth: int = 8
    """I/Os in flight. At least 1."""

    def __post_init__(self) -> None:
        for key in ("read_rate", "write_rate"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"FioLoad.{key}: {value!r} is not allowed; use bytes per second >= 0")
        if self.read_rate == 0 and self.write_rate == 0:
            raise ValueError("FioLoad: read_rate and write_rate are both 0; give at least one a rate")
        for key in ("size", "block_size", "queue_depth"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"FioLoad.{key}: {value!r} is not allowed; use an integer >= 1")
        if self.block_size % 512 or self.size % self.block_size:
            raise ValueError(f"FioLoad: size {self.size} must be a multiple of block_size {self.block_size}, "
                             f"itself a multiple of 512")

    @property
    def directions(self) -> tuple[str, ...]:
        """The directions with a rate: "read", "write" or both."""
        return tuple(rw for rw, rate in (("read", self.read_rate), ("write", self.write_rate)) if rate)

    def command(self, fio: str, filename: str | os.PathLike) -> list[str]:
        """The fio command line that keeps this traffic going on ``filename`` until interrupted."""
        total = self.read_rate + self.write_rate
        rw = "rw" if len(self.directions) == 2 else self.directions[0]
        return [
            fio,
            "--output-format=json",
            "--name=tensorio-load",
            f"--filename={filename}",
            f"--rw={rw}",
            f"--rwmixread={round(100 * self.read_rate / total)}",
            f"--rate={self.read_rate},{self.write_rate}",
            f"--size={self.size}",
            f"--bs={self.block_size}",
            f"--iodepth={self.queue_depth}",
            "--ioengine=io_uring",
            "--direct=1",
            "--time_based",
            "--runtime=24h",  # until interrupted
            "--thread",
        ]


@dataclass(slots=True)
class FioLoadRun:
    """A running `fio_load`: its fio process, then what it moved per direction with a rate (None
    until the load has stopped)."""

    process: subprocess.Popen[str] | None = None
    read: FioResult | None = None
    write: FioResult | None = None


@contextlib.contextmanager
def fio_load(load: FioLoad, *, fio: str | None = None) -> Iterator[FioLoadRun]:
    """Keep ``load``'s traffic going while the body runs; on exit stop fio (SIGINT, so that it
    reports), fill the yielded `FioLoadRun` with its figures and remove its file.

    The file is written out first (a plain write job), so that the traffic starts at once and reads
    read data. Raises what `run_fio` raises for that first job, and FioError when fio fails or stops
    on its own before the body ends (its error output included).
    """
    fio = fio or fio_path()
    if fio is None:
        raise FioNotFound(f"fio is not installed (not found on PATH); {INSTALL_HINT}")
    filename = Path(load.directory) / f"{FILE_PREFIX}load-{os.getpid()}-{uuid.uuid4().hex[:8]}.dat"
    run = FioLoadRun()
    try:
        run_fio(FioJob(directory=load.directory, rw="write", size=load.size, block_size=load.block_size,
                       queue_depth=load.queue_depth), fio=fio, filename=filename)
        cmd = load.command(fio, filename)
        proc = run.process = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            yield run
        finally:
            ended_early = proc.poll() is not None
            if not ended_early:
                proc.send_signal(signal.SIGINT)
            try:
                stdout, stderr = proc.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                stdout, stderr = proc.communicate()
        if ended_early:
            raise FioError(f"fio stopped before the workload ended (exit status {proc.returncode}): "
                           f"{' '.join(cmd)}\n{_tail(stderr or stdout)}")
        for rw in load.directions:
            setattr(run, rw, _parse(rw, stdout, cmd, stderr))
    finally:
        filename.unlink(missing_ok=True)


def _tail(text: str, lines: int = 20) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def _parse(rw: str, stdout: str, cmd: list[str], stderr: str) -> FioResult:
    """Build a FioResult from fio's JSON output; fio may print warnings before the JSON."""
    start = stdout.find("{")
    try:
        data = json.loads(stdout[start:]) if start >= 0 else None
    except json.JSONDecodeError:
        data = None
    if not isinstance(data, dict) or not data.get("jobs"):
        raise FioError(f"fio printed no JSON job report: {' '.join(cmd)}\n{_tail(stderr or stdout)}")
    job = data["jobs"][0]
    if job.get("error"):
        raise FioError(f"fio reported error {job['error']}: {' '.join(cmd)}\n{_tail(stderr)}")
    try:
        stats = job["read" if rw == "rw" else rw]
        clat = stats["clat_ns"]
        percentiles = clat.get("percentile", {})
        result = FioResult(
            rw=rw,
            bw_bytes=int(stats["bw_bytes"]),
            iops=float(stats["iops"]),
            io_bytes=int(stats["io_bytes"]),
            runtime_s=stats["runtime"] / 1000.0,
            clat_ns_p50=int(percentiles.get("50.000000", 0)),
            clat_ns_p99=int(percentiles.get("99.000000", 0)),
            clat_ns_mean=float(clat["mean"]),
            command=cmd,
            fio_version=str(data.get("fio version", "")),
            job=job,
            mix_write_bw_bytes=int(job["write"]["bw_bytes"]) if rw == "rw" else None,
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise FioError(f"fio's JSON lacks {exc} for {rw}: {' '.join(cmd)}") from None
    if result.io_bytes == 0:
        raise FioError(f"fio moved no bytes: {' '.join(cmd)}\n{_tail(stderr)}")
    return result
