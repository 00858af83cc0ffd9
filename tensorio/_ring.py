"""A liburing ``Ring``'s submission and completion queues as numpy arrays: whole batches per call.

The liburing package prepares one entry per Python call (four or five calls per piece) and holds the
GIL in each, the kernel's issue of the I/O included. `RingQueues` writes a batch of submission
entries (SQEs) with a few numpy operations, hands them to the kernel with liburing's C
``io_uring_submit`` called through ctypes (which releases the GIL), and reads every posted completion
(CQE) at once. Python's cost is then per batch, not per piece (docs/tensorio.md, "Small blocks").

The package's extension exports liburing's C functions, and its ``Ring`` object holds a pointer to the
C ``struct io_uring`` right after the PyObject header. The layout of that struct (`_IoUring`, liburing
2.x) is checked before use, end to end: the ring's flags, fd and features must sit where expected,
liburing's own ``io_uring_get_sqe`` must return the entry this module computes, and a no-op written
here must complete with the tag written. A liburing laid out otherwise is not used (the thread-pool
backend runs instead). Ordering: ``io_uring_cq_ready`` (a load-acquire of the CQ tail) is called before
the entries are read and ``io_uring_cq_advance`` (a store-release of the CQ head) after, both in C.
"""

from __future__ import annotations

import ctypes
import errno
import os
import sys

import numpy as np

_HEADER = ctypes.sizeof(ctypes.c_ssize_t) + ctypes.sizeof(ctypes.c_void_p)  # PyObject header
_UINT_P = ctypes.POINTER(ctypes.c_uint)

OP_NOP, OP_READ, OP_WRITE = 0, 22, 23  # enum io_uring_op (kernel ABI)
SQE_BYTES, CQE_BYTES = 64, 16
SQE_WORDS = SQE_BYTES // 8
_TEST_TAG = 0x7E5701


class _SubmissionQueue(ctypes.Structure):
    _fields_ = [("khead", _UINT_P), ("ktail", _UINT_P), ("kring_mask", _UINT_P), ("kring_entries", _UINT_P),
                ("kflags", _UINT_P), ("kdropped", _UINT_P), ("array", _UINT_P), ("sqes", ctypes.c_void_p),
                ("sqe_head", ctypes.c_uint), ("sqe_tail", ctypes.c_uint), ("ring_sz", ctypes.c_size_t),
                ("ring_ptr", ctypes.c_void_p), ("ring_mask", ctypes.c_uint), ("ring_entries", ctypes.c_uint),
                ("pad", ctypes.c_uint * 2)]


class _CompletionQueue(ctypes.Structure):
    _fields_ = [("khead", _UINT_P), ("ktail", _UINT_P), ("kring_mask", _UINT_P), ("kring_entries", _UINT_P),
                ("kflags", _UINT_P), ("koverflow", _UINT_P), ("cqes", ctypes.c_void_p),
                ("ring_sz", ctypes.c_size_t), ("ring_ptr", ctypes.c_void_p), ("ring_mask", ctypes.c_uint),
                ("ring_entries", ctypes.c_uint), ("pad", ctypes.c_uint * 2)]


class _IoUring(ctypes.Structure):
    _fields_ = [("sq", _SubmissionQueue), ("cq", _CompletionQueue), ("flags", ctypes.c_uint),
                ("ring_fd", ctypes.c_int), ("features", ctypes.c_uint), ("enter_ring_fd", ctypes.c_int)]


def _library(L, *, keep_gil: bool) -> ctypes.CDLL:
    """The package's extension as a ctypes library (PyDLL keeps the GIL: for calls of nanoseconds)."""
    path = sys.modules[L.io_uring_submit.__module__].__file__
    return ctypes.PyDLL(path) if keep_gil else ctypes.CDLL(path)


def _ring_address(ring) -> int:
    return ctypes.c_void_p.from_address(id(ring) + _HEADER).value or 0


class RingSubmit:
    """``io_uring_submit`` on a liburing ``Ring`` without holding the GIL: call it to submit every
    prepared entry; returns how many the kernel took, raises OSError for a failed system call.

    Raises RuntimeError (at construction) when the Ring's layout is not the one tensorio knows, and
    OSError or AttributeError when the package's extension does not export ``io_uring_submit``.
    """

    def __init__(self, L, ring) -> None:
        self._submit = _library(L, keep_gil=False).io_uring_submit
        self._submit.argtypes = [ctypes.c_void_p]
        self._submit.restype = ctypes.c_int
        self._ring = ring  # the C struct lives as long as this object
        address = _ring_address(ring)
        if not address or ring.ring_fd <= 0:
            raise RuntimeError("liburing's Ring layout is not the one tensorio knows (no initialised ring)")
        struct = _IoUring.from_address(address)
        if (struct.flags, struct.ring_fd, struct.features, struct.enter_ring_fd) != (
                ring.flags, ring.ring_fd, ring.features, ring.enter_ring_fd):
            raise RuntimeError("liburing's Ring layout is not the one tensorio knows")
        self._address = address

    def __call__(self) -> int:
        while True:
            submitted = self._submit(self._address)
            if submitted >= 0:
                return submitted
            if submitted != -errno.EINTR:
                raise OSError(-submitted, f"io_uring_submit: {os.strerror(-submitted)}")


class RingQueues:
    """Batched access to an initialised liburing ``Ring`` of 64-byte SQEs and 16-byte CQEs.

    ``push_run`` writes the entries of a run of pieces with a few numpy operations (``push_one`` one
    entry); ``submit()`` hands them to the kernel (GIL released); ``completions()`` gives every
    completion posted so far as one structured array (tag, res), and ``release`` frees them.

    Raises RuntimeError (at construction) when the Ring is not laid out as tensorio knows it or a
    no-op written and read here does not round-trip.
    """

    def __init__(self, L, ring) -> None:
        self.submit = RingSubmit(L, ring)
        self._ring = ring
        self._address = _ring_address(ring)
        c = _library(L, keep_gil=True)
        self._cq_ready = c.io_uring_cq_ready
        self._cq_ready.argtypes, self._cq_ready.restype = [ctypes.c_void_p], ctypes.c_uint
        self._cq_advance = c.io_uring_cq_advance
        self._cq_advance.argtypes, self._cq_advance.restype = [ctypes.c_void_p, ctypes.c_uint], None
        self._get_sqe = c.io_uring_get_sqe
        self._get_sqe.argtypes, self._get_sqe.restype = [ctypes.c_void_p], ctypes.c_void_p
        self._struct = _IoUring.from_address(self._address)
        self._sq = sq = self._struct.sq  # views sharing the struct's memory
        cq = self._struct.cq
        unusual = 0
        for name in ("IORING_SETUP_SQE128", "IORING_SETUP_CQE32", "IORING_SETUP_SQE_MIXED", "IORING_SETUP_CQE_MIXED",
                     "IORING_SETUP_SQPOLL", "IORING_SETUP_SQ_REWIND"):
            unusual |= getattr(L, name, 0)
        if self._struct.flags & unusual:
            raise RuntimeError(f"the ring has setup flags {self._struct.flags:#x} that tensorio does not write for")
        for queue in (sq, cq):
            entries = queue.ring_entries
            if (not entries or entries & (entries - 1) or queue.ring_mask != entries - 1
                    or queue.kring_entries[0] != entries or queue.kring_mask[0] != queue.ring_mask):
                raise RuntimeError("liburing's Ring layout is not the one tensorio knows (queue sizes)")
        self.sq_entries = sq.ring_entries
        self.cq_entries = cq.ring_entries
        self._sq_mask, self._cq_mask = sq.ring_mask, cq.ring_mask
        self._sqes = np.ctypeslib.as_array((ctypes.c_uint64 * (sq.ring_entries * SQE_WORDS)).from_address(sq.sqes)
                                           ).reshape(sq.ring_entries, SQE_WORDS)
        self._cqes = np.ctypeslib.as_array((ctypes.c_uint64 * (cq.ring_entries * 2)).from_address(cq.cqes)
                                           ).view(CQE_DTYPE).reshape(cq.ring_entries)
        self._cq_head = cq.khead
        self._sq_head = sq.khead
        self._steps_u64 = np.arange(sq.ring_entries, dtype=np.uint64)
        self._entries = np.zeros((sq.ring_entries, SQE_WORDS), dtype=np.uint64)  # a batch is built here
        self._self_test()

    def _self_test(self) -> None:
        """A no-op through liburing's get_sqe position, this module's writer and reader."""
        tail = self._sq.sqe_tail
        address = self._get_sqe(self._address)  # advances sqe_tail by one, as push does below
        expected = self._sq.sqes + (tail & self._sq_mask) * SQE_BYTES
        if address != expected or self._sq.sqe_tail != (tail + 1) & 0xFFFFFFFF:
            raise RuntimeError("liburing's Ring layout is not the one tensorio knows (submission queue)")
        self._sq.sqe_tail = tail  # take it back: push_one writes the entry itself
        self.push_one(OP_NOP, 0, 0, 0, 0, _TEST_TAG)
        if self.submit() != 1:
            raise RuntimeError("a no-op written by tensorio was not taken by the kernel")
        while not self._cq_ready(self._address):
            os.sched_yield()  # a no-op completes inside the submit call; this does not loop in practice
        done = self.completions()
        seen = (done["tag"].tolist(), done["res"].tolist())
        self.release(len(done))
        if seen != ([_TEST_TAG], [0]):
            raise RuntimeError("liburing's Ring layout is not the one tensorio knows (completion queue)")

    def unsubmitted(self) -> int:
        """Entries pushed that the kernel has not taken yet (it stops at an entry it cannot start)."""
        return (self._sq.sqe_tail - self._sq_head[0]) & 0xFFFFFFFF

    def push_run(self, op: int, fd: int, offset: int, address: int, piece_bytes: int, count: int, end: int,
                 tag: int) -> None:
        """Write ``count`` entries for pieces back to back: piece i moves ``piece_bytes`` bytes (fewer
        for a piece reaching ``end``) at file offset ``offset + i * piece_bytes`` and memory address
        ``address + i * piece_bytes``, with user data ``tag + i``. ``op``: OP_READ or OP_WRITE.
        Entries are submitted by ``submit()``; the caller keeps the count within the free SQ entries."""
        entries = self._entries[:count]  # words 5-7 (buf_index, personality, addr3, ...) stay 0
        steps = self._steps_u64[:count]
        entries[:, 0] = op | (fd << 32)  # opcode (u8) | flags (u8) = 0 | ioprio (u16) = 0 | fd (s32)
        np.multiply(steps, piece_bytes, out=entries[:, 1])
        entries[:, 1] += offset
        np.add(entries[:, 1], (address - offset) & _U64, out=entries[:, 2])  # wraps modulo 2**64
        entries[:, 3] = piece_bytes  # len (u32) | rw_flags (u32) = 0
        last = offset + (count - 1) * piece_bytes
        if end - last < piece_bytes:
            entries[count - 1, 3] = end - last
        np.add(steps, tag, out=entries[:, 4])
        self._copy_in(entries)

    def push_one(self, op: int, fd: int, offset: int, address: int, length: int, tag: int) -> None:
        """Write one entry: as `push_run` for a single piece of ``length`` bytes."""
        entry = self._entries[:1]
        entry[0, :5] = (op | (fd << 32), offset, address, length, tag)
        self._copy_in(entry)

    def _copy_in(self, entries: np.ndarray) -> None:
        count = len(entries)
        tail = self._sq.sqe_tail
        start = tail & self._sq_mask
        first = min(count, self.sq_entries - start)  # the ring wraps after `first` entries
        self._sqes[start:start + first] = entries[:first]
        if first < count:
            self._sqes[:count - first] = entries[first:]
        self._sq.sqe_tail = (tail + count) & 0xFFFFFFFF

    def ready(self) -> int:
        """How many completions are posted and not yet released."""
        return self._cq_ready(self._address)

    def completions(self) -> np.ndarray:
        """Every completion posted and not yet released, oldest first, as a structured array with the
        fields ``tag`` (uint64 user data) and ``res`` (int32 result). Read it, then `release` it: the
        kernel may overwrite the entries once released."""
        ready = self._cq_ready(self._address)  # load-acquire of the tail: entries below it are complete
        if not ready:
            return self._cqes[:0]
        start = self._cq_head[0] & self._cq_mask
        if start + ready <= len(self._cqes):
            return self._cqes[start:start + ready]  # a view of the ring itself
        return np.concatenate((self._cqes[start:], self._cqes[:start + ready - len(self._cqes)]))

    def release(self, count: int) -> None:
        """Free the ``count`` oldest completions for the kernel to reuse."""
        self._cq_advance(self._address, count)  # store-release of the head


_U64 = (1 << 64) - 1
CQE_DTYPE = np.dtype([("tag", "<u8"), ("res", "<i4"), ("flags", "<u4")])
