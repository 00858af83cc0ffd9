"""`phase_timer`: where a transfer's CPU time goes, phase by phase, in an io_uring handle's worker.

    with tensorio.AioHandle(block_size=16 << 10, queue_depth=32, backend="io_uring", direct=True) as handle:
        with tensorio.phase_timer(handle) as timer:
            ns = timer.transfer(tensor, path, write=True)   # {"prepare": ..., "fill": ..., "worker": ...}

The phases (`PHASES`), each in CPU nanoseconds of the thread that runs it:

- prepare: the caller's ``write``/``read`` call (checks, plan, runs handed to the worker);
- fill: the worker writing submission entries (numpy batches; Tasks for staged or short pieces);
- submit: ``io_uring_submit``, in which the kernel issues the I/O (mostly system time);
- reap: reading completions, checking every byte count, and (after the next submit) counting them to
  their requests, which hashes a checksummed one's bytes and resolves what is done;
- wait: the rest of the worker's CPU (waking from its eventfd, the loop itself);

and "worker", the worker thread's whole CPU time over the transfer. The timers wrap the worker's fill,
reap and submit calls while the context is open (a few clock reads per batch) and are gone after it.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import torch

from ._handle import AioHandle
from ._uring import UringBackend

__all__ = ["PHASES", "PhaseTimer", "phase_timer"]

PHASES = ("prepare", "fill", "submit", "reap", "wait")


class PhaseTimer:
    """Times whole transfers of one io_uring handle by phase (made by `phase_timer`)."""

    def __init__(self, handle: AioHandle, worker) -> None:
        self._handle, self._worker = handle, worker
        self._totals = dict.fromkeys(PHASES, 0)
        self.open = True
        """The timers are installed (False once the `phase_timer` context has exited)."""

    def _timed(self, method, phase: str):
        totals = self._totals

        def timed(*args, **kwargs):
            start = time.thread_time_ns()
            try:
                return method(*args, **kwargs)
            finally:
                totals[phase] += time.thread_time_ns() - start
        return timed

    def transfer(self, tensor: torch.Tensor, path: str, *, write: bool) -> dict[str, int]:
        """Write ``tensor`` whole to ``path`` (``write``) or read it whole from there, and wait for it;
        return the CPU nanoseconds of each of `PHASES` and of the whole "worker" thread. Sleeps 10 ms
        after the transfer, so that the worker's clock holds all of it. Raises RuntimeError after the
        `phase_timer` context has exited; the transfer's own errors (TensorIOError, OSError)."""
        if not self.open:
            raise RuntimeError("PhaseTimer.transfer: the phase_timer context has exited; time inside it")
        totals = self._totals
        for phase in PHASES:
            totals[phase] = 0
        clock = time.pthread_getcpuclockid(self._worker.ident)
        worker_start = time.clock_gettime_ns(clock)
        start = time.thread_time_ns()
        future = (self._handle.write if write else self._handle.read)(tensor, path)
        totals["prepare"] = time.thread_time_ns() - start
        future.result()
        time.sleep(0.01)  # let the worker go back to sleep, so that its clock holds the whole transfer
        worker = time.clock_gettime_ns(clock) - worker_start
        totals["wait"] = worker - totals["fill"] - totals["submit"] - totals["reap"]
        return {**totals, "worker": worker}


@contextlib.contextmanager
def phase_timer(handle: AioHandle) -> Iterator[PhaseTimer]:
    """Time ``handle``'s transfers by phase while the context is open (see the module docstring).

    ``handle`` must run the io_uring backend with one worker (``backend="io_uring"``,
    ``thread_count=1``): ValueError otherwise. Time one transfer at a time (`PhaseTimer.transfer`):
    the phases of transfers in flight together are not told apart.
    """
    backend = handle._backend
    workers = backend._workers if isinstance(backend, UringBackend) else []
    if len(workers) != 1:
        raise ValueError(f"phase_timer times one io_uring worker; this handle runs {handle.backend_name} with "
                         f"thread_count={handle.config.thread_count}: make it with backend='io_uring', thread_count=1")
    worker = workers[0]
    timer = PhaseTimer(handle, worker)
    queues = worker._queues
    fill, reap, report, submit = worker._fill, worker._reap, worker._report, queues.submit
    worker._fill, worker._reap = timer._timed(fill, "fill"), timer._timed(reap, "reap")
    worker._report = timer._timed(report, "reap")  # the reaped pieces counted to their requests, after the submit
    queues.submit = timer._timed(submit, "submit")
    try:
        yield timer
    finally:
        queues.submit = submit
        del worker._fill, worker._reap, worker._report  # the class's methods again
        timer.open = False
