"""What the disk itself saw: request counts, sizes and merges from ``/sys/block/<disk>/stat``, and the
device's queue settings.

``block_size`` is what a tool asks for, not what reaches the disk: the block layer merges adjacent
requests (io_uring's 1 MiB reads arrived here as 4 MiB requests, the thread backend's and fio's
mostly as 1 MiB) and splits those above ``max_sectors_kb``. So every comparison with fio records,
for both sides, the deltas of the disk's counters over the run: requests completed, bytes, merges,
and the average request size. The counters are the whole disk's, other processes' I/O included:
on a shared disk that is the *foreign* I/O a measurement cannot exclude, and a reason to compare
side by side. The sysfs root is an argument, so that tests give a fake tree.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .device import device_of

__all__ = ["DiskCounters", "DiskTraffic", "device_facts", "disk_names", "read_counters", "traffic"]

SECTOR = 512


@dataclass(frozen=True, slots=True)
class DiskCounters:
    """The cumulative counters of one or more disks (summed), as the kernel keeps them."""

    reads: int
    read_merges: int
    read_bytes: int
    writes: int
    write_merges: int
    write_bytes: int


@dataclass(frozen=True, slots=True)
class DiskTraffic:
    """Requests the disk completed between two readings of its counters."""

    disks: tuple[str, ...]
    reads: int
    read_bytes: int
    read_merges: int
    writes: int
    write_bytes: int
    write_merges: int

    @property
    def read_request_bytes(self) -> float | None:
        """Average bytes per read request the disk completed (None: no reads)."""
        return self.read_bytes / self.reads if self.reads else None

    @property
    def write_request_bytes(self) -> float | None:
        """Average bytes per write request the disk completed (None: no writes)."""
        return self.write_bytes / self.writes if self.writes else None

    def to_json(self) -> dict[str, Any]:
        """The deltas and the average request sizes, in bytes."""
        def size(value: float | None) -> int | None:
            return None if value is None else round(value)

        return {"disks": list(self.disks), "reads": self.reads, "read_bytes": self.read_bytes,
                "read_merges": self.read_merges, "read_request_bytes": size(self.read_request_bytes),
                "writes": self.writes, "write_bytes": self.write_bytes, "write_merges": self.write_merges,
                "write_request_bytes": size(self.write_request_bytes)}

    def describe(self) -> str:
        """"disk saw reads of 4.0 MiB (1203 merged), writes of 1.0 MiB" for a report line."""
        from ._units import format_bytes

        parts = []
        for rw, count, avg, merges in (("reads", self.reads, self.read_request_bytes, self.read_merges),
                                       ("writes", self.writes, self.write_request_bytes, self.write_merges)):
            if count:
                parts.append(f"{rw} of {format_bytes(avg)} on average ({count} requests, {merges} merged)")
        return f"{'+'.join(self.disks)} saw " + (", ".join(parts) if parts else "no requests")


def disk_names(directory: str | os.PathLike, *, sys_root: str | os.PathLike = "/sys") -> tuple[str, ...]:
    """The disks under ``directory`` that have counters in ``/sys/block`` (empty for tmpfs and the like).
    Raises OSError when the directory cannot be stat'ed."""
    device = device_of(directory, sys_root=sys_root)
    return tuple(sorted(d for d in device.disks if (Path(sys_root) / "block" / d / "stat").is_file()))


def read_counters(disks: Iterable[str], *, sys_root: str | os.PathLike = "/sys") -> DiskCounters | None:
    """The disks' counters summed; None when there are no disks or one cannot be read."""
    disks = list(disks)
    if not disks:
        return None
    total = [0] * 6
    try:
        for disk in disks:
            fields = (Path(sys_root) / "block" / disk / "stat").read_text().split()
            # reads, read merges, read sectors, _, writes, write merges, write sectors
            values = [int(fields[i]) for i in (0, 1, 2, 4, 5, 6)]
            total = [a + b for a, b in zip(total, values)]
    except (OSError, ValueError, IndexError):
        return None
    reads, read_merges, read_sectors, writes, write_merges, write_sectors = total
    return DiskCounters(reads=reads, read_merges=read_merges, read_bytes=read_sectors * SECTOR, writes=writes,
                        write_merges=write_merges, write_bytes=write_sectors * SECTOR)


def traffic(disks: Iterable[str], before: DiskCounters | None, after: DiskCounters | None) -> DiskTraffic | None:
    """What the disks completed between ``before`` and ``after`` (None where either is unknown)."""
    if before is None or after is None:
        return None
    return DiskTraffic(disks=tuple(disks), reads=after.reads - before.reads,
                       read_bytes=after.read_bytes - before.read_bytes,
                       read_merges=after.read_merges - before.read_merges, writes=after.writes - before.writes,
                       write_bytes=after.write_bytes - before.write_bytes,
                       write_merges=after.write_merges - before.write_merges)


def device_facts(disk: str, *, sys_root: str | os.PathLike = "/sys") -> dict[str, Any]:
    """What the system says of ``disk``'s queue: the I/O scheduler in use, rotational, max_sectors_kb
    (the largest request the block layer sends), nr_requests, and the model where the device names one.
    Keys whose file is missing are left out."""
    base = Path(sys_root) / "block" / disk
    facts: dict[str, Any] = {"name": disk}

    def read(path: Path) -> str | None:
        try:
            return path.read_text().strip()
        except OSError:
            return None

    scheduler = read(base / "queue" / "scheduler")
    if scheduler is not None:
        chosen = [word[1:-1] for word in scheduler.split() if word.startswith("[")]
        facts["scheduler"] = chosen[0] if chosen else scheduler
    for key in ("rotational", "max_sectors_kb", "max_hw_sectors_kb", "nr_requests"):
        value = read(base / "queue" / key)
        if value is not None and value.isdigit():
            facts[key] = int(value)
    model = read(base / "device" / "model")
    if model:
        facts["model"] = model
    return facts


def describe_facts(facts: dict[str, Any]) -> str:
    """One line of `device_facts` for a report."""
    parts = [f"{key} {facts[key]}" for key in ("scheduler", "rotational", "max_sectors_kb", "nr_requests", "model")
             if key in facts]
    return f"{facts['name']}: " + (", ".join(parts) if parts else "no queue settings in sysfs")
