"""Sweep results as JSON and CSV files, as text tables, and as the `aio` config section to paste."""

from __future__ import annotations

import csv
import json
import os
import platform
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tensorio import AioConfig

from ._units import format_ns, format_size
from .measure import PointResult
from .sweep import DiskSweep, config_label

CSV_FIELDS = [
    "directory", "filesystem", "backend", "block_size", "queue_depth", "thread_count", "single_submit",
    "overlap_events", "direct", "write_bw_bytes", "write_iops", "write_clat_ns_p50", "write_clat_ns_p99",
    "read_bw_bytes", "read_iops", "read_clat_ns_p50", "read_clat_ns_p99", "both_bw_bytes",
    "write_cpu_us_per_io", "read_cpu_us_per_io",
]

BUFFERED_NOTE = ("buffered I/O (no O_DIRECT here): the page cache absorbs writes and serves reads, so these "
                 "figures are RAM speed, not the disk's")


def point_json(point: PointResult) -> dict[str, Any]:
    """One point in fio's field names: the aio section it ran with, then "write" and "read"."""
    return {
        "aio": point.config.to_dict(),
        "backend": point.backend,
        "direct": point.direct,
        "write": point.write.to_json(),
        "read": point.read.to_json(),
        "both_bw_bytes": round(point.both_bw_bytes),
    }


def sweep_json(disks: Sequence[DiskSweep], settings: dict[str, Any], chosen: AioConfig) -> dict[str, Any]:
    """The whole sweep as one JSON document."""
    return {
        "tool": "tensorio-bench sweep",
        "timestamp": int(time.time()),
        "host": {"hostname": platform.node(), "kernel": platform.release(), "cpus": os.cpu_count()},
        "settings": settings,
        "disks": [
            {
                "directory": str(Path(d.validation.directory).resolve()),
                "filesystem": d.validation.filesystem,
                "direct": d.validation.direct,
                "note": None if d.validation.direct else BUFFERED_NOTE,
                "points": [point_json(p) for p in d.points],
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
        "chosen": {"aio": chosen.to_dict()},
    }


def write_json(path: Path, document: dict[str, Any]) -> None:
    """Write ``document`` as indented JSON."""
    path.write_text(json.dumps(document, indent=2) + "\n", encoding="utf-8")


def write_csv(path: Path, disks: Sequence[DiskSweep]) -> None:
    """One row per point and disk, bandwidths in bytes/s and latencies in ns."""
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
                })


def write_aio_config(path: Path, config: AioConfig) -> None:
    """Write ``{"aio": {...}}`` with exactly the keys and types ``AioConfig.from_file`` reads."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"aio": config.to_dict()}, indent=2) + "\n", encoding="utf-8")


def format_point(point: PointResult) -> str:
    """Both directions of one point, one line each: GB/s, IOPS and request latency percentiles."""
    lines = []
    for m in point.measurements():
        lines.append(f"{m.rw:<5} {m.gb_per_s:6.2f} GB/s  {m.iops:9.0f} IOPS ({format_size(point.config.block_size)})"
                     f"  clat p50 {format_ns(m.clat_ns_p50)}, p99 {format_ns(m.clat_ns_p99)}"
                     f" (per {format_size(m.request_bytes)} request), CPU {m.cpu_us_per_io:.1f} us per I/O")
    return "\n".join(lines)


def format_table(points: Sequence[PointResult], limit: int | None = None) -> str:
    """Points sorted by round-trip bandwidth, best first, as an aligned table."""
    rows = sorted(points, key=lambda p: p.both_bw_bytes, reverse=True)[:limit]
    header = (f"{'backend':<9}{'block':>6}{'qd':>5}{'thr':>4}{'ss':>3}{'oe':>3}"
              f"{'write GB/s':>12}{'read GB/s':>11}{'both GB/s':>11}{'write p99':>11}{'read p99':>10}")
    lines = [header, "-" * len(header)]
    for p in rows:
        c = p.config
        flags = ("T" if c.single_submit else "F", "T" if c.overlap_events else "F") if p.backend == "io_uring" else ("-", "-")
        lines.append(f"{p.backend:<9}{format_size(c.block_size):>6}{c.queue_depth:>5}{c.thread_count:>4}"
                     f"{flags[0]:>3}{flags[1]:>3}{p.write.gb_per_s:>12.2f}{p.read.gb_per_s:>11.2f}"
                     f"{p.both_bw_bytes / 1e9:>11.2f}{format_ns(p.write.clat_ns_p99):>11}"
                     f"{format_ns(p.read.clat_ns_p99):>10}")
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
