"""A sweep's measurements saved as they come, so that an interrupted sweep keeps them and ``--resume``
continues it.

The file is the sweep's ``sweep.json`` with ``"complete": false``: the settings, and per directory
the points and the reference measurements taken so far (`bench.report.point_json` records). It is
replaced atomically, at most every `SAVE_EVERY_S` seconds while the sweep runs and at once when it
is interrupted or fails. A finished sweep overwrites it with the whole report (``"complete": true``).
"""

from __future__ import annotations

import json
import os
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .measure import PointResult
from .workload import WorkloadResult
from .report import point_json
from .sweep import Step, config_key

__all__ = ["RESUME_SETTINGS", "SAVE_EVERY_S", "SweepJournal", "load_partial"]

_Entry = tuple[str, int, PointResult]
"""A measured step: its kind ("point", "reference"), slot, and result."""

SAVE_EVERY_S = 10.0
"""Seconds between saves while a sweep runs (each writes every point so far)."""

RESUME_SETTINGS = ("grid", "block_sizes", "queue_depths", "thread_counts", "single_submit", "overlap_events",
                   "backends", "size", "request_size", "repeats", "direct", "references")
"""The settings a resumed sweep must share with the saved one, or its points would not compare."""


class SweepJournal:
    """The measurements of a sweep in progress, per directory, saved to ``path``."""

    def __init__(self, path: Path, settings: dict[str, Any], directories: Sequence[Path],
                 done: Sequence[dict[str, _Entry]] | None = None) -> None:
        self.path = Path(path)
        self.settings = settings
        self.directories = [Path(d).resolve() for d in directories]
        self.disks: list[dict[str, _Entry]] = (
            [dict(d) for d in done] if done else [{} for _ in directories])
        self._lock = threading.Lock()  # disks measured side by side record from their own threads
        self._saved = time.monotonic()

    @property
    def measured(self) -> int:
        """Steps measured so far, over every directory."""
        return sum(len(d) for d in self.disks)

    def done(self, disk: int) -> dict[str, PointResult]:
        """The results of directory number ``disk`` by `Step.key`, for ``sweep_directory(done=...)``."""
        return {key: result for key, (_, _, result) in self.disks[disk].items()}

    def record(self, disk: int, step: Step, result: PointResult) -> None:
        """Keep ``result`` of ``step`` on directory number ``disk``; save when `SAVE_EVERY_S` has passed."""
        with self._lock:
            self.disks[disk][step.key] = (step.kind, step.slot, result)
            due = time.monotonic() - self._saved >= SAVE_EVERY_S
        if due:
            self.save()

    def save(self) -> None:
        """Write the measurements so far, marked incomplete (atomically: an interrupt never leaves half a file)."""
        with self._lock:
            document = {
                "tool": "tensorio-bench sweep",
                "complete": False,
                "timestamp": int(time.time()),
                "settings": self.settings,
                "disks": [{"directory": str(directory),
                           "points": [point_json(r) for kind, _, r in disk.values() if kind == "point"],
                           "reference_points": [{**point_json(r), "slot": slot} for kind, slot, r in disk.values()
                                                if kind == "reference"]}
                          for directory, disk in zip(self.directories, self.disks)],
            }
            self._saved = time.monotonic()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".sweep.", suffix=".tmp", dir=self.path.parent)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(document, f, indent=2)
                f.write("\n")
            os.replace(tmp, self.path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise


def load_partial(path: Path, settings: dict[str, Any],
                 directories: Sequence[Path]) -> list[dict[str, _Entry]]:
    """The measurements of the interrupted sweep saved in ``path``, per directory, for `SweepJournal`.

    Raises ValueError, in one line naming the file and how to go on, when there is none, when it is
    complete, or when its directories or `RESUME_SETTINGS` differ from this sweep's.
    """
    path = Path(path)
    try:
        saved = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ValueError(f"--resume: no sweep to resume in {path}; run without --resume "
                         f"(or give that sweep's --out-dir)") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"--resume: {path} is not valid JSON ({exc}); run without --resume to start again") from None
    if saved.get("complete", True):
        raise ValueError(f"--resume: the sweep in {path} is complete, nothing to resume; run without --resume to "
                         f"sweep again")
    before = saved.get("settings", {})
    for key in RESUME_SETTINGS:
        if before.get(key) != settings.get(key):
            raise ValueError(f"--resume: the sweep in {path} ran with {key} {before.get(key)!r}, this one with "
                             f"{settings.get(key)!r}; give the same options, or run without --resume")
    saved_dirs = [d.get("directory") for d in saved.get("disks", [])]
    wanted = [str(Path(d).resolve()) for d in directories]
    if saved_dirs != wanted:
        raise ValueError(f"--resume: the sweep in {path} measured {', '.join(map(str, saved_dirs))}, this one "
                         f"{', '.join(wanted)}; name the same directories, or run without --resume")
    loaded = []
    try:
        for disk in saved["disks"]:
            results: dict[str, _Entry] = {}
            for record in disk.get("points", []):
                point = _point(record)
                results[config_key(point.config)] = ("point", -1, point)
            for record in disk.get("reference_points", []):
                point = _point(record)
                step = Step("reference", point.config, int(record["slot"]))
                results[step.key] = ("reference", step.slot, point)
            loaded.append(results)
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"--resume: {path} holds a record that cannot be read ({exc}); run without --resume") from None
    return loaded


def _point(record: dict[str, Any]) -> PointResult:
    """A saved point, with the engine's workload where the sweep measured it."""
    point = PointResult.from_json(record)
    if record.get("workload"):
        point.workload = WorkloadResult.from_json(record["workload"])
    return point
