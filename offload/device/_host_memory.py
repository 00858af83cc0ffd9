"""`host_memory`: the host memory this process may still take now, and where that figure comes from.

The smaller of the kernel's MemAvailable (/proc/meminfo) and, for each memory cgroup the process is
in that sets a limit (its own and its ancestors'), that limit less the cgroup's usage, the usage
without its inactive page cache (``inactive_file``, which the kernel reclaims before it fails a
charge: the working set, as Kubernetes counts it). cgroup v1 is read under ``<root>/memory`` (limit
``memory.limit_in_bytes``, usage ``memory.usage_in_bytes``, ``total_inactive_file``), v2 under
``<root>`` itself (``memory.max``, ``memory.current``, ``inactive_file``). The paths are arguments,
so that tests give a fake /proc/meminfo and a fake cgroup tree.

With several ranks of one job on the node (``LOCAL_WORLD_SIZE``), both figures are this rank's share:
1/ranks of the node's, so that every share the engine sizes from them (its I/O pool, read-ahead, kept
gradients, optimizer buffers, "auto" budgets) adds up to the node once, not once per rank.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

__all__ = ["AUTO_MARGIN_BYTES", "AUTO_MARGIN_SHARE", "HostMemory", "auto_budget", "host_memory", "local_ranks"]

_UNLIMITED = 1 << 60
"""cgroup v1 writes "no limit" as the largest page-aligned 63-bit number; anything above this is none."""


@dataclass(frozen=True, slots=True)
class HostMemory:
    """What `host_memory` found: bytes this process may still take, and the figures behind them."""

    available: int
    """Bytes the process may take now: the smallest of MemAvailable and each limiting cgroup's room."""
    total: int
    """The memory the process may ever hold: MemTotal, or the tightest cgroup limit where smaller."""
    source: str
    """Where ``available`` comes from, for people: "MemAvailable 21.40 GiB (/proc/meminfo)" or
    "cgroup v1 /sys/fs/cgroup/memory/x: limit 11.00 GiB - usage 1.20 GiB (0.30 GiB inactive page
    cache not counted)"."""
    cgroup_limit: int | None = None
    """The tightest cgroup limit found, in bytes; None where no cgroup limits the process."""
    ranks: int = 1
    """The ranks on this node sharing its memory (`local_ranks`): ``available`` and ``total`` are this
    rank's share, 1/``ranks`` of the node's, so that the ranks never claim the same memory twice."""


def _gib(nbytes: int) -> str:
    return f"{nbytes / (1 << 30):.2f} GiB"


def _meminfo(path: Path) -> dict[str, int]:
    figures = {}
    with open(path) as f:
        for line in f:
            key, _, rest = line.partition(":")
            parts = rest.split()
            if parts and parts[0].isdigit():
                figures[key] = int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
    return figures


def _read_int(path: Path) -> int | None:
    """The number in a cgroup file; None for "max", a missing file, or one that cannot be read."""
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _stat(path: Path, key: str) -> int:
    try:
        with open(path) as f:
            for line in f:
                name, _, value = line.partition(" ")
                if name == key:
                    return int(value)
    except OSError:
        pass
    return 0


def _cgroup_dirs(proc: Path, root: Path) -> list[tuple[str, Path]]:
    """(version, directory) of the memory cgroup the process is in and each ancestor, innermost first."""
    try:
        lines = (proc / "self" / "cgroup").read_text().splitlines()
    except OSError:
        return []
    found: list[tuple[str, Path, str]] = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(",") and (root / "memory").is_dir():
            found.append(("v1", root / "memory", path))
        elif controllers == "" and (root / "cgroup.controllers").is_file():
            found.append(("v2", root, path))
    dirs = []
    for version, mount, path in sorted(found)[:1]:  # "v1" first: on a hybrid host the memory controller is there
        relative = Path(path.lstrip("/"))
        if not (mount / relative).is_dir():  # a cgroup namespace: the mount's root is the process's own cgroup
            relative = Path()
        for part in [relative, *relative.parents]:
            dirs.append((version, mount / part))
    return dirs


def host_memory(*, proc: str | os.PathLike = "/proc", cgroup_root: str | os.PathLike = "/sys/fs/cgroup") -> HostMemory:
    """The host memory this process may take now (see the module docstring). ``proc`` and
    ``cgroup_root`` are where /proc and the cgroup mounts are (tests give fake ones). Raises OSError
    where ``proc``/meminfo cannot be read or has no MemAvailable (Linux 3.14+)."""
    proc, root = Path(proc), Path(cgroup_root)
    meminfo = _meminfo(proc / "meminfo")
    if "MemAvailable" not in meminfo:
        raise OSError(f"{proc / 'meminfo'} has no MemAvailable line (Linux 3.14 or later has it); give the memory "
                      f"budget as a number instead of \"auto\"")
    available, total = meminfo["MemAvailable"], meminfo.get("MemTotal", meminfo["MemAvailable"])
    source = f"MemAvailable {_gib(available)} (/proc/meminfo)"
    tightest = None
    for version, directory in _cgroup_dirs(proc, root):
        if version == "v1":
            limit, usage = _read_int(directory / "memory.limit_in_bytes"), _read_int(directory / "memory.usage_in_bytes")
            inactive = _stat(directory / "memory.stat", "total_inactive_file")
        else:
            limit, usage = _read_int(directory / "memory.max"), _read_int(directory / "memory.current")
            inactive = _stat(directory / "memory.stat", "inactive_file")
        if limit is None or limit >= _UNLIMITED or usage is None:
            continue
        working = max(0, usage - inactive)
        room = max(0, limit - working)
        tightest = limit if tightest is None else min(tightest, limit)
        if room < available:
            available = room
            source = (f"cgroup {version} {directory}: limit {_gib(limit)} - usage {_gib(working)}"
                      + (f" ({_gib(inactive)} inactive page cache not counted)" if inactive else ""))
    total = min(total, tightest) if tightest else total
    ranks = local_ranks()
    if ranks > 1:  # the node's memory is shared by its ranks: each takes its share, never the whole
        available, total = available // ranks, total // ranks
        source = f"this rank's 1/{ranks} (LOCAL_WORLD_SIZE {ranks}) of {source}"
    return HostMemory(available=available, total=total, source=source, cgroup_limit=tightest, ranks=ranks)


def local_ranks() -> int:
    """The processes of this job on this node that share its memory: ``LOCAL_WORLD_SIZE`` (torchrun,
    DeepSpeed's launcher and Accelerate set it), else 1. Raises ValueError naming it when it is not a
    positive integer."""
    value = os.environ.get("LOCAL_WORLD_SIZE", "1").strip() or "1"
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"LOCAL_WORLD_SIZE: {value!r} is not a positive integer (the ranks on this node)")
    return int(value)


AUTO_MARGIN_BYTES = 512 << 20
"""The fixed part of "auto"'s margin: the process's own growth (allocator slack, generate's tensors,
thread stacks) that no plan counts."""

AUTO_MARGIN_SHARE = 0.05
"""The part of "auto"'s margin that grows with the memory found: activations and what other processes
on the host take after the figure was read."""


def auto_budget(memory: HostMemory, reserved: dict[str, int] | None = None, *,
                margin_bytes: int = AUTO_MARGIN_BYTES) -> tuple[int, str]:
    """(bytes, how they were found) of an "auto" budget: ``memory.available`` less ``reserved`` (what the
    caller will also take beside the budget, by name: {"ring buffers": n}) less the margin of
    ``margin_bytes`` (default `AUTO_MARGIN_BYTES`; a caller that reserves its own estimates gives less) +
    `AUTO_MARGIN_SHARE` of the available memory. At least 1 byte (0 would mean "stream everything" to a
    DeepSpeed config): a budget too small for what must stay is then refused by the plan, which names these
    figures."""
    reserved = {name: nbytes for name, nbytes in (reserved or {}).items() if nbytes}
    margin = margin_bytes + int(AUTO_MARGIN_SHARE * memory.available)
    budget = memory.available - sum(reserved.values()) - margin
    parts = "".join(f" - {name} {_gib(nbytes)}" for name, nbytes in reserved.items())
    how = (f"\"auto\": {_gib(memory.available)} available ({memory.source}){parts} - margin {_gib(margin)} "
           f"({margin_bytes >> 20} MiB + {AUTO_MARGIN_SHARE:.0%}: "
           + ("activations, " if margin_bytes >= AUTO_MARGIN_BYTES else "")
           + "the process's growth, other processes)")
    return max(1, budget), how
