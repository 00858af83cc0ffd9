"""The simulated device's streams and events: a side stream's work run in order by a thread of its own, after
a seeded random delay (``schedule="random"``) or only when something waits for it (``schedule="late"``), and
the compute stream, which is the host thread. Each stream carries a vector clock of the side-stream work it
is ordered after, which `SimulatedDevice`'s checks read (offload/device/_simulated.py, docs/device.md).

The device is handed to the events and streams (composition): they call its ``raise_faults`` and
``_observe`` and import nothing of it.
"""

from __future__ import annotations

import random
import threading
import time
import weakref
from collections import deque
from typing import Any, Callable

from offload.at_exit import end_at_exit
from offload.device._base import Event, Stream
from offload.device._errors import DeviceError
from offload.device._simtorch import note_host_sync

__all__ = ["COMPUTE", "SCHEDULES", "Clock", "ComputeStream", "Queue", "SideStream", "SimEvent", "merge"]

COMPUTE = 0  # the compute stream's index in the vector clocks
SCHEDULES = ("random", "late")

Clock = dict[int, int]


def merge(a: Clock, b: Clock) -> Clock:
    """The later of two vector clocks, entry by entry."""
    return {k: max(a.get(k, 0), b.get(k, 0)) for k in a.keys() | b.keys()}


class Queue:
    """A side stream's work: run in order by one thread, each op when the schedule lets it."""

    def __init__(self, index: int, name: str, schedule: str, rng: random.Random, max_delay_s: float,
                 on_fault: Callable[[BaseException], None]) -> None:
        self.index, self.name = index, name
        self._schedule, self._rng, self._max_delay = schedule, rng, max_delay_s
        self._on_fault = on_fault
        self._cond = threading.Condition()
        self._ops: deque[tuple[int, Callable[[], None]]] = deque()
        self.issued = 0
        self.executed = 0
        self._demanded = 0
        self.stopped = False
        self._retired = False
        self._thread = threading.Thread(target=self._run, name=f"simulated-stream-{name}", daemon=True)
        self._thread.start()
        end_at_exit(self, lambda queue: (queue.stop(), queue.join()))

    def submit(self, op: Callable[[], None]) -> int:
        with self._cond:
            if self.stopped:
                raise DeviceError(f"stream {self.name!r}: the simulated device is closed")
            self.issued += 1
            self._ops.append((self.issued, op))
            self._cond.notify_all()
            return self.issued

    def wait_executed(self, seq: int) -> None:
        """Block until op ``seq`` has run (under ``schedule="late"``, this is what lets it run)."""
        with self._cond:
            self._demanded = max(self._demanded, seq)
            self._cond.notify_all()
            while self.executed < seq:
                if self.stopped:
                    raise DeviceError(f"stream {self.name!r}: the simulated device was closed with work pending")
                self._cond.wait()

    def stop(self) -> None:
        """End the thread now; work not yet run is dropped (the device is closing)."""
        with self._cond:
            self.stopped = True
            self._cond.notify_all()

    def join(self) -> None:
        """Wait for the thread to end (after `stop`): a daemon thread still in a torch call when the
        interpreter exits can abort the process (offload/at_exit.py)."""
        if self._thread is not threading.current_thread():
            self._thread.join()

    def retire(self) -> None:
        """End the thread once the work issued has run (its stream is gone; its events may still wait)."""
        with self._cond:
            self._retired = True
            self._cond.notify_all()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self.stopped and not (
                        self._ops and (self._schedule == "random" or self._ops[0][0] <= self._demanded)):
                    if self._retired and not self._ops:
                        self.stopped = True
                        break
                    self._cond.wait()
                if self.stopped:
                    return
                seq, op = self._ops[0]
            if self._schedule == "random":
                time.sleep(self._rng.uniform(0.0, self._max_delay))  # scheduling noise, not a wait for an outcome
            try:
                op()
            except BaseException as exc:  # noqa: BLE001 - handed to the host at its next call
                self._on_fault(exc)
            del op  # what it holds (views of device buffers) goes now, not at the next op
            with self._cond:
                self._ops.popleft()
                self.executed = seq
                self._cond.notify_all()


class SimEvent(Event):
    def __init__(self, device: Any, queue: Queue | None, index: int, seq: int, clock: Clock) -> None:
        self._device, self._queue = device, queue
        self.index, self.seq, self.clock = index, seq, clock
        self.number = 0
        """The copy it ends (the device's count of copies issued), 0 for other work."""
        self.work = ""
        """What it ends where that is not a copy (a collective), for errors."""

    @property
    def label(self) -> str:
        """How errors name the work it ends: "copy #3", "collective #2 (all_gather of ...)"."""
        return self.work or f"copy #{self.number}"

    @property
    def stream_name(self) -> str:
        return "compute" if self._queue is None else self._queue.name

    @property
    def done(self) -> bool:
        return self._queue is None or self._queue.executed >= self.seq

    def run(self) -> None:
        """Block until done (demanding it under the late schedule); not a host observation."""
        if self._queue is not None:
            self._queue.wait_executed(self.seq)

    def query(self) -> bool:
        self._device.raise_faults()
        if self.done:
            self._device._observe(self.clock)
            return True
        return False

    def synchronize(self) -> None:
        note_host_sync("synchronize")
        self._device.raise_faults()
        self.run()
        self._device._observe(self.clock)
        self._device.raise_faults()


class SideStream(Stream):
    def __init__(self, device: Any, queue: Queue) -> None:
        self._device, self.queue, self.name = device, queue, queue.name
        self.index = queue.index
        self.clock: Clock = {queue.index: 0}
        weakref.finalize(self, queue.retire)

    def submit(self, op: Callable[[], None]) -> SimEvent:
        seq = self.queue.submit(op)
        self.clock[self.queue.index] = seq
        return SimEvent(self._device, self.queue, self.queue.index, seq, dict(self.clock))

    def wait_event(self, event: Event) -> None:
        self._device.raise_faults()
        self.clock = merge(self.clock, event.clock)
        self.submit(event.run)

    def record(self) -> Event:
        return self.submit(lambda: None)


class ComputeStream(Stream):
    """The host thread: what it waits for is run before the next compute, not before the host goes on."""

    name = "compute"
    index = COMPUTE

    def __init__(self, device: Any) -> None:
        self._device = device
        self.clock: Clock = {COMPUTE: 0}
        self._pending: list[SimEvent] = []

    def wait_event(self, event: Event) -> None:
        self._device.raise_faults()
        self.clock = merge(self.clock, event.clock)
        self._pending.append(event)

    def run_pending(self) -> None:
        for event in self._pending:
            event.run()
        self._pending.clear()

    def submit(self, op: Callable[[], None]) -> SimEvent:
        self.run_pending()
        op()
        return self.record()

    def record(self) -> Event:
        self.run_pending()
        return SimEvent(self._device, None, COMPUTE, self.mark(), dict(self.clock))

    def mark(self) -> int:
        """A new point in compute's order, after the compute issued so far: what a later event covers."""
        self.clock[COMPUTE] += 1
        return self.clock[COMPUTE]
