"""The GPU machine's one command (scripts/gpu_check.sh, benchmarks/gpu/check.py) end to end at a tiny size
on the simulated device, without fio (its inference part, ``python -m benchmarks.gpu infer`` at a tiny size,
checked here); its refusals and skips; and the disk floor it falls back on."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import bench.fio
from benchmarks.disk_floor import disk_rates
from benchmarks.gpu import _report, check
from offload.device import cuda_available
from tensorio import AioConfig

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.bench
@pytest.mark.subprocess
@pytest.mark.simulated
@pytest.mark.skipif(cuda_available(), reason="CUDA is available: pytest -m gpu would run the whole GPU tier")
def test_the_check_runs_end_to_end_at_a_tiny_size_without_fio(tmp_path):
    out, tools = tmp_path / "out", tmp_path / "bin"
    tools.mkdir()
    for tool in ("bash", "dirname", "git"):  # what the script uses, and not fio
        (tools / tool).symlink_to(shutil.which(tool))
    env = {**os.environ, "PYTHON": sys.executable, "PATH": str(tools)}
    done = subprocess.run([str(tools / "bash"), str(REPO / "scripts" / "gpu_check.sh"), str(out), "--tiny",
                           "--tests", "tests/test_device_seam.py"], env=env, capture_output=True, text=True,
                          check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = (out / "summary.md").read_text()
    # The checks said what was missing and what stood in for it.
    assert "# GPU check: no GPU (CUDA not available); the simulated device stood in (--tiny)" in summary
    assert "- fio: not installed; the disk's floors come from a tensorio sequential write/read" in summary
    # Each part ran under its limit and left its log; pytest's counts are in the table.
    for part, log in (("pytest", "pytest-gpu.log"), ("train", "train.log"), ("profile", "profile.log"),
                      ("infer", "infer.log")):
        assert f"| {part} | passed" in summary and (out / log).stat().st_size > 0
    assert "| pytest | passed: 0 passed, 0 failed, 0 errors, 1 skipped |" in summary
    assert "not fio: fio is not installed" in (out / "train.log").read_text()  # the benchmark said so too
    assert "Training (benchmarks.gpu.train, tensorio disk floor" in summary and "| custom |" in summary
    assert "Generation (benchmarks.gpu infer, disk read" in summary and "by tensorio" in summary
    # The inference part at its tiny size: all three tiers in use, the device within its budget.
    runs = json.loads((out / "infer.json").read_text())["runs"]
    assert "accelerate" not in runs  # no Accelerate GPU run without a GPU
    ours = runs["ours"]
    assert "error" not in ours, ours.get("error")
    assert ours["s_per_token"] > 0 and ours["device_reserved_bytes"] <= 1536 << 10
    assert ours["h2d_bytes_per_token"] > 0 and ours["nvme_bytes_per_token"] > 0
    infer_log = (out / "infer.log").read_text()
    assert "device: budget 1.5 MiB (max_memory[0])" in infer_log and "per token: nvme->host" in infer_log
    assert "not judged: the simulated device's times are not GPU figures" in infer_log
    # Every GPU target is listed, none judged on the simulated device.
    assert "- pytest -m gpu passes whole: not judged, none ran (1 skipped: no CUDA)" in summary
    assert "- train step <= 1.2x its bound, custom:" in summary and "(disk floor from tensorio, not fio): not judged" \
        in summary
    assert "- memory flat over 100 training steps: not measured by this check" in summary
    assert "none of the figures above is a GPU's" in summary
    assert not (out / "work").exists()  # the default work directory (swap files, checkpoint) is removed
    # Issue 51: each GPU target listed with its verdict; on the simulated device none is judged.
    lines = summary.splitlines()
    for name in _report.TARGETS:
        line = next((x for x in lines if x.startswith(f"- {name} (")), None)
        assert line is not None, f"{name} missing from summary.md"
        assert re.search(r": (met|not met|not measured)( \(.*\))?$", line), line
        assert line.endswith(")") and ": not measured (" in line, line
    # The breakdowns: side by side per token, per training step, at equal memory (no cgroup at this size).
    assert "Generation with each side's default, per token (benchmarks.gpu profile, simulated" in summary
    assert "| per token (ms) | ours | transformers |" in summary and "| synchronisations (count) |" in summary
    assert "| per step (s) | custom |" in summary and "| NVMe read waits (training thread) |" in summary
    assert "| ours |" in summary and "page cache unbounded" in summary
    # The small tables: present, each with rows beyond its header; no raw trace kept.
    for name in ("profile-ours.md", "profile-transformers.md", "generation-breakdown.md", "train-custom.md",
                 "train-breakdown.md"):
        rows = [x for x in (out / name).read_text().splitlines() if x.startswith("| ") and not x.startswith("|---")]
        assert len(rows) >= 3, f"{name}: {rows}"
    assert "| aten::" in (out / "profile-ours.md").read_text() and "| aten::" in (out / "train-custom.md").read_text()
    assert not [p for p in out.iterdir() if p.suffix in (".json", ".gz") and "trace" in p.name]
    profile = json.loads((out / "profile.json").read_text())
    assert profile["sides"]["ours"]["breakdown"]["syncs"] > 0  # counted by the simulated device


def test_without_write_access_to_the_work_directory_the_benchmarks_are_skipped_saying_why(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    code = check.main([str(tmp_path / "out"), "--dir", str(blocker / "work"), "--parts", "train,infer", "--tiny"])
    assert code == 1
    summary = (tmp_path / "out" / "summary.md").read_text()
    assert f"- write access to the work directory: {blocker / 'work'}: Not a directory; the benchmarks" in summary
    assert "| train | skipped (no write access to the work directory) | 0 | - |" in summary
    assert "| infer | skipped (no write access to the work directory) | 0 | - |" in summary


def test_an_unwritable_outdir_is_refused_naming_it(tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    assert check.main([str(blocker / "out"), "--parts", "train"]) == 2
    assert f"cannot write to OUTDIR {blocker / 'out'}" in capsys.readouterr().err


def test_an_unknown_part_is_refused(tmp_path):
    with pytest.raises(SystemExit):
        check.main([str(tmp_path), "--parts", "train,bogus"])


def test_the_script_names_what_the_interpreter_lacks(tmp_path):
    done = subprocess.run(["bash", str(REPO / "scripts" / "gpu_check.sh"), str(tmp_path)],
                          env={**os.environ, "PYTHON": "/usr/bin/env"}, capture_output=True, text=True, check=False)
    assert done.returncode == 2 and "set PYTHON to the interpreter that has torch" in done.stderr
    assert not any(tmp_path.iterdir())


def test_disk_floor_falls_back_to_tensorio_without_fio(tmp_path, monkeypatch):
    monkeypatch.setattr(bench.fio, "fio_path", lambda: None)
    rates = disk_rates(AioConfig(block_size=1 << 20, queue_depth=4), tmp_path, 4 << 20)
    assert rates.source == "tensorio" and rates.read_bps > 0 and rates.write_bps > 0
    assert rates.fio_missing.startswith("fio is not installed")
    assert "a tensorio sequential write/read of the same size, not fio: fio is not installed" in rates.describe()
    assert list(tmp_path.iterdir()) == []  # its file removed


@pytest.mark.fio
def test_disk_floor_is_fios_where_fio_runs(tmp_path):
    rates = disk_rates(AioConfig(block_size=1 << 20, queue_depth=4), tmp_path, 4 << 20)
    assert rates.source == "fio" and rates.fio_missing is None and rates.read_bps > 0 and rates.write_bps > 0
    assert rates.describe().startswith("disk (fio): read ")
    assert list(tmp_path.iterdir()) == []
