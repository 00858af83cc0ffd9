"""What the benchmark scripts share: peak RSS sampling and running a configuration in a child process.

Byte sizes ("128K", "1G") are parsed by the installed tool's ``bench._units.parse_size``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import psutil

#: The clone's root, put on a child's PYTHONPATH so that ``python -m benchmarks.NAME`` imports there.
REPO = Path(__file__).resolve().parent.parent


class RssSampler:
    """This process's resident set size (psutil), sampled by a thread while the ``with`` block runs.

    A sample is taken on entry, every ``interval`` seconds, and on exit; ``peak`` is the highest.
    Peaks shorter than ``interval`` can fall between two samples. ``mark(name, **figures)`` starts a
    phase; ``phases()`` gives each phase's duration and highest sample.
    """

    def __init__(self, interval: float = 0.002) -> None:
        self.interval = interval
        self.samples: list[tuple[float, int]] = []
        """(time.perf_counter(), RSS in bytes) of each sample."""
        self.marks: list[tuple[float, str, dict[str, Any]]] = []
        self._process = psutil.Process()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)

    def __enter__(self) -> "RssSampler":
        self._sample()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()

    def _sample(self) -> None:
        self.samples.append((time.perf_counter(), self._process.memory_info().rss))

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample()

    @property
    def peak(self) -> int:
        """The highest RSS sampled, in bytes."""
        return max(rss for _, rss in self.samples)

    def mark(self, name: str, **figures: Any) -> None:
        """End the current phase and start phase ``name`` now; ``figures`` are reported with it."""
        self.marks.append((time.perf_counter(), name, figures))

    def phases(self) -> list[dict[str, Any]]:
        """Per phase: name, seconds, highest RSS sampled in it (0 if none) and the figures of its mark."""
        rows = []
        for (start, name, figures), (end, *_) in zip(self.marks, self.marks[1:]):  # the last mark only ends
            peak = max((rss for t, rss in self.samples if start <= t < end), default=0)
            rows.append({"phase": name, "seconds": end - start, "peak_rss": peak, **figures})
        return rows


def run_child(module: str, args: Sequence[str], *, mmap_threshold: int | None = None) -> dict[str, Any]:
    """Run ``python -m module *args`` in a fresh interpreter (so that its peak RSS is its own) and
    return the JSON object it printed on its last line of output.

    The child runs in the current directory with the clone on its PYTHONPATH. ``mmap_threshold``
    sets glibc's ``MALLOC_MMAP_THRESHOLD_`` for it (None: glibc's default; a value inherited from
    the environment is dropped either way). Raises RuntimeError, with the end of the child's error
    output, when it fails.
    """
    env = dict(os.environ)
    env.pop("MALLOC_MMAP_THRESHOLD_", None)
    if mmap_threshold is not None:
        env["MALLOC_MMAP_THRESHOLD_"] = str(mmap_threshold)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    command = [sys.executable, "-m", module, *args]
    done = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
    if done.returncode:
        raise RuntimeError(f"{' '.join(command)} failed with exit status {done.returncode}:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])
