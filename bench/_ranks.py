"""Training ranks as processes, as the engine runs them: one process per rank, each with its own
`AioHandle`, slots and swap files, driving the disk at once.

The processes come from the ``forkserver`` context with this module preloaded (torch and tensorio
imported once, in the server: a rank starts in a fraction of a second, not an interpreter's start
with torch), so no rank inherits this process's threads or open handles. The parent keeps the clock:

1. every rank lays out its files (untimed) and says ``ready``;
2. ``go``: all ranks start the swap pipeline together; the parent sleeps through the ramp;
3. ``begin``: the counted time starts (each rank notes its CPU time; the parent reads the disk's
   counters); ``halt`` ends it, and each rank sends back every request it completed (submitted and
   completed ns, from CLOCK_MONOTONIC, which every process shares), its process id and its CPU.

A rank that fails sends its error and sets ``halt``; one that dies without a word is named with its
exit status. The ranks ignore Ctrl-C (it reaches the whole process group): the parent's interrupt
handling (a sweep keeps what it measured) stops them through ``halt``. Either way every rank is stopped and its files removed before the error is raised.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import queue as queue_module
import signal
import threading
import time
from pathlib import Path
from typing import Any

from tensorio import AioConfig, AioHandle

from .diskstat import read_counters
from .measure import MeasurementError, process_cpu_seconds
from .workload import Counted, Workload, _buffer, _layout, _Recorder, _sleep, _train

__all__ = ["run_rank_processes"]

#: Seconds a rank may take to stop and send its requests after ``halt`` (its last pair in flight).
STOP_TIMEOUT_S = 60.0


def _context() -> Any:
    """The forkserver context, this module preloaded in the server (spawn where there is no forkserver)."""
    try:
        ctx = multiprocessing.get_context("forkserver")
    except ValueError:  # not on this platform
        return multiprocessing.get_context("spawn")
    ctx.set_forkserver_preload([__name__])
    return ctx


def run_rank_processes(config: AioConfig, directory: Path, workload: Workload, *, disks: tuple[str, ...] = (),
                       stop: threading.Event | None = None) -> Counted:
    """Run ``workload``'s ``ranks`` training ranks, each in its own process, and return what they did.
    Raises the rank's TensorIOError or MeasurementError, or MeasurementError for a rank that died."""
    ctx = _context()
    messages = ctx.Queue()
    go, begin, halt = ctx.Event(), ctx.Event(), ctx.Event()
    processes = [ctx.Process(target=_rank_main, args=(r, config, directory, workload, messages, go, begin, halt),
                             name=f"tensorio-bench-rank{r}", daemon=True) for r in range(workload.ranks)]
    for p in processes:
        p.start()
    try:
        backends = _collect(messages, processes, "ready", halt)
        go.set()  # sync point: every rank starts driving together
        _sleep(workload.ramp_s, halt, stop)
        cpu0, start, before = process_cpu_seconds(), time.perf_counter_ns(), read_counters(disks)
        begin.set()
        _sleep(workload.runtime_s, halt, stop)
        cpu1, end, after = process_cpu_seconds(), time.perf_counter_ns(), read_counters(disks)
        halt.set()
        done = _collect(messages, processes, "done", halt)
    finally:
        halt.set()
        _stop(processes, messages)
    events = [(r, *request) for r in range(workload.ranks) for request in done[r]["requests"]]
    return Counted(done=events, pids=[done[r]["pid"] for r in range(workload.ranks)], backend=backends[0]["backend"],
                   start=start, end=end, cpu=cpu1 - cpu0 + sum(done[r]["cpu"] for r in range(workload.ranks)),
                   before=before, after=after, disks=disks)


def _stop(processes: list[Any], messages: Any) -> None:
    """Wait for every rank to end, draining what they still send (a process cannot exit while its
    queue holds data nobody reads); kill one that takes over `STOP_TIMEOUT_S` (its files may stay)."""
    deadline = time.monotonic() + STOP_TIMEOUT_S
    while any(p.is_alive() for p in processes) and time.monotonic() < deadline:
        try:
            messages.get(timeout=0.1)
        except queue_module.Empty:
            pass
    for p in processes:
        if p.is_alive():
            p.kill()
        p.join()


def _collect(messages: Any, processes: list[Any], kind: str, halt: Any) -> list[dict[str, Any]]:
    """Every rank's ``kind`` message, in rank order. Raises the first rank's error, or MeasurementError
    naming a rank whose process ended without sending one."""
    got: dict[int, dict[str, Any]] = {}
    while len(got) < len(processes):
        try:
            message = messages.get(timeout=0.2)
        except queue_module.Empty:
            for r, p in enumerate(processes):
                if r not in got and p.exitcode is not None:
                    try:  # its last words may still be in the pipe
                        message = messages.get(timeout=1.0)
                        break
                    except queue_module.Empty:
                        halt.set()
                        raise MeasurementError(f"training rank {r} (pid {p.pid}) ended with exit status "
                                               f"{p.exitcode} before it was {kind}") from None
            else:
                continue
        if message["kind"] == "error":
            halt.set()
            raise message["error"]
        if message["kind"] == kind:
            got[message["rank"]] = message
    return [got[r] for r in range(len(processes))]


def _rank_main(r: int, config: AioConfig, directory: Path, workload: Workload, messages: Any, go: Any, begin: Any,
               halt: Any) -> None:
    """One rank, in its own process: lay out its files, say ready, run the swap pipeline from ``go`` to
    ``halt``, send back its requests, process id and CPU over the counted time (or its error)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the parent stops the ranks
    paths = [directory / f"workload-r{r}-f{i}.dat" for i in range(workload.files)]
    recorder = _Recorder()
    cpu = [0.0, 0.0]
    try:
        buffer = _buffer(2 * workload.request_bytes, workload.huge_pages)
        with AioHandle.from_config(config) as handle:
            for path in paths:  # 1. lay the files out (untimed)
                _layout(handle, buffer, path, workload.file_size())
            messages.put({"kind": "ready", "rank": r, "backend": handle.backend_name})
            while not go.wait(0.05):
                if halt.is_set():
                    return
            watcher = threading.Thread(target=_watch_cpu, args=(begin, halt, cpu), daemon=True)
            watcher.start()
            _train(handle, buffer, paths, workload, config, recorder, halt)
            watcher.join()
        messages.put({"kind": "done", "rank": r, "pid": os.getpid(), "requests": recorder.done,
                      "cpu": cpu[1] - cpu[0]})
    except BaseException as exc:  # sent to the parent, which raises it
        halt.set()
        messages.put({"kind": "error", "rank": r, "error": _sendable(exc, r)})
    finally:
        for path in paths:
            path.unlink(missing_ok=True)


def _watch_cpu(begin: Any, halt: Any, cpu: list[float]) -> None:
    """Note this process's CPU seconds at ``begin`` and at ``halt`` (nothing counted if it never begins)."""
    while not begin.wait(0.05):
        if halt.is_set():
            return
    cpu[0] = process_cpu_seconds()
    halt.wait()
    cpu[1] = process_cpu_seconds()


def _sendable(exc: BaseException, r: int) -> BaseException:
    """``exc`` if it crosses a pipe intact, else a MeasurementError naming it."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:
        return MeasurementError(f"training rank {r}: {type(exc).__name__}: {exc}")
