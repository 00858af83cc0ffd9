"""A request (one read or write of one tensor), its pieces in flight, and the future it resolves."""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import threading
from typing import Callable, Iterable

import torch

from ._checksum import ChecksumError, Checksums, checksum
from ._errors import TensorIOError, io_error
from ._files import OpenFile
from ._landing import LandingHashes
from ._plan import Mode, Piece, Run

log = logging.getLogger("tensorio")


def byte_view(tensor: torch.Tensor) -> memoryview:
    """A writable byte memoryview over a contiguous CPU tensor's memory (any dtype, any offset)."""
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes == 0:
        return memoryview(bytearray(0))
    array = (ctypes.c_char * nbytes).from_address(tensor.data_ptr())
    array._tensor = tensor  # the view keeps the array alive, and the array keeps the memory alive
    return memoryview(array).cast("B")


class IOFuture:
    """The outcome of one read or write: ``result()`` waits and returns the bytes moved, or raises.

    Raises TensorIOError from ``result()`` for a failed request (`ChecksumError` for a read that failed
    its verification), TimeoutError when ``timeout`` passes first. Callbacks added with
    ``add_done_callback`` run in the I/O thread that finished it.
    """

    __slots__ = ("_event", "_nbytes", "_error", "_callbacks", "_lock", "checksums")

    def __init__(self) -> None:
        self.checksums: Checksums | None = None
        """A write's checksums, when it was started with ``checksum=``: set once it succeeded."""
        self._event = threading.Event()
        self._nbytes = 0
        self._error: BaseException | None = None
        self._callbacks: list[Callable[["IOFuture"], None]] = []
        self._lock = threading.Lock()

    def done(self) -> bool:
        """Whether the request has finished (successfully or not)."""
        return self._event.is_set()

    def result(self, timeout: float | None = None) -> int:
        """Wait for the request; return the bytes moved. Raises its TensorIOError, or TimeoutError."""
        if not self._event.wait(timeout):
            raise TimeoutError(f"I/O request not finished after {timeout} s")
        if self._error is not None:
            raise self._error
        return self._nbytes

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """Wait for the request; return its error, or None when it succeeded."""
        if not self._event.wait(timeout):
            raise TimeoutError(f"I/O request not finished after {timeout} s")
        return self._error

    def add_done_callback(self, fn: Callable[["IOFuture"], None]) -> None:
        """Call ``fn(future)`` once the request finishes (at once if it already has)."""
        with self._lock:
            if not self._event.is_set():
                self._callbacks.append(fn)
                return
        fn(self)

    @classmethod
    def all_of(cls, futures: "list[IOFuture]") -> "IOFuture":
        """One future for several requests (a request split over files): it finishes when every one has,
        with the sum of their bytes, or with the first failure in the order given once all are done (so that
        no buffer is still in use when it raises). It carries no ``checksums``: each part keeps its own.
        An empty list gives a future already done with 0 bytes."""
        joined = cls()
        if not futures:
            joined._resolve(0, None)
            return joined
        remaining = [len(futures)]
        lock = threading.Lock()

        def finished(_: "IOFuture") -> None:
            with lock:
                remaining[0] -= 1
                if remaining[0]:
                    return
            error = next((f._error for f in futures if f._error is not None), None)
            joined._resolve(0 if error else sum(f._nbytes for f in futures), error)

        for future in futures:
            future.add_done_callback(finished)
        return joined

    def _resolve(self, nbytes: int, error: BaseException | None, checksums: Checksums | None = None) -> None:
        with self._lock:
            self._nbytes, self._error, self.checksums = nbytes, error, checksums
            self._event.set()
            callbacks, self._callbacks = self._callbacks, []
        for fn in callbacks:
            fn(self)


class Request:
    """One read or write of a whole tensor: holds its shared file until its last piece is done.

    A checksummed one (a write's ``checksum_chunk``, a read's ``verify``) hashes its chunks as its pieces
    land (`LandingHashes`, in the I/O threads that landed them) and resolves its future once the last
    piece has landed and every chunk is hashed: a write's `Checksums` are then set, a read's are compared.
    """

    __slots__ = ("write", "path", "tensor", "memory", "address", "file", "offset", "nbytes", "future", "error",
                 "checksum_chunk", "verify", "what", "hashes", "_remaining", "_lock")

    def __init__(self, *, write: bool, path: str, tensor: torch.Tensor, offset: int, file: OpenFile,
                 pieces: int, checksum_chunk: int | None = None, verify: Checksums | None = None,
                 what: str = "") -> None:
        self.write = write
        self.path = path
        self.tensor = tensor  # kept alive until the I/O is done
        self.memory = byte_view(tensor)
        self.address = tensor.data_ptr()
        self.offset = offset
        self.nbytes = len(self.memory)
        self.file = file  # released when the last piece finishes
        self.future = IOFuture()
        self.error: TensorIOError | None = None
        self.checksum_chunk = checksum_chunk  # a write: hash its bytes in chunks of this size as they land
        self.verify = verify  # a read: the checksums its bytes must have
        self.what = what  # the caller's name for the range, in a ChecksumError
        self.hashes: LandingHashes | None = None  # the chunks' hashes, built as the pieces land
        if checksum_chunk:
            self.hashes = LandingHashes(self.memory, checksum_chunk, self.nbytes)
        elif verify is not None:
            self.hashes = LandingHashes(self.memory, verify.chunk, verify.nbytes, verify.start)
        self._remaining = pieces
        self._lock = threading.Lock()
        if pieces == 0:
            self._finish()

    @property
    def op(self) -> str:
        return "write" if self.write else "read"

    def piece_finished(self, error: TensorIOError | None, landed: tuple[int, int] | None = None) -> None:
        """Count one piece as finished (``landed``: the bytes of the memory it moved, when it succeeded)."""
        self.pieces_finished(1, error, () if landed is None else (landed,))

    def pieces_finished(self, count: int, error: TensorIOError | None = None,
                        landed: Iterable[tuple[int, int]] = ()) -> None:
        """Count ``count`` pieces as finished (``error``: one of them failed so; ``landed``: the [first, end)
        ranges of the memory that those that succeeded moved, for the checksums: pass them whenever
        ``hashes`` is set). Hashes the chunks the landed bytes complete up to; the last piece (and the last
        hash) releases the file and resolves the future."""
        feed: list[int] = []
        with self._lock:
            if error is not None and self.error is None:
                self.error = error
            if self.hashes is not None and self.error is None:
                for first, end in landed:
                    feed += self.hashes.land(first, end)
                self._remaining += len(feed)  # a chunk being fed holds the request open
            self._remaining -= count
            last = self._remaining == 0
        for index in feed:
            self._feed(index)
        if last:
            self._finish()

    def _feed(self, index: int) -> None:
        """Hash chunk ``index``'s landed bytes from its next one on, until none are left to hash."""
        hashes, error = self.hashes, None
        try:
            while True:
                with self._lock:
                    taken = hashes.take(index) if self.error is None else None
                if taken is None:
                    break
                hashes.feed(index, *taken)
        except Exception as exc:  # reported through the future: the request fails, it never hangs
            error = TensorIOError(errno.EIO, f"checksum failed ({exc!r})", path=self.path, offset=self.offset,
                                  length=self.nbytes, name_errno=False)
        self.pieces_finished(1, error)

    def _finish(self) -> None:
        error, checksums = self.error, None
        if error is None and self.hashes is not None:
            try:
                values = tuple(self.hashes.values)
                if None in values:  # every piece is reported as landed, so every chunk was fed
                    raise RuntimeError(f"internal error: chunk {values.index(None)} was never hashed")
                if self.write:
                    checksums = Checksums(values, self.checksum_chunk, self.nbytes)
                else:
                    self._verify(self.verify, values)
            except TensorIOError as exc:
                error = exc
            except Exception as exc:  # every failure is reported through the future, never lost
                error = TensorIOError(getattr(exc, "errno", None) or errno.EIO, f"checksum failed ({exc})",
                                      path=self.path, offset=self.offset, length=self.nbytes)
        self.file.release()
        self.tensor = self.memory = None  # the caller's memory is released with the last piece
        self.hashes = None
        self.future._resolve(0 if error else self.nbytes, error, checksums)

    def _verify(self, expected: Checksums, landed: tuple[int, ...]) -> None:
        """Raise ChecksumError unless every chunk read (whose checksums as landed are ``landed``) hashes to
        ``expected``; a mismatched chunk is read once more through the page cache first (the first read's
        transfer may have been the fault)."""
        for i, value in enumerate(expected.values):
            if landed[i] == value:
                continue
            first, length = expected.span(i)
            window = self.memory[first:first + length]
            _pread_all(self.file.buffered(), window, self.offset + first, self.path)
            actual = checksum(window)
            if actual != value:
                raise ChecksumError(path=self.path, offset=self.offset + first, length=length, expected=value,
                                    actual=actual, what=self.what)
            log.warning("tensorio: %s at offset %d, length %d%s: checksum mismatch on the first read, the second "
                        "read is good", self.path, self.offset + first, length,
                        f" ({self.what})" if self.what else "")


class RoundRobin:
    """Spreads each request's pieces over ``workers`` workers, continuing where the last one stopped."""

    def __init__(self, workers: int) -> None:
        self._workers = workers
        self._next = 0
        self._lock = threading.Lock()

    def split(self, items: list["Span | Task"]) -> list[list["Span | Task"]]:
        """The work for each worker, in order: a Task goes whole to one worker, a Span is cut into
        one contiguous share per worker (fewer when it has fewer pieces)."""
        if self._workers == 1:
            return [items]
        parts: list[Span | Task] = []
        for item in items:
            parts += item.split(self._workers) if isinstance(item, Span) else [item]
        with self._lock:
            start = self._next
            self._next = (start + len(parts)) % self._workers
        shares: list[list[Span | Task]] = [[] for _ in range(self._workers)]
        for i, part in enumerate(parts):
            shares[(start + i) % self._workers].append(part)
        return shares


def join_or_hand_off(threads: list[threading.Thread], join: Callable[[], None]) -> None:
    """Run ``join`` now, or in a new thread when called from one of ``threads`` (a completion
    callback closing its own handle): a thread cannot join itself."""
    if threading.current_thread() in threads:
        threading.Thread(target=join, name="tensorio-close", daemon=True).start()
    else:
        join()


class Span:
    """A run of a request's pieces as a backend takes them: whole batches of DIRECT pieces at a time
    (`take`, no Python object per piece), or one `Task` at a time for the other modes (`take_task`)."""

    __slots__ = ("request", "next_offset", "end", "piece_bytes", "mode", "_buf_base", "_address_base")

    def __init__(self, request: Request, run: Run) -> None:
        self.request = request
        self.next_offset = run.file_offset  # file offset of the first piece not yet taken
        self.end = run.file_offset + run.length
        self.piece_bytes = run.piece_bytes
        self.mode = run.mode
        self._buf_base = run.buf_offset - run.file_offset  # buf_offset = file_offset + this
        self._address_base = request.address + self._buf_base

    @property
    def remaining(self) -> int:
        """Pieces not yet taken."""
        return -(-(self.end - self.next_offset) // self.piece_bytes)

    def split(self, parts: int) -> list["Span"]:
        """This span cut into at most ``parts`` contiguous spans of whole pieces, in file order."""
        per = -(-self.remaining // parts)
        out = []
        for start in range(self.next_offset, self.end, per * self.piece_bytes):
            share = Span.__new__(Span)
            share.request, share.piece_bytes, share.mode = self.request, self.piece_bytes, self.mode
            share._buf_base, share._address_base = self._buf_base, self._address_base
            share.next_offset, share.end = start, min(self.end, start + per * self.piece_bytes)
            out.append(share)
        return out

    def address(self) -> int:
        """Memory address of the first piece not yet taken."""
        return self.next_offset + self._address_base

    def skip(self, count: int) -> None:
        """Take the next ``count`` pieces (the caller moves them)."""
        self.next_offset = min(self.end, self.next_offset + count * self.piece_bytes)

    def take_task(self) -> "Task":
        """The next piece as a `Task`."""
        start = self.next_offset
        self.next_offset = min(self.end, start + self.piece_bytes)
        return Task(self.request, Piece(start, start + self._buf_base, self.next_offset - start, self.mode))

    def tasks(self) -> list["Task"]:
        """Every piece not yet taken, as Tasks."""
        return [self.take_task() for _ in range(self.remaining)]

    def drop(self) -> int:
        """Take every remaining piece without moving it (its request failed); returns how many."""
        count = self.remaining
        self.next_offset = self.end
        return count


class Task:
    """One piece of a request as a backend carries it out, including the retries of short transfers."""

    __slots__ = ("request", "file_offset", "buf_offset", "length", "mode", "done", "staging")

    def __init__(self, request: Request, piece: Piece) -> None:
        self.request = request
        self.file_offset = piece.file_offset
        self.buf_offset = piece.buf_offset
        self.length = piece.length
        self.mode = piece.mode
        self.done = 0
        self.staging: memoryview | None = None

    def begin(self, staging: memoryview) -> None:
        """Prepare the piece for its first system call (fill the staging buffer for a staged write)."""
        self.staging = staging if self.mode is Mode.STAGED else None
        if self.staging is not None and self.request.write:
            _copy(self.staging, self.request.memory, self.buf_offset, self.length, to_staging=True)

    @property
    def fd(self) -> int:
        file = self.request.file
        return file.buffered_fd if self.mode is Mode.BUFFERED else file.fd  # type: ignore[return-value]

    @property
    def position(self) -> int:
        """File offset of the next byte to move."""
        return self.file_offset + self.done

    def window_span(self) -> tuple[int, int]:
        """(address, length) of the memory the next system call moves."""
        base = _address(self.staging) if self.staging is not None else self.request.address + self.buf_offset
        return base + self.done, self.length - self.done

    def window(self) -> memoryview:
        """The memory the next system call moves."""
        if self.staging is not None:
            return self.staging[self.done : self.length]
        start = self.buf_offset + self.done
        return self.request.memory[start : self.buf_offset + self.length]

    def advance(self, result: int, align: int) -> bool:
        """Account for a system call's result; True once the whole piece has moved.

        Raises TensorIOError for an error result, EOF on a read, or a write that made no progress.
        """
        request = self.request
        if result < 0:
            raise io_error(-result, request.op, path=request.path, offset=self.position, length=self.length - self.done)
        if result == 0:
            if request.write:
                raise io_error(errno.EIO, "write", path=request.path, offset=self.position,
                               length=self.length - self.done)
            raise TensorIOError(
                errno.EIO, f"short read: the file is {os.fstat(self.fd).st_size} bytes long", path=request.path,
                offset=self.position, length=self.length - self.done, name_errno=False,
                hint=f"the request needs bytes up to {request.offset + request.nbytes}",
            )
        self.done += result
        if self.done == self.length:
            return True
        if self.mode is not Mode.BUFFERED and (self.position % align or (self.length - self.done) % align):
            # A short O_DIRECT transfer left an unaligned remainder: finish it through the page cache.
            request.file.buffered()
            self.mode = Mode.BUFFERED
        return False

    def error_from(self, exc: BaseException) -> TensorIOError:
        """The TensorIOError to report for ``exc``, raised while moving this piece."""
        if isinstance(exc, TensorIOError):
            return exc
        request = self.request
        if not isinstance(exc, OSError):  # not the disk's: the I/O worker itself failed
            return TensorIOError(errno.EIO, f"{request.op} failed: the I/O worker failed ({exc!r})", path=request.path,
                                 offset=self.position, length=self.length - self.done, name_errno=False)
        return io_error(exc.errno or errno.EIO, request.op, path=request.path, offset=self.position,
                        length=self.length - self.done)

    def finish(self, error: TensorIOError | None) -> None:
        """Complete the piece (copy a staged read out to the caller) and report it to its request."""
        if error is None and self.staging is not None and not self.request.write:
            _copy(self.staging, self.request.memory, self.buf_offset, self.length, to_staging=False)
        self.staging = None
        self.request.piece_finished(error, (self.buf_offset, self.buf_offset + self.length))


def _pread_all(fd: int, window: memoryview, offset: int, path: str) -> None:
    """Fill ``window`` from ``fd`` at ``offset`` with blocking reads. Raises TensorIOError."""
    done = 0
    while done < len(window):
        try:
            moved = os.preadv(fd, [window[done:]], offset + done)
        except OSError as exc:
            raise io_error(exc.errno or errno.EIO, "read", path=path, offset=offset + done,
                           length=len(window) - done) from None
        if moved == 0:
            raise TensorIOError(errno.EIO, "short read while checking a checksum", path=path, offset=offset + done,
                                length=len(window) - done, name_errno=False)
        done += moved


def _address(view: memoryview) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


def _copy(staging: memoryview, memory: memoryview, buf_offset: int, length: int, *, to_staging: bool) -> None:
    # ctypes.memmove releases the GIL, so staging copies run beside the caller's Python code.
    user = _address(memory[buf_offset:]) if length else 0
    stage = _address(staging)
    if to_staging:
        ctypes.memmove(stage, user, length)
    else:
        ctypes.memmove(user, stage, length)
