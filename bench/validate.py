"""`tensorio-bench validate`: what works for swap files in a directory, and why not.

Each check is one line: directory (exists, writable), file system, O_DIRECT, free space, io_uring,
memlock, CUDA and fio. Only the directory and free-space checks can fail: a directory on tmpfs,
without O_DIRECT or without io_uring still holds swap files (buffered, or with the thread
backend), and the report says what that costs.
"""

from __future__ import annotations

import errno
import os
import resource
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import tensorio

from ._units import format_bytes
from .fio import INSTALL_HINT, fio_path

OK, INFO, WARN, FAIL = "ok", "info", "warn", "FAIL"

#: Room a swap directory needs at the very least (one block of the largest default size).
MIN_FREE_BYTES = 8 << 20

#: Headroom kept on top of a requested size, so a benchmark never fills a disk to the last byte.
HEADROOM = 0.10

_NETWORK_FS = frozenset({"nfs", "cifs", "fuse", "overlayfs"})
_CAP_IPC_LOCK = 14


@dataclass(frozen=True, slots=True)
class Check:
    """One line of the report: what was checked, ok/info/warn/FAIL, and what it means."""

    name: str
    status: str
    detail: str


@dataclass(slots=True)
class Validation:
    """All checks on one directory, with the facts the benchmarks need from them."""

    directory: Path
    checks: list[Check] = field(default_factory=list)
    filesystem: str = "unknown"
    direct: bool = False
    """O_DIRECT works here (tmpfs and ramfs count as not: they are memory)."""
    io_uring: bool = False
    free_bytes: int = 0
    devices: list[dict] = field(default_factory=list)
    """The queue settings of each disk under the directory (`bench.diskstat.device_facts`); empty for
    tmpfs and other file systems without a block device."""

    @property
    def disks(self) -> tuple[str, ...]:
        """The names of the disks under the directory (``vda``), whose counters `bench.diskstat` reads."""
        return tuple(f["name"] for f in self.devices)

    @property
    def usable(self) -> bool:
        """The directory can hold swap files (no check failed)."""
        return all(c.status != FAIL for c in self.checks)

    def failures(self) -> list[Check]:
        """The checks that failed."""
        return [c for c in self.checks if c.status == FAIL]

    def format(self) -> str:
        """The report as aligned lines, ending with a verdict."""
        lines = [f"  {c.name:<12} {c.status:<5} {c.detail}" for c in self.checks]
        if self.usable:
            how = ", ".join(filter(None, [self.filesystem, "O_DIRECT" if self.direct else "buffered I/O only",
                                          "io_uring" if self.io_uring else "thread backend"]))
            lines.append(f"verdict: {self.directory} can hold swap files ({how})")
        else:
            lines.append(f"verdict: {self.directory} cannot hold swap files: {self.failures()[0].detail}")
        return "\n".join(lines)


def validate_directory(directory: str | os.PathLike, *, need_bytes: int = 0) -> Validation:
    """Check ``directory`` for swap files; ``need_bytes`` is the room a benchmark will use there.

    Never raises for a bad directory: a missing, unwritable or full one is a FAIL check. Writes
    and removes two small probe files.
    """
    v = Validation(directory=Path(directory))
    if _check_directory(v):
        _check_filesystem(v)
        _check_free_space(v, need_bytes)
        _check_device(v)
    v.checks.append(_check_io_uring(v))
    v.checks.append(_check_memlock())
    v.checks.append(_check_cuda())
    v.checks.append(_check_fio())
    return v


def _check_directory(v: Validation) -> bool:
    d = v.directory
    try:
        d.stat()
    except PermissionError:  # a parent directory this user may not search
        v.checks.append(Check("directory", FAIL, f"permission denied: {d} (a directory on its path may not be "
                                                 f"searched by this user); check the owner and permissions"))
        return False
    except FileNotFoundError:
        v.checks.append(Check("directory", FAIL, f"{d} does not exist; create it with `mkdir -p {d}`"))
        return False
    if not d.is_dir():
        v.checks.append(Check("directory", FAIL, f"{d} is not a directory; pass the directory to hold swap files"))
        return False
    try:
        fd, probe = tempfile.mkstemp(prefix=".tensorio-validate-", dir=d)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        hint = "the file system is read-only" if exc.errno == errno.EROFS else "check its owner and permissions"
        denied = "permission denied: " if exc.errno in (errno.EACCES, errno.EPERM) else ""
        v.checks.append(Check("directory", FAIL, f"{denied}cannot create files in {d} ({exc.strerror}); {hint}"))
        return False
    v.checks.append(Check("directory", OK, f"{d.resolve()} exists and is writable"))
    return True


def _check_filesystem(v: Validation) -> None:
    v.filesystem = tensorio.filesystem_type(v.directory)
    if v.filesystem in ("tmpfs", "ramfs"):
        v.checks.append(Check("file system", WARN, f"{v.filesystem}: memory, not a disk; swap files there "
                                                   "take the RAM they are meant to free"))
    elif v.filesystem in _NETWORK_FS:
        v.checks.append(Check("file system", WARN, f"{v.filesystem}: not a local disk; expect lower and "
                                                   "less steady speed"))
    else:
        v.checks.append(Check("file system", OK, v.filesystem))
    v.direct, reason = tensorio.probe_direct(v.directory)
    if v.direct:
        v.checks.append(Check("O_DIRECT", OK, reason))
    else:
        v.checks.append(Check("O_DIRECT", WARN, f"{reason}: I/O goes through the page cache, which inflates "
                                                "benchmark figures and competes with training for RAM"))


def _check_free_space(v: Validation, need_bytes: int) -> None:
    v.free_bytes = shutil.disk_usage(v.directory).free
    free = format_bytes(v.free_bytes)
    if need_bytes:
        need = int(need_bytes * (1 + HEADROOM))
        if v.free_bytes < need:
            v.checks.append(Check("free space", FAIL, f"needs {format_bytes(need)} ({format_bytes(need_bytes)} "
                                                      f"plus {HEADROOM:.0%} headroom), only {free} free; "
                                                      "free space or use a smaller --size"))
            return
        v.checks.append(Check("free space", OK, f"{free} free, {format_bytes(need)} needed"))
    elif v.free_bytes < MIN_FREE_BYTES:
        v.checks.append(Check("free space", FAIL, f"only {free} free; a swap file needs at least "
                                                  f"{format_bytes(MIN_FREE_BYTES)}"))
    else:
        v.checks.append(Check("free space", OK, f"{free} free"))


def _check_device(v: Validation) -> None:
    from .diskstat import describe_facts, device_facts, disk_names

    try:
        names = disk_names(v.directory)
    except OSError:
        names = ()
    v.devices = [device_facts(name) for name in names]
    if v.devices:
        v.checks.append(Check("device", INFO, "; ".join(describe_facts(f) for f in v.devices)))
    else:
        v.checks.append(Check("device", INFO, "no block device under this file system: no request counts"))


def _check_io_uring(v: Validation) -> Check:
    v.io_uring, reason = tensorio.probe_io_uring()
    if v.io_uring:
        return Check("io_uring", OK, reason)
    return Check("io_uring", WARN, f"{reason}; the thread backend is used instead (slower at small blocks)")


def _check_memlock() -> Check:
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    if soft == resource.RLIM_INFINITY:
        return Check("memlock", OK, "unlimited: buffers of any size can be locked")
    limit = format_bytes(soft)
    if _has_cap_ipc_lock():
        return Check("memlock", OK, f"limit {limit}, but CAP_IPC_LOCK (root) lifts it")
    return Check("memlock", WARN, f"limit {limit}: larger buffers stay pageable (slower GPU copies); raise it "
                                  "with `ulimit -l unlimited` or `memlock` in /etc/security/limits.conf")


def _has_cap_ipc_lock() -> bool:
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("CapEff:"):
                    return bool(int(line.split()[1], 16) >> _CAP_IPC_LOCK & 1)
    except OSError:
        pass
    return False


def _check_cuda() -> Check:
    import torch

    if torch.cuda.is_available():
        count = torch.cuda.device_count()
        return Check("CUDA", OK, f"{count} device(s), {torch.cuda.get_device_name(0)}: buffers are CUDA-registered")
    return Check("CUDA", INFO, "not available: buffers are mlock'ed host memory, no GPU copies involved")


def _check_fio() -> Check:
    path = fio_path()
    if path is None:
        return Check("fio", WARN, f"not installed, so no fio comparison; {INSTALL_HINT}")
    try:
        version = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError) as exc:
        return Check("fio", WARN, f"{path} does not run ({exc})")
    return Check("fio", OK, f"{path} ({version})")
