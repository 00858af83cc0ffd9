"""The thread-pool backend: blocking os.preadv / os.pwritev calls, which release the GIL.

Each of ``thread_count`` workers has ``queue_depth`` threads, so up to ``queue_depth`` pieces per
worker are in flight, one blocking system call each. Every piece is its own system call and a
thread takes its next piece as soon as it finishes one, so ``single_submit`` and ``overlap_events``
have nothing to change here; the io_uring backend honours both.

A thread takes a request's DIRECT pieces a few at a time (a chunk: one lock, one count towards the
request) and moves them with one call each straight between the caller's memory and the file; a
piece that comes back short, and every staged or buffered piece, is carried as a `Task`. A checksummed
request's pieces are reported one by one, each hashed by the thread that moved it right after.
"""

from __future__ import annotations

import collections
import errno
import os
import threading

from ._buffers import aligned_tensor
from ._config import AioConfig
from ._plan import Mode, Piece
from ._request import RoundRobin, Span, Task, byte_view, join_or_hand_off

_CHUNK = 16  # most DIRECT pieces a thread takes at once


class ThreadBackend:
    """Pieces go round-robin to per-worker queues, each drained by ``queue_depth`` threads."""

    name = "threads"

    def __init__(self, config: AioConfig, *, piece_bytes: int, align: int) -> None:
        self._align = align
        self._piece_bytes = piece_bytes
        self._depth = config.queue_depth
        self._queues = [_Queue() for _ in range(config.thread_count)]
        self._spread = RoundRobin(config.thread_count)
        self._threads = [
            threading.Thread(target=self._serve, args=(q,), name=f"tensorio-w{w}-t{t}", daemon=True)
            for w, q in enumerate(self._queues)
            for t in range(config.queue_depth)
        ]
        for thread in self._threads:
            thread.start()

    def submit(self, items: list[Span | Task]) -> None:
        """Queue a request's runs (or Tasks), spread over the workers."""
        for q, share in zip(self._queues, self._spread.split(items)):
            if share:
                q.put(share)

    def close(self) -> None:
        """Finish the queued pieces, then stop the threads (from any thread)."""
        for q in self._queues:
            q.stop()
        join_or_hand_off(self._threads, self._join)

    def _join(self) -> None:
        for thread in self._threads:
            thread.join()

    def _serve(self, work: "_Queue") -> None:
        # One staging buffer per thread: an anonymous mapping that costs RSS only once used.
        staging = byte_view(aligned_tensor(self._piece_bytes))
        while (item := work.take(self._depth)) is not None:
            if isinstance(item, tuple):
                _run_chunk(*item, staging, self._align)
            else:
                _run(item, staging, self._align)


class _Queue:
    """A worker's queue of Spans and Tasks; threads take a chunk of a DIRECT span's pieces at a time."""

    def __init__(self) -> None:
        self._items: collections.deque[Span | Task] = collections.deque()
        self._ready = threading.Condition(threading.Lock())
        self._stopping = False

    def put(self, items: list[Span | Task]) -> None:
        with self._ready:
            self._items.extend(items)
            self._ready.notify(sum(item.remaining if isinstance(item, Span) else 1 for item in items))

    def stop(self) -> None:
        """Let the threads exit once the queue is empty."""
        with self._ready:
            self._stopping = True
            self._ready.notify_all()

    def take(self, threads: int) -> Task | tuple[Span, int, int] | None:
        """The next Task, or (span, file offset, pieces) of a DIRECT span's next chunk; None once stopped
        and empty. A chunk is a share of the span's pieces left over the ``threads`` of the worker."""
        with self._ready:
            while not self._items:
                if self._stopping:
                    return None
                self._ready.wait()
            item = self._items[0]
            if not isinstance(item, Span):
                self._items.popleft()
                return item
            if item.request.error is not None:  # a failed request: the rest is skipped in one chunk
                self._items.popleft()
                return item, item.next_offset, item.drop()
            if item.mode is not Mode.DIRECT:
                task = item.take_task()
                if not item.remaining:
                    self._items.popleft()
                return task
            count = max(1, min(_CHUNK, item.remaining // (2 * threads)))
            offset = item.next_offset
            item.skip(count)
            if not item.remaining:
                self._items.popleft()
            return item, offset, count


def _run_chunk(span: Span, offset: int, count: int, staging: memoryview, align: int) -> None:
    """Move ``count`` DIRECT pieces of ``span`` from file ``offset`` on, one call each; report the ones
    that moved their whole length together, carry a short or failed one on as a Task."""
    request = span.request
    if request.error is not None:  # a request that already failed: its remaining pieces are skipped
        request.pieces_finished(count)
        return
    fd, memory, base = request.file.fd, request.memory, request.offset
    write, hashed = request.write, request.hashes is not None
    whole = 0
    for i in range(count):
        start = offset + i * span.piece_bytes
        length = min(span.piece_bytes, span.end - start)
        view = memory[start - base:start - base + length]
        try:
            moved = os.pwritev(fd, [view], start) if write else os.preadv(fd, [view], start)
        except OSError as exc:
            moved = -(exc.errno or errno.EIO)
        if moved == length:
            if hashed:  # report it at once, so that it is hashed right after it moved
                request.pieces_finished(1, None, ((start - base, start - base + length),))
            else:
                whole += 1
            continue
        task = Task(request, Piece(start, start - base, length, Mode.DIRECT))
        _run(task, staging, align, first=moved)
    if whole:
        request.pieces_finished(whole)


def _run(task: Task, staging: memoryview, align: int, first: int | None = None) -> None:
    """Move one piece with blocking calls until done or failed; report it to its request. ``first``
    is the result of a call already made for it."""
    error = None
    if task.request.error is None:  # a piece of a request that already failed is skipped
        call = os.pwritev if task.request.write else os.preadv
        try:
            if first is None:
                task.begin(staging)
            while True:
                if first is not None:
                    moved, first = first, None
                else:
                    try:
                        moved = call(task.fd, [task.window()], task.position)
                    except OSError as exc:
                        moved = -(exc.errno or errno.EIO)
                if task.advance(moved, align):
                    break
        except Exception as exc:  # every failure is reported through the request, never lost
            error = task.error_from(exc)
    task.finish(error)
