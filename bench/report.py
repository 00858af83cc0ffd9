"""Sweep results as JSON and CSV files and as text tables: each point with its spread and 95% interval,
the disk's noise, the configurations tied with the best and the choice among them."""

from __future__ import annotations

import csv
import json
import os
import platform
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ._units import format_ns, format_size
from .choose import Choice
from .measure import PointResult
from .stats import Noise, Summary
from .sweep import DiskSweep, config_key, config_label

CSV_FIELDS = [
    "directory", "filesystem", "backend", "block_size", "queue_depth", "thread_count", "single_submit",
    "overlap_events", "direct", "write_bw_bytes", "write_iops", "write_clat_ns_p50", "write_clat_ns_p99",
    "read_bw_bytes", "read_iops", "read_clat_ns_p50", "read_clat_ns_p99", "both_bw_bytes",
    "write_cpu_us_per_io", "read_cpu_us_per_io", "both_ci95_low", "both_ci95_high", "both_spread", "cpu_ms_per_gb",
    "tied", "workload", "workload_read_bw_bytes", "workload_write_bw_bytes", "workload_spread",
]

BUFFERED_NOTE = ("buffered I/O (no O_DIRECT here): the page cache absorbs writes and serves reads, so these "
                 "figures are RAM speed, not the disk's")


def point_json(point: PointResult, *, tied: bool | None = None) -> dict[str, Any]:
    """One point in fio's field names: the aio section it ran with, then "write" and "read" (each with
    its repeats' spread and 95% interval), the round trip's ("both"), CPU per GB, and whether it is
    tied with the best (``tied``, where a choice was made)."""
    record: dict[str, Any] = {
        "aio": point.config.to_dict(),
        "backend": point.backend,
        "direct": point.direct,
        "write": point.write.to_json() if point.write else None,
        "read": point.read.to_json() if point.read else None,
    }
    if point.write and point.read:
        both = point.both_summary
        record.update(both_bw_bytes=round(point.both_bw_bytes), both_spread=round(both.spread, 4),
                      both_ci95=[round(both.low), round(both.high)])
    record["cpu_ms_per_gb"] = round(point.cpu_ms_per_gb, 2)
    if point.workload is not None:
        record["workload"] = point.workload.to_json()
    if tied is not None:
        record["tied"] = tied
    return record


def noise_json(noise: Noise) -> dict[str, Any]:
    """A disk's noise: the fraction, the reference's round trips over the sweep (their range and the 95%
    bound on two measurements' difference), the repeats' spread, and the CPU's."""
    def fraction(value: float | None) -> float | None:
        return None if value is None else round(value, 4)

    return {"relative": round(noise.relative, 4), "reference_bw_bytes": [round(v) for v in noise.reference],
            "reference_spread": fraction(noise.reference_spread),
            "reference_difference": fraction(noise.reference_difference),
            "repeat_spread": fraction(noise.repeat_spread), "cpu": fraction(noise.cpu)}


def choice_json(choice: Choice) -> dict[str, Any]:
    """The choice: the chosen and the best configuration, the noise, every tied one, and the reason."""
    return {"aio": choice.config.to_dict(), "reason": choice.reason, "noise": round(choice.noise, 4),
            "cpu_noise": None if choice.cpu_noise is None else round(choice.cpu_noise, 4),
            "best": {"aio": choice.best.config.to_dict(), "both_bw_bytes": round(choice.best.bw_bytes)},
            "tied": [{"aio": c.config.to_dict(), "both_bw_bytes": round(c.bw_bytes),
                      "cpu_ms_per_gb": None if c.cpu_ms_per_gb is None else round(c.cpu_ms_per_gb, 2)}
                     for c in choice.tied]}


def sweep_json(disks: Sequence[DiskSweep], settings: dict[str, Any], choice: Choice) -> dict[str, Any]:
    """The whole sweep as one JSON document (``"complete": true``; `bench.journal` writes the partial one)."""
    tied = {config_key(c.config) for c in choice.tied}
    return {
        "tool": "tensorio-bench sweep",
        "complete": True,
        "timestamp": int(time.time()),
        "host": {"hostname": platform.node(), "kernel": platform.release(), "cpus": os.cpu_count()},
        "settings": settings,
        "disks": [
            {
                "directory": str(Path(d.validation.directory).resolve()),
                "filesystem": d.validation.filesystem,
                "devices": d.validation.devices,
                "direct": d.validation.direct,
                "note": None if d.validation.direct else BUFFERED_NOTE,
                "noise": noise_json(d.noise),
                "reference_points": [{**point_json(r), "slot": i} for i, r in enumerate(d.references)],
                "points": [point_json(p, tied=config_key(p.config) in tied) for p in d.points],
                "best": {role: point_json(p) for role, p in d.best.items()},
                "fio": [
                    {"role": c.role, "rw": c.rw, "aio": c.config.to_dict(), "ours_bw_bytes": c.ours_bw_bytes,
                     "fio_bw_bytes": c.fio_bw_bytes, "fio_bw_bytes_samples": c.fio_bw_bytes_samples,
                     "ratio": None if c.ratio is None else round(c.ratio, 3),
                     "ours_cpu_us_per_io": round(c.ours_cpu_us_per_io, 3),
                     "fio_cpu_us_per_io": None if c.fio_cpu_us_per_io is None else round(c.fio_cpu_us_per_io, 3),
                     "fio_command": c.command, "error": c.error}
                    for c in d.fio
                ],
                "fio_missing": d.fio_missing,
                "fio_by_block_size": [{"rw": f.rw, "block_size": f.block_size, "thread_count": f.thread_count,
                                       "queue_depth": f.queue_depth, "bw_bytes": f.bw_bytes,
                                       "cpu_us_per_io": None if f.cpu_us_per_io is None else round(f.cpu_us_per_io, 3)}
                                      for f in d.fio_curve],
            }
            for d in disks
        ],
        "choice": choice_json(choice),
        **({"together": together_json(disks, choice)} if len(disks) > 1 else {}),
        "chosen": {"aio": choice.config.to_dict()},
    }


def write_json(path: Path, document: dict[str, Any]) -> None:
    """Write ``document`` as indented JSON."""
    path.write_text(json.dumps(document, indent=2) + "\n", encoding="utf-8")


def write_csv(path: Path, disks: Sequence[DiskSweep], choice: Choice) -> None:
    """One row per point and disk, bandwidths in bytes/s and latencies in ns; ``tied`` with the best."""
    tied = {config_key(c.config) for c in choice.tied}
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_FIELDS)
        writer.writeheader()
        for d in disks:
            for p in d.points:
                c = p.config
                writer.writerow({
                    "directory": str(Path(d.validation.directory).resolve()), "filesystem": d.validation.filesystem,
                    "backend": p.backend, "block_size": c.block_size, "queue_depth": c.queue_depth,
                    "thread_count": c.thread_count, "single_submit": c.single_submit,
                    "overlap_events": c.overlap_events, "direct": p.direct,
                    "write_bw_bytes": p.write.bw_bytes, "write_iops": round(p.write.iops, 1),
                    "write_clat_ns_p50": p.write.clat_ns_p50, "write_clat_ns_p99": p.write.clat_ns_p99,
                    "read_bw_bytes": p.read.bw_bytes, "read_iops": round(p.read.iops, 1),
                    "read_clat_ns_p50": p.read.clat_ns_p50, "read_clat_ns_p99": p.read.clat_ns_p99,
                    "both_bw_bytes": round(p.both_bw_bytes),
                    "write_cpu_us_per_io": round(p.write.cpu_us_per_io, 3),
                    "read_cpu_us_per_io": round(p.read.cpu_us_per_io, 3),
                    "both_ci95_low": round(p.both_summary.low), "both_ci95_high": round(p.both_summary.high),
                    "both_spread": round(p.both_summary.spread, 4), "cpu_ms_per_gb": round(p.cpu_ms_per_gb, 2),
                    "tied": config_key(c) in tied,
                    **_workload_columns(p),
                })


def _workload_columns(p: PointResult) -> dict[str, Any]:
    w = p.workload
    if w is None:
        return {}
    return {"workload": w.workload.kind, "workload_read_bw_bytes": w.read_bw_bytes,
            "workload_write_bw_bytes": w.write_bw_bytes, "workload_spread": round(w.summary.spread, 4)}


def format_point(point: PointResult) -> str:
    """Both directions of one point, one line each: GB/s with the repeats' 95% interval and spread,
    IOPS, request latency percentiles and CPU per I/O."""
    lines = []
    for m in point.measurements():
        lines.append(f"{m.rw:<5} {m.gb_per_s:6.2f} GB/s ({_interval(m.summary)})  {m.iops:7.0f} IOPS "
                     f"({format_size(point.config.block_size)})  clat p50 {format_ns(m.clat_ns_p50)}, "
                     f"p99 {format_ns(m.clat_ns_p99)} (per {format_size(m.request_bytes)} request, "
                     f"{m.clat_samples} timed{': p99 is their maximum' if m.clat_samples < 100 else ''}), "
                     f"CPU {m.cpu_us_per_io:.1f} us per I/O")
    return "\n".join(lines)


def _interval(summary: Summary) -> str:
    if summary.n < 2:
        return "1 repeat: no spread"
    return (f"95% CI {summary.low / 1e9:.2f}-{summary.high / 1e9:.2f}, {summary.n} repeats "
            f"{summary.spread:.0%} apart")


def format_table(points: Sequence[PointResult], limit: int | None = None, choice: Choice | None = None) -> str:
    """Points sorted by the goal (the round trip, or the engine's workload where measured), best first,
    as an aligned table: the round trip's 95% interval and the repeats' spread beside it, the workload's
    figure and the spread of its slices where measured, and with ``choice`` a mark: "=" tied with the
    best, "chosen" the choice."""
    rows = sorted(points, key=lambda p: p.goal_bw_bytes, reverse=True)[:limit]
    kind = points[0].workload.workload.kind if points and points[0].workload is not None else None
    tied = {config_key(c.config) for c in choice.tied} if choice else set()
    chosen = config_key(choice.config) if choice else None
    header = (f"{'backend':<9}{'block':>6}{'qd':>5}{'thr':>4}{'ss':>3}{'oe':>3}"
              f"{'write GB/s':>12}{'read GB/s':>11}{'both GB/s':>11}{'95% CI':>12}{'spread':>7}"
              f"{'write p99':>11}{'read p99':>10}" + (f"{kind[:5] + ' GB/s':>12}{'spread':>7}" if kind else "")
              + "  tie")
    lines = [header, "-" * len(header)]
    for p in rows:
        c = p.config
        flags = ("T" if c.single_submit else "F", "T" if c.overlap_events else "F") if p.backend == "io_uring" else ("-", "-")
        both = p.both_summary
        key = config_key(c)
        mark = "chosen" if key == chosen else "=" if key in tied else ""
        lines.append(f"{p.backend:<9}{format_size(c.block_size):>6}{c.queue_depth:>5}{c.thread_count:>4}"
                     f"{flags[0]:>3}{flags[1]:>3}{p.write.gb_per_s:>12.2f}{p.read.gb_per_s:>11.2f}"
                     f"{p.both_bw_bytes / 1e9:>11.2f}{f'{both.low / 1e9:.2f}-{both.high / 1e9:.2f}':>12}"
                     f"{both.spread:>7.0%}{format_ns(p.write.clat_ns_p99):>11}{format_ns(p.read.clat_ns_p99):>10}"
                     + (f"{p.goal_bw_bytes / 1e9:>12.2f}{p.goal_summary.spread:>7.0%}" if p.workload is not None else "")
                     + f"  {mark}".rstrip())
    return "\n".join(lines)


def format_noise(disk: DiskSweep) -> str:
    """The disk's noise in one line, naming the reference point."""
    reference = config_label(disk.references[0].config) if disk.references else "the reference point"
    return disk.noise.describe(reference)


def _per_disk(disks: Sequence[DiskSweep], config: Any) -> list[float]:
    """The round trip of ``config`` on each disk."""
    key = config_key(config)
    return [next(p.both_bw_bytes for p in d.points if config_key(p.config) == key) for d in disks]


def together_json(disks: Sequence[DiskSweep], choice: Choice) -> dict[str, Any]:
    """Directories measured at once: the chosen and the best configuration's round trip on each, and the sum."""
    return {role: {"aio": c.config.to_dict(), "both_bw_bytes": [round(f) for f in _per_disk(disks, c.config)],
                   "sum_bw_bytes": round(c.bw_bytes)}
            for role, c in (("chosen", choice.chosen), ("best", choice.best))}


def format_together(disks: Sequence[DiskSweep], choice: Choice) -> str:
    """Directories measured at once: the round trip of the chosen (and the best) configuration on each,
    and their sum."""
    lines = [f"all {len(disks)} directories at once (each step started on every one together), round trip:"]
    shown = [("chosen", choice.chosen)] + ([("best sum", choice.best)] if choice.best is not choice.chosen else [])
    for role, c in shown:
        figures = _per_disk(disks, c.config)
        lines.append(f"  {role:<9}{c.name:<38} " + " + ".join(f"{f / 1e9:.2f}" for f in figures)
                     + f" = {sum(figures) / 1e9:.2f} GB/s")
    return "\n".join(lines)


NOISY = 0.25
"""Noise above which the report says the sweep cannot rank the configurations."""


def format_choice(choice: Choice, disks: int = 1, goal: str = "round trip") -> str:
    """How many configurations are tied with the best ``goal`` figure ("round trip", or the workload's)
    and which was chosen, and why; a note when the noise is above `NOISY`."""
    lines = [choice.reason]
    if len(choice.tied) > 1:
        over = ", summed over the disks" if disks > 1 else ""
        lines.insert(0, f"{len(choice.tied)} configurations lie within the noise ({choice.noise:.0%}) of the best "
                        f"{goal} ({choice.best.bw_bytes / 1e9:.2f} GB/s{over}): tied, marked in the table")
    if choice.noise > NOISY:
        lines.append(f"note: figures {choice.noise:.0%} apart cannot rank configurations; sweep again when the disk "
                     f"is quiet, or with a larger --size and more --repeats")
    return "\n".join(lines)


def format_best(disk: DiskSweep) -> str:
    """The best configuration for reading, writing and both, and fio's figures beside them."""
    b = disk.best
    lines = [
        f"best read : {config_label(b['read'].config):<40} {b['read'].read.gb_per_s:.2f} GB/s",
        f"best write: {config_label(b['write'].config):<40} {b['write'].write.gb_per_s:.2f} GB/s",
        f"best both : {config_label(b['both'].config):<40} write {b['both'].write.gb_per_s:.2f}, "
        f"read {b['both'].read.gb_per_s:.2f}, round trip {b['both'].both_bw_bytes / 1e9:.2f} GB/s",
    ]
    if "workload" in b:
        lines.append(f"best {b['workload'].workload.workload.kind}: {config_label(b['workload'].config):<36} "
                     f"{format_workload(b['workload'].workload)}; its sequential round trip "
                     f"{b['workload'].both_bw_bytes / 1e9:.2f} GB/s")
    if disk.fio_missing:
        lines.append(f"fio column missing: {disk.fio_missing}")
    if disk.fio:
        lines.append("ours vs fio, same disk and settings (ours measured again beside fio; medians):")
    for c in disk.fio:
        head = f"  best {c.role:<5} {c.rw:<5} {config_label(c.config):<38} ours {c.ours_bw_bytes / 1e9:5.2f} GB/s"
        if c.ratio is not None:
            lines.append(f"{head}, fio {c.fio_bw_bytes / 1e9:5.2f} GB/s -> {c.ratio:.2f} of fio")
        else:
            lines.append(f"{head}, fio failed: {c.error.splitlines()[0] if c.error else 'no result'}")
    if disk.fio_curve:
        lines.append(format_block_table(disk))
    if not disk.validation.direct:
        lines.append(f"note: {BUFFERED_NOTE}")
    return "\n".join(lines)


def format_workload(result: Any) -> str:
    """The engine's workload in one line: reads and writes per second, latency percentiles with their
    sample counts (a percentile the samples cannot give is left out, the maximum named instead), CPU."""
    parts = []
    for rw, bw in (("reads", result.read_bw_bytes), ("writes", result.write_bw_bytes)):
        lat = result.latency_ns.get(rw[:-1])
        if not lat:
            continue
        shown = [f"{name} {format_ns(lat[name])}" for name in ("p50", "p99", "p99.9") if lat.get(name) is not None]
        if lat.get("p99") is None and lat.get("max") is not None:
            shown.append(f"max {format_ns(lat['max'])} (too few for p99)")
        parts.append(f"{rw} {bw / 1e9:.2f} GB/s (per {format_size(result.workload.request_bytes)} request: "
                     f"{', '.join(shown)}; {lat['samples']} timed)")
    line = (", ".join(parts) + f", CPU {result.cpu_ms_per_gb:.0f} ms/GB = {result.cpu_share:.0%} of a core, "
            f"{result.summary.spread:.0%} spread over {len(result.total_samples)} slices")
    if len(result.per_rank) > 1:  # one process per rank: each one's reads + writes, and their sum
        ranks = " + ".join(f"rank {r['rank']} (pid {r['pid']}) {(r['read_bw_bytes'] + r['write_bw_bytes']) / 1e9:.2f}"
                           for r in result.per_rank)
        line += f"; {ranks} = {result.total_bw_bytes / 1e9:.2f} GB/s"
    return line


def format_block_table(disk: DiskSweep) -> str:
    """Ours and fio side by side at each block size and thread count fio ran (the grid's deepest queue
    depth): our best point there in each direction, fio's figure, the ratio, and the CPU microseconds
    per I/O of each."""
    header = (f"  {'block':>6} {'thr':>3} {'op':<5} {'ours GB/s':>9} {'fio GB/s':>9} {'x fio':>6}"
              f" {'CPU us/IO ours':>15} {'fio':>6}  ours")
    lines = [f"at each block size, ours (best there) vs fio, queue depth {disk.fio_curve[0].queue_depth}:", header]
    for f in disk.fio_curve:
        same = [p for p in disk.points if (p.config.block_size, p.config.thread_count, p.config.queue_depth)
                == (f.block_size, f.thread_count, f.queue_depth)]
        if not same:
            continue
        ours = max((p for p in same), key=lambda p: getattr(p, f.rw).bw_bytes)
        m = getattr(ours, f.rw)
        ratio = f"{m.bw_bytes / f.bw_bytes:6.2f}" if f.bw_bytes else f"{'-':>6}"
        fio_cpu = f"{f.cpu_us_per_io:6.1f}" if f.cpu_us_per_io is not None else f"{'-':>6}"
        lines.append(f"  {format_size(f.block_size):>6} {f.thread_count:>3} {f.rw:<5} {m.gb_per_s:9.2f}"
                     f" {f.bw_bytes / 1e9:9.2f} {ratio} {m.cpu_us_per_io:15.1f} {fio_cpu}  {config_label(ours.config)}")
    return "\n".join(lines)
