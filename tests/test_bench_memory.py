"""Memory checked before the benchmark's buffers are locked (bench/memory.py): where the figure comes from
(MemAvailable, a memory cgroup's limit, ulimit -v), and one line instead of an ENOMEM traceback."""

from __future__ import annotations

import resource
import subprocess
import sys
from pathlib import Path

import pytest

import bench.measure
import bench.memory
from bench.cli import main
from bench.memory import MARGIN_BYTES, MemoryRoom, NotEnoughMemory, check_room, memory_room

GiB = 1 << 30
REPO = Path(__file__).resolve().parents[1]


def _fake_proc(tmp_path: Path, available_kib: int, cgroup_line: str) -> Path:
    proc = tmp_path / "proc"
    (proc / "self").mkdir(parents=True)
    (proc / "meminfo").write_text(f"MemTotal:       32000000 kB\nMemAvailable:   {available_kib} kB\n")
    (proc / "self" / "cgroup").write_text(cgroup_line + "\n")
    return proc


def test_without_a_cgroup_limit_the_room_is_memavailable(tmp_path):
    proc = _fake_proc(tmp_path, 8 * 1024 * 1024, "0::/")
    room = memory_room(proc=proc, cgroup_root=tmp_path / "no-cgroups")
    assert room == MemoryRoom(8 * GiB, "MemAvailable in /proc/meminfo")


def test_a_cgroup_v1_limit_below_memavailable_is_the_room_inactive_page_cache_not_counted(tmp_path):
    proc = _fake_proc(tmp_path, 20 * 1024 * 1024, "4:memory:/jobs/me")
    group = tmp_path / "cg" / "memory" / "jobs" / "me"
    group.mkdir(parents=True)
    (group / "memory.limit_in_bytes").write_text(str(2 * GiB))
    (group / "memory.usage_in_bytes").write_text(str(GiB))
    (group / "memory.stat").write_text(f"total_inactive_file {GiB // 2}\n")
    (tmp_path / "cg" / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712")  # the root: no limit
    (tmp_path / "cg" / "memory" / "memory.usage_in_bytes").write_text(str(5 * GiB))
    room = memory_room(proc=proc, cgroup_root=tmp_path / "cg")
    assert room.available == 2 * GiB - GiB // 2
    assert room.source == f"memory cgroup {group} limit 2.0 GiB, 512.0 MiB in use"


def test_a_cgroup_v2_parent_limit_counts(tmp_path):
    proc = _fake_proc(tmp_path, 20 * 1024 * 1024, "0::/a/b")
    root = tmp_path / "cg"
    (root / "a" / "b").mkdir(parents=True)
    (root / "cgroup.controllers").write_text("memory cpu\n")
    (root / "a" / "b" / "memory.max").write_text("max\n")
    (root / "a" / "b" / "memory.current").write_text(str(GiB))
    (root / "a" / "memory.max").write_text(str(3 * GiB))
    (root / "a" / "memory.current").write_text(str(2 * GiB))
    assert memory_room(proc=proc, cgroup_root=root).available == GiB


def test_check_room_names_the_buffers_their_size_and_what_is_available():
    check_room(GiB, "two buffers", MemoryRoom(GiB + MARGIN_BYTES, "MemAvailable"))
    with pytest.raises(NotEnoughMemory) as raised:
        check_room(4 * GiB, "two buffers of 2G", MemoryRoom(3 * GiB, "memory cgroup /x limit 3.0 GiB"))
    assert str(raised.value) == ("two buffers of 2G need 4.0 GiB of RAM (plus 256.0 MiB for the process) but only "
                                 "3.0 GiB is available (memory cgroup /x limit 3.0 GiB); use a smaller --size")


def test_run_refuses_before_locking_a_buffer(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(bench.memory, "memory_room", lambda: MemoryRoom(GiB, "MemAvailable in /proc/meminfo"))

    def no_buffers(*args, **kwargs):
        raise AssertionError("buffers allocated before the memory check")

    monkeypatch.setattr(bench.measure, "Buffers", no_buffers)
    assert main(["run", str(tmp_path), "--size", "2G", "--request-size", "16M"]) == 1
    err = capsys.readouterr().err
    assert err == ("tensorio-bench run: error: two buffers of 2G (written, then read back into the second) need "
                   "4.0 GiB of RAM (plus 256.0 MiB for the process) but only 1.0 GiB is available (MemAvailable in "
                   "/proc/meminfo); use a smaller --size\n")
    assert list(tmp_path.iterdir()) == []


def test_an_allocation_the_check_could_not_foresee_is_one_line_too(tmp_path, capsys, monkeypatch):
    def enomem(size):
        raise OSError(12, "Cannot allocate memory")

    monkeypatch.setattr(bench.measure, "Buffers", enomem)
    assert main(["run", str(tmp_path), "--size", "4M", "--request-size", "1M"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("tensorio-bench run: error: two buffers of 4M (written, then read back into the second) "
                          "could not be allocated (Cannot allocate memory; ")
    assert "available); use a smaller --size" in err and "Traceback" not in err and err.count("\n") == 1


@pytest.mark.subprocess
def test_run_under_an_address_space_limit_says_so_in_one_line(tmp_path):
    """The user's way in: the command line, under `ulimit -v` set to what the interpreter and torch need
    plus 1 GiB, asked for two buffers of 2 GiB."""
    probe = subprocess.run([sys.executable, "-c", "import bench.cli, torch, tensorio; "
                            "print(open('/proc/self/status').read().split('VmPeak:')[1].split()[0])"],
                           cwd=REPO, capture_output=True, text=True, check=True)
    limit = int(probe.stdout) * 1024 + GiB
    done = subprocess.run([sys.executable, "-m", "bench.cli", "run", str(tmp_path), "--size", "2G"], cwd=REPO,
                          capture_output=True, text=True, timeout=300,
                          preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_AS, (limit, limit)))
    assert done.returncode == 1, done.stderr
    error = done.stderr.strip().splitlines()[-1]
    assert error.startswith("tensorio-bench run: error: two buffers of 2G (written, then read back into the second) "
                            "need 4.0 GiB of RAM") and "(ulimit -v" in error
    assert "Traceback" not in done.stderr and list(tmp_path.iterdir()) == []


@pytest.mark.subprocess
def test_run_in_a_memory_cgroup_too_small_for_its_buffers_says_so_in_one_line(tmp_path):
    """The issue's case: `run --size 2G` under a 1.5 GiB memory limit ended in an ENOMEM traceback."""
    from benchmarks._cgroup import MemoryCgroup

    group = MemoryCgroup.create("tensorio-bench-test")
    if isinstance(group, str):
        pytest.skip(f"no memory cgroup here: {group}")
    try:
        group.set_limit(3 * GiB // 2)
        done = subprocess.run([sys.executable, "-m", "bench.cli", "run", str(tmp_path), "--size", "2G"], cwd=REPO,
                              capture_output=True, text=True, timeout=300, preexec_fn=group.enter)
    finally:
        group.close()
    assert done.returncode == 1, done.stderr
    error = done.stderr.strip().splitlines()[-1]
    assert error.startswith("tensorio-bench run: error: two buffers of 2G (written, then read back into the second) "
                            "need 4.0 GiB of RAM") and f"(memory cgroup {group.path} limit 1.5 GiB" in error
    assert "Traceback" not in done.stderr and list(tmp_path.iterdir()) == []
