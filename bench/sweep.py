"""The sweep: every configuration of a grid measured on each disk, the best ones, and fio beside them.

``Grid.configs`` and ``best_points`` / ``chosen_config`` are pure; ``sweep_directory`` does the I/O
inside a scratch directory that is removed on every exit (Ctrl-C and SIGTERM included).
"""

from __future__ import annotations

import itertools
import json
import statistics
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from tensorio import AioConfig

from ._units import format_size
from .fio import INSTALL_HINT, FioError, FioNotFound, FioResult, fio_path, job_for_config, run_fio
from .measure import Buffers, PointResult, measure_point
from .scratch import scratch_dir
from .validate import Validation

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30

#: The thread backend makes one system call per piece whatever these say, so it is swept once.
_URING_ONLY_KNOBS = ("single_submit", "overlap_events")


@dataclass(frozen=True, slots=True)
class Grid:
    """The values of each aio setting to cross, and the test size that suits them."""

    block_sizes: tuple[int, ...]
    queue_depths: tuple[int, ...]
    thread_counts: tuple[int, ...]
    single_submit: tuple[bool, ...] = (False,)
    overlap_events: tuple[bool, ...] = (True,)
    backends: tuple[str, ...] = ("io_uring", "threads")
    size: int = 256 * MiB
    """Bytes written and read per pass, by default."""

    def configs(self, *, backends: Iterable[str], direct: bool | str = "auto") -> list[AioConfig]:
        """Every configuration of the grid for the ``backends`` that can run, threads deduplicated."""
        usable = [b for b in self.backends if b in set(backends)]
        out: list[AioConfig] = []
        for backend, bs, qd, tc in itertools.product(usable, self.block_sizes, self.queue_depths, self.thread_counts):
            flags = itertools.product(self.single_submit, self.overlap_events) if backend == "io_uring" else [(False, True)]
            out += [AioConfig(block_size=bs, queue_depth=qd, thread_count=tc, single_submit=ss, overlap_events=oe,
                              backend=backend, direct=direct) for ss, oe in flags]
        return out


GRIDS = {
    "quick": Grid(block_sizes=(128 * KiB, MiB), queue_depths=(8, 32), thread_counts=(1, 2), size=128 * MiB),
    "default": Grid(block_sizes=(64 * KiB, 256 * KiB, MiB, 4 * MiB), queue_depths=(4, 16, 64), thread_counts=(1, 2),
                    single_submit=(False, True), overlap_events=(True, False), size=256 * MiB),
    "full": Grid(block_sizes=(16 * KiB, 64 * KiB, 256 * KiB, MiB, 4 * MiB, 8 * MiB),
                 queue_depths=(1, 4, 8, 16, 32, 64, 128), thread_counts=(1, 2, 4, 8),
                 single_submit=(False, True), overlap_events=(True, False), size=GiB),
}


def config_key(config: AioConfig) -> str:
    """A stable key for a configuration, equal for equal settings."""
    return json.dumps(config.to_dict(), sort_keys=True)


def config_label(config: AioConfig) -> str:
    """Short label: "io_uring bs=1M qd=32 t=2" plus the non-default flags."""
    label = f"{config.backend} bs={format_size(config.block_size)} qd={config.queue_depth} t={config.thread_count}"
    if config.backend != "threads":
        label += f" ss={'T' if config.single_submit else 'F'} oe={'T' if config.overlap_events else 'F'}"
    return label


def best_points(points: Sequence[PointResult]) -> dict[str, PointResult]:
    """The point with the highest read, write and round-trip ("both") bandwidth."""
    if not points:
        raise ValueError("no points measured")
    return {
        "read": max(points, key=lambda p: p.read.bw_bytes),
        "write": max(points, key=lambda p: p.write.bw_bytes),
        "both": max(points, key=lambda p: p.both_bw_bytes),
    }


def chosen_config(disks: Sequence[Sequence[PointResult]]) -> AioConfig:
    """The configuration with the highest round-trip bandwidth summed over every disk it ran on.

    With one disk this is that disk's best "both". Raises ValueError when nothing was measured.
    """
    totals: dict[str, float] = {}
    configs: dict[str, AioConfig] = {}
    for points in disks:
        for p in points:
            key = config_key(p.config)
            totals[key] = totals.get(key, 0.0) + p.both_bw_bytes
            configs[key] = p.config
    if not totals:
        raise ValueError("no points measured")
    complete = [k for k in totals if all(any(config_key(p.config) == k for p in d) for d in disks)]
    return configs[max(complete or totals, key=totals.__getitem__)]


@dataclass(kw_only=True, slots=True)
class FioComparison:
    """Our bandwidth next to fio's for one of the best configurations, in one direction."""

    role: str
    """Which best it is: "read", "write" or "both"."""
    rw: str
    config: AioConfig
    ours_bw_bytes: int
    """Ours measured again next to fio (median), not the sweep's figure."""
    ours_cpu_us_per_io: float = 0.0
    """Our CPU microseconds (user + system) per block-sized piece, measured again next to fio."""
    fio_bw_bytes: int | None = None
    """Median of fio's runs, as many as the sweep's repeats."""
    fio_cpu_us_per_io: float | None = None
    """fio's CPU microseconds (its usr_cpu + sys_cpu) per I/O, the median of its runs."""
    fio_bw_bytes_samples: list[int] = field(default_factory=list)
    command: list[str] = field(default_factory=list)
    error: str | None = None

    @property
    def ratio(self) -> float | None:
        """Our GB/s as a fraction of fio's (None when fio did not run)."""
        return self.ours_bw_bytes / self.fio_bw_bytes if self.fio_bw_bytes else None


@dataclass(frozen=True, slots=True)
class FioCurvePoint:
    """fio at one block size and thread count (the grid's deepest queue depth), in one direction: the
    line the chart draws beside ours."""

    rw: str
    block_size: int
    thread_count: int
    queue_depth: int
    bw_bytes: int
    """Median of fio's runs, as many as the sweep's repeats."""
    cpu_us_per_io: float | None = None
    """fio's CPU microseconds (usr_cpu + sys_cpu) per I/O, the median of its runs (None where fio's
    JSON lacks them)."""


@dataclass(kw_only=True, slots=True)
class DiskSweep:
    """Everything measured on one directory."""

    validation: Validation
    points: list[PointResult]
    best: dict[str, PointResult]
    fio: list[FioComparison]
    fio_missing: str | None = None
    """Why there is no fio column (fio not installed), or None."""
    fio_curve: list[FioCurvePoint] = field(default_factory=list)
    """fio at each block size and thread count of the grid (empty without fio)."""


def sweep_directory(validation: Validation, configs: Sequence[AioConfig], buffers: Buffers, *, request_size: int,
                    repeats: int, with_fio: bool = True,
                    on_point: Callable[[str, AioConfig, PointResult | None], None] | None = None) -> DiskSweep:
    """Measure every config in ``validation.directory``, then run fio for the best ones.

    ``on_point(phase, config, result)`` is called with "start" (result None) and "done" around each
    point, for a progress bar. All files live in a scratch directory removed on every exit.
    Raises TensorIOError / MeasurementError from a point (the sweep stops: a disk that fails a
    point is not one to tune) and KeyboardInterrupt when interrupted, after cleaning up.
    """
    points: list[PointResult] = []
    with scratch_dir(validation.directory) as scratch:
        path = scratch / "sweep.dat"
        for config in configs:
            if on_point:
                on_point("start", config, None)
            try:
                result = measure_point(config, path, buffers, request_size=request_size, repeats=repeats,
                                       direct=validation.direct)
            finally:
                path.unlink(missing_ok=True)
            points.append(result)
            if on_point:
                on_point("done", config, result)
        best = best_points(points)
        comparisons, missing = (_compare_with_fio(scratch, best, buffers, request_size, repeats) if with_fio
                                else ([], "skipped (--no-fio)"))
        curve = _fio_curve(scratch, points, buffers.nbytes, repeats) if with_fio and missing is None else []
    return DiskSweep(validation=validation, points=points, best=best, fio=comparisons, fio_missing=missing,
                     fio_curve=curve)


def _fio_curve(scratch: Path, points: Sequence[PointResult], size: int, repeats: int) -> list[FioCurvePoint]:
    """fio at every block size and thread count of the sweep, at its deepest queue depth (fio's best
    case), O_DIRECT as ours had it; empty when fio fails (the comparison above already says why)."""
    depth = max(p.config.queue_depth for p in points)
    direct = all(p.direct for p in points)
    curve: list[FioCurvePoint] = []
    for tc in sorted({p.config.thread_count for p in points}):
        for bs in sorted({p.config.block_size for p in points}):
            config = AioConfig(block_size=bs, queue_depth=depth, thread_count=tc)
            try:
                runs = _fio_runs(config, direct, scratch, size, repeats)
            except (FioError, OSError, ValueError):
                return []
            curve += [FioCurvePoint(rw=rw, block_size=bs, thread_count=tc, queue_depth=depth,
                                    bw_bytes=int(statistics.median(r.bw_bytes for r in runs[rw])),
                                    cpu_us_per_io=_median_or_none([r.cpu_us_per_io for r in runs[rw]]))
                      for rw in ("write", "read")]
    return curve


def _median_or_none(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def _compare_with_fio(scratch: Path, best: dict[str, PointResult], buffers: Buffers, request_size: int,
                      repeats: int) -> tuple[list[FioComparison], str | None]:
    """fio with the settings of each best point, in the direction it is best at ("both": each).

    Ours is measured again right before fio: the best of many noisy points is flattered by its
    selection, a fresh measurement is not. fio follows our protocol (``_fio_runs``); medians.
    """
    if fio_path() is None:
        return [], f"fio is not installed; {INSTALL_HINT}"
    comparisons: list[FioComparison] = []
    measured: dict[str, tuple[PointResult, dict[str, list[FioResult]] | str]] = {}  # fio runs, or its error
    for role, point in best.items():
        key = config_key(point.config)
        if key not in measured:
            path = scratch / "again.dat"
            try:
                again = measure_point(point.config, path, buffers, request_size=request_size, repeats=repeats,
                                      direct=point.direct)
            finally:
                path.unlink(missing_ok=True)
            try:
                measured[key] = again, _fio_runs(point.config, point.direct, scratch, buffers.nbytes, repeats)
            except FioNotFound as exc:
                return [], str(exc)
            except (FioError, OSError) as exc:
                measured[key] = again, str(exc)
        again, runs = measured[key]
        for rw in ("read", "write") if role == "both" else (role,):
            ours = again.read if rw == "read" else again.write
            comparison = FioComparison(role=role, rw=rw, config=point.config, ours_bw_bytes=ours.bw_bytes,
                                       ours_cpu_us_per_io=ours.cpu_us_per_io)
            if isinstance(runs, str):
                comparison.error = runs
            else:
                comparison.fio_bw_bytes_samples = [r.bw_bytes for r in runs[rw]]
                comparison.fio_bw_bytes = int(statistics.median(comparison.fio_bw_bytes_samples))
                comparison.fio_cpu_us_per_io = _median_or_none([r.cpu_us_per_io for r in runs[rw]])
                comparison.command = runs[rw][0].command
            comparisons.append(comparison)
    return comparisons, None


def _fio_runs(config: AioConfig, direct: bool, scratch: Path, size: int, repeats: int) -> dict[str, list[FioResult]]:
    """fio on ``config``'s settings with our protocol: a warm-up write lays one file out, then each
    repeat writes it over and reads it back; O_DIRECT exactly when ours had it (``direct``)."""
    path = scratch / "fio.dat"
    write = replace(job_for_config(config, directory=scratch, rw="write", size=size), direct=direct, overwrite=True)
    read = replace(write, rw="read")
    runs: dict[str, list[FioResult]] = {"write": [], "read": []}
    try:
        run_fio(write, filename=path)  # untimed warm-up
        for _ in range(repeats):
            runs["write"].append(run_fio(write, filename=path))
            runs["read"].append(run_fio(read, filename=path))
    finally:
        path.unlink(missing_ok=True)
    return runs
