"""What a directory's file system can do: its type, O_DIRECT, and opening files for tensor I/O."""

from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import os
import stat
import threading

from ._errors import TensorIOError, io_error

log = logging.getLogger("tensorio")

#: Alignment of file offsets, lengths and memory under O_DIRECT. The page size rather than the
#: device's 512-byte sector, so that a direct piece never shares a page-cache page with a buffered
#: head or tail piece of the same request (that sharing can lose a write).
DIRECT_ALIGN = mmap.PAGESIZE

FILE_MODE = 0o600

# statfs f_type magic numbers (linux/magic.h) of the file systems we name in reports.
_FS_MAGIC = {
    0xEF53: "ext4",
    0x58465342: "xfs",
    0x9123683E: "btrfs",
    0x2FC12FC1: "zfs",
    0xF2F52010: "f2fs",
    0x01021994: "tmpfs",
    0x858458F6: "ramfs",
    0x794C7630: "overlayfs",
    0x6969: "nfs",
    0xFF534D42: "cifs",
    0x65735546: "fuse",
    0x5346544E: "ntfs",
    0x4D44: "vfat",
}
# File systems that are memory: O_DIRECT there is either refused or silently buffered.
MEMORY_FILESYSTEMS = frozenset({"tmpfs", "ramfs"})


class _StatFs(ctypes.Structure):
    _fields_ = [("f_type", ctypes.c_long)] + [(f"_pad{i}", ctypes.c_long) for i in range(15)]


_libc = ctypes.CDLL(None, use_errno=True)


def filesystem_type(path: str | os.PathLike) -> str:
    """Name of the file system holding ``path`` ("ext4", "tmpfs", ...; "0x<magic>" when unknown).

    Raises FileNotFoundError when ``path`` does not exist.
    """
    buf = _StatFs()
    if _libc.statfs(os.fsencode(path), ctypes.byref(buf)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), os.fspath(path))
    magic = buf.f_type & 0xFFFFFFFF
    return _FS_MAGIC.get(magic, f"0x{magic:x}")


def probe_direct(directory: str | os.PathLike) -> tuple[bool, str]:
    """Whether O_DIRECT I/O works in ``directory``, and why not when it does not.

    Writes and removes one page-sized probe file. Raises FileNotFoundError for a missing directory.
    """
    directory = os.fspath(directory)
    if not os.path.isdir(directory):
        raise FileNotFoundError(errno.ENOENT, "not a directory", directory)
    fstype = filesystem_type(directory)
    if fstype in MEMORY_FILESYSTEMS:
        return False, f"{fstype} keeps files in memory and has no direct I/O to a device"
    path = os.path.join(directory, f".tensorio-probe-{os.getpid()}-{threading.get_ident()}")
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_DIRECT, FILE_MODE)
    except OSError as exc:
        if exc.errno == errno.EINVAL:
            return False, f"{fstype} refuses O_DIRECT opens"
        raise
    try:
        page = mmap.mmap(-1, DIRECT_ALIGN)
        try:
            os.pwritev(fd, [page], 0)
        except OSError as exc:
            return False, f"{fstype} refuses O_DIRECT writes ({exc.strerror})"
        finally:
            page.close()
    finally:
        os.close(fd)
        os.unlink(path)
    return True, f"{fstype} supports O_DIRECT"


_warned_dirs: set[str] = set()
_direct_cache: dict[str, tuple[bool, str]] = {}
_cache_lock = threading.Lock()


def probed_direct(directory: str) -> tuple[bool, str]:
    """``probe_direct(directory)``, probed once per directory and process (the I/O path asks on every
    request). Raises FileNotFoundError for a missing directory, as the probe does."""
    with _cache_lock:
        cached = _direct_cache.get(directory)
    if cached is None:
        cached = probe_direct(directory)
        with _cache_lock:
            _direct_cache[directory] = cached
    return cached


def direct_supported(directory: str) -> bool:
    """`probed_direct`'s answer for the I/O path; warns once per directory when it falls back."""
    supported, reason = probed_direct(directory)
    if not supported and directory not in _warned_dirs:
        _warned_dirs.add(directory)
        log.warning("tensorio: no O_DIRECT in %s (%s); using buffered I/O there", directory, reason)
    return supported


def open_for_io(path: str, *, write: bool, direct: bool, offset: int = 0, length: int = 0) -> int:
    """Open ``path`` for a read or a write (created 0600, never truncated); returns the fd.

    Raises TensorIOError naming the path (see `open_error`); ``offset`` and ``length`` are the
    request's, for the message.
    """
    flags = os.O_CLOEXEC | (os.O_RDWR | os.O_CREAT if write else os.O_RDONLY)
    if direct:
        flags |= os.O_DIRECT
    try:
        return os.open(path, flags, FILE_MODE)
    except OSError as exc:
        raise open_error(exc.errno or errno.EIO, path, write=write, offset=offset, length=length) from None


def open_error(err: int, path: str, *, write: bool, offset: int, length: int) -> TensorIOError:
    """The TensorIOError for a failed open of ``path``, saying what is wrong with the path.

    A directory is named as one (O_DIRECT opens of a directory fail with EINVAL, which would
    otherwise read as an O_DIRECT problem); a missing file or directory names the missing part.
    """
    op = "write" if write else "read"
    if err == errno.EISDIR or (err == errno.EINVAL and os.path.isdir(path)):
        return TensorIOError(errno.EISDIR, f"cannot {op} a directory", path=path, offset=offset, length=length,
                             hint="pass the path of a file, not of a directory")
    if err in (errno.ENOENT, errno.ENOTDIR):
        directory = os.path.dirname(os.path.abspath(path))
        if os.path.exists(directory) and not os.path.isdir(directory):
            return TensorIOError(errno.ENOTDIR, "parent is not a directory", path=path, offset=offset,
                                 length=length, hint=f"{directory} is a file, not a directory")
        if not os.path.isdir(directory):
            hint = f"create {directory} first" if write else f"{directory} does not exist; check the path"
            return TensorIOError(errno.ENOENT, "directory does not exist", path=path, offset=offset, length=length,
                                 hint=hint)
        if not write:
            return TensorIOError(errno.ENOENT, "open for read failed: the file does not exist", path=path,
                                 offset=offset, length=length, hint="check the path, or write the file first")
    return io_error(err, "open for " + op, path=path, offset=offset, length=length)


def fd_is_direct(fd: int) -> bool:
    """Whether an open file descriptor has O_DIRECT set."""
    import fcntl

    return bool(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT)


def reopen_buffered(fd: int, *, write: bool) -> int:
    """A second, buffered descriptor for the file behind ``fd`` (for its unaligned heads and tails)."""
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        raise ValueError(f"fd {fd} is not a regular file")
    return os.open(f"/proc/self/fd/{fd}", os.O_CLOEXEC | (os.O_RDWR if write else os.O_RDONLY))
