"""Several directories swept at once: one thread per device, every device starting each step together.

fio runs one job per device and ds_io maps one folder per device; here each directory gets a thread
that runs the whole sweep (`sweep_directory`) with its own buffers, and a barrier before each step
makes every device measure the same configuration at the same time, so that a configuration's figures
on the devices add up to what they move together. A failure or an interrupt on one stops them all
at the next step; each thread removes its own files.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence

from .measure import Buffers, PointResult
from .scratch import sigterm_as_interrupt
from .sweep import DiskSweep, Step, SweepStopped, sweep_directory
from .validate import Validation
from .workload import Workload

__all__ = ["sweep_together"]


def sweep_together(validations: Sequence[Validation], plan: Sequence[Step], buffers: Sequence[Buffers], *,
                   request_size: int, repeats: int, with_fio: bool = True,
                   done: Sequence[Mapping[str, PointResult]] | None = None,
                   on_step: Callable[[int, str, Step, PointResult | None], None] | None = None,
                   on_stopping: Callable[[], None] | None = None, workload: Workload | None = None) -> list[DiskSweep]:
    """`sweep_directory` on every directory at once, each with its own ``buffers[i]``, in step.

    ``done[i]`` are directory i's results already measured (a resumed sweep); ``on_step(i, phase,
    step, result)`` is called from directory i's thread as ``sweep_directory`` calls its own; ``workload``
    is the engine's traffic each step also drives (`sweep_directory`).
    Raises the first error of any directory (TensorIOError, MeasurementError), after every thread
    has stopped, and KeyboardInterrupt on Ctrl-C or SIGTERM, after calling ``on_stopping()`` and
    waiting for the step or fio run in flight on each to end (their files are then removed).
    """
    count = len(validations)
    if len(buffers) != count:
        raise ValueError(f"{count} directories but {len(buffers)} sets of buffers: one set each")
    done = done or [{} for _ in validations]
    barrier = threading.Barrier(count)
    stop = threading.Event()
    results: list[DiskSweep | None] = [None] * count
    errors: list[BaseException | None] = [None] * count
    # Waited on instead of Thread.join: a join interrupted by Ctrl-C no longer waits for its thread
    # afterwards (CPython releases the thread's lock on the way out), and the process would exit with
    # the thread's files in place and its I/O in flight.
    finished = [threading.Event() for _ in range(count)]

    def run(i: int) -> None:
        def gate(phase: str, step: Step, result: PointResult | None) -> None:
            if phase in ("start", "skip"):  # a step this device has from before waits for the others too
                try:
                    barrier.wait()  # sync point: every device starts this step together
                except threading.BrokenBarrierError:  # aborted: another failed, or the sweep is stopping
                    raise SweepStopped from None
            if on_step and phase != "skip":
                on_step(i, phase, step, result)

        try:
            results[i] = sweep_directory(validations[i], plan, buffers[i], request_size=request_size, repeats=repeats,
                                         with_fio=with_fio, done=done[i], on_step=gate, stop=stop,
                                         workload=workload)
        except SweepStopped:
            pass
        except BaseException as exc:  # handed to the caller's thread below
            errors[i] = exc
            stop.set()
            barrier.abort()
        finally:
            finished[i].set()

    threads = [threading.Thread(target=run, args=(i,), name=f"tensorio-bench-disk{i + 1}") for i in range(count)]
    with sigterm_as_interrupt():
        try:
            for t in threads:
                t.start()
            for event in finished:
                event.wait()
        except KeyboardInterrupt:
            stop.set()
            barrier.abort()
            if on_stopping:
                on_stopping()
            for event, t in zip(finished, threads):
                if t.ident is not None:  # started
                    event.wait()
            raise
    for error in errors:
        if error is not None:
            raise error
    return [r for r in results if r is not None]
