"""fio given the engine's workload (`bench.workload.Workload`), so that "x fio" compares like with like.

The mapping (``fio_workload_command``):

- ``training``: per rank, two fio jobs at once over the rank's swap files (one partition each): one
  reads them in order starting at the second, the other writes them in order starting at the first
  (``file_service_type=sequential``), so the disk reads one partition while another is written, as the
  swap pipeline does. ``filesize`` is the partition.
- ``inference``, ``read``, ``write``: one job, sequential over one file of the workload's file size.
- Each job has as many I/Os in flight as ours can have in that direction: ``iodepth`` = the smaller of
  ``queue_depth x thread_count`` (the handle's queues) and the requests ours keeps in flight times the
  blocks in a request; ``bs`` is ours; ``single_submit``/``overlap_events`` map as in `bench.fio`.
- Time-based, with ours' ramp (``ramp_time``) and runtime; O_DIRECT; ``--iomem=malloc`` (fio's
  default, stated: on a system whose transparent huge pages are "madvise" those are 4 KiB pages, so
  ours is run with ``huge_pages=False`` beside it for the like-for-like figure).

The files are laid out before fio starts (by the caller), so that the disk's counters read around
the run (`bench.diskstat`) see fio's own requests and no layout.
"""

from __future__ import annotations

import json
import math
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tensorio import AioConfig

from .diskstat import DiskTraffic, read_counters, traffic
from .fio import INSTALL_HINT, FioError, FioNotFound, fio_path
from .workload import Workload

__all__ = ["FioMixResult", "fio_depth", "fio_workload_command", "run_fio_workload"]


def fio_depth(config: AioConfig, workload: Workload) -> int:
    """I/Os in flight per fio job: as many as ours can have in one direction (see the module doc)."""
    blocks = math.ceil(workload.request_bytes / config.block_size)
    requests = 1 if workload.kind == "training" else workload.in_flight(config)
    return max(1, min(config.queue_depth * config.thread_count, requests * blocks))


def workload_files(directory: Path, workload: Workload) -> list[list[Path]]:
    """The files fio uses, per rank (training) or one list of one."""
    if workload.kind == "training":
        return [[directory / f"fio-r{r}-f{i}.dat" for i in range(workload.files)] for r in range(workload.ranks)]
    return [[directory / "fio-0.dat"]]


def fio_workload_command(fio: str, config: AioConfig, workload: Workload, files: list[list[Path]]) -> list[str]:
    """The fio command line that drives ``workload`` with ``config``'s settings on ``files``
    (`workload_files`). Raises ValueError for a file name holding ':' (fio's list separator)."""
    for path in (p for rank in files for p in rank):
        if ":" in str(path):
            raise ValueError(f"{path}: fio separates file names with ':'; use a directory without one")
    depth = fio_depth(config, workload)
    cmd = [fio, "--output-format=json", "--ioengine=io_uring", "--direct=1", "--thread", "--group_reporting",
           "--time_based", f"--runtime={max(1, round(workload.runtime_s * 1000))}ms",
           f"--ramp_time={round(workload.ramp_s * 1000)}ms", f"--bs={config.block_size}", f"--iodepth={depth}",
           f"--iodepth_batch_submit={1 if config.single_submit else depth}",
           f"--iodepth_batch_complete_min={1 if config.overlap_events else depth}", "--iomem=malloc"]
    if workload.kind == "training":
        for r, paths in enumerate(files):
            rotated = paths[1:] + paths[:1]  # the reader is one partition ahead of the writer
            cmd += [f"--name=rank{r}-read", "--rw=read", f"--filename={':'.join(map(str, rotated))}",
                    f"--filesize={workload.file_size()}", "--file_service_type=sequential",
                    f"--name=rank{r}-write", "--rw=write", f"--filename={':'.join(map(str, paths))}",
                    f"--filesize={workload.file_size()}", "--file_service_type=sequential", "--overwrite=1"]
    else:
        rw = "write" if workload.kind == "write" else "read"
        cmd += [f"--name={workload.kind}", f"--rw={rw}", f"--filename={files[0][0]}", f"--size={workload.file_size()}"]
        if rw == "write":
            cmd.append("--overwrite=1")
    return cmd


@dataclass(kw_only=True, slots=True)
class FioMixResult:
    """What fio moved on the workload, reads and writes summed over its jobs."""

    read_bw_bytes: int
    write_bw_bytes: int
    cpu_ms_per_gb: float | None
    clat_ns: dict[str, dict[str, Any]]
    """Per direction: fio's p50 / p99 / p99.9 per block-sized I/O, and how many I/Os."""
    command: list[str]
    fio_version: str
    disk: DiskTraffic | None = None

    def goal_bw_bytes(self, kind: str) -> int:
        """Reads alone for inference, reads plus writes otherwise (as `WorkloadResult.goal_bw_bytes`)."""
        return self.read_bw_bytes if kind == "inference" else self.read_bw_bytes + self.write_bw_bytes

    def to_json(self) -> dict[str, Any]:
        """The figures, fio's command and version, and what the disk saw."""
        return {"read_bw_bytes": self.read_bw_bytes, "write_bw_bytes": self.write_bw_bytes,
                "cpu_ms_per_gb": None if self.cpu_ms_per_gb is None else round(self.cpu_ms_per_gb, 2),
                "clat_ns": self.clat_ns, "command": self.command, "fio_version": self.fio_version,
                "disk": self.disk.to_json() if self.disk else None}


def run_fio_workload(config: AioConfig, workload: Workload, files: list[list[Path]], *,
                     disks: tuple[str, ...] = (), timeout_s: float | None = None) -> FioMixResult:
    """Run fio on ``workload`` over ``files`` (laid out by the caller), reading ``disks``' counters around
    it. Raises FioNotFound without fio, FioError when it fails or its JSON lacks a field."""
    fio = fio_path()
    if fio is None:
        raise FioNotFound(f"fio is not installed (not found on PATH); {INSTALL_HINT}")
    cmd = fio_workload_command(fio, config, workload, files)
    before = read_counters(disks)
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise FioError(f"fio did not finish within {timeout_s} s: {' '.join(cmd)}") from None
    after = read_counters(disks)
    if proc.returncode != 0:
        raise FioError(f"fio failed with exit status {proc.returncode}: {' '.join(cmd)}\n{proc.stderr[-2000:]}")
    return parse_mix(proc.stdout, cmd, disk=traffic(disks, before, after))


def parse_mix(stdout: str, cmd: list[str], *, disk: DiskTraffic | None = None) -> FioMixResult:
    """A `FioMixResult` from fio's JSON (group-reported jobs). Raises FioError for output without it."""
    start = stdout.find("{")
    try:
        data = json.loads(stdout[start:]) if start >= 0 else None
        job = data["jobs"][0]
        read, write = job["read"], job["write"]
        moved = int(read["io_bytes"]) + int(write["io_bytes"])
        busy = (float(job["usr_cpu"]) + float(job["sys_cpu"])) / 100 * float(job["job_runtime"]) / 1000  # seconds
        clat = {}
        for rw, stats in (("read", read), ("write", write)):
            if int(stats["total_ios"]):
                pct = stats["clat_ns"].get("percentile", {})
                clat[rw] = {"samples": int(stats["total_ios"]), "p50": pct.get("50.000000"),
                            "p99": pct.get("99.000000"), "p99.9": pct.get("99.900000"),
                            "mean": round(float(stats["clat_ns"]["mean"]), 1)}
        return FioMixResult(read_bw_bytes=int(read["bw_bytes"]), write_bw_bytes=int(write["bw_bytes"]),
                            cpu_ms_per_gb=busy * 1e3 / (moved / 1e9) if moved else None, clat_ns=clat,
                            command=cmd, fio_version=str(data.get("fio version", "")), disk=disk)
    except (TypeError, KeyError, ValueError, IndexError) as exc:
        raise FioError(f"fio's JSON lacks {exc}: {' '.join(cmd)}\n{stdout[-2000:]}") from None
