"""One measurement point: write then read one file with one `AioConfig`, through tensorio.

The workload is what swapping does: a tensor of ``size`` bytes moved as requests of
``request_size`` bytes (slices of one buffer, at the matching offsets of one file). Enough
requests are kept in flight to fill the handle's queues (``thread_count x queue_depth`` blocks,
and at least two requests), so the aio settings, not the benchmark, set the concurrency.

What the figures mean, next to fio's:
- ``bw_bytes``: bytes of one pass over its wall time, submission of the first request to the
  completion of the last; the median over the repeats.
- ``iops``: block-sized pieces per second at that bandwidth (fio's IOPS of ``bs``-sized I/Os).
- ``clat_ns``: completion latency of one *request* (``request_size`` bytes, split into pieces),
  from its submission to its future resolving, over all repeats (``clat_samples`` of them: below
  100, the nearest-rank p99 is their maximum). fio's clat is per block-sized I/O, so ours is larger
  by design; compare ours with ours.
- ``cpu_us_per_io``: CPU time (user + system, every thread of the process) per block-sized piece,
  the median over the repeats: fio's usr_cpu + sys_cpu per I/O is the figure to set beside it.

Each point starts with an untimed warm-up write that lays the file out and starts the workers,
so the timed writes overwrite it in place, as swap files are rewritten. After the last read the
bytes are compared with what was written.
"""

from __future__ import annotations

import collections
import math
import resource
import statistics
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tensorio import AioConfig, AioHandle, lock_status, locked_tensor

from .stats import Summary, round_trip, summarize

#: Request size when none is given: large enough for every block size we sweep.
DEFAULT_REQUEST_BYTES = 16 << 20


class MeasurementError(RuntimeError):
    """A measurement moved the wrong number of bytes or read back different bytes."""


@dataclass(kw_only=True, slots=True)
class Measurement:
    """One direction (read or write) of one point, in fio's units."""

    rw: str
    bw_bytes: int
    """Median bytes per second over the repeats."""
    iops: float
    """Block-sized pieces per second at ``bw_bytes``."""
    clat_ns_p50: int
    """Median completion latency of one request, in ns."""
    clat_ns_p99: int
    clat_ns_mean: float
    bw_bytes_samples: list[int]
    """Bytes per second of each repeat."""
    io_bytes: int
    """Bytes moved per repeat."""
    request_bytes: int
    cpu_us_per_io: float = 0.0
    """Median CPU microseconds (user + system, the whole process) per block-sized piece."""
    clat_samples: int = 0
    """Requests timed for the latency percentiles, over all repeats: below 100, p99 is their maximum."""

    @property
    def gb_per_s(self) -> float:
        """Bandwidth in GB/s (10**9 bytes per second)."""
        return self.bw_bytes / 1e9

    @property
    def summary(self) -> Summary:
        """The repeats' median, 95% confidence interval of the mean and spread (bytes per second)."""
        return summarize(self.bw_bytes_samples)

    def cpu_ms_per_gb(self, block_size: int) -> float:
        """CPU milliseconds per GB (10**9 bytes) moved, from ``cpu_us_per_io`` and the pieces of
        ``block_size`` bytes each request is split into."""
        pieces_per_byte = -(-self.request_bytes // block_size) / self.request_bytes
        return self.cpu_us_per_io * pieces_per_byte * 1e9 / 1e3

    def to_json(self) -> dict[str, Any]:
        """fio's field names: bw_bytes, iops, clat_ns.percentile in ns (per request, see the module doc),
        and the repeats' spread and 95% confidence interval of the mean (``bw_bytes_ci95``)."""
        summary = self.summary
        return {
            "io_bytes": self.io_bytes,
            "bw_bytes": self.bw_bytes,
            "iops": round(self.iops, 3),
            "clat_ns": {
                "unit_bytes": self.request_bytes,
                "samples": self.clat_samples,
                "mean": round(self.clat_ns_mean, 1),
                "percentile": {"50.000000": self.clat_ns_p50, "99.000000": self.clat_ns_p99},
            },
            "bw_bytes_samples": self.bw_bytes_samples,
            "bw_bytes_spread": round(summary.spread, 4),
            "bw_bytes_ci95": [round(summary.low), round(summary.high)],
            "cpu_us_per_io": round(self.cpu_us_per_io, 3),
        }

    @classmethod
    def from_json(cls, rw: str, data: dict[str, Any]) -> "Measurement":
        """The measurement ``to_json`` wrote (a resumed sweep reads its points back). Raises KeyError,
        TypeError or ValueError for a record that is not one."""
        clat = data["clat_ns"]
        return cls(rw=rw, bw_bytes=int(data["bw_bytes"]), iops=float(data["iops"]),
                   clat_ns_p50=int(clat["percentile"]["50.000000"]), clat_ns_p99=int(clat["percentile"]["99.000000"]),
                   clat_ns_mean=float(clat["mean"]), bw_bytes_samples=[int(s) for s in data["bw_bytes_samples"]],
                   io_bytes=int(data["io_bytes"]), request_bytes=int(clat["unit_bytes"]),
                   cpu_us_per_io=float(data["cpu_us_per_io"]), clat_samples=int(clat.get("samples", 0)))


@dataclass(kw_only=True, slots=True)
class PointResult:
    """Both directions of one configuration, and what actually ran."""

    config: AioConfig
    backend: str
    """The backend that did the I/O ("io_uring" or "threads")."""
    direct: bool
    """Whether O_DIRECT was used (False means the page cache inflated the figures)."""
    write: Measurement | None
    """None when only reads were measured (``run --rw read``); a sweep measures both."""
    read: Measurement | None
    workload: Any = None
    """The engine's own traffic with this configuration (`bench.workload.WorkloadResult`), where the
    sweep measured it (``--workload``); None otherwise."""

    @property
    def goal_bw_bytes(self) -> float:
        """The figure a choice goes by: the workload's (reads for inference, reads plus writes for
        training) where measured, else the round trip."""
        return self.workload.goal_bw_bytes if self.workload is not None else self.both_bw_bytes

    @property
    def goal_summary(self) -> Summary:
        """Spread and 95% interval of the goal: the workload's slices, else the round trip's repeats."""
        return self.workload.summary if self.workload is not None else self.both_summary

    @property
    def both_bw_bytes(self) -> float:
        """Rate of a round trip (write then read the same bytes): the harmonic mean of the two."""
        return 2 / (1 / self.write.bw_bytes + 1 / self.read.bw_bytes)

    @property
    def both_summary(self) -> Summary:
        """Spread and 95% interval of the round trip, from each repeat's write and read."""
        return summarize(round_trip(self.write.bw_bytes_samples, self.read.bw_bytes_samples))

    @property
    def cpu_ms_per_gb(self) -> float:
        """CPU milliseconds per GB moved, the mean over the directions measured."""
        per_gb = [m.cpu_ms_per_gb(self.config.block_size) for m in self.measurements()]
        return sum(per_gb) / len(per_gb)

    def measurements(self) -> list[Measurement]:
        """The directions measured, write first."""
        return [m for m in (self.write, self.read) if m is not None]

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "PointResult":
        """The point ``bench.report.point_json`` wrote, without its workload (`bench.journal` adds it). Raises KeyError, TypeError or ValueError (the
        config's own, naming the key) for a record that is not one."""
        return cls(config=AioConfig.from_dict(data["aio"]), backend=str(data["backend"]), direct=bool(data["direct"]),
                   write=Measurement.from_json("write", data["write"]) if data.get("write") else None,
                   read=Measurement.from_json("read", data["read"]) if data.get("read") else None)


class Buffers:
    """A source tensor with a known pattern and a destination for reads, allocated once and reused."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self.source = locked_tensor(nbytes)
        self.dest = locked_tensor(nbytes)
        generator = torch.Generator().manual_seed(1234)
        filled = min(nbytes, 1 << 20)  # 1 MiB of random bytes, doubled until the buffer is full
        self.source[:filled] = torch.randint(0, 256, (filled,), dtype=torch.uint8, generator=generator)
        while filled < nbytes:
            n = min(filled, nbytes - filled)
            self.source[filled:filled + n] = self.source[:n]
            filled += n
        pages = self.source[: nbytes // 4096 * 4096].view(-1, 4096)  # stamp each page with its index
        pages[:, :8] = torch.arange(pages.shape[0], dtype=torch.int64).view(-1, 1).view(torch.uint8)
        self.lock_status = lock_status(self.source)


def measure_point(config: AioConfig, path: str | Path, buffers: Buffers, *, request_size: int,
                  repeats: int, direct: bool, rws: tuple[str, ...] = ("write", "read")) -> PointResult:
    """Warm up, then time ``repeats`` writes and reads of ``buffers.nbytes`` bytes to ``path``.

    ``rws`` picks the directions timed (the warm-up write always runs: reads need the file).
    ``direct`` is whether the directory has O_DIRECT (from validation), for the report. The file is
    left in place for the caller to remove. Raises TensorIOError from the I/O and MeasurementError
    for a short transfer or for read-back bytes that differ from the written ones.
    """
    if repeats < 1 or not rws or set(rws) - {"write", "read"}:
        raise ValueError(f"repeats must be >= 1 and rws a choice of 'write', 'read'; got {repeats}, {rws}")
    if buffers.nbytes % request_size:
        raise ValueError(f"size {buffers.nbytes} is not a multiple of the request size {request_size}")
    window = max(2, math.ceil(config.block_size * config.queue_depth * config.thread_count / request_size))
    timings: dict[str, list[tuple[int, list[int], float]]] = {"write": [], "read": []}
    with AioHandle.from_config(config) as handle:
        _stream(handle, buffers.source, path, request_size, window, write=True)  # untimed warm-up
        for _ in range(repeats):
            if "write" in rws:
                timings["write"].append(_timed_stream(handle, buffers.source, path, request_size, window, write=True))
            if "read" in rws:
                buffers.dest.zero_()
                timings["read"].append(_timed_stream(handle, buffers.dest, path, request_size, window, write=False))
        backend = handle.backend_name
    if "read" in rws and not torch.equal(buffers.source, buffers.dest):
        differ = (buffers.source != buffers.dest).nonzero()[0].item()
        raise MeasurementError(f"{path}: bytes read back differ from those written, first at byte {differ}")
    used_direct = direct and config.direct is not False
    summary = {rw: _summarise(rw, runs, buffers.nbytes, request_size, config.block_size) if runs else None
               for rw, runs in timings.items()}
    return PointResult(config=config, backend=backend, direct=used_direct, write=summary["write"],
                       read=summary["read"])


def process_cpu_seconds() -> float:
    """CPU time (user + system) this process has used so far, every thread included, in seconds."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def time_transfer(handle: AioHandle, tensor: torch.Tensor, path: str | Path, *, write: bool) -> float:
    """GB/s (10**9 bytes per second) of one whole-tensor write or read of ``path`` as a single request.

    Raises TensorIOError from the I/O.
    """
    return timed_transfer(handle, tensor, path, write=write)[0]


def timed_transfer(handle: AioHandle, tensor: torch.Tensor, path: str | Path, *,
                   write: bool) -> tuple[float, float]:
    """(GB/s, CPU seconds of the process) of one whole-tensor write or read of ``path`` as a single
    request: divide the CPU by the pieces (``nbytes / block_size``) for fio's CPU per I/O.

    Raises TensorIOError from the I/O.
    """
    cpu, start = process_cpu_seconds(), time.perf_counter()
    (handle.write if write else handle.read)(tensor, path).result()
    elapsed, cpu = time.perf_counter() - start, process_cpu_seconds() - cpu
    return tensor.numel() * tensor.element_size() / elapsed / 1e9, cpu


def _timed_stream(handle: AioHandle, tensor: torch.Tensor, path: str | Path, request_size: int, window: int, *,
                  write: bool) -> tuple[int, list[int], float]:
    """`_stream`, and the process's CPU seconds meanwhile."""
    cpu = process_cpu_seconds()
    elapsed, latencies = _stream(handle, tensor, path, request_size, window, write=write)
    return elapsed, latencies, process_cpu_seconds() - cpu


def _stream(handle: AioHandle, tensor: torch.Tensor, path: str | Path, request_size: int, window: int, *,
            write: bool) -> tuple[int, list[int]]:
    """Move ``tensor`` as requests with at most ``window`` in flight; (elapsed ns, latency per request)."""
    count = tensor.numel() // request_size
    submitted = [0] * count
    completed = [0] * count
    in_flight: collections.deque[tuple[int, Any, threading.Event]] = collections.deque()
    op = handle.write if write else handle.read

    def stamp(index: int, stamped: threading.Event) -> None:  # runs in the I/O thread that finished it
        completed[index] = time.perf_counter_ns()
        stamped.set()

    def finish(index: int, future: Any, stamped: threading.Event) -> None:
        moved = future.result()  # raises the request's TensorIOError
        stamped.wait()  # the future is done before its callbacks have run
        if moved != request_size:
            raise MeasurementError(f"{path}: request {index} moved {moved} bytes, expected {request_size}")

    start = time.perf_counter_ns()
    for i in range(count):
        if len(in_flight) == window:
            finish(*in_flight.popleft())
        stamped = threading.Event()
        submitted[i] = time.perf_counter_ns()
        future = op(tensor[i * request_size:(i + 1) * request_size], path, i * request_size)
        future.add_done_callback(lambda _f, i=i, stamped=stamped: stamp(i, stamped))
        in_flight.append((i, future, stamped))
    while in_flight:
        finish(*in_flight.popleft())
    return max(completed) - start, [done - sub for sub, done in zip(submitted, completed)]


def _summarise(rw: str, runs: list[tuple[int, list[int], float]], nbytes: int, request_size: int,
               block_size: int) -> Measurement:
    samples = [int(nbytes * 1e9 / elapsed) for elapsed, _, _ in runs]
    latencies = sorted(lat for _, lats, _ in runs for lat in lats)
    pieces = nbytes // request_size * -(-request_size // block_size)
    bw = int(statistics.median(samples))
    return Measurement(
        rw=rw,
        bw_bytes=bw,
        iops=bw / min(block_size, request_size),
        clat_ns_p50=_percentile(latencies, 50),
        clat_ns_p99=_percentile(latencies, 99),
        clat_ns_mean=statistics.fmean(latencies),
        bw_bytes_samples=samples,
        io_bytes=nbytes,
        request_bytes=request_size,
        cpu_us_per_io=statistics.median(cpu * 1e6 / pieces for _, _, cpu in runs),
        clat_samples=len(latencies),
    )


def _percentile(sorted_values: list[int], pct: float) -> int:
    """Nearest-rank percentile, as fio reports them."""
    rank = max(1, math.ceil(pct / 100 * len(sorted_values)))
    return sorted_values[rank - 1]
