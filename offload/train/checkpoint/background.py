"""`BackgroundSaves`: the engine's asynchronous checkpoint saves, one at a time, on a thread of their own.

``save_checkpoint(..., async_save=True)`` fixes a snapshot of the step (`offload.train.checkpoint.snapshot`)
and hands its writing here; training goes on. The rules (docs/engine.md, "Asynchronous save"):

- one save in flight per engine: the next save waits for it (or, asked not to wait, is refused), so two
  writers never share a folder;
- `load_checkpoint`, `close()` and the end of the process wait for it (the thread is not a daemon, and an
  ``atexit`` hook waits and logs a failure nobody was left to see);
- a failure is kept and raised once, as `CheckpointSaveError` naming the checkpoint and (in its message,
  from the OSError) the file, at the engine's next forward (the first call of a step: the update may run
  during backward), save, load or close; the save's staging folder
  is removed, so ``latest`` still names the previous checkpoint.
"""

from __future__ import annotations

import atexit
import logging
import threading
import weakref
from dataclasses import dataclass
from typing import Any, Callable

import torch.distributed as dist

from offload.storage import CheckpointInUseError

__all__ = ["BackgroundSaves", "CheckpointSaveError", "SaveInFlight"]

log = logging.getLogger("offload")


class CheckpointSaveError(RuntimeError):
    """An asynchronous checkpoint save failed; raised at the engine's next call. Its ``__cause__`` is the
    error the save met (an OSError naming the file, a TensorIOError naming the swap file)."""


@dataclass(frozen=True, slots=True)
class SaveInFlight:
    """Where an asynchronous save is (`Engine.checkpoint_in_flight`)."""

    tag: str
    path: str
    """The tag's directory once committed (``save_dir/tag``)."""
    bytes_written: int
    """Bytes of tensors written so far."""
    total_bytes: int
    """Bytes of tensors the save writes."""
    wait_seconds: float
    """Seconds training has waited so far for the save to read the slots its steps would write."""


class BackgroundSaves:
    """At most one save running on a background thread, its failure kept for the next call (module docstring).

    `start` hands a save over; `wait` is the sync point every other checkpoint call passes first; `raise_failure`
    reports a failed save once. Thread-safe for `in_flight` (any thread); the rest from the training thread.
    """

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._job: Any = None
        self._error: BaseException | None = None
        self._failed: str = ""
        self._last: str | None = None
        self._group: Any = None
        self.last_wait_seconds = 0.0
        """Seconds training waited for the last save that ended to read the slots its steps would write."""
        ref = weakref.ref(self)
        self._at_exit = lambda: (lambda saves: saves is not None and saves._wait_at_exit())(ref())
        atexit.register(self._at_exit)

    def start(self, job: Any, run: Callable[[], str], *, tag: str, path: str, done: Callable[[str], None],
              keep_alive: Any = None) -> None:
        """Run ``run()`` (writing ``job``, a `CheckpointSave`) on the background thread; ``done(path)`` after it
        succeeded; ``job.close()`` either way. ``keep_alive`` (the engine) stays referenced until it ends, so
        that its swap files are not closed under the save. Call `wait` first: one save at a time."""
        if self._thread is not None:
            raise RuntimeError("internal error: a checkpoint save is already in flight; wait for it first")

        def body(owner: Any = keep_alive) -> None:
            try:
                saved = run()
                done(saved)
                self._last = saved
            except BaseException as error:  # kept for the next engine call
                self._error, self._failed = error, path
            finally:
                self.last_wait_seconds = job.snapshot.wait_seconds if job.snapshot is not None else 0.0
                job.close()

        self._job = (job, tag, path)
        self._thread = threading.Thread(target=body, name=f"offload-checkpoint-{tag}", daemon=False)
        self._thread.start()

    def group_for(self, group: Any, world_size: int) -> Any:
        """The process group the background saves agree in: with several ranks a gloo group of ``group``'s
        ranks of their own, made at the first asynchronous save (every rank makes it, in the same call),
        so that their collectives never interleave with training's. None with one rank."""
        if world_size <= 1 or not dist.is_available() or not dist.is_initialized():
            return None
        if self._group is None:
            ranks = dist.get_process_group_ranks(group) if group is not None else None
            self._group = dist.new_group(ranks=ranks, backend="gloo")
        return self._group

    def in_flight(self) -> SaveInFlight | None:
        """The save running now, or None."""
        thread, job = self._thread, self._job
        if thread is None or job is None or not thread.is_alive():
            return None
        save, tag, path = job
        snapshot = save.snapshot
        return SaveInFlight(tag=tag, path=path, bytes_written=save.bytes_written, total_bytes=save.total_bytes,
                            wait_seconds=snapshot.wait_seconds if snapshot is not None else 0.0)

    def wait(self, *, refuse: bool = False) -> str | None:
        """Sync point: the save in flight has ended (``refuse``: raise `CheckpointInUseError` instead of
        waiting when one runs). Returns the path of the last save that succeeded, if any. Does not raise
        its failure (`raise_failure` does)."""
        thread = self._thread
        if thread is not None:
            if refuse and thread.is_alive():
                status = self.in_flight()
                progress = f" ({status.bytes_written / 1e6:.0f} of {status.total_bytes / 1e6:.0f} MB written)" \
                    if status is not None else ""
                raise CheckpointInUseError(
                    f"checkpoint {self._job[2]} is still being saved in the background{progress}; save again "
                    f"with wait=True to wait for it, or later (engine.checkpoint_in_flight() says where it is)")
            thread.join()
            self._thread, self._job = None, None
        return self._last

    def raise_failure(self) -> None:
        """Raise `CheckpointSaveError` for a save that failed since the last call, once."""
        error, self._error = self._error, None
        if error is not None:
            raise CheckpointSaveError(
                f"the asynchronous save of checkpoint {self._failed} failed: {type(error).__name__}: {error}; "
                f"nothing of it was made visible ('latest' still names the previous checkpoint), the training "
                f"state is as it was: save again") from error

    def finish(self, *, refuse: bool = False) -> str | None:
        """`wait`, then `raise_failure`: what a checkpoint call does first. Returns `wait`'s path."""
        path = self.wait(refuse=refuse)
        self.raise_failure()
        return path

    def close(self) -> None:
        """Wait for the save in flight (its failure stays for `raise_failure`) and drop the exit hook."""
        self.wait()
        atexit.unregister(self._at_exit)

    def _wait_at_exit(self) -> None:
        self.wait()
        if self._error is not None:
            log.error("the asynchronous save of checkpoint %s failed (%s: %s); 'latest' names the previous "
                      "checkpoint", self._failed, type(self._error).__name__, self._error)
            self._error = None
