"""`offload.device.host_memory` and `auto_budget`: the host memory a process may take, from a fake
/proc/meminfo and a fake cgroup tree (v1 and v2), and the "auto" budget's arithmetic."""

from __future__ import annotations

from pathlib import Path

import pytest

from offload.device import AUTO_MARGIN_BYTES, AUTO_MARGIN_SHARE, HostMemory, auto_budget, host_memory

GiB = 1 << 30


def fake_proc(root: Path, *, available: int, total: int = 24 * GiB, cgroup: str = "0::/\n") -> Path:
    """A /proc with meminfo (kB, as the kernel writes it) and self/cgroup."""
    proc = root / "proc"
    (proc / "self").mkdir(parents=True)
    (proc / "meminfo").write_text(f"MemTotal:       {total // 1024} kB\nMemFree:        1000 kB\n"
                                  f"MemAvailable:   {available // 1024} kB\nCached:         500 kB\n")
    (proc / "self" / "cgroup").write_text(cgroup)
    return proc


def v1_group(mount: Path, path: str, *, limit: int, usage: int = 0, inactive: int = 0) -> None:
    directory = mount / "memory" / path.lstrip("/")
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "memory.limit_in_bytes").write_text(f"{limit}\n")
    (directory / "memory.usage_in_bytes").write_text(f"{usage}\n")
    (directory / "memory.stat").write_text(f"cache 0\ninactive_file 0\ntotal_inactive_file {inactive}\n")


V1_UNLIMITED = 9223372036854771712


def test_without_a_cgroup_limit_it_is_mem_available(tmp_path):
    proc = fake_proc(tmp_path, available=20 * GiB)
    memory = host_memory(proc=proc, cgroup_root=tmp_path / "cgroup")
    assert memory == HostMemory(available=20 * GiB, total=24 * GiB, source=memory.source, cgroup_limit=None)
    assert memory.source == "MemAvailable 20.00 GiB (/proc/meminfo)"


def test_a_v1_cgroup_limit_less_its_working_set_bounds_it(tmp_path):
    proc = fake_proc(tmp_path, available=20 * GiB, cgroup="4:memory:/jobs/a\n0::/\n")
    mount = tmp_path / "cgroup"
    v1_group(mount, "/", limit=V1_UNLIMITED, usage=5 * GiB)
    v1_group(mount, "/jobs", limit=V1_UNLIMITED, usage=4 * GiB)
    v1_group(mount, "/jobs/a", limit=11 * GiB, usage=3 * GiB, inactive=GiB)  # 1 GiB of it reclaimable page cache
    memory = host_memory(proc=proc, cgroup_root=mount)
    assert memory.available == 9 * GiB  # 11 - (3 - 1)
    assert memory.total == memory.cgroup_limit == 11 * GiB
    assert memory.source == (f"cgroup v1 {mount / 'memory' / 'jobs' / 'a'}: limit 11.00 GiB - usage 2.00 GiB "
                             f"(1.00 GiB inactive page cache not counted)")


def test_an_ancestors_v1_limit_counts_and_the_tightest_room_wins(tmp_path):
    proc = fake_proc(tmp_path, available=20 * GiB, cgroup="4:memory:/jobs/a\n")
    mount = tmp_path / "cgroup"
    v1_group(mount, "/", limit=V1_UNLIMITED)
    v1_group(mount, "/jobs", limit=8 * GiB, usage=7 * GiB)  # siblings of a use most of it
    v1_group(mount, "/jobs/a", limit=V1_UNLIMITED, usage=GiB)
    memory = host_memory(proc=proc, cgroup_root=mount)
    assert memory.available == GiB and memory.cgroup_limit == 8 * GiB
    assert str(mount / "memory" / "jobs") in memory.source


def test_mem_available_wins_where_it_is_smaller_than_the_cgroups_room(tmp_path):
    proc = fake_proc(tmp_path, available=2 * GiB, cgroup="4:memory:/a\n")
    v1_group(tmp_path / "cgroup", "/a", limit=11 * GiB, usage=GiB)
    memory = host_memory(proc=proc, cgroup_root=tmp_path / "cgroup")
    assert memory.available == 2 * GiB and memory.source.startswith("MemAvailable")
    assert memory.total == 11 * GiB


def test_a_v2_cgroup(tmp_path):
    proc = fake_proc(tmp_path, available=100 * GiB, total=125 * GiB, cgroup="0::/user.slice/run-1.scope\n")
    mount = tmp_path / "cgroup"
    (mount / "user.slice" / "run-1.scope").mkdir(parents=True)
    (mount / "cgroup.controllers").write_text("cpu io memory pids\n")
    for directory, limit, current in ((mount / "user.slice", "max", 30 * GiB),
                                      (mount / "user.slice" / "run-1.scope", str(9 * GiB), 2 * GiB)):
        (directory / "memory.max").write_text(limit + "\n")
        (directory / "memory.current").write_text(f"{current}\n")
        (directory / "memory.stat").write_text(f"anon {current}\ninactive_file {GiB // 2}\n")
    memory = host_memory(proc=proc, cgroup_root=mount)
    assert memory.available == 9 * GiB - (2 * GiB - GiB // 2)
    assert memory.cgroup_limit == 9 * GiB and memory.source.startswith("cgroup v2 ")


def test_a_cgroup_namespace_reads_the_mounts_root(tmp_path):
    """Inside a cgroup namespace /proc/self/cgroup names a path the mount does not have: its root is ours."""
    proc = fake_proc(tmp_path, available=20 * GiB, cgroup="4:memory:/outer/view/of/us\n")
    v1_group(tmp_path / "cgroup", "/", limit=6 * GiB, usage=GiB)
    assert host_memory(proc=proc, cgroup_root=tmp_path / "cgroup").available == 5 * GiB


def test_a_meminfo_without_mem_available_is_refused(tmp_path):
    proc = tmp_path / "proc"
    proc.mkdir()
    (proc / "meminfo").write_text("MemTotal: 1000 kB\n")
    with pytest.raises(OSError, match="MemAvailable.*give the memory budget as a number"):
        host_memory(proc=proc, cgroup_root=tmp_path)


def test_auto_budget_is_available_less_what_is_reserved_less_the_margin():
    memory = HostMemory(available=20 * GiB, total=24 * GiB, source="MemAvailable 20.00 GiB (/proc/meminfo)")
    budget, how = auto_budget(memory, {"ring buffers (2 x 512 MiB)": GiB, "nothing": 0})
    margin = AUTO_MARGIN_BYTES + int(AUTO_MARGIN_SHARE * 20 * GiB)
    assert budget == 20 * GiB - GiB - margin
    assert how == ("\"auto\": 20.00 GiB available (MemAvailable 20.00 GiB (/proc/meminfo)) - ring buffers (2 x 512 MiB) "
                   "1.00 GiB - margin 1.50 GiB (512 MiB + 5%: activations, the process's growth, other processes)")


def test_auto_budget_never_reaches_zero_which_would_mean_stream_everything():
    budget, _ = auto_budget(HostMemory(available=GiB // 2, total=GiB, source="x"), {"ring": GiB})
    assert budget == 1


def test_this_hosts_figures_are_read():
    memory = host_memory()
    assert 0 < memory.available <= memory.total


def test_the_ranks_of_a_node_each_take_their_share(tmp_path, monkeypatch):
    """torchrun's LOCAL_WORLD_SIZE ranks share the node: each is given 1/ranks of what is available and of
    the total, so that the shares sized from them (pools, read-ahead, "auto" budgets) add up to the node
    once; the source says so."""
    proc = fake_proc(tmp_path, available=20 * GiB)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    memory = host_memory(proc=proc, cgroup_root=tmp_path / "cgroup")
    assert (memory.available, memory.total, memory.ranks) == (5 * GiB, 6 * GiB, 4)
    assert memory.source == "this rank's 1/4 (LOCAL_WORLD_SIZE 4) of MemAvailable 20.00 GiB (/proc/meminfo)"
    alone, _ = auto_budget(host_memory(proc=proc, cgroup_root=tmp_path / "cgroup"), {})
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert alone < auto_budget(host_memory(proc=proc, cgroup_root=tmp_path / "cgroup"), {})[0] / 3
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "two")
    with pytest.raises(ValueError, match="LOCAL_WORLD_SIZE: 'two' is not a positive integer"):
        host_memory(proc=proc, cgroup_root=tmp_path / "cgroup")
