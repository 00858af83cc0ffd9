"""`AioHandle`: reads and writes of tensors to files, asynchronous first.

Two surfaces over one engine: the Pythonic ``read``/``write`` returning futures, and the
method-for-method surface of DeepSpeed's ``aio_handle`` (``sync_pread``, ``async_pwrite``,
``wait``, ...) for code written against DeepSpeed.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import weakref

import torch

from ._buffers import in_locked_buffer, locked_tensor, unlock_at
from ._checksum import Checksums
from ._config import MiB, AioConfig
from ._errors import TensorIOError
from ._files import FileTable, OpenFile
from ._fs import DIRECT_ALIGN, direct_supported, open_error, probed_direct
from ._plan import Mode, piece_size, plan_runs
from ._request import IOFuture, Request, Span
from ._threads import ThreadBackend
from ._uring import UringBackend, probe_io_uring

log = logging.getLogger("tensorio")

PathOrFd = str | os.PathLike | int


def _make_backend(config: AioConfig, piece_bytes: int):
    if config.backend in ("auto", "io_uring"):
        available, reason = probe_io_uring()
        if available:
            return UringBackend(config, piece_bytes=piece_bytes, align=DIRECT_ALIGN)
        if config.backend == "io_uring":
            raise RuntimeError(f"aio.backend is \"io_uring\" but io_uring cannot run here: {reason}")
        log.info("tensorio: using the thread-pool backend: %s", reason)
    return ThreadBackend(config, piece_bytes=piece_bytes, align=DIRECT_ALIGN)


def _check_tensor(tensor: object, name: str = "buffer") -> torch.Tensor:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.device.type != "cpu":
        raise ValueError(f"{name} is on {tensor.device}; tensorio moves CPU tensors (copy it to a locked "
                         f"CPU buffer first, e.g. with new_cpu_locked_tensor)")
    if not tensor.is_contiguous():
        raise ValueError(f"{name} is not contiguous (shape {tuple(tensor.shape)}, stride {tensor.stride()}); "
                         f"pass tensor.contiguous()")
    return tensor


class AioHandle:
    """Asynchronous tensor reads and writes with the aio settings of an `AioConfig`.

    The buffer may be any contiguous CPU tensor of any dtype: locked or not, aligned or not, a view
    at any offset. Page-aligned buffers (``new_cpu_locked_tensor``) at page-aligned file offsets
    move straight between memory and disk with O_DIRECT; anything else goes through this handle's
    staging buffers (tc x qd x block_size bytes at most, allocated once) or the page cache for
    unaligned heads and tails. A write changes exactly the bytes [offset, offset + nbytes) of the
    file (created with mode 0600, never truncated); a read fills the whole tensor or fails.

    Requests on the same file share one descriptor (per mode and O_DIRECT setting), held until the
    last of them completes. A handle dropped without ``close()`` is closed when it is garbage
    collected, like a Python file: its started requests finish, then its threads and rings go.

    Raises RuntimeError when ``backend="io_uring"`` is asked for and io_uring cannot run here.
    """

    def __init__(self, block_size: int = MiB, queue_depth: int = 8, single_submit: bool = False,
                 overlap_events: bool = True, thread_count: int = 1, *, backend: str = "auto",
                 direct: bool | str = "auto", intra_op_parallelism: int | None = None) -> None:
        if intra_op_parallelism is not None:
            thread_count = intra_op_parallelism
        self.config = AioConfig(block_size=block_size, queue_depth=queue_depth, single_submit=single_submit,
                                overlap_events=overlap_events, thread_count=thread_count,
                                backend=backend, direct=direct)
        piece_bytes = piece_size(self.config.block_size, True, DIRECT_ALIGN)
        self._backend = _make_backend(self.config, piece_bytes)
        # Closing the backend must not need the handle: the finalizer holds only the backend, and
        # the backend's threads never see the handle, so a dropped handle is collected and closed.
        self._finalizer = weakref.finalize(self, _close_backend, self._backend)
        self._files = FileTable()
        self._pending: list[tuple[IOFuture, torch.Tensor | None, PathOrFd, int]] = []  # for wait()
        self._pending_lock = threading.Lock()
        self._closed = False

    @classmethod
    def from_config(cls, config: AioConfig) -> "AioHandle":
        """A handle with the settings of ``config``."""
        return cls(config.block_size, config.queue_depth, config.single_submit, config.overlap_events,
                   config.thread_count, backend=config.backend, direct=config.direct)

    @property
    def backend_name(self) -> str:
        """The backend doing the I/O: "io_uring" or "threads"."""
        return self._backend.name

    # ---- the Pythonic surface -------------------------------------------------------------------

    def read(self, tensor: torch.Tensor, path: PathOrFd, offset: int = 0, file_offset: int | None = None, *,
             validate: bool | None = None, verify: Checksums | None = None, what: str = "") -> IOFuture | int:
        """Start filling ``tensor`` from ``path`` (a file name or an open fd) at byte ``offset``.

        Returns a future whose ``result()`` is the byte count, or raises TensorIOError (a short
        file, EIO, ...). Raises at once TypeError/ValueError for a bad tensor or offset and
        TensorIOError when the file cannot be opened. Do not touch ``tensor`` until it is done.

        ``verify``: the `Checksums` the bytes read must have (those a write's ``future.checksums``
        gave, ranges of the tensor's bytes). They are checked piece by piece as they land, before the future
        resolves; a chunk that differs is read once more, and ``result()`` raises `ChecksumError`
        (naming ``what``, the path, the chunk's offset and length, and both checksums) if it differs again.

        DeepSpeed's ``read(buffer, filename, validate, file_offset=0)`` works too: a bool third
        argument (or ``validate=``) makes it that synchronous call, which returns 0 once done.
        """
        if isinstance(offset, bool) or validate is not None or file_offset is not None:
            return self._deepspeed_read_write(False, tensor, path, offset, file_offset, validate)
        return self._start(False, tensor, path, offset, verify=verify, what=what)

    def write(self, tensor: torch.Tensor, path: PathOrFd, offset: int = 0, file_offset: int | None = None, *,
              validate: bool | None = None, checksum: int | None = None) -> IOFuture | int:
        """Start writing ``tensor``'s bytes to ``path`` (a file name or an open fd) at byte ``offset``.

        Returns a future whose ``result()`` is the byte count, or raises TensorIOError (ENOSPC, EIO,
        ...). Raises at once TypeError/ValueError for a bad tensor or offset and TensorIOError when
        the file cannot be created. Do not modify ``tensor`` until it is done.

        ``checksum``: a chunk size in bytes; once the write has succeeded, ``future.checksums`` holds
        the `Checksums` of its bytes in chunks of that size (hashed piece by piece as they are written, before the
        future resolves), for a later ``read(..., verify=...)``.

        DeepSpeed's ``write(buffer, filename, validate, file_offset=0)`` works too: a bool third
        argument (or ``validate=``) makes it that synchronous call, which returns 0 once done.
        """
        if isinstance(offset, bool) or validate is not None or file_offset is not None:
            return self._deepspeed_read_write(True, tensor, path, offset, file_offset, validate)
        return self._start(True, tensor, path, offset, checksum=checksum)

    def _start(self, write: bool, tensor: torch.Tensor, path: PathOrFd, offset: int, *, checksum: int | None = None,
               verify: Checksums | None = None, what: str = "") -> IOFuture:
        # 1. Guard the boundary: nothing is opened or queued for a bad argument.
        if self._closed:
            raise RuntimeError("this AioHandle is closed")
        tensor = _check_tensor(tensor)
        if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
            raise ValueError(f"file offset must be an integer >= 0, got {offset!r}")
        nbytes = tensor.numel() * tensor.element_size()
        if checksum is not None and (isinstance(checksum, bool) or not isinstance(checksum, int) or checksum < 1):
            raise ValueError(f"checksum is a chunk size in bytes (an integer >= 1), got {checksum!r}")
        if verify is not None and (not isinstance(verify, Checksums) or verify.start + verify.nbytes > nbytes):
            raise ValueError(f"verify must be Checksums of a range inside the {nbytes}-byte buffer, got {verify!r}")
        # 2. Take the file's shared descriptor (or the caller's fd), with or without O_DIRECT.
        file, name = self._open(write, path, offset, nbytes)
        # 3. Plan the pieces, as runs of equal ones; unaligned ones need the buffered companion descriptor.
        runs = plan_runs(offset=offset, nbytes=nbytes, buf_addr=tensor.data_ptr(),
                         block_size=self.config.block_size, direct=file.direct, align=DIRECT_ALIGN)
        if file.direct and any(r.mode is Mode.BUFFERED for r in runs):
            try:
                file.buffered()
            except (OSError, ValueError) as exc:
                file.release()
                raise TensorIOError(getattr(exc, "errno", None) or errno.EIO, "reopen for unaligned I/O failed",
                                    path=name, offset=offset, length=nbytes) from None
        # 4. Hand the runs to the backend; the request releases the file after its last piece.
        request = Request(write=write, path=name, tensor=tensor, offset=offset, file=file,
                          pieces=sum(r.count for r in runs), checksum_chunk=checksum, verify=verify, what=what)
        if runs:
            self._backend.submit([Span(request, run) for run in runs])
        return request.future

    def _open(self, write: bool, path: PathOrFd, offset: int, nbytes: int) -> tuple[OpenFile, str]:
        """(the shared open file, the name for errors)."""
        if isinstance(path, bool) or not isinstance(path, (int, str, os.PathLike)):
            raise TypeError(f"filename must be a path or an open file descriptor, got {type(path).__name__}")
        if isinstance(path, int):
            return self._files.acquire_fd(path, write=write), f"fd {path}"
        name = os.fspath(path)
        direct = self._direct_for(write, name, offset, nbytes)
        return self._files.acquire_path(name, write=write, direct=direct, offset=offset, length=nbytes), name

    def _direct_for(self, write: bool, name: str, offset: int, nbytes: int) -> bool:
        mode = self.config.direct
        if mode is False:
            return False
        directory = os.path.dirname(os.path.abspath(name))
        try:  # probed once per directory; a directory gone since is named by the open that follows
            if mode is True:
                supported, reason = probed_direct(directory)
                if not supported:
                    raise TensorIOError(errno.EINVAL, "direct=True but O_DIRECT is unavailable", path=name,
                                        offset=offset, length=nbytes, hint=f"{reason}; use direct=\"auto\" or False")
                return True
            return direct_supported(directory)
        except FileNotFoundError:  # the directory is missing (or a file): not probed, named as the open would
            raise open_error(errno.ENOENT, name, write=write, offset=offset, length=nbytes) from None

    # ---- the DeepSpeed aio_handle surface ---------------------------------------------------------

    # Return values are DeepSpeed's (csrc/aio/py_lib/deepspeed_py_io_handle.cpp, py_ds_aio.cpp). Where
    # DeepSpeed returns -1, prints, or moves fewer bytes without a word (a short read or write, a failed
    # validation, an unopenable file), tensorio raises TensorIOError instead.

    def sync_pread(self, buffer: torch.Tensor, filename: PathOrFd | None = None, file_offset: int = 0, *,
                   fd: int | None = None) -> int:
        """Read ``buffer`` from ``filename`` (or ``fd``) at ``file_offset`` and wait.

        Returns the operations completed: 1, plus the asynchronous ones still pending, which this
        call waits for too (as in DeepSpeed). Raises TensorIOError naming the path, offset and length
        when this or a pending operation failed.
        """
        return self._sync(False, buffer, _target(filename, fd), file_offset, validate=False)

    def sync_pwrite(self, buffer: torch.Tensor, filename: PathOrFd | None = None, file_offset: int = 0, *,
                    fd: int | None = None) -> int:
        """Write ``buffer`` to ``filename`` (or ``fd``) at ``file_offset`` and wait.

        Returns the operations completed: 1, plus the asynchronous ones still pending (as in
        DeepSpeed). Raises TensorIOError naming the path, offset and length when one failed.
        """
        return self._sync(True, buffer, _target(filename, fd), file_offset, validate=False)

    def async_pread(self, buffer: torch.Tensor, filename: PathOrFd | None = None, file_offset: int = 0, *,
                    fd: int | None = None) -> int:
        """Start a read; returns 0 at once. ``wait()`` reports its completion or raises its error."""
        return self._start_pending(False, buffer, _target(filename, fd), file_offset, validate=False)

    def async_pwrite(self, buffer: torch.Tensor, filename: PathOrFd | None = None, file_offset: int = 0, *,
                     fd: int | None = None) -> int:
        """Start a write; returns 0 at once. ``wait()`` reports its completion or raises its error.

        As in DeepSpeed, an int ``filename`` is an open file descriptor (``async_pwrite(buf, fd, off)``).
        """
        return self._start_pending(True, buffer, _target(filename, fd), file_offset, validate=False)

    def pread(self, buffer: torch.Tensor, filename: PathOrFd | None = None, validate: bool = False,
              async_op: bool = False, file_offset: int = 0, *, fd: int | None = None) -> int:
        """DeepSpeed's ``pread``: with ``async_op`` started (returns 0), else as ``sync_pread``.

        With ``validate`` the bytes are checked against an independent buffered read of the file and
        a mismatch raises TensorIOError (from here, or from ``wait()`` for an asynchronous read).
        """
        if async_op:
            return self._start_pending(False, buffer, _target(filename, fd), file_offset, validate=validate)
        return self._sync(False, buffer, _target(filename, fd), file_offset, validate=validate)

    def pwrite(self, buffer: torch.Tensor, filename: PathOrFd | None = None, validate: bool = False,
               async_op: bool = False, file_offset: int = 0, *, fd: int | None = None) -> int:
        """DeepSpeed's ``pwrite``: with ``async_op`` started (returns 0), else as ``sync_pwrite``.

        With ``validate`` the file is read back independently and a mismatch raises TensorIOError.
        """
        if async_op:
            return self._start_pending(True, buffer, _target(filename, fd), file_offset, validate=validate)
        return self._sync(True, buffer, _target(filename, fd), file_offset, validate=validate)

    def _sync(self, write: bool, buffer: torch.Tensor, path: PathOrFd, offset: int, *, validate: bool) -> int:
        # DeepSpeed's synchronous calls queue the operation, then wait for everything queued.
        self._start_pending(write, buffer, path, offset, validate=validate)
        return self.wait()

    def _start_pending(self, write: bool, buffer: torch.Tensor, path: PathOrFd, offset: int, *,
                       validate: bool) -> int:
        future = self._start(write, buffer, path, offset)
        with self._pending_lock:
            self._pending.append((future, buffer if validate else None, path, offset))
        return 0

    def _deepspeed_read_write(self, write: bool, buffer: torch.Tensor, path: PathOrFd, offset: int | bool,
                              file_offset: int | None, validate: bool | None) -> int:
        # DeepSpeed's read/write(buffer, filename, validate, file_offset=0): synchronous, outside the
        # wait() accounting, 0 when done.
        if isinstance(offset, bool):
            validate, offset = offset if validate is None else validate, 0
        if offset and file_offset:
            raise TypeError("pass the file offset once: offset= or DeepSpeed's file_offset=")
        offset = file_offset or offset
        self._start(write, buffer, path, offset).result()
        if validate:
            _validate(buffer, path, offset)
        return 0

    def wait(self) -> int:
        """Wait for every asynchronous operation started since the last ``wait()``; return their count.

        Returns 0 when none is pending. Raises the first failed operation's TensorIOError once all of
        them have finished.
        """
        with self._pending_lock:
            pending, self._pending = self._pending, []
        first_error: BaseException | None = None
        for future, validate_buffer, path, offset in pending:
            error = future.exception()
            if error is None and validate_buffer is not None:
                try:
                    _validate(validate_buffer, path, offset)
                except TensorIOError as exc:
                    error = exc
            first_error = first_error or error
        if first_error is not None:
            raise first_error
        return len(pending)

    def new_cpu_locked_tensor(self, num_elem: int, example_tensor: torch.Tensor) -> torch.Tensor:
        """A page-aligned, locked, zero-filled 1-D CPU tensor of ``num_elem`` elements of
        ``example_tensor``'s dtype. Any handle's ``free_cpu_locked_tensor`` unlocks it."""
        return locked_tensor(int(num_elem), example_tensor.dtype)

    def free_cpu_locked_tensor(self, tensor: torch.Tensor) -> bool:
        """Unlock a tensor from ``new_cpu_locked_tensor``; returns True, or False (doing nothing) for
        any other tensor, an already freed one, or a view not starting at its buffer (as DeepSpeed).

        Unlike DeepSpeed, the memory stays valid until the tensor's last reference goes.
        """
        return unlock_at(tensor.data_ptr())

    def is_pinned(self, buffer: torch.Tensor) -> bool:
        """Whether ``buffer`` lies inside one ``new_cpu_locked_tensor`` buffer or is torch-pinned
        (DeepSpeed's test for a buffer that needs no bounce copy)."""
        if buffer.device.type != "cpu":
            return False
        return in_locked_buffer(buffer) or buffer.is_pinned()

    def get_alignment(self) -> int:
        """DeepSpeed's alignment number: 512 x ``intra_op_parallelism`` (its callers size buffers and
        file offsets to multiples of it). tensorio needs no alignment to be correct; its fast path
        is page-aligned (4096) memory and offsets."""
        return self.config.thread_count * 512

    def get_block_size(self) -> int:
        """The block size in bytes."""
        return self.config.block_size

    def get_queue_depth(self) -> int:
        """Pieces in flight per worker."""
        return self.config.queue_depth

    def get_single_submit(self) -> bool:
        """Whether each piece is submitted with its own system call."""
        return self.config.single_submit

    def get_overlap_events(self) -> bool:
        """Whether the queue is topped up as completions arrive."""
        return self.config.overlap_events

    def get_intra_op_parallelism(self) -> int:
        """Workers a request is spread over (DeepSpeed's name for ``thread_count``)."""
        return self.config.thread_count

    def get_thread_count(self) -> int:
        """Workers a request is spread over (tensorio's name; DeepSpeed's handle has no such getter)."""
        return self.config.thread_count

    # ---- lifetime ---------------------------------------------------------------------------------

    def close(self) -> None:
        """Finish every started operation, then stop the workers. Further I/O calls raise RuntimeError.

        Called from a completion callback (an I/O thread), it returns at once and the workers stop
        on their own once done.
        """
        self._closed = True
        self._finalizer()  # closes the backend once; later calls do nothing

    def __enter__(self) -> "AioHandle":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


def _close_backend(backend) -> None:
    backend.close()  # looked up when called, so that tensorio.testing's patch applies


def _target(filename: PathOrFd | None, fd: int | None) -> PathOrFd:
    if (filename is None) == (fd is None):
        raise TypeError("pass exactly one of filename= and fd=")
    return fd if fd is not None else filename  # type: ignore[return-value]


def _validate(buffer: torch.Tensor, path: PathOrFd, offset: int) -> None:
    """Compare ``buffer`` with the file's bytes, read independently through the page cache."""
    nbytes = buffer.numel() * buffer.element_size()
    if isinstance(path, int):
        data = os.pread(path, nbytes, offset)
        name = f"fd {path}"
    else:
        with open(path, "rb") as f:
            f.seek(offset)
            data = f.read(nbytes)
        name = os.fspath(path)
    expected = buffer.reshape(-1).view(torch.uint8).numpy().tobytes() if nbytes else b""
    if data != expected:
        first = next((i for i, (a, b) in enumerate(zip(data, expected)) if a != b), min(len(data), nbytes))
        raise TensorIOError(errno.EIO, f"validation failed: first difference at byte {offset + first}",
                            path=name, offset=offset, length=nbytes)
