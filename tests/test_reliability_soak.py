"""The soak benchmark runs end to end at a tiny size (issue 14): a few children killed at random
markers and one injected fault, and the result still matches the uninterrupted run bit for bit with
nothing left behind. No timing is asserted; the kills land where the random delays put them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.subprocess, pytest.mark.bench]

REPO = Path(__file__).resolve().parent.parent


def test_soak_tiny(disk_dir):
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.soak", "--minutes", "0", "--kills", "2", "--faults", "1", "--model", "mlp",
         "--steps", "6", "--save-every", "2", "--dir", str(disk_dir)],
        capture_output=True, text=True, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.stdout, done.stderr[-3000:]
    summary = json.loads(done.stdout.splitlines()[-1])
    assert summary["completed"], done.stdout
    assert summary["kills"] >= 2 and summary["faults"] >= 1
    assert summary["loss_mismatches"] == summary["param_mismatches"] == 0, done.stdout
    assert summary["losses_checked"] >= 6
    assert summary["stale_swap_files_never_removed"] == 0
    # a child killed while it removes stale files may remove one without its log line
    assert (summary["stale_swap_files_reclaimed"] + summary["stale_swap_files_removed_unlogged"]
            == summary["stale_swap_files_after_kills"])
    assert summary["leftover_swap_files"] == summary["leftover_staging"] == 0
    assert summary["child_after_drop"] == {"fds": 0, "threads": 0, "vmlck_kb": 0}
    # locked memory right after close() while the optimizer is still referenced: tests/test_reliability_leaks.py
    assert summary["child_after_close"]["fds"] == summary["child_after_close"]["threads"] == 0
    assert summary["parent_fd_growth"] == summary["hangs"] == summary["crashes"] == 0
    assert done.returncode == (0 if summary["ok"] else 1)
    if summary["ok"]:
        assert os.listdir(disk_dir) == []  # the working directory is removed after a clean run
