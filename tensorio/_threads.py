"""The thread-pool backend: blocking os.preadv / os.pwritev calls, which release the GIL.

Each of ``thread_count`` workers has ``queue_depth`` threads, so up to ``queue_depth`` pieces per
worker are in flight, one blocking system call each. Every piece is its own system call and a
thread takes its next piece as soon as it finishes one, so ``single_submit`` and ``overlap_events``
have nothing to change here; the io_uring backend honours both.
"""

from __future__ import annotations

import errno
import os
import queue
import threading

from ._buffers import aligned_tensor
from ._config import AioConfig
from ._request import RoundRobin, Span, Task, byte_view, join_or_hand_off


class ThreadBackend:
    """Pieces go round-robin to per-worker queues, each drained by ``queue_depth`` threads."""

    name = "threads"

    def __init__(self, config: AioConfig, *, piece_bytes: int, align: int) -> None:
        self._align = align
        self._piece_bytes = piece_bytes
        self._queues: list[queue.SimpleQueue] = [queue.SimpleQueue() for _ in range(config.thread_count)]
        self._spread = RoundRobin(config.thread_count)
        self._threads = [
            threading.Thread(target=self._serve, args=(q,), name=f"tensorio-w{w}-t{t}", daemon=True)
            for w, q in enumerate(self._queues)
            for t in range(config.queue_depth)
        ]
        for thread in self._threads:
            thread.start()

    def submit(self, items: list[Span | Task]) -> None:
        """Queue a request's pieces (its runs cut into one Task per piece), spread over the workers."""
        tasks: list[Span | Task] = []
        for item in items:
            tasks += item.tasks() if isinstance(item, Span) else [item]
        for q, share in zip(self._queues, self._spread.split(tasks)):
            for task in share:
                q.put(task)

    def close(self) -> None:
        """Finish the queued pieces, then stop the threads (from any thread)."""
        for q in self._queues:
            for _ in range(len(self._threads) // len(self._queues)):
                q.put(None)
        join_or_hand_off(self._threads, self._join)

    def _join(self) -> None:
        for thread in self._threads:
            thread.join()

    def _serve(self, tasks: queue.SimpleQueue) -> None:
        # One staging buffer per thread: an anonymous mapping that costs RSS only once used.
        staging = byte_view(aligned_tensor(self._piece_bytes))
        while (task := tasks.get()) is not None:
            _run(task, staging, self._align)


def _run(task: Task, staging: memoryview, align: int) -> None:
    """Move one piece with blocking calls until done or failed; report it to its request."""
    error = None
    if task.request.error is None:  # a piece of a request that already failed is skipped
        call = os.pwritev if task.request.write else os.preadv
        try:
            task.begin(staging)
            while True:
                try:
                    moved = call(task.fd, [task.window()], task.position)
                except OSError as exc:
                    moved = -(exc.errno or errno.EIO)
                if task.advance(moved, align):
                    break
        except Exception as exc:  # every failure is reported through the request, never lost
            error = task.error_from(exc)
    task.finish(error)
