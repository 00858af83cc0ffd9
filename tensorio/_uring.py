"""The io_uring backend, through the `liburing` package.

Each of ``thread_count`` workers is one thread driving its own ring with ``queue_depth`` slots.
The worker sleeps in a read of an eventfd that the ring signals on every completion and that
``submit`` signals on new work: liburing's own waits hold the GIL, an eventfd read releases it.
Entries are written and completions read in whole batches (`RingQueues`): the DIRECT pieces of a
request's run go in with a few numpy operations per batch and complete in bulk once every one's byte
count is checked, with no Python object per piece; staged and buffered pieces, and any piece that
fails or comes back short, are carried one by one as `Task`s. Submission is liburing's C
``io_uring_submit`` called by ctypes (`RingSubmit`), which releases the GIL: the kernel issues the I/O
inside that call, and the package's binding of it would hold the GIL meanwhile, stopping every other
Python thread of the process (a training loop's included).
"""

from __future__ import annotations

import collections
import itertools
import logging
import os
import platform
import threading

import numpy as np

from ._buffers import aligned_tensor
from ._config import AioConfig
from ._plan import Mode, Piece
from ._request import RoundRobin, Span, Task, byte_view, join_or_hand_off
from ._ring import OP_READ, OP_WRITE, RingQueues, RingSubmit

__all__ = ["MIN_KERNEL", "RingSubmit", "UringBackend", "probe_io_uring"]

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
    ring = L.Ring()
    try:
        L.io_uring_queue_init(2, ring)
    except OSError as exc:
        return False, f"io_uring_setup failed ({exc.strerror}); io_uring may be disabled (sysctl or seccomp)"
    try:
        RingQueues(L, ring)  # writes, submits and reaps a no-op through the batched path
    except (AttributeError, RuntimeError, TypeError, ValueError) as exc:
        return False, f"the installed liburing {L.__version__} is not usable: {exc}"
    except OSError as exc:
        return False, f"an io_uring no-op failed ({exc.strerror})"
    finally:
        L.io_uring_queue_exit(ring)
    return True, f"io_uring works (Linux {platform.release()}, liburing {L.__version__})"


class UringBackend:
    """Pieces go round-robin to the workers' rings."""

    name = "io_uring"

    def __init__(self, config: AioConfig, *, piece_bytes: int, align: int) -> None:
        self._workers = [_Worker(config, piece_bytes, align, w) for w in range(config.thread_count)]
        self._spread = RoundRobin(config.thread_count)
        for worker in self._workers:
            worker.start()

    def submit(self, items: list[Span | Task]) -> None:
        """Queue a request's runs (or Tasks), spread over the workers."""
        for worker, share in zip(self._workers, self._spread.split(items)):
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


# A completion's tag (user data) says what it finished: a Task in staging slot N is TASK | N; piece i
# (from the start of its flight) of a span's flight F is F << 32 | i.
_TASK = 1 << 62
_TASK_FLIGHT = _TASK >> 32
_FLIGHTS = 1 << 30  # flight numbers cycle below this
_INDEX = 0xFFFFFFFF  # a span piece's tag: its index in the flight


class _Flight:
    """A span's DIRECT pieces, pushed in batches: where they start (tags count pieces from there)
    and how many are in flight."""

    __slots__ = ("span", "origin", "inflight")

    def __init__(self, span: Span) -> None:
        self.span = span
        self.origin = span.next_offset
        self.inflight = 0

    def piece(self, index: int) -> Piece:
        """Piece ``index`` of the flight."""
        span = self.span
        offset = self.origin + index * span.piece_bytes
        return Piece(offset, offset - span.request.offset, min(span.piece_bytes, span.end - offset), Mode.DIRECT)

    def ranges(self, indices: np.ndarray) -> list[tuple[int, int]]:
        """The [first, end) ranges of the request's memory that pieces ``indices`` of the flight cover,
        back-to-back pieces joined."""
        span = self.span
        base, end, size = self.origin - span.request.offset, span.end - span.request.offset, span.piece_bytes
        order = np.sort(indices)
        runs = np.split(order, np.flatnonzero(np.diff(order) != 1) + 1)
        return [(base + int(run[0]) * size, min(end, base + (int(run[-1]) + 1) * size)) for run in runs]


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
        self._queues = RingQueues(L, self._ring)
        self._wakeup = os.eventfd(0, os.EFD_CLOEXEC)
        L.io_uring_register_eventfd(self._ring, self._wakeup)
        self._incoming: collections.deque[Span | Task] = collections.deque()
        self._stopping = False
        self._broken: BaseException | None = None  # set when the ring itself failed
        self._enqueue_lock = threading.Lock()  # orders enqueue against the ring failing
        # One staging buffer per slot: anonymous mappings that cost RSS only once used. A Task holds a
        # slot from its start to its finish; span pieces hold none (they move the caller's memory).
        self._staging = [byte_view(aligned_tensor(piece_bytes)) for _ in range(self._depth)]
        self._free_slots = list(range(self._depth))
        self._tasks: dict[int, Task] = {}  # slot -> the Task whose system call the kernel holds
        self._again: collections.deque[tuple[int, Task]] = collections.deque()  # short transfers to continue
        self._flights: dict[int, _Flight] = {}  # flight number -> the flight
        self._numbers = itertools.count()
        self._pushing: tuple[Span, int] | None = None  # the span being pushed, and its flight number
        self._inflight = 0  # pieces the kernel holds
        self._reported: list[tuple[_Flight, int, np.ndarray | None]] = []  # reaped, not yet counted (`_report`)

    def enqueue(self, items: list[Span | Task]) -> None:
        with self._enqueue_lock:
            broken = self._broken
            if broken is None:
                self._incoming.extend(items)
                os.eventfd_write(self._wakeup, 1)
                return
        for item in items:  # the ring failed earlier: fail at once rather than queue for nobody
            _fail(item, broken)

    def stop(self) -> None:
        """Ask the worker to finish what it holds and exit; ``join`` it, then ``close`` it."""
        self._stopping = True
        os.eventfd_write(self._wakeup, 1)

    def close(self) -> None:
        os.close(self._wakeup)

    def run(self) -> None:
        prefill = self._overlap and not self._single_submit
        try:
            while True:
                if prefill and (ready := self._queues.ready()) and self._fill(ready, spans_only=True):
                    self._queues.submit()  # 0. the disk's next pieces first, in the slots those completions free
                self._reap()  # 1. every completion already posted, in one batch
                if self._overlap or not self._inflight:  # 2. refill: as slots free up, or once drained
                    if self._fill() or self._queues.unsubmitted():
                        self._queues.submit()  # the kernel issues the I/O here (GIL released)
                self._report()  # 3. the pieces reaped in 1. to their requests (which hash them) while the disk works
                if self._stopping and not self._inflight and not self._again and not self._incoming:
                    return
                os.eventfd_read(self._wakeup)  # 4. sleep until a completion or new work (GIL released)
        except Exception as exc:  # the ring itself failed: fail every piece it holds, never hang
            log.error("tensorio: io_uring worker failed: %r", exc)
            with self._enqueue_lock:
                self._broken = exc
        finally:
            self._L.io_uring_queue_exit(self._ring)  # waits for or cancels what the kernel still holds
        self._fail_stranded()

    # ---- 1. completions ------------------------------------------------------------------------

    def _reap(self) -> None:
        """Account for every posted completion, checking each one's byte count: a batch of one
        flight's whole pieces in one step, anything else entry by entry."""
        done = self._queues.completions()
        count = len(done)
        if not count:
            return
        numbers = done["tag"] >> 32
        number = int(numbers[0])
        flight = self._flights.get(number) if number != _TASK_FLIGHT else None
        if flight is not None and (numbers == number).all() and (done["res"] == flight.span.piece_bytes).all():
            indices = done["tag"] & _INDEX if flight.span.request.hashes is not None else None
            self._queues.release(count)
            self._inflight -= count
            self._land(number, flight, count)
            self._reported.append((flight, count, indices))
            return
        entries = list(zip(done["tag"].tolist(), done["res"].tolist()))
        self._queues.release(count)
        self._inflight -= count
        whole: dict[int, list[int]] = {}  # flight number -> its pieces that moved their whole length
        for tag, result in entries:
            number, index = tag >> 32, tag & _INDEX
            if number == _TASK_FLIGHT:
                self._continue(index, self._tasks.pop(index), result)
                continue
            flight = self._flights[number]
            piece = flight.piece(index)
            if result == piece.length:
                whole.setdefault(number, []).append(index)
            else:  # failed or short: from here on the piece is a Task of its own
                self._land(number, flight, 1)
                self._continue(self._free_slots.pop(), Task(flight.span.request, piece), result)
        for number, indices in whole.items():
            flight = self._flights[number]
            self._land(number, flight, len(indices))
            self._reported.append((flight, len(indices),
                                   np.array(indices) if flight.span.request.hashes is not None else None))

    def _report(self) -> None:
        """Count the whole pieces reaped as finished to their requests (after the next submission, so that
        a checksummed request's hashing of them overlaps the disk's work)."""
        reported, self._reported = self._reported, []
        for flight, count, indices in reported:
            flight.span.request.pieces_finished(count, None, () if indices is None else flight.ranges(indices))

    def _land(self, number: int, flight: _Flight, count: int) -> Span:
        """Count ``count`` pieces of a flight as no longer in flight; returns its span."""
        flight.inflight -= count
        if not flight.inflight and not flight.span.remaining:
            del self._flights[number]
        return flight.span

    def _continue(self, slot: int, task: Task, result: int) -> None:
        """Account for a Task's system call: queue its continuation, or finish it and free its slot."""
        try:
            if not task.advance(result, self._align):
                self._again.append((slot, task))
                return
            error = None
        except Exception as exc:
            error = task.error_from(exc)
        task.finish(error)
        self._free_slots.append(slot)

    # ---- 2. submissions ------------------------------------------------------------------------

    def _fill(self, freed: int = 0, *, spans_only: bool = False) -> int:
        """Prepare entries for continuations and new pieces while the queue has room; returns how many
        are left for ``submit`` (none with single_submit, which submits each at once).

        ``freed``: completions posted but not yet reaped, counted as room; ``spans_only``: only DIRECT
        span pieces (they need no staging slot), up to the first other item. Before a reap, the disk gets
        its next pieces without waiting for the completions' bookkeeping (a 16 KiB queue of 32 completes
        all at once: the reap's 33 us were the disk's idle time, 10% of a batch). Pieces in the kernel
        and completions not yet reaped (`_inflight`), with the continuations to come, never exceed the
        completion ring: an overflowed completion is not seen by `_reap` and its request would hang."""
        room = self._depth - self._inflight - len(self._again) + freed
        if freed:
            room = min(room, self._queues.cq_entries - self._inflight - len(self._again))
        tasks: list[tuple[int, Task]] = []
        if not spans_only:  # the continuations first: they hold staging slots already
            tasks.extend(self._again)
            self._again.clear()
        prepared = 0
        incoming = self._incoming
        while room > 0 and incoming:
            item = incoming[0]
            if item.request.error is not None:  # the request already failed: skip what is left of it
                incoming.popleft()
                if isinstance(item, Span):
                    item.request.pieces_finished(item.drop())
                else:
                    item.finish(None)
                continue
            if isinstance(item, Span) and item.mode is Mode.DIRECT:
                count = min(room, item.remaining)
                self._push_span(item, count)
                room -= count
                prepared += count
            elif spans_only:
                break
            else:
                task = item.take_task() if isinstance(item, Span) else item
                slot = self._free_slots.pop()
                try:
                    task.begin(self._staging[slot])
                except Exception as exc:
                    task.finish(task.error_from(exc))
                    self._free_slots.append(slot)
                else:
                    tasks.append((slot, task))
                    room -= 1
            if not isinstance(item, Span) or not item.remaining:
                incoming.popleft()
                if self._pushing is not None and self._pushing[0] is item:
                    self._pushing = None  # its flight stays until its last piece lands
        if tasks:
            self._push_tasks(tasks)
            prepared += len(tasks)
        return 0 if self._single_submit else prepared

    def _push_span(self, span: Span, count: int) -> None:
        """Prepare the next ``count`` pieces of ``span`` as one batch of entries."""
        if self._pushing is None or self._pushing[0] is not span:
            number = next(self._numbers) % _FLIGHTS
            self._flights[number] = _Flight(span)
            self._pushing = (span, number)
        number = self._pushing[1]
        flight = self._flights[number]
        op, fd = (OP_WRITE if span.request.write else OP_READ), span.request.file.fd
        index = (span.next_offset - flight.origin) // span.piece_bytes
        offset, address = span.next_offset, span.address()
        flight.inflight += count
        self._inflight += count
        span.skip(count)
        if not self._single_submit:
            self._queues.push_run(op, fd, offset, address, span.piece_bytes, count, span.end, number << 32 | index)
            return
        for i in range(count):  # one system call per piece
            step = i * span.piece_bytes
            self._queues.push_run(op, fd, offset + step, address + step, span.piece_bytes, 1, span.end,
                                  number << 32 | (index + i))
            self._queues.submit()

    def _push_tasks(self, tasks: list[tuple[int, Task]]) -> None:
        """Prepare one entry for each (slot, Task): its next system call."""
        for slot, task in tasks:
            address, length = task.window_span()
            self._tasks[slot] = task
            self._queues.push_one(OP_WRITE if task.request.write else OP_READ, task.fd, task.position, address,
                                  length, _TASK | slot)
            if self._single_submit:
                self._queues.submit()
        self._inflight += len(tasks)

    def _fail_stranded(self) -> None:
        """After the ring stopped: report the pieces reaped, fail whatever it still held or had queued."""
        self._report()
        with self._enqueue_lock:  # from here on enqueue fails items itself
            stranded: list[Span | Task] = list(self._tasks.values()) + [task for _, task in self._again]
            stranded += list(self._incoming)
            flights = list(self._flights.values())
            self._incoming.clear()
        error = self._broken or RuntimeError("io_uring worker stopped")
        for flight in flights:
            if flight.inflight:  # its untaken pieces are failed with the incoming items
                flight.span.request.pieces_finished(flight.inflight, _error_for(flight.span, error))
        for item in stranded:
            _fail(item, error)


def _error_for(span: Span, exc: BaseException):
    return Task(span.request, Piece(span.next_offset, span.next_offset - span.request.offset,
                                    span.piece_bytes, span.mode)).error_from(exc)


def _fail(item: Span | Task, exc: BaseException) -> None:
    """Finish every piece of ``item`` as failed with ``exc``."""
    if isinstance(item, Span):
        count = item.drop()
        if count:
            item.request.pieces_finished(count, _error_for(item, exc))
    else:
        item.finish(item.error_from(exc))
