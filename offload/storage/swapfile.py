"""`SwapFile`: the one swap-file implementation, for parameter, gradient and optimizer-state swapping.

Layout (see docs/engine.md, "Swap files"): a swap file is named ``offload-<kind>-<pid>-<random>.swp``,
created with mode 0600 in the configured directory, and holds extents at page-aligned offsets
(`allocate`), each of one or more equal slots (the optimizer's A/B slots). Nothing in it is meant to
outlive the process: it is removed by `close`, and a file left by a process that was killed is
reclaimed by the next `SwapFile` made in the same directory (see `stale_swap_files`).

Checksums (``aio.verify``, on by default): every write records the xxh3 checksum of its bytes, in
chunks the caller chooses (the optimizer's state regions; a whole partition otherwise), hashed in the
I/O thread once the write has landed; every read is verified against the last write of the same range
before its future resolves, and a mismatch (read twice) is a `tensorio.ChecksumError` naming the file,
offset, length, what the range holds and both checksums. The checksums live in memory only, like the
file itself.

Liveness: the owning process holds an exclusive ``flock`` on its swap file for as long as the file
exists. A swap file nobody holds a lock on is stale when its named process is not running, or runs
but started after the file was last written (its pid was reused). ``python -m offload.swapfiles DIR``
lists the stale swap files of a directory and removes them with ``--remove``.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import re
import shutil
import threading
import time
import uuid
from dataclasses import dataclass

import torch

from tensorio import DIRECT_ALIGN, AioConfig, AioHandle, BufferPool, Checksums, IOFuture, TensorIOError, aligned_tensor

__all__ = ["PAGE", "PooledBuffers", "SwapFile", "StaleSwapFile", "check_swap_directory", "is_swap_file_name",
           "remove_stale_swap_files", "stale_swap_files"]

log = logging.getLogger("offload")

PAGE = DIRECT_ALIGN
"""Every extent starts at a multiple of this (O_DIRECT's alignment)."""

_NAME = re.compile(r"^offload-(?P<kind>[a-z]+)-(?P<pid>\d+)-[0-9a-f]{8}\.swp$")


def aligned_size(nbytes: int) -> int:
    """``nbytes`` rounded up to a whole number of pages."""
    return -(-nbytes // PAGE) * PAGE


def check_swap_directory(directory: str | os.PathLike, key: str) -> str:
    """The absolute path of ``directory``, checked to be a directory this process can create files in.

    ``key`` names the setting in the errors: FileNotFoundError, NotADirectoryError, PermissionError.
    """
    path = os.path.abspath(os.fspath(directory))
    if not os.path.exists(path):
        raise FileNotFoundError(errno.ENOENT, f"{key} {os.fspath(directory)!r} does not exist; create it first")
    if not os.path.isdir(path):
        raise NotADirectoryError(errno.ENOTDIR, f"{key} {os.fspath(directory)!r} is not a directory")
    if not os.access(path, os.W_OK | os.X_OK):
        raise PermissionError(errno.EACCES, f"{key} {os.fspath(directory)!r} is not writable by this process; "
                              "choose a directory you can create files in")
    return path


class PooledBuffers:
    """The buffers of a swap file's I/O (`SwapFile`, `offload.storage.striped.StripedSwapFile`): from its
    ``pool`` (set by the owner) when it has one. Needs the file's ``read(buffer, offset, what=...)``."""

    pool: BufferPool | None

    def buffer(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A page-aligned buffer of ``numel`` elements for this file's I/O (O_DIRECT), contents
        unspecified: from the file's pool when it has one, so that its memory is not faulted in anew."""
        return self.pool.take(numel, dtype) if self.pool is not None else aligned_tensor(numel, dtype)

    def read_new(self, numel: int, dtype: torch.dtype, offset: int, *, what: str = "") -> tuple[torch.Tensor, IOFuture]:
        """Start reading ``numel`` elements at ``offset`` into a new page-aligned buffer (`buffer`), verified
        as `read` does."""
        buffer = self.buffer(numel, dtype)
        return buffer, self.read(buffer, offset, what=what)


class SwapFile(PooledBuffers):
    """One swap file of page-aligned extents, read and written through one tensorio handle.

    The file is created (mode 0600, locked) at construction, so that a bad directory fails here and
    not in the middle of a step; relative directories are resolved once, here. Stale swap files of
    dead processes in the same directory are removed first, with a log line.

    Raises FileNotFoundError / NotADirectoryError / PermissionError naming ``key`` for a bad
    ``directory``, OSError when the file cannot be created.
    """

    def __init__(self, directory: str | os.PathLike, aio: AioConfig, *, kind: str,
                 key: str = "nvme_path") -> None:
        if not re.fullmatch(r"[a-z]+", kind):
            raise ValueError(f"kind {kind!r}: use lower-case letters only")
        directory = check_swap_directory(directory, key)
        remove_stale_swap_files(directory)
        self.path = os.path.join(directory, f"offload-{kind}-{os.getpid()}-{uuid.uuid4().hex[:8]}.swp")
        self._lock_fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            self._handle: AioHandle | None = AioHandle.from_config(aio)
        except BaseException:
            os.close(self._lock_fd)
            os.unlink(self.path)
            raise
        self.pool: BufferPool | None = None
        """Where `buffer` takes buffers from; set by the owner (the engine shares one among its files)."""
        self._end = 0
        self._reserved = 0
        """Bytes whose blocks `preallocate` reserved."""
        self.bytes_read = 0
        self.bytes_written = 0
        self.verify = aio.verify
        """Whether writes are checksummed and reads verified (``aio.verify``)."""
        self.bytes_verified = 0
        """Bytes read whose checksums were checked (all of `bytes_read` when `verify`)."""
        self._counting = threading.Lock()
        self._written: dict[int, tuple[IOFuture, int, int]] = {}
        """file offset of a checksummed chunk -> (the last write there, the chunk's index in it, its length)."""

    def allocate(self, nbytes: int, slots: int = 1) -> int:
        """Reserve ``slots`` page-aligned slots of ``nbytes`` at the end of the file; return the offset
        of the first (slot ``i`` starts at ``offset + i * aligned_size(nbytes)``)."""
        offset = self._end
        self._end += slots * aligned_size(nbytes)
        return offset

    def preallocate(self) -> None:
        """Reserve the disk blocks of every extent allocated so far (``os.posix_fallocate``), so that a full
        disk is named now (at `initialize`) rather than by a write in the middle of a step. Where the file
        system cannot (EOPNOTSUPP, EINVAL), nothing is reserved and writes allocate as they go.

        Raises OSError (ENOSPC, EDQUOT, ...) naming the file, the bytes it needs and the bytes free, after
        giving the file back its size (nothing half-reserved is left as if it were the file's)."""
        if self._end <= self._reserved:
            return
        size = os.fstat(self._lock_fd).st_size
        try:
            os.posix_fallocate(self._lock_fd, 0, self._end)
        except OSError as error:
            if error.errno in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                return  # this file system cannot preallocate: writes allocate as they go
            os.ftruncate(self._lock_fd, size)
            free = shutil.disk_usage(os.path.dirname(self.path)).free
            raise OSError(error.errno, f"swap file {self.path}: cannot reserve its {self._end:,} bytes "
                                       f"({error.strerror}); the file system has {free:,} bytes free; free space, "
                                       f"point nvme_path at a larger disk, or keep more in memory (max_in_cpu, "
                                       f"offload_optimizer.ratio)") from error
        self._reserved = self._end

    @property
    def allocated_bytes(self) -> int:
        """Bytes reserved so far: the file's size once every extent is written."""
        return self._end

    def read(self, buffer: torch.Tensor, offset: int, *, chunk: int | None = None, what: str = "") -> IOFuture:
        """Start filling ``buffer`` (contiguous, CPU) from ``offset``, verified (with `verify`) against the
        checksums of the writes of the same range in chunks of ``chunk`` bytes (default: the whole buffer), as
        they were written; ``what`` names the range in a `tensorio.ChecksumError`. Raises RuntimeError (at once)
        for a range not written that way, TensorIOError for one whose last write failed."""
        verify = self.verify and buffer.nbytes > 0
        expected = self._expected(offset, buffer.nbytes, chunk or buffer.nbytes, what) if verify else None
        future = self._io().read(buffer, self.path, offset, verify=expected, what=what)
        with self._counting:  # reads start on the training thread and the optimizer's
            self.bytes_read += buffer.nbytes
            self.bytes_verified += buffer.nbytes if verify else 0
        return future

    def _expected(self, offset: int, nbytes: int, chunk: int, what: str) -> Checksums:
        """The checksums the bytes at ``offset`` must have: those of the last writes there (sync point: waits
        for a write still in flight, which callers never read over)."""
        values = []
        for first in range(0, nbytes, chunk):
            length = min(chunk, nbytes - first)
            entry = self._written.get(offset + first)
            if entry is None or entry[2] != length:
                raise RuntimeError(f"internal error: {what or 'a read'} at byte {offset + first} of {self.path} "
                                   f"({length} bytes) has no checksummed write of that range to verify against")
            future, index, _ = entry
            error = future.exception()
            if error is not None or future.checksums is None:
                raise TensorIOError(getattr(error, "errno", None) or errno.EIO, "the last write of these bytes failed, so "
                                    "they cannot be trusted", path=self.path, offset=offset + first, length=length,
                                    name_errno=False, hint=f"{what}; write them again (load a checkpoint)")
            values.append(future.checksums.values[index])
        return Checksums(tuple(values), chunk, nbytes)

    def write(self, tensor: torch.Tensor, offset: int, *, chunk: int | None = None) -> IOFuture:
        """Start writing ``tensor`` (contiguous, CPU) at ``offset``; keep it unchanged until done. With
        `verify` its checksums are recorded in chunks of ``chunk`` bytes (default: one for the whole
        tensor), to verify the reads of the same range in the same chunks."""
        self.bytes_written += tensor.nbytes
        if not self.verify or not tensor.nbytes:
            return self._io().write(tensor, self.path, offset)
        chunk = chunk or tensor.nbytes
        future = self._io().write(tensor, self.path, offset, checksum=chunk)
        for index, first in enumerate(range(0, tensor.nbytes, chunk)):
            self._written[offset + first] = (future, index, min(chunk, tensor.nbytes - first))
        return future

    @staticmethod
    def io_bytes_of(file: "SwapFile | None") -> dict[str, int]:
        """``{"read": bytes, "written": bytes}`` moved through ``file`` so far (zeros for None: no file)."""
        return {"read": file.bytes_read if file else 0, "written": file.bytes_written if file else 0}

    @property
    def closed(self) -> bool:
        return self._handle is None

    def close(self) -> None:
        """Finish the I/O in flight, stop the I/O workers and remove the file; let go of the pool (its
        idle buffers are freed with it). Idempotent."""
        if self._handle is None:
            return
        self.pool = None
        try:
            self._handle.close()
        finally:
            self._handle = None
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
            os.close(self._lock_fd)  # the lock goes with the descriptor

    def _io(self) -> AioHandle:
        if self._handle is None:
            raise RuntimeError(f"swap file {self.path} is closed")
        return self._handle


@dataclass(frozen=True, slots=True)
class StaleSwapFile:
    """A swap file left by a process that is gone."""

    path: str
    pid: int
    """The process that made it (from its name)."""
    nbytes: int
    """Disk space it takes (allocated blocks)."""
    reason: str = ""
    """Why it is stale: its process is not running, or its pid now names a younger process."""


def is_swap_file_name(name: str) -> bool:
    """Whether ``name`` (a file name, no directory) is one `SwapFile` gives its files."""
    return _NAME.match(name) is not None


def stale_swap_files(directory: str | os.PathLike) -> list[StaleSwapFile]:
    """The swap files in ``directory`` that nobody holds locked and whose process is gone (not running,
    or its pid reused by a process started after the file's last write), sorted by name. Files of this
    process are never stale. A missing directory has none.

    Raises NotADirectoryError / PermissionError (OSError) naming ``directory`` when it cannot be listed.
    """
    stale = []
    try:
        names = sorted(os.listdir(directory))
    except FileNotFoundError:
        return []
    for name in names:
        match = _NAME.match(name)
        if match is None:
            continue
        pid = int(match["pid"])
        path = os.path.join(os.fspath(directory), name)
        if pid == os.getpid():
            continue  # ours; and opening it to test the lock could drop a POSIX (NFS) lock we hold
        try:
            info = os.stat(path, follow_symlinks=False)
        except FileNotFoundError:
            continue  # removed meanwhile
        reason = _gone(pid, info.st_mtime)
        if reason is None or _locked(path):
            continue
        stale.append(StaleSwapFile(path=path, pid=pid, nbytes=info.st_blocks * 512, reason=reason))
    return stale


def remove_stale_swap_files(directory: str | os.PathLike) -> list[StaleSwapFile]:
    """Remove the stale swap files of ``directory`` (see `stale_swap_files`), logging each; return the
    ones removed. A file that cannot be removed (another user's, say) is logged and left; nothing raises
    except listing ``directory`` (see `stale_swap_files`)."""
    removed = []
    for entry in stale_swap_files(directory):
        try:
            os.unlink(entry.path)
        except FileNotFoundError:
            continue
        except OSError as exc:
            log.warning("could not remove the stale swap file %s (%.1f MB; %s): %s", entry.path, entry.nbytes / 1e6,
                        entry.reason, exc.strerror or exc)
            continue
        log.warning("removed the stale swap file %s (%.1f MB): %s", entry.path, entry.nbytes / 1e6, entry.reason)
        removed.append(entry)
    return removed


_REUSE_MARGIN = 1.0
"""Seconds by which a process must have started after a swap file's last write to be taken for a
reused pid rather than its owner (clock granularity and rounding stay well below this)."""


def _gone(pid: int, last_write: float) -> str | None:
    """Why process ``pid`` cannot be the owner of a file last written at ``last_write``, or None if it can."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return f"process {pid} is not running"
    except PermissionError:
        pass  # another user's process
    state, started = _process_stat(pid)
    if state == "Z":
        return f"process {pid} has exited (its parent has not reaped it yet)"
    if started is not None and started > last_write + _REUSE_MARGIN:
        return f"process {pid} is not running (pid {pid} now names a process started after the file's last write)"
    return None


def _process_stat(pid: int) -> tuple[str | None, float | None]:
    """Process ``pid``'s state letter and start time in ``time.time()`` seconds (Linux /proc); None when unknown."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as file:
            stat = file.read()
        fields = stat[stat.rindex(b")") + 2:].split()  # from field 3 (state) on
        state, ticks = fields[0].decode(), int(fields[19])  # field 22: starttime, in clock ticks since boot
    except (OSError, ValueError, IndexError):
        return None, None
    since_boot = time.clock_gettime(time.CLOCK_BOOTTIME)
    return state, time.time() - since_boot + ticks / os.sysconf("SC_CLK_TCK")


def _locked(path: str) -> bool:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError:
        return True  # cannot tell: leave it alone
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False
