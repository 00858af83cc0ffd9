"""Which device a directory's files land on, so that two directories on one disk are not taken for two disks.

A directory's file system names a device number (``st_dev``); ``/sys/dev/block/MAJOR:MINOR`` leads
to it. A partition counts as its whole disk, and a device-mapper or md device (LVM, RAID, dm-crypt)
as the disks below it (its ``slaves/``, followed down), so two logical volumes on one disk share
it. A file system with no block device (tmpfs, overlayfs over another, NFS) is its own device. The
sysfs root is an argument, so that tests give a fake tree.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Device", "device_of", "shared_devices"]


@dataclass(frozen=True, slots=True)
class Device:
    """The disks a directory's I/O reaches."""

    name: str
    """How people call it: "vda", "nvme0n1", "dm-0 (on nvme0n1, nvme1n1)", or "tmpfs 0:27"."""
    disks: frozenset[str]
    """The physical disks (``vda``), or the file system's device number where there is no disk."""


def device_of(directory: str | os.PathLike, *, sys_root: str | os.PathLike = "/sys") -> Device:
    """The `Device` under ``directory``. Raises OSError when the directory cannot be stat'ed."""
    st = os.stat(directory)
    number = f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}"
    node = Path(sys_root) / "dev" / "block" / number
    if not node.exists():
        return Device(name=f"no block device, file system {number}", disks=frozenset({f"fs {number}"}))
    top = _whole_disk(node.resolve())
    disks = frozenset(_leaves(top))
    below = f" (on {', '.join(sorted(disks))})" if disks != {top.name} else ""
    return Device(name=top.name + below, disks=disks)


def shared_devices(directories: list[Path], *, sys_root: str | os.PathLike = "/sys") -> list[tuple[Path, Path, str]]:
    """Each pair of ``directories`` whose I/O reaches a common disk, with the disk(s) they share:
    [(a, b, "vda")]. Raises OSError for a directory that cannot be stat'ed."""
    devices = [device_of(d, sys_root=sys_root) for d in directories]
    pairs = []
    for i, (a, da) in enumerate(zip(directories, devices)):
        for b, db in zip(directories[i + 1:], devices[i + 1:]):
            common = da.disks & db.disks
            if common:
                pairs.append((a, b, ", ".join(sorted(common))))
    return pairs


def _whole_disk(node: Path) -> Path:
    """A partition's disk (its parent in sysfs), or the node itself."""
    return node.parent if (node / "partition").exists() else node


def _leaves(node: Path, depth: int = 0) -> list[str]:
    """The disks at the bottom of ``node``'s stack (itself when nothing lies below)."""
    slaves = node / "slaves"
    below = sorted(slaves.iterdir()) if slaves.is_dir() and depth < 8 else []
    if not below:
        return [node.name]
    return [leaf for s in below for leaf in _leaves(_whole_disk(s.resolve()), depth + 1)]
