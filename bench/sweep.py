"""The sweep: every configuration of a grid measured on each disk, a reference point measured again
through it for the disk's noise, the best ones, the choice, and fio beside them.

``Grid.configs``, ``sweep_plan``, ``best_points`` and ``choose_config`` are pure; ``sweep_directory``
does the I/O inside a scratch directory that is removed on every exit (Ctrl-C and SIGTERM included).
"""

from __future__ import annotations

import itertools
import json
import math
import statistics
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from tensorio import AioConfig

from ._units import format_size
from .choose import Choice, candidates, choose
from .fio import INSTALL_HINT, FioError, FioNotFound, FioResult, fio_path, job_for_config, run_fio
from .measure import Buffers, Measurement, PointResult, measure_point
from .scratch import scratch_dir
from .stats import Noise, disk_noise
from .validate import Validation
from .workload import Workload, measure_workload

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30

REFERENCE_MEASUREMENTS = 5
"""How often the reference point is measured through a sweep (first, last and evenly between)."""


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
    """The point with the highest read, write and round-trip ("both") bandwidth, and with the engine's
    workload measured on every point, the best at it ("workload")."""
    if not points:
        raise ValueError("no points measured")
    return {
        "read": max(points, key=lambda p: p.read.bw_bytes),
        "write": max(points, key=lambda p: p.write.bw_bytes),
        "both": max(points, key=lambda p: p.both_bw_bytes),
        **({"workload": max(points, key=lambda p: p.goal_bw_bytes)} if all(p.workload for p in points) else {}),
    }


def choose_config(disks: Sequence[Sequence[PointResult]], noise: float, cpu_noise: float | None = None) -> Choice:
    """The lightest configuration of those whose round trip, summed over every disk, lies within
    ``noise`` (a fraction: the noisiest disk's) of the best (see `bench.choose`), and why; CPU figures
    within ``cpu_noise`` (at least `bench.choose.CPU_TOLERANCE`) of the lowest count as equally low.

    Only configurations measured on every disk take part. Raises ValueError when nothing was measured.
    """
    return choose(candidates(disks, label=config_label), noise, cpu_noise=cpu_noise)


def reference_config(configs: Sequence[AioConfig]) -> AioConfig:
    """The configuration measured again through the sweep for its noise: the grid's closest to
    AioConfig's defaults (block size, then queue depth, threads and flags; the first backend)."""
    if not configs:
        raise ValueError("no configurations")
    default = AioConfig()
    return min(configs, key=lambda c: (abs(math.log2(c.block_size / default.block_size)),
                                       abs(math.log2(c.queue_depth / default.queue_depth)), c.thread_count,
                                       c.single_submit != default.single_submit,
                                       c.overlap_events != default.overlap_events))


@dataclass(frozen=True, slots=True)
class Step:
    """One measurement of a sweep: a grid point, or the reference point measured again."""

    kind: str
    """"point" or "reference"."""
    config: AioConfig
    slot: int
    """The point's index in the grid, or which of the reference's measurements this is."""

    @property
    def key(self) -> str:
        """Names the step in a saved sweep (a resumed sweep skips the steps it has)."""
        return config_key(self.config) if self.kind == "point" else f"reference {self.slot}"


def sweep_plan(configs: Sequence[AioConfig], *, references: int = REFERENCE_MEASUREMENTS) -> list[Step]:
    """The grid's points in order with the reference point (`reference_config`) measured ``references``
    times among them, evenly: first, last, and between. Raises ValueError for no configs or
    ``references`` below 2 (one measurement shows no drift)."""
    if references < 2:
        raise ValueError(f"references {references}: at least 2 measurements are needed to see the noise")
    reference = reference_config(configs)
    at = [round(i * len(configs) / (references - 1)) for i in range(references)]
    steps: list[Step] = []
    for i in range(len(configs) + 1):
        steps += [Step("reference", reference, slot) for slot, position in enumerate(at) if position == i]
        if i < len(configs):
            steps.append(Step("point", configs[i], i))
    return steps


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
    references: list[PointResult] = field(default_factory=list)
    """The reference point (`reference_config`) each time it was measured, in order."""
    noise: Noise = field(default_factory=lambda: Noise(relative=0.0))
    """How far one configuration's round trip moved on this disk during the sweep (`disk_noise`)."""


def pooled(point: PointResult, again: Sequence[PointResult]) -> PointResult:
    """``point`` with the repeats of its measurements ``again`` (the same configuration: the reference
    point measured through the sweep) added to its own: bandwidth the median of all the passes, CPU per
    I/O the median of the measurements'. Latency percentiles stay ``point``'s (those of different
    measurements do not combine). Raises ValueError for a measurement of another configuration."""
    if any(config_key(p.config) != config_key(point.config) for p in again):
        raise ValueError("pooled: every measurement must be of the point's configuration")
    measured = [point, *again]

    def pool(rw: str) -> Measurement | None:
        own = getattr(point, rw)
        if own is None:
            return None
        samples = [s for p in measured for s in getattr(p, rw).bw_bytes_samples]
        bw = int(statistics.median(samples))
        return replace(own, bw_bytes=bw, iops=own.iops * bw / own.bw_bytes, bw_bytes_samples=samples,
                       cpu_us_per_io=statistics.median(getattr(p, rw).cpu_us_per_io for p in measured))

    return replace(point, write=pool("write"), read=pool("read"))


def sweep_noise(points: Sequence[PointResult], references: Sequence[PointResult]) -> Noise:
    """The disk's noise: the reference's goal figures over the sweep (round trips, or the engine's
    workload where measured), and each point's repeats or workload slices."""
    spreads = [p.goal_summary.spread for p in points if p.workload is not None or len(p.write.bw_bytes_samples) > 1]
    cpu = [r.workload.cpu_ms_per_gb if r.workload is not None else r.cpu_ms_per_gb for r in references]
    return disk_noise([r.goal_bw_bytes for r in references], spreads, cpu)


class SweepStopped(Exception):
    """The caller asked the sweep to stop (``sweep_directory(stop=...)``); raised at the next step or fio run."""


def _check(stop: threading.Event | None) -> None:
    if stop is not None and stop.is_set():
        raise SweepStopped


def sweep_directory(validation: Validation, plan: Sequence[Step], buffers: Buffers, *, request_size: int,
                    repeats: int, with_fio: bool = True, done: Mapping[str, PointResult] | None = None,
                    on_step: Callable[[str, Step, PointResult | None], None] | None = None,
                    stop: threading.Event | None = None, workload: Workload | None = None) -> DiskSweep:
    """Measure every step of ``plan`` (`sweep_plan`) in ``validation.directory``, then run fio for the
    best points.

    Steps whose `Step.key` is in ``done`` (a resumed sweep's) are not measured again. ``on_step(phase,
    step, result)`` is called with "start" (result None) and "done" around each step measured, for a
    progress bar and for saving results as they come, and with "skip" for each step taken from ``done``. All files live in a scratch directory removed on
    every exit. Raises TensorIOError / MeasurementError from a point (the sweep stops: a disk that
    fails a point is not one to tune) and KeyboardInterrupt when interrupted, after cleaning up; and
    `SweepStopped` before the next step or fio run once ``stop`` is set (another thread's way to stop it).
    With ``workload`` each step also drives the engine's traffic (`bench.workload`) after its sequential
    passes, and the choice goes by it (`PointResult.goal_bw_bytes`).
    """
    done = done or {}
    results: dict[str, PointResult] = {}
    with scratch_dir(validation.directory) as scratch:
        path = scratch / "sweep.dat"
        for step in plan:
            if step.key in done:
                results[step.key] = done[step.key]
                if on_step:
                    on_step("skip", step, done[step.key])
                continue
            _check(stop)
            if on_step:
                on_step("start", step, None)
            try:
                result = measure_point(step.config, path, buffers, request_size=request_size, repeats=repeats,
                                       direct=validation.direct)
            finally:
                path.unlink(missing_ok=True)
            if workload is not None:
                result.workload = measure_workload(step.config, scratch, workload, disks=validation.disks, stop=stop)
            results[step.key] = result
            if on_step:
                on_step("done", step, result)
        references = [results[s.key] for s in plan if s.kind == "reference"]
        # The reference configuration was measured again through the sweep: its figure is all of them.
        points = [pooled(results[s.key], references) if references and config_key(s.config) ==
                  config_key(references[0].config) else results[s.key] for s in plan if s.kind == "point"]
        best = best_points(points)
        sequential = {role: p for role, p in best.items() if role != "workload"}  # fio's passes are sequential
        comparisons, missing = (_compare_with_fio(scratch, sequential, buffers, request_size, repeats, stop) if with_fio
                                else ([], "skipped (--no-fio)"))
        curve = _fio_curve(scratch, points, buffers.nbytes, repeats, stop) if with_fio and missing is None else []
    return DiskSweep(validation=validation, points=points, best=best, fio=comparisons, fio_missing=missing,
                     fio_curve=curve, references=references, noise=sweep_noise(points, references))


def _fio_curve(scratch: Path, points: Sequence[PointResult], size: int, repeats: int,
               stop: threading.Event | None = None) -> list[FioCurvePoint]:
    """fio at every block size and thread count of the sweep, at its deepest queue depth (fio's best
    case), O_DIRECT as ours had it; empty when fio fails (the comparison above already says why)."""
    depth = max(p.config.queue_depth for p in points)
    direct = all(p.direct for p in points)
    curve: list[FioCurvePoint] = []
    for tc in sorted({p.config.thread_count for p in points}):
        for bs in sorted({p.config.block_size for p in points}):
            config = AioConfig(block_size=bs, queue_depth=depth, thread_count=tc)
            try:
                runs = _fio_runs(config, direct, scratch, size, repeats, stop)
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
                      repeats: int, stop: threading.Event | None = None) -> tuple[list[FioComparison], str | None]:
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
            _check(stop)
            path = scratch / "again.dat"
            try:
                again = measure_point(point.config, path, buffers, request_size=request_size, repeats=repeats,
                                      direct=point.direct)
            finally:
                path.unlink(missing_ok=True)
            try:
                measured[key] = again, _fio_runs(point.config, point.direct, scratch, buffers.nbytes, repeats, stop)
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


def _fio_runs(config: AioConfig, direct: bool, scratch: Path, size: int, repeats: int,
              stop: threading.Event | None = None) -> dict[str, list[FioResult]]:
    """fio on ``config``'s settings with our protocol: a warm-up write lays one file out, then each
    repeat writes it over and reads it back; O_DIRECT exactly when ours had it (``direct``)."""
    path = scratch / "fio.dat"
    write = replace(job_for_config(config, directory=scratch, rw="write", size=size), direct=direct, overwrite=True)
    read = replace(write, rw="read")
    runs: dict[str, list[FioResult]] = {"write": [], "read": []}
    try:
        run_fio(write, filename=path)  # untimed warm-up
        for _ in range(repeats):
            _check(stop)
            runs["write"].append(run_fio(write, filename=path))
            runs["read"].append(run_fio(read, filename=path))
    finally:
        path.unlink(missing_ok=True)
    return runs
