"""Fault injection for tests: fail, shorten or hold tensorio requests where the backend takes them.

While ``inject_faults(...)`` is active, every request of every `AioHandle` in the process (created
before or inside the block, either backend) passes through its rules on its way into the backend.
The faults are results of system calls, so what a test sees is tensorio's real error handling: a
`TensorIOError` naming the path and offset, short-transfer continuation, futures resolving late.

    import errno
    from tensorio.testing import FailNth, inject_faults

    with inject_faults() as faults:                 # no rules: count the requests of one step
        step()
    for n in range(1, faults.count + 1):            # then fail each of them in turn
        with inject_faults(FailNth(n, errno.ENOSPC)):
            with pytest.raises(TensorIOError):
                step()

A request is one ``read``/``write`` (or DeepSpeed ``*pread``/``*pwrite``) of at least one byte;
requests are numbered from 1 in the order they reach the backend (with several threads submitting,
that order may vary between runs: select by ``path=`` then).
"""

from __future__ import annotations

import contextlib
import errno as _errno
import os
import threading
from dataclasses import dataclass
from typing import Callable, Iterator

from ._request import Span, Task
from ._threads import ThreadBackend
from ._uring import UringBackend

__all__ = ["Delay", "Fail", "FailNth", "FaultInjector", "FlipBit", "RequestInfo", "Rule", "ShortTransfer", "flip_bit",
           "inject_faults"]

_BACKENDS = (ThreadBackend, UringBackend)


@dataclass(frozen=True, slots=True)
class RequestInfo:
    """A request as the rules see it."""

    op: str
    """"read" or "write"."""
    path: str
    """The file name as passed to the handle, or "fd N"."""
    offset: int
    length: int


class Rule:
    """Selects requests: those of ``op`` ("read"/"write", None for both) whose path satisfies
    ``path`` (a predicate, None for all); of those, only the ``n``-th (from 1) when ``n`` is given.

    ``matched`` counts the requests that passed ``op`` and ``path``; ``hits`` those acted on.
    """

    def __init__(self, *, n: int | None = None, path: Callable[[str], bool] | None = None,
                 op: str | None = None) -> None:
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
            raise ValueError(f"n counts requests from 1, got {n!r}")
        if op not in (None, "read", "write"):
            raise ValueError(f"op must be \"read\", \"write\" or None, got {op!r}")
        if path is not None and not callable(path):
            raise TypeError(f"path must be a predicate taking the path (a str), got {type(path).__name__}")
        self.n, self.path, self.op = n, path, op
        self.matched = 0
        self.hits = 0

    def _select(self, info: RequestInfo) -> bool:
        if (self.op is not None and info.op != self.op) or (self.path is not None and not self.path(info.path)):
            return False
        self.matched += 1
        if self.n is not None and self.matched != self.n:
            return False
        self.hits += 1
        return True


class Fail(Rule):
    """The selected requests fail with ``errno`` (ENOSPC, EIO, ...): their first piece's system call
    moves nothing and completes with ``-errno``, so ``result()``/``wait()`` raise the TensorIOError
    tensorio builds for that error, naming the path and the request's first offset."""

    def __init__(self, errno: int = _errno.EIO, *, n: int | None = None, path: Callable[[str], bool] | None = None,
                 op: str | None = None) -> None:
        super().__init__(n=n, path=path, op=op)
        if isinstance(errno, bool) or not isinstance(errno, int) or errno <= 0:
            raise ValueError(f"errno must be a positive error number such as errno.ENOSPC, got {errno!r}")
        self.errno = errno


class FailNth(Fail):
    """The ``n``-th request (from 1) fails with ``errno``: ``FailNth(3, errno.ENOSPC)``."""

    def __init__(self, n: int, errno: int = _errno.EIO, *, path: Callable[[str], bool] | None = None,
                 op: str | None = None) -> None:
        super().__init__(errno, n=n, path=path, op=op)


class ShortTransfer(Rule):
    """The first system call of every piece of a selected request reports only ``nbytes`` moved
    (default: half the piece, at least 1), so tensorio continues the piece from there (through the
    page cache when the remainder is no longer aligned). The bytes on disk or in memory end right."""

    def __init__(self, *, nbytes: int | None = None, n: int | None = None,
                 path: Callable[[str], bool] | None = None, op: str | None = None) -> None:
        super().__init__(n=n, path=path, op=op)
        if nbytes is not None and (isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 1):
            raise ValueError(f"nbytes must be an integer >= 1 or None, got {nbytes!r}")
        self.nbytes = nbytes


def flip_bit(path: str | os.PathLike, offset: int, bit: int = 0) -> None:
    """Flip bit ``bit`` (0-7) of the byte at ``offset`` of the file at ``path``, in place (a corruption
    at rest). Raises ValueError for an offset past the file's end."""
    fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    try:
        byte = os.pread(fd, 1, offset)
        if len(byte) != 1:
            raise ValueError(f"flip_bit: offset {offset} is past the end of {os.fspath(path)}")
        os.pwrite(fd, bytes([byte[0] ^ (1 << bit)]), offset)
    finally:
        os.close(fd)


class FlipBit(Rule):
    """One bit of the bytes a selected read moves is flipped in its file just before the read starts
    (between the write that put them there and this read): bit ``bit`` of the byte ``byte`` bytes
    into the request (default: the middle byte), so that a checksum verification must name it.

    ``transient``: the file is put back as soon as the piece holding the byte has been read, as if
    the bit had flipped on its way (a bad transfer, a bad DIMM under the buffer): the verification's
    second read gets the right bytes. Otherwise the flip stays (a corruption on the disk).
    ``flipped`` lists (path, file offset) of each flip made.
    """

    def __init__(self, *, n: int | None = None, path: Callable[[str], bool] | None = None, byte: int | None = None,
                 bit: int = 0, transient: bool = False) -> None:
        super().__init__(n=n, path=path, op="read")
        if not 0 <= bit <= 7:
            raise ValueError(f"bit is 0..7, got {bit!r}")
        self.byte, self.bit, self.transient = byte, bit, transient
        self.flipped: list[tuple[str, int]] = []

    def _flip(self, request) -> int:
        """Flip the bit in ``request``'s file; return its offset in the request."""
        at = request.nbytes // 2 if self.byte is None else self.byte
        if not 0 <= at < request.nbytes:
            raise ValueError(f"FlipBit: byte {at} is outside the {request.nbytes}-byte request")
        flip_bit(request.path, request.offset + at, self.bit)
        self.flipped.append((request.path, request.offset + at))
        return at


class Delay(Rule):
    """The selected requests are held before the backend starts them until ``event`` is set: they
    move no data and their futures stay pending until then. A held request is released early when
    its handle is closed (``close()`` finishes every started request) or the injection ends."""

    def __init__(self, event: threading.Event, *, n: int | None = None,
                 path: Callable[[str], bool] | None = None, op: str | None = None) -> None:
        super().__init__(n=n, path=path, op=op)
        self.event = event
        self._held: list[tuple[object, list]] = []  # (backend, tasks), in arrival order
        self._lock = threading.Lock()
        self._waiter: threading.Thread | None = None
        self._stopped = False

    def _hold(self, backend: object, tasks: list) -> bool:
        """Keep ``tasks`` until the event; False when the event is already set (submit them now)."""
        with self._lock:
            if self.event.is_set() or self._stopped:
                return False
            self._held.append((backend, tasks))
            if self._waiter is None:
                self._waiter = threading.Thread(target=self._wait, name="tensorio-delay", daemon=True)
                self._waiter.start()
            return True

    def _wait(self) -> None:
        while not self.event.wait(0.05) and not self._stopped:
            pass
        self._release(lambda backend: True)

    def _release(self, which: Callable[[object], bool]) -> None:
        with self._lock:
            now = [(b, t) for b, t in self._held if which(b)]
            self._held = [(b, t) for b, t in self._held if not which(b)]
        for backend, tasks in now:
            _ORIGINAL_SUBMIT[type(backend)](backend, tasks)

    def _stop(self) -> None:
        with self._lock:
            self._stopped = True
            waiter = self._waiter
        self._release(lambda backend: True)
        if waiter is not None:
            waiter.join()


class FaultInjector:
    """The active injection: its rules, and the requests it has seen (``count``, ``requests``)."""

    def __init__(self, rules: tuple[Rule, ...]) -> None:
        for rule in rules:
            if not isinstance(rule, Rule):
                raise TypeError(f"inject_faults takes Fail, FailNth, ShortTransfer or Delay rules, got {rule!r}")
        self.rules = rules
        self.requests: list[RequestInfo] = []

    @property
    def count(self) -> int:
        """Requests seen while active, of every handle."""
        return len(self.requests)


@contextlib.contextmanager
def inject_faults(*rules: Rule) -> Iterator[FaultInjector]:
    """Apply ``rules`` to every request submitted, by any AioHandle, inside the block.

    Injections may be nested; each sees every request. On exit, requests still held by a `Delay`
    are released (nothing is left stranded) and the backends are restored.
    """
    injector = FaultInjector(rules)
    with _state_lock:
        if not _active:
            _patch()
        _active.append(injector)
    try:
        yield injector
    finally:
        with _state_lock:
            _active.remove(injector)
            if not _active:
                _unpatch()
        for rule in rules:
            if isinstance(rule, Delay):
                rule._stop()


# ---- the patch at the backends' submit point ------------------------------------------------------

_active: list[FaultInjector] = []
_state_lock = threading.Lock()  # guards _active, the patch, and rule counting (so n-th is exact)
_ORIGINAL_SUBMIT = {cls: cls.submit for cls in _BACKENDS}
_ORIGINAL_CLOSE = {cls: cls.close for cls in _BACKENDS}


def _patch() -> None:
    for cls in _BACKENDS:
        cls.submit = _submit
        cls.close = _close


def _unpatch() -> None:
    for cls in _BACKENDS:
        cls.submit = _ORIGINAL_SUBMIT[cls]
        cls.close = _ORIGINAL_CLOSE[cls]


def _submit(backend, items: list[Span | Task]) -> None:
    """Every request's way into the backend while an injection is active (one call per request)."""
    request = items[0].request
    info = RequestInfo(request.op, request.path, request.offset, request.nbytes)
    fail: Fail | None = None
    short: ShortTransfer | None = None
    delay: Delay | None = None
    flip: FlipBit | None = None
    with _state_lock:
        for injector in _active:
            injector.requests.append(info)
            for rule in injector.rules:
                if rule._select(info):
                    if isinstance(rule, Fail):
                        fail = fail or rule
                    elif isinstance(rule, ShortTransfer):
                        short = short or rule
                    elif isinstance(rule, Delay):
                        delay = delay or rule
                    elif isinstance(rule, FlipBit):
                        flip = flip or rule
    restore = None
    if flip is not None and request.nbytes:
        at = flip._flip(request)
        if flip.transient:
            restore = (at, lambda: flip_bit(request.path, request.offset + at, flip.bit))
    if fail is not None or short is not None or restore is not None:  # a faulty request goes in piece by piece
        tasks = [task for item in items for task in (item.tasks() if isinstance(item, Span) else [item])]
        items = [_FaultyTask(task, fail.errno if fail is not None and i == 0 else 0, short,
                             restore if restore is not None and
                             task.buf_offset <= restore[0] < task.buf_offset + task.length else None)
                 for i, task in enumerate(tasks)]
    if delay is None or not delay._hold(backend, items):
        _ORIGINAL_SUBMIT[type(backend)](backend, items)


def _close(backend) -> None:
    """Closing a backend first releases its held requests, so that close() finishes them."""
    with _state_lock:
        delays = [rule for injector in _active for rule in injector.rules if isinstance(rule, Delay)]
    for rule in delays:
        rule._release(lambda held: held is backend)
    _ORIGINAL_CLOSE[type(backend)](backend)


class _FaultyTask:
    """A Task whose first system call fails or comes back short; everything else is the Task's own."""

    __slots__ = ("_task", "_errno", "_short", "_calls", "_restore")

    def __init__(self, task: Task, errno: int, short: ShortTransfer | None, restore=None) -> None:
        self._task = task
        self._errno = errno
        self._short = short
        self._calls = 0
        self._restore = restore  # (byte, undo): a transient FlipBit's byte lies in this piece

    def finish(self, error) -> None:
        if self._restore is not None:  # the piece is read: put the file back before its verification
            self._restore[1]()
        self._task.finish(error)

    def __getattr__(self, name: str):
        return getattr(self._task, name)

    def window(self) -> memoryview:
        view = self._task.window()
        return view[:0] if self._failing() else view

    def window_span(self) -> tuple[int, int]:
        address, length = self._task.window_span()
        return (address, 0) if self._failing() else (address, length)

    def advance(self, result: int, align: int) -> bool:
        first, self._calls = self._calls == 0, self._calls + 1
        if first and self._errno:
            result = -self._errno
        elif first and self._short is not None and result > 0:
            result = min(result, self._short.nbytes or max(1, self._task.length // 2))
        return self._task.advance(result, align)

    def _failing(self) -> bool:
        return self._calls == 0 and self._errno != 0
