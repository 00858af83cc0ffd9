"""Room for the benchmark's buffers, checked before they are locked.

A point moves one buffer of ``--size`` bytes out and reads it back into a second: both are locked
in RAM, so a size the memory cannot hold ends in the kernel refusing the allocation (ENOMEM) or the
OOM killer. `check_room` says so first, in one line. The memory this process may take is the
smallest of the kernel's MemAvailable (/proc/meminfo), the room under each memory cgroup limit it is
in (the limit less the usage, inactive page cache not counted: the kernel reclaims it before it
refuses), and the room under the address-space limit (``ulimit -v``). The paths are arguments, so
that tests give a fake /proc and cgroup tree.
"""

from __future__ import annotations

import os
import resource
from dataclasses import dataclass
from pathlib import Path

from ._units import format_bytes

__all__ = ["MARGIN_BYTES", "MemoryRoom", "NotEnoughMemory", "check_room", "memory_room"]

MARGIN_BYTES = 256 << 20
"""Memory the process needs beside the buffers (the I/O handle's staging, Python, torch)."""

_NO_LIMIT = 1 << 60  # cgroup v1 writes "no limit" as the largest page-aligned 63-bit number


class NotEnoughMemory(Exception):
    """The buffers would not fit in the memory this process may take; the message says both sizes."""


@dataclass(frozen=True, slots=True)
class MemoryRoom:
    """Bytes this process may still take, and what limits it (for people: "MemAvailable", "cgroup
    v1 /sys/fs/cgroup/memory/x limit 1.0 GiB", "ulimit -v 4.0 GiB")."""

    available: int
    source: str


def memory_room(*, proc: str | os.PathLike = "/proc", cgroup_root: str | os.PathLike = "/sys/fs/cgroup") -> MemoryRoom:
    """The memory this process may still take (see the module docstring); MemAvailable alone where no
    cgroup or address-space limit is tighter. Raises OSError where ``proc``/meminfo cannot be read."""
    proc, root = Path(proc), Path(cgroup_root)
    room = MemoryRoom(_meminfo(proc / "meminfo"), "MemAvailable in /proc/meminfo")
    for directory, limit, usage, inactive in _cgroups(proc, root):
        if limit < _NO_LIMIT and max(0, limit - max(0, usage - inactive)) < room.available:
            room = MemoryRoom(max(0, limit - max(0, usage - inactive)), f"memory cgroup {directory} limit "
                              f"{format_bytes(limit)}, {format_bytes(max(0, usage - inactive))} in use")
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft != resource.RLIM_INFINITY:
        left = max(0, soft - _vm_size(proc))
        if left < room.available:
            room = MemoryRoom(left, f"ulimit -v {format_bytes(soft)} (address space), {format_bytes(soft - left)} "
                                    f"mapped")
    return room


def check_room(nbytes: int, what: str, room: MemoryRoom | None = None) -> None:
    """Raise `NotEnoughMemory`, one line naming ``what`` (the buffers: "two buffers of 2.0 GiB"), the
    bytes they need and the bytes available, when ``nbytes`` plus `MARGIN_BYTES` do not fit ``room``
    (default: `memory_room()`). Where the figures cannot be read, says nothing: the allocation will."""
    if room is None:
        try:
            room = memory_room()
        except OSError:
            return
    if nbytes + MARGIN_BYTES > room.available:
        raise NotEnoughMemory(f"{what} need {format_bytes(nbytes)} of RAM (plus {format_bytes(MARGIN_BYTES)} for the "
                              f"process) but only {format_bytes(room.available)} is available ({room.source}); "
                              f"use a smaller --size")


def _meminfo(path: Path) -> int:
    with open(path, encoding="ascii") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise OSError(f"{path} has no MemAvailable line (Linux 3.14 or later has it)")


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # "max" (v2): no limit


def _stat(path: Path, key: str) -> int:
    try:
        with open(path, encoding="ascii") as f:
            for line in f:
                name, _, value = line.partition(" ")
                if name == key:
                    return int(value)
    except (OSError, ValueError):
        pass
    return 0


def _cgroups(proc: Path, root: Path) -> list[tuple[Path, int, int, int]]:
    """(directory, limit, usage, inactive page cache) of the memory cgroup this process is in and of
    each ancestor that sets a limit."""
    try:
        lines = (proc / "self" / "cgroup").read_text().splitlines()
    except OSError:
        return []
    found = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(",") and (root / "memory").is_dir():
            mount, files = root / "memory", ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")
        elif controllers == "" and (root / "cgroup.controllers").is_file():
            mount, files = root, ("memory.max", "memory.current", "inactive_file")
        else:
            continue
        relative = Path(path.lstrip("/"))
        if not (mount / relative).is_dir():  # a cgroup namespace: the mount's root is the process's own group
            relative = Path()
        for directory in [mount / relative, *(mount / p for p in relative.parents)]:
            limit, usage = _read_int(directory / files[0]), _read_int(directory / files[1])
            if limit is not None and usage is not None:
                found.append((directory, limit, usage, _stat(directory / "memory.stat", files[2])))
        return found  # the first hierarchy with a memory controller (v1 is listed first on hybrid hosts)
    return found


def _vm_size(proc: Path) -> int:
    try:
        with open(proc / "self" / "status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmSize:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return 0
