"""The engine's own traffic, time-based: what a sweep point's sequential passes are not.

Four kinds (`Workload.kind`):

- ``training``: the optimizer's swap pipeline. Each rank has ``files`` swap files of one partition
  (``request_bytes``) each and two slots (A/B) of that size in memory; every step reads the next
  partition into one slot while the other slot's partition is written back, both requests at once,
  then the slots swap: reads and writes always in flight together, partition-sized, over several
  files. ``ranks`` ranks run at once, each in its own process (`bench._ranks`, as the engine runs a
  process per rank) with its own `AioHandle`, slots and files; one rank runs in this process.
- ``inference``: a checkpoint read as layer windows (``request_bytes``, 64 MiB by default) split into
  the engine's pieces (the aio ``block_size``: 8 MiB in the engine's defaults), ``window`` windows in
  flight (2), cycling over one file of ``file_bytes``: reads alone.
- ``read`` / ``write``: sequential passes over one file in requests of ``request_bytes``, as many in
  flight as the handle's queues hold (the sweep's protocol, but time-based and with small buffers).

Each run lays its files out first (untimed: overwrites, as swap files are rewritten), then runs for
``ramp_s`` seconds uncounted and ``runtime_s`` seconds counted, split into ``slices`` equal windows
whose rates give the spread. The buffers are the slots (or the window's pieces) alone, reused over
the files, so the files may be far larger than RAM. Every request's byte count is checked; the bytes
are not compared (a point of the sweep does that).
"""

from __future__ import annotations

import math
import mmap
import os
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tensorio import AioConfig, AioHandle, locked_tensor

from .diskstat import DiskTraffic, read_counters, traffic
from .measure import MeasurementError, process_cpu_seconds
from .stats import Summary, summarize

__all__ = ["KINDS", "Workload", "WorkloadResult", "latency_percentiles", "measure_workload", "slice_rates"]

KINDS = ("training", "inference", "read", "write")
INFERENCE_PIECE = 8 << 20
"""The inference engine's read piece: its default ``aio.block_size``, added to a sweep's block sizes."""
INFERENCE_REQUEST = 64 << 20
"""One layer window read by the inference engine (a 2.7 GB, 16-layer Llama's layers are ~160 MiB)."""
INFERENCE_WINDOW = 2
"""Layer windows in flight: the one being read and the next (the engine's ring of two buffers)."""
TRAINING_PARTITION = 48 << 20
"""One optimizer sub-group's state: the default ``sub_group_size`` (4 Mi elements) x 12 bytes (fp32
master weights, exp_avg, exp_avg_sq)."""


@dataclass(kw_only=True, slots=True)
class Workload:
    """What to drive on the disk, and for how long."""

    kind: str
    """One of `KINDS`."""
    request_bytes: int
    """Bytes per request: a partition (training), a piece (inference), a request (read/write)."""
    file_bytes: int = 0
    """Bytes per file for inference/read/write (0: ``8 x request_bytes``); training's files hold one
    partition each."""
    files: int = 4
    """Swap files per rank (training)."""
    ranks: int = 1
    """Ranks driving the disk at once (training), each with its own handle, slots and files."""
    window: int = 0
    """Requests in flight for inference/read/write (0: inference's 2, or what fills the handle's
    queues, at least 2)."""
    runtime_s: float = 2.0
    """Seconds counted, after the ramp."""
    ramp_s: float = 0.5
    """Seconds run before counting starts (workers started, queues full)."""
    slices: int = 4
    """Equal windows the counted time is split into; their rates give the spread."""
    huge_pages: bool = True
    """Buffers as the engine has them (locked, advised into 2 MiB pages); False: 4 KiB pages, not
    locked, as fio's malloc'd buffers are where transparent huge pages are 'madvise'."""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"Workload.kind: {self.kind!r} is not allowed; use one of {', '.join(KINDS)}")
        for key in ("request_bytes", "files", "ranks", "slices"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Workload.{key}: {value!r} is not allowed; use an integer >= 1")
        if self.request_bytes % 4096:
            raise ValueError(f"Workload.request_bytes: {self.request_bytes} is not a multiple of 4096 (O_DIRECT)")
        if self.file_bytes < 0 or self.file_bytes % self.request_bytes:
            raise ValueError(f"Workload.file_bytes: {self.file_bytes} is not a multiple of request_bytes "
                             f"({self.request_bytes}); round it to one")
        if self.kind == "training" and self.files < 2:
            raise ValueError("Workload.files: training needs at least 2 swap files per rank (one read while "
                             "another is written)")
        if not self.runtime_s > 0 or self.ramp_s < 0:
            raise ValueError(f"Workload.runtime_s {self.runtime_s!r} must be > 0 and ramp_s {self.ramp_s!r} >= 0")

    @property
    def reads(self) -> bool:
        """Whether the workload reads."""
        return self.kind != "write"

    @property
    def writes(self) -> bool:
        """Whether the workload writes."""
        return self.kind in ("training", "write")

    def file_size(self) -> int:
        """Bytes of each file."""
        if self.kind == "training":
            return self.request_bytes
        return self.file_bytes or 8 * self.request_bytes

    def disk_bytes(self) -> int:
        """Bytes of all the files on disk."""
        return self.file_size() * (self.files * self.ranks if self.kind == "training" else 1)

    def buffer_bytes(self, config: AioConfig) -> int:
        """Bytes of memory the buffers take (two slots per rank, or the window's pieces)."""
        if self.kind == "training":
            return 2 * self.request_bytes * self.ranks
        return self.in_flight(config) * self.request_bytes

    def in_flight(self, config: AioConfig) -> int:
        """Requests kept in flight (inference/read/write)."""
        if self.window:
            return self.window
        if self.kind == "inference":
            return INFERENCE_WINDOW
        return max(2, math.ceil(config.block_size * config.queue_depth * config.thread_count / self.request_bytes))

    def to_json(self) -> dict[str, Any]:
        """The settings, for a report."""
        return {"kind": self.kind, "request_bytes": self.request_bytes, "file_bytes": self.file_size(),
                "files": self.files if self.kind == "training" else 1, "ranks": self.ranks if self.kind == "training"
                else 1, "window": self.window, "runtime_s": self.runtime_s, "ramp_s": self.ramp_s,
                "slices": self.slices, "huge_pages": self.huge_pages}


@dataclass(kw_only=True, slots=True)
class WorkloadResult:
    """What a workload moved in its counted time."""

    workload: Workload
    backend: str
    read_bw_bytes: int
    """Bytes read per second over the counted time (0: no reads)."""
    write_bw_bytes: int
    total_samples: list[int]
    """Bytes per second (reads plus writes) in each slice of the counted time."""
    latency_ns: dict[str, dict[str, Any]]
    """Per direction: `latency_percentiles` of each request completed in the counted time."""
    cpu_ms_per_gb: float
    """CPU milliseconds (user + system, the whole process) per GB moved."""
    cpu_share: float
    """The process's CPU time over the counted time: 1.0 is one core busy throughout."""
    elapsed_s: float
    disk: DiskTraffic | None = None
    """What the disk completed in the counted time (None: no block device, e.g. tmpfs)."""
    per_rank: list[dict[str, int]] = field(default_factory=list)
    """Each rank's figures: ``rank``, ``pid`` (its process), ``read_bw_bytes``, ``write_bw_bytes``; they
    sum to the totals."""

    @property
    def total_bw_bytes(self) -> int:
        """Reads plus writes per second: training's figure (they run at once)."""
        return self.read_bw_bytes + self.write_bw_bytes

    @property
    def goal_bw_bytes(self) -> int:
        """The figure a choice goes by: reads alone for inference, reads plus writes otherwise."""
        return self.read_bw_bytes if self.workload.kind == "inference" else self.total_bw_bytes

    @property
    def summary(self) -> Summary:
        """Spread and 95% interval of the slices' rates (of the goal's directions)."""
        samples = self.goal_samples
        return summarize(samples)

    @property
    def goal_samples(self) -> list[int]:
        """The slices' rates, scaled to the goal's share of the total."""
        if not self.total_bw_bytes:
            return self.total_samples
        share = self.goal_bw_bytes / self.total_bw_bytes
        return [round(s * share) for s in self.total_samples]

    def to_json(self) -> dict[str, Any]:
        """The figures in bytes per second and ns, with the slices' spread and 95% interval."""
        summary = self.summary
        return {"workload": self.workload.to_json(), "backend": self.backend, "read_bw_bytes": self.read_bw_bytes,
                "write_bw_bytes": self.write_bw_bytes, "goal_bw_bytes": self.goal_bw_bytes,
                "total_samples": self.total_samples, "spread": round(summary.spread, 4),
                "ci95": [round(summary.low), round(summary.high)], "clat_ns": self.latency_ns,
                "cpu_ms_per_gb": round(self.cpu_ms_per_gb, 2), "cpu_share": round(self.cpu_share, 3),
                "elapsed_s": round(self.elapsed_s, 3), "disk": self.disk.to_json() if self.disk else None,
                "per_rank": self.per_rank}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "WorkloadResult":
        """The result ``to_json`` wrote (a resumed sweep). Raises KeyError, TypeError or ValueError."""
        w = dict(data["workload"])
        workload = Workload(kind=w["kind"], request_bytes=int(w["request_bytes"]),
                            file_bytes=0 if w["kind"] == "training" else int(w["file_bytes"]), files=max(2, int(w["files"]))
                            if w["kind"] == "training" else 4, ranks=int(w["ranks"]), window=int(w["window"]),
                            runtime_s=float(w["runtime_s"]), ramp_s=float(w["ramp_s"]), slices=int(w["slices"]),
                            huge_pages=bool(w["huge_pages"]))
        return cls(workload=workload, backend=str(data["backend"]), read_bw_bytes=int(data["read_bw_bytes"]),
                   write_bw_bytes=int(data["write_bw_bytes"]), total_samples=[int(s) for s in data["total_samples"]],
                   latency_ns=dict(data["clat_ns"]), cpu_ms_per_gb=float(data["cpu_ms_per_gb"]),
                   cpu_share=float(data["cpu_share"]), elapsed_s=float(data["elapsed_s"]),
                   per_rank=[dict(r) for r in data.get("per_rank", [])])


def latency_percentiles(values: list[int]) -> dict[str, Any]:
    """p50, p99 and p99.9 (nearest rank) of ``values`` with their count; a percentile needs enough
    samples to exist (100 for p99, 1000 for p99.9), else it is None and ``max`` is what there is."""
    ordered = sorted(values)
    n = len(ordered)

    def pct(p: float, needed: int) -> int | None:
        if n < needed:
            return None
        return ordered[max(1, math.ceil(round(p / 100 * n, 9))) - 1]  # round: 99.9% of 2000 is 1998

    return {"samples": n, "p50": pct(50, 1), "p99": pct(99, 100), "p99.9": pct(99.9, 1000),
            "max": ordered[-1] if ordered else None, "mean": round(statistics.fmean(ordered), 1) if ordered else None}


def slice_rates(events: list[tuple[int, int]], start: int, end: int, slices: int) -> list[int]:
    """Bytes per second in each of ``slices`` equal windows of [start, end) ns, from (completion ns,
    bytes) events; a request counts in the window it completed in."""
    if end <= start or slices < 1:
        raise ValueError(f"slice_rates: empty interval [{start}, {end}) or slices {slices} < 1")
    width = (end - start) / slices
    moved = [0] * slices
    for at, nbytes in events:
        if start <= at < end:
            moved[min(slices - 1, int((at - start) / width))] += nbytes
    return [round(m * 1e9 / width) for m in moved]


class _Recorder:
    """Completed requests, from every rank's threads: (direction, submitted ns, completed ns, bytes)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.done: list[tuple[str, int, int, int]] = []

    def add(self, rw: str, submitted: int, completed: int, nbytes: int) -> None:
        with self.lock:
            self.done.append((rw, submitted, completed, nbytes))


def measure_workload(config: AioConfig, directory: str | Path, workload: Workload, *,
                     disks: tuple[str, ...] = (), stop: threading.Event | None = None) -> WorkloadResult:
    """Lay out ``workload``'s files in ``directory``, run it for its ramp and runtime, and return what it
    moved in the counted time; ``disks`` (`bench.diskstat.disk_names`) are the disks whose counters are
    read around the counted time. Training with ``ranks`` > 1 runs each rank in its own process
    (`bench._ranks`), as the engine does; one rank, and the other kinds, run in this process. The files
    are removed. Raises TensorIOError from the I/O and MeasurementError for a request that moved the
    wrong number of bytes (or a rank's process that died)."""
    if workload.kind == "training" and workload.ranks > 1:
        from ._ranks import run_rank_processes

        counted = run_rank_processes(config, Path(directory), workload, disks=disks, stop=stop)
    else:
        counted = _run_in_process(config, Path(directory), workload, disks=disks, stop=stop)
    if stop is not None and stop.is_set():
        from .sweep import SweepStopped  # only the sweep sets ``stop``
        raise SweepStopped
    return counted.result(workload, config)


@dataclass(kw_only=True, slots=True)
class Counted:
    """What the ranks did, raw: every request completed, the counted interval, the CPU spent in it."""

    done: list[tuple[int, str, int, int, int]]
    """(rank, direction, submitted ns, completed ns, bytes) of every request, counted or not."""
    pids: list[int]
    """Each rank's process id."""
    backend: str
    start: int
    """perf_counter_ns at the counted time's start and end (CLOCK_MONOTONIC: the same in every process)."""
    end: int
    cpu: float
    """CPU seconds over the counted time, every rank's process together."""
    before: Any = None
    after: Any = None
    disks: tuple[str, ...] = ()

    def result(self, workload: Workload, config: AioConfig) -> WorkloadResult:
        """The figures of the counted time, with each rank's."""
        counted = [e for e in self.done if self.start <= e[3] < self.end]
        seconds = (self.end - self.start) / 1e9
        read = sum(n for _, rw, _, _, n in counted if rw == "read")
        written = sum(n for _, rw, _, _, n in counted if rw == "write")
        per_rank = [{"rank": r, "pid": pid,
                     "read_bw_bytes": round(sum(n for q, rw, _, _, n in counted if q == r and rw == "read") / seconds),
                     "write_bw_bytes": round(sum(n for q, rw, _, _, n in counted if q == r and rw == "write")
                                             / seconds)} for r, pid in enumerate(self.pids)]
        return WorkloadResult(
            workload=workload, backend=self.backend or config.backend,
            read_bw_bytes=round(read / seconds), write_bw_bytes=round(written / seconds),
            total_samples=slice_rates([(done, n) for _, _, _, done, n in counted], self.start, self.end,
                                      workload.slices),
            latency_ns={rw: latency_percentiles([done - sub for _, d, sub, done, _ in counted if d == rw])
                        for rw in ("read", "write") if (rw == "read" and workload.reads) or
                        (rw == "write" and workload.writes)},
            cpu_ms_per_gb=self.cpu * 1e3 / ((read + written) / 1e9) if read + written else 0.0,
            cpu_share=self.cpu / seconds, elapsed_s=seconds, disk=traffic(self.disks, self.before, self.after),
            per_rank=per_rank)


def _run_in_process(config: AioConfig, directory: Path, workload: Workload, *, disks: tuple[str, ...],
                    stop: threading.Event | None) -> Counted:
    """One rank (or an inference / read / write stream) in a thread of this process; the main thread
    keeps the clock and reads the disk's counters."""
    recorder = _Recorder()
    halt = threading.Event()
    errors: list[BaseException] = []
    ready = threading.Barrier(2)
    backends: list[str] = []
    buffer = _buffer(workload.buffer_bytes(config), workload.huge_pages)
    paths = [directory / f"workload-r0-f{i}.dat" for i in range(workload.files if workload.kind == "training" else 1)]

    def rank() -> None:
        try:
            with AioHandle.from_config(config) as handle:
                backends.append(handle.backend_name)
                for path in paths:  # 1. lay the files out (untimed)
                    _layout(handle, buffer, path, workload.file_size())
                ready.wait()  # sync point: the clock starts once the files are laid out
                driver = _train if workload.kind == "training" else _stream
                driver(handle, buffer, paths, workload, config, recorder, halt)
        except threading.BrokenBarrierError:
            pass
        except BaseException as exc:  # handed to the caller below
            errors.append(exc)
            halt.set()
            ready.abort()
        finally:
            for path in paths:
                path.unlink(missing_ok=True)

    thread = threading.Thread(target=rank, name="tensorio-bench-rank0")
    thread.start()
    try:
        ready.wait()
        # 2. Ramp, then count.
        _sleep(workload.ramp_s, halt, stop)
        cpu0, start, before = process_cpu_seconds(), time.perf_counter_ns(), read_counters(disks)
        _sleep(workload.runtime_s, halt, stop)
        cpu1, end, after = process_cpu_seconds(), time.perf_counter_ns(), read_counters(disks)
    except threading.BrokenBarrierError:
        start, end, cpu0, cpu1, before, after = 0, 1, 0.0, 0.0, None, None
    finally:
        halt.set()
        thread.join()
    if errors:
        raise errors[0]
    return Counted(done=[(0, *d) for d in recorder.done], pids=[os.getpid()], backend=backends[0] if backends else "",
                   start=start, end=end, cpu=cpu1 - cpu0, before=before, after=after, disks=disks)


def _sleep(seconds: float, halt: threading.Event, stop: threading.Event | None) -> None:
    """Wait ``seconds``, or less when a rank failed (``halt``) or the caller stops."""
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0 and not halt.is_set() and not (stop and stop.is_set()):
        time.sleep(min(left, 0.05))


def _buffer(nbytes: int, huge_pages: bool) -> torch.Tensor:
    """The engine's kind of buffer (locked, 2 MiB pages advised), or fio's (4 KiB pages, not locked)."""
    if huge_pages:
        return locked_tensor(nbytes)
    region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_NOHUGEPAGE"):
        region.madvise(mmap.MADV_NOHUGEPAGE)
    tensor = torch.frombuffer(region, dtype=torch.uint8)
    tensor.fill_(0x5A)  # touched, as fio fills its buffers before the job
    return tensor


def _layout(handle: AioHandle, buffer: torch.Tensor, path: Path, nbytes: int) -> None:
    """Write ``nbytes`` to ``path`` from ``buffer`` (repeated), so that the timed run overwrites and reads data."""
    piece = min(buffer.numel(), nbytes)
    piece -= piece % 4096
    offset = 0
    while offset < nbytes:
        n = min(piece, nbytes - offset)
        _check(handle.write(buffer[:n], path, offset).result(), n, path, offset)
        offset += n


def _check(moved: int, expected: int, path: Path, offset: int) -> None:
    if moved != expected:
        raise MeasurementError(f"{path}: request at offset {offset} moved {moved} bytes, expected {expected}")


def _submit(handle: AioHandle, rw: str, tensor: torch.Tensor, path: Path, offset: int,
            recorder: _Recorder) -> Callable[[], None]:
    """Submit one request; returns the wait for it, which checks its byte count."""
    submitted = time.perf_counter_ns()
    done: list[int] = []
    stamped = threading.Event()

    def stamp(_future: Any) -> None:  # in the I/O thread that finished it
        done.append(time.perf_counter_ns())
        stamped.set()

    future = (handle.read if rw == "read" else handle.write)(tensor, path, offset)
    future.add_done_callback(stamp)
    nbytes = tensor.numel()

    def wait() -> None:
        moved = future.result()  # raises the request's TensorIOError
        stamped.wait()
        _check(moved, nbytes, path, offset)
        recorder.add(rw, submitted, done[0], nbytes)

    return wait


def _train(handle: AioHandle, buffer: torch.Tensor, paths: list[Path], workload: Workload, config: AioConfig,
           recorder: _Recorder, halt: threading.Event) -> None:
    """The swap pipeline: read partition i+1 into one slot while writing partition i from the other."""
    size = workload.request_bytes
    slots = (buffer[:size], buffer[size:2 * size])
    step = 0
    while not halt.is_set():
        reading, writing = slots[step % 2], slots[(step + 1) % 2]
        i = step % len(paths)
        waits = [_submit(handle, "read", reading, paths[(i + 1) % len(paths)], 0, recorder),
                 _submit(handle, "write", writing, paths[i], 0, recorder)]
        for wait in waits:  # sync point: both slots done before they swap
            wait()
        step += 1


def _stream(handle: AioHandle, buffer: torch.Tensor, paths: list[Path], workload: Workload, config: AioConfig,
            recorder: _Recorder, halt: threading.Event) -> None:
    """Requests in order over one file, cycling, ``in_flight`` at a time, each into its own piece."""
    size, path = workload.request_bytes, paths[0]
    rw = "write" if workload.kind == "write" else "read"
    window = workload.in_flight(config)
    pieces = workload.file_size() // size
    in_flight: list[Callable[[], None]] = []
    index = 0
    while not halt.is_set():
        if len(in_flight) == window:
            in_flight.pop(0)()
        slot = index % window
        in_flight.append(_submit(handle, rw, buffer[slot * size:(slot + 1) * size], path, (index % pieces) * size,
                                 recorder))
        index += 1
    for wait in in_flight:
        wait()


def workload_for(kind: str, *, user_config: dict[str, Any] | None = None, request_bytes: int | None = None,
                 **settings: Any) -> Workload:
    """The workload of ``kind`` ("training" or "inference"), its request size from ``request_bytes``, else
    from the user's config where it says (training: ``zero_optimization.sub_group_size`` x 12 bytes, as
    the optimizer swaps fp32 weights and two moments), else the engine's defaults
    (`TRAINING_PARTITION`, `INFERENCE_REQUEST`). ``settings`` are `Workload`'s other fields. Raises
    ValueError for a bad setting."""
    if request_bytes is None:
        request_bytes = TRAINING_PARTITION if kind == "training" else INFERENCE_REQUEST
        zero = (user_config or {}).get("zero_optimization") or {}
        sub_group = zero.get("sub_group_size") if isinstance(zero, dict) else None
        if kind == "training" and isinstance(sub_group, (int, float)) and 1024 <= sub_group <= 1 << 26:
            request_bytes = -(-int(sub_group) * 12 // (1 << 20)) << 20  # whole MiB: whole blocks
    return Workload(kind=kind, request_bytes=request_bytes, **settings)
