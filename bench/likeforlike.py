"""Ours beside fio on the same workload, in the same buffer conditions, with what the disk saw for each.

Three sides, run in turn ``repeats`` times (side by side: a disk whose speed swings within minutes
moves all three alike), medians reported:

1. ``ours``: the engine's buffers (locked, advised into 2 MiB transparent huge pages);
2. ``ours, 4 KiB pages``: the same with buffers as fio's (``--iomem=malloc``: 4 KiB pages where
   transparent huge pages are "madvise", not locked): the like-for-like figure against fio;
3. ``fio`` on the same workload (`bench.fio_mix`).

For each, the disk's average request sizes over the run (`bench.diskstat`): a 1 MiB request whose
buffer lies in 2 MiB pages reaches the disk merged with its neighbours (4 MiB here), one in 4 KiB
pages split into pieces, so buffers alone can move "x fio" far from 1.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from tensorio import AioConfig, AioHandle, locked_tensor

from .fio import FioError
from .fio_mix import FioMixResult, run_fio_workload, workload_files
from .workload import Workload, WorkloadResult, _layout, measure_workload

__all__ = ["SIDES", "SideBySide", "side_by_side", "thp_mode"]

SIDES = ("ours", "ours-4k", "fio")


def thp_mode(path: str = "/sys/kernel/mm/transparent_hugepage/enabled") -> str:
    """The system's transparent huge page mode ("always", "madvise", "never"), or "unknown"."""
    try:
        words = Path(path).read_text().split()
    except OSError:
        return "unknown"
    chosen = [w[1:-1] for w in words if w.startswith("[")]
    return chosen[0] if chosen else "unknown"


@dataclass(kw_only=True, slots=True)
class SideBySide:
    """Each side's runs, in order."""

    config: AioConfig
    workload: Workload
    ours: list[WorkloadResult] = field(default_factory=list)
    ours_4k: list[WorkloadResult] = field(default_factory=list)
    fio: list[FioMixResult] = field(default_factory=list)
    fio_error: str | None = None
    thp: str = "unknown"

    def median(self, side: str) -> float | None:
        """The median goal figure (bytes/s) of a side (`SIDES`); None where it did not run."""
        kind = self.workload.kind
        values = {"ours": [r.goal_bw_bytes for r in self.ours], "ours-4k": [r.goal_bw_bytes for r in self.ours_4k],
                  "fio": [r.goal_bw_bytes(kind) for r in self.fio]}[side]
        return statistics.median(values) if values else None

    def request_bytes(self, side: str) -> dict[str, float | None]:
        """The median average request size the disk saw per direction for a side (None: unknown)."""
        runs = {"ours": self.ours, "ours-4k": self.ours_4k, "fio": self.fio}[side]
        out: dict[str, float | None] = {}
        for rw in ("read", "write"):
            sizes = [getattr(r.disk, f"{rw}_request_bytes") for r in runs if r.disk is not None]
            sizes = [s for s in sizes if s is not None]
            out[rw] = statistics.median(sizes) if sizes else None
        return out

    def to_json(self) -> dict[str, Any]:
        """Every run of every side, the medians and ratios."""
        ratio = {side: (self.median(side) / self.median("fio")) if self.median(side) and self.median("fio") else None
                 for side in ("ours", "ours-4k")}
        return {"aio": self.config.to_dict(), "workload": self.workload.to_json(), "thp": self.thp,
                "fio_buffers": "malloc", "median_bw_bytes": {s: self.median(s) for s in SIDES},
                "ratio_to_fio": ratio, "request_bytes": {s: self.request_bytes(s) for s in SIDES},
                "ours": [r.to_json() for r in self.ours], "ours_4k": [r.to_json() for r in self.ours_4k],
                "fio": [r.to_json() for r in self.fio], "fio_error": self.fio_error}

    def format(self) -> str:
        """Three lines, one per side: the goal figure, the ratio to fio, the disk's request sizes."""
        from ._units import format_bytes

        fio = self.median("fio")
        what = "reads" if self.workload.kind == "inference" else "reads + writes"
        lines = [f"like for like on the {self.workload.kind} workload ({what}; medians of {len(self.ours)} "
                 f"side-by-side runs; transparent huge pages: {self.thp}):"]
        names = {"ours": "ours (engine's buffers, 2 MiB pages)", "ours-4k": "ours, 4 KiB pages (as fio's)",
                 "fio": "fio --iomem=malloc"}
        for side in SIDES:
            value = self.median(side)
            if value is None:
                lines.append(f"  {names[side]:<38} {'not run: ' + (self.fio_error or '') if side == 'fio' else '-'}")
                continue
            ratio = f"{value / fio:5.2f} x fio" if fio and side != "fio" else " " * 10
            sizes = self.request_bytes(side)
            seen = ", ".join(f"{rw} {format_bytes(v)}" for rw, v in sizes.items() if v)
            lines.append(f"  {names[side]:<38} {value / 1e9:5.2f} GB/s {ratio}  disk requests: {seen or 'unknown'}")
        return "\n".join(lines)


def side_by_side(config: AioConfig, directory: Path, workload: Workload, *, repeats: int = 3,
                 disks: tuple[str, ...] = (), with_fio: bool = True) -> SideBySide:
    """Run the three sides (`SIDES`) in turn ``repeats`` times on ``workload`` in ``directory``. fio's
    failure is recorded (``fio_error``), not raised; ours raises TensorIOError / MeasurementError."""
    result = SideBySide(config=config, workload=workload, thp=thp_mode())
    files = workload_files(Path(directory), workload)
    try:
        if with_fio:
            _layout_files(config, files, workload.file_size())
        for _ in range(repeats):
            result.ours.append(measure_workload(config, directory, replace(workload, huge_pages=True), disks=disks))
            result.ours_4k.append(measure_workload(config, directory, replace(workload, huge_pages=False),
                                                   disks=disks))
            if with_fio and result.fio_error is None:
                try:
                    result.fio.append(run_fio_workload(config, workload, files, disks=disks,
                                                       timeout_s=60 + 4 * (workload.ramp_s + workload.runtime_s)))
                except (FioError, OSError, ValueError) as exc:
                    result.fio_error = str(exc).splitlines()[0]
        if not with_fio:
            result.fio_error = "skipped"
    finally:
        for path in (p for rank in files for p in rank):
            path.unlink(missing_ok=True)
    return result


def _layout_files(config: AioConfig, files: list[list[Path]], nbytes: int) -> None:
    """Write fio's files once before it runs, so that the disk's counters around fio see its requests alone."""
    buffer = locked_tensor(min(nbytes, 16 << 20))
    with AioHandle.from_config(replace(config, backend="auto")) as handle:
        for path in (p for rank in files for p in rank):
            _layout(handle, buffer, path, nbytes)
