"""The io_uring backend, through the `liburing` package.

Each of ``thread_count`` workers is one thread driving its own ring with ``queue_depth`` slots.
The worker sleeps in a read of an eventfd that the ring signals on every completion and that
``submit`` signals on new work: liburing's own waits hold the GIL, an eventfd read releases it.
It submits through liburing's C ``io_uring_submit`` called by ctypes (`RingSubmit`), which releases
the GIL too: the kernel issues the I/O inside that call, and the package's binding of it holds the
GIL meanwhile, stopping every other Python thread of the process (a training loop's included).
"""

from __future__ import annotations

import collections
import ctypes
import errno
import logging
import os
import platform
import sys
import threading

from ._buffers import aligned_tensor
from ._config import AioConfig
from ._request import RoundRobin, Task, byte_view, join_or_hand_off

log = logging.getLogger("tensorio")

MIN_KERNEL = (6, 14)  # the liburing package's own requirement

_probe: tuple[bool, str] | None = None
_probe_lock = threading.Lock()


def _kernel_version() -> tuple[int, int]:
    parts = platform.release().split(".")
    try:
        return int(parts[0]), int("".join(c for c in parts[1] if c.isdigit()) or 0)
    except (IndexError, ValueError):
        return (0, 0)


def probe_io_uring() -> tuple[bool, str]:
    """Whether the io_uring backend can run here, and why not when it cannot (probed once)."""
    global _probe
    with _probe_lock:
        if _probe is None:
            _probe = _probe_once()
        return _probe


def _probe_once() -> tuple[bool, str]:
    kernel = _kernel_version()
    if kernel < MIN_KERNEL:
        return False, f"Linux {platform.release()} is older than the {MIN_KERNEL[0]}.{MIN_KERNEL[1]} liburing needs"
    try:
        import liburing as L
    except ImportError as exc:
        return False, f"the liburing package is not importable ({exc}); pip install liburing"
    try:
        SlotIovec(L)
    except (RuntimeError, TypeError, ValueError) as exc:
        return False, f"the installed liburing {L.__version__} is not usable: {exc}"
    ring = L.Ring()
    try:
        L.io_uring_queue_init(2, ring)
    except OSError as exc:
        return False, f"io_uring_setup failed ({exc.strerror}); io_uring may be disabled (sysctl or seccomp)"
    try:
        try:
            submit = RingSubmit(L, ring)
        except (AttributeError, OSError, RuntimeError) as exc:
            return False, f"the installed liburing {L.__version__} is not usable: {exc}"
        sqe = L.io_uring_get_sqe(ring)
        L.io_uring_prep_nop(sqe)
        L.io_uring_sqe_set_data64(sqe, 7)
        submit()
        cqe = L.Cqe()
        L.io_uring_wait_cqe(ring, cqe)
        entry = cqe[0]
        ok = entry.user_data == 7 and entry.res == 0
        L.io_uring_cqe_seen(ring, entry)
    except OSError as exc:
        return False, f"an io_uring no-op failed ({exc.strerror})"
    finally:
        L.io_uring_queue_exit(ring)
    if not ok:
        return False, "an io_uring no-op completed wrongly"
    return True, f"io_uring works (Linux {platform.release()}, liburing {L.__version__})"


# The liburing package's Iovec never releases the buffers it was built from: one Iovec per piece
# would keep every tensor it ever moved alive. So each ring slot builds one Iovec, once, over a
# one-byte anchor, and points its C `struct iovec` at each piece's memory. The object layout this
# relies on (PyObject header, then `size_t len`, then `struct iovec *`) is checked by `SlotIovec`
# itself, and by the probe, before any I/O: a liburing that lays it out otherwise is not used.
_HEADER = ctypes.sizeof(ctypes.c_ssize_t) + ctypes.sizeof(ctypes.c_void_p)


class _CIovec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


class SlotIovec:
    """A liburing ``Iovec`` of one entry that can be re-pointed at any memory without a new object.

    Raises RuntimeError when the installed liburing lays its Iovec out differently than expected.
    """

    def __init__(self, L) -> None:
        self._anchor = bytearray(1)  # kept alive for good by the Iovec, by design of liburing
        self.iovec = L.Iovec([memoryview(self._anchor)])
        count = ctypes.c_size_t.from_address(id(self.iovec) + _HEADER).value
        entry = _CIovec.from_address(ctypes.c_void_p.from_address(id(self.iovec) + _HEADER + 8).value)
        anchor = ctypes.addressof(ctypes.c_char.from_buffer(self._anchor))
        if count != 1 or entry.iov_base != anchor or entry.iov_len != 1:
            raise RuntimeError("liburing's Iovec layout is not the one tensorio knows")
        self._entry = entry

    def point(self, address: int, length: int) -> None:
        """Make the Iovec describe ``length`` bytes at ``address``."""
        self._entry.iov_base = address
        self._entry.iov_len = length


# The liburing package holds the GIL in every call, `io_uring_submit` included, in which the kernel
# issues the I/O (milliseconds for a batch of O_DIRECT pieces). Its extension exports liburing's C
# functions, and its `Ring` object holds a pointer to the C `struct io_uring` right after the PyObject
# header; `RingSubmit` calls the C function on that struct through ctypes, which releases the GIL.
# The pointer is checked before use: the struct must hold the ring's flags, fd, features and
# registered fd, as the binding reports them, side by side (as liburing's struct io_uring does).
_STRUCT_SCAN = 512  # bytes of struct io_uring searched for those fields (it is 216 in liburing 2.x)


class RingSubmit:
    """``io_uring_submit`` on a liburing ``Ring`` without holding the GIL: call it to submit every
    prepared entry; returns how many the kernel took, raises OSError for a failed system call.

    Raises RuntimeError (at construction) when the Ring's layout is not the one tensorio knows, and
    OSError or AttributeError when the package's extension does not export ``io_uring_submit``.
    """

    def __init__(self, L, ring) -> None:
        library = ctypes.CDLL(sys.modules[L.io_uring_submit.__module__].__file__)
        self._submit = library.io_uring_submit
        self._submit.argtypes = [ctypes.c_void_p]
        self._submit.restype = ctypes.c_int
        self._ring = ring  # the C struct lives as long as this object
        address = ctypes.c_void_p.from_address(id(ring) + _HEADER).value
        if not address or ring.ring_fd <= 0:
            raise RuntimeError("liburing's Ring layout is not the one tensorio knows (no initialised ring)")
        expected = [value & 0xFFFFFFFF for value in (ring.flags, ring.ring_fd, ring.features, ring.enter_ring_fd)]
        words = list((ctypes.c_uint32 * (_STRUCT_SCAN // 4)).from_address(address))
        if sum(words[i:i + 4] == expected for i in range(len(words) - 3)) != 1:
            raise RuntimeError("liburing's Ring layout is not the one tensorio knows")
        self._address = address

    def __call__(self) -> int:
        while True:
            submitted = self._submit(self._address)
            if submitted >= 0:
                return submitted
            if submitted != -errno.EINTR:
                raise OSError(-submitted, f"io_uring_submit: {os.strerror(-submitted)}")


class UringBackend:
    """Pieces go round-robin to the workers' rings."""

    name = "io_uring"

    def __init__(self, config: AioConfig, *, piece_bytes: int, align: int) -> None:
        self._workers = [_Worker(config, piece_bytes, align, w) for w in range(config.thread_count)]
        self._spread = RoundRobin(config.thread_count)
        for worker in self._workers:
            worker.start()

    def submit(self, tasks: list[Task]) -> None:
        """Queue a request's pieces, spread over the workers."""
        for worker, share in zip(self._workers, self._spread.split(tasks)):
            if share:
                worker.enqueue(share)

    def close(self) -> None:
        """Finish the queued pieces, then stop the workers and free the rings (from any thread)."""
        for worker in self._workers:
            worker.stop()
        join_or_hand_off(self._workers, self._join)

    def _join(self) -> None:
        for worker in self._workers:
            worker.join()
            worker.close()


class _Worker(threading.Thread):
    def __init__(self, config: AioConfig, piece_bytes: int, align: int, index: int) -> None:
        super().__init__(name=f"tensorio-uring-{index}", daemon=True)
        import liburing as L

        self._L = L
        self._depth = config.queue_depth
        self._single_submit = config.single_submit
        self._overlap = config.overlap_events
        self._align = align
        self._ring = L.Ring()
        L.io_uring_queue_init(max(2, 1 << (self._depth - 1).bit_length()), self._ring)
        self._submit = RingSubmit(L, self._ring)
        self._wakeup = os.eventfd(0, os.EFD_CLOEXEC)
        L.io_uring_register_eventfd(self._ring, self._wakeup)
        self._incoming: collections.deque[Task] = collections.deque()
        self._stopping = False
        self._broken: BaseException | None = None  # set when the ring itself failed
        self._enqueue_lock = threading.Lock()  # orders enqueue against the ring failing
        # One staging buffer and one iovec per slot: anonymous mappings that cost RSS only once used.
        self._staging = [byte_view(aligned_tensor(piece_bytes)) for _ in range(self._depth)]
        self._iovecs = [SlotIovec(L) for _ in range(self._depth)]

    def enqueue(self, tasks: list[Task]) -> None:
        with self._enqueue_lock:
            broken = self._broken
            if broken is None:
                self._incoming.extend(tasks)
                os.eventfd_write(self._wakeup, 1)
                return
        for task in tasks:  # the ring failed earlier: fail at once rather than queue for nobody
            task.finish(task.error_from(broken))

    def stop(self) -> None:
        """Ask the worker to finish what it holds and exit; ``join`` it, then ``close`` it."""
        self._stopping = True
        os.eventfd_write(self._wakeup, 1)

    def close(self) -> None:
        os.close(self._wakeup)

    def run(self) -> None:
        L, ring = self._L, self._ring
        free = list(range(self._depth))
        inflight: dict[int, Task] = {}  # slot -> the task whose piece the kernel holds
        again: collections.deque[tuple[int, Task]] = collections.deque()  # short transfers to continue
        cqe = L.Cqe()
        try:
            while True:
                # 1. Reap every completion already posted; never block inside liburing (it holds the GIL).
                for _ in range(L.io_uring_cq_ready(ring)):
                    L.io_uring_peek_cqe(ring, cqe)
                    entry = cqe[0]
                    slot = entry.user_data
                    try:
                        result = entry.res
                    except OSError as exc:  # the binding raises for a negative result
                        result = -(exc.errno or errno.EIO)
                    L.io_uring_cqe_seen(ring, entry)
                    task = inflight.pop(slot)
                    try:
                        if not task.advance(result, self._align):
                            again.append((slot, task))
                            continue
                        error = None
                    except Exception as exc:
                        error = task.error_from(exc)
                    task.finish(error)
                    free.append(slot)

                # 2. Submit: at once as slots free up (overlap_events), else only once the batch drained.
                if self._overlap or not inflight:
                    prepared = 0
                    while again:
                        slot, task = again.popleft()
                        self._prep(slot, task)
                        inflight[slot] = task
                        prepared += self._submit_one()
                    while free and self._incoming:
                        task = self._incoming.popleft()
                        if task.request.error is not None:  # the request already failed: skip
                            task.finish(None)
                            continue
                        slot = free.pop()
                        try:
                            task.begin(self._staging[slot])
                        except Exception as exc:
                            task.finish(task.error_from(exc))
                            free.append(slot)
                            continue
                        self._prep(slot, task)
                        inflight[slot] = task
                        prepared += self._submit_one()
                    if prepared:
                        self._submit()  # releases the GIL

                if self._stopping and not inflight and not again and not self._incoming:
                    return
                # 3. Sleep until a completion or new work arrives (releases the GIL).
                os.eventfd_read(self._wakeup)
        except Exception as exc:  # the ring itself failed: fail every piece it holds, never hang
            log.error("tensorio: io_uring worker failed: %r", exc)
            with self._enqueue_lock:
                self._broken = exc
        finally:
            L.io_uring_queue_exit(ring)  # waits for or cancels what the kernel still holds
        with self._enqueue_lock:  # from here on enqueue fails tasks itself
            stranded = list(inflight.values()) + [task for _, task in again] + list(self._incoming)
            self._incoming.clear()
        for task in stranded:
            task.finish(task.error_from(self._broken or RuntimeError("io_uring worker stopped")))

    def _prep(self, slot: int, task: Task) -> None:
        L = self._L
        slot_iovec = self._iovecs[slot]
        slot_iovec.point(*task.window_span())
        iovec = slot_iovec.iovec
        sqe = L.io_uring_get_sqe(self._ring)
        if task.request.write:
            L.io_uring_prep_writev(sqe, task.fd, iovec, task.position)
        else:
            L.io_uring_prep_readv(sqe, task.fd, iovec, task.position)
        L.io_uring_sqe_set_data64(sqe, slot)

    def _submit_one(self) -> int:
        """Count a prepared entry; with single_submit, submit it now with its own system call."""
        if self._single_submit:
            self._submit()
            return 0
        return 1
