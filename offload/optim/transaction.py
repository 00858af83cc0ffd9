"""The step transaction: a step's optimizer state commits whole, once every write of it has landed, or not at all.

Offloaded state is written to each sub-group's uncommitted slot (`StateSwapper`); the step counts wait
in ``new_step``. `commit` makes both the committed ones and runs the commit hooks (the engine flips its
parameter slots with them); `abort` forgets them and runs the abort hooks. With overlap_backward the
last writes of a step may land during the next forward (write-behind): the step then stays
``uncommitted`` until the next sync point (`sync`, `finish_write_behind`). With ``hold`` (several ranks)
a step whose writes have all landed still waits, uncommitted, until the caller `release`s it once every
rank has agreed (offload/train/step/agree.py): no rank commits a step another rank gives up.
"""

from __future__ import annotations

from typing import Callable, Protocol

from offload.optim.kernel import ParamState, StepInputs
from offload.optim.schedule import SwapSchedule
from offload.optim.swapper import StateSwapper


class Background(Protocol):
    """The updates during backward (`offload.optim.overlap.BackwardUpdates`), as the transaction waits for them."""

    def join(self) -> None:
        """Wait for the thread's queued updates; raise the first one's error."""

    def wait_dependents(self) -> None:
        """Wait for the writes the update callbacks started; raise the first one's error."""

    def forget(self) -> None:
        """Drop the aborted step's hand-offs once the writes its callbacks started are done."""


class StepTransaction:
    """Commit or abort one step's state (see the module docstring)."""

    def __init__(self, swapper: StateSwapper, params: list[ParamState], schedule: SwapSchedule,
                 inputs: StepInputs) -> None:
        self._swapper, self._params, self._schedule, self._inputs = swapper, params, schedule, inputs
        self.background: Background | None = None
        """The updates during backward, whose thread and callbacks' writes belong to the step (overlap_backward)."""
        self.uncommitted = False
        """Writes of the last step still in flight (overlap_backward), or landed and held (``hold``)."""
        self.hold = False
        """A step commits only through `release` (the engine's agreement of every rank), never by itself."""
        self._commit_hooks: list[Callable[[], None]] = []
        self._abort_hooks: list[Callable[[], None]] = []

    def add_hooks(self, on_commit: Callable[[], None] | None, on_abort: Callable[[], None] | None) -> None:
        """See `OffloadAdam.add_step_hooks`."""
        if on_commit is not None:
            self._commit_hooks.append(on_commit)
        if on_abort is not None:
            self._abort_hooks.append(on_abort)

    def sync(self) -> None:
        """Wait for the background thread and the last step's write-behind, and commit them.

        On failure the step is aborted (nothing committed) and its error raised (a TensorIOError
        for the swap file).
        """
        if self.background is not None:
            try:
                self.background.join()
            except BaseException:
                self.abort()
                raise
        try:
            self.finish_write_behind()
        except BaseException:
            self.abort()
            raise

    def finish_write_behind(self) -> None:
        """Sync point: the last step's writes land, and it commits."""
        if self.uncommitted:
            self._swapper.drain()
            self.commit()

    def wait_dependents(self) -> None:
        """Sync point: the writes grad_ready's callbacks started. Raises the first one's error."""
        if self.background is not None:
            self.background.wait_dependents()

    def commit(self) -> None:
        """Every write of the step has landed: its state and step counts become the committed ones (with
        ``hold``: once `release`d)."""
        self.wait_dependents()
        if self.hold:
            self.uncommitted = True  # landed; committed by `release`
            return
        self._commit()

    def release(self) -> None:
        """With ``hold``: every rank agreed, commit the held step (call `sync` first: its writes have landed)."""
        if self.uncommitted:
            self._swapper.drain()  # nothing in flight after `sync`; raises a write's error otherwise
            self.wait_dependents()
            self._commit()

    def _commit(self) -> None:
        self._swapper.commit()
        for rec in self._params:
            if rec.new_step is not None:
                rec.step, rec.new_step = rec.new_step, None
        self.uncommitted = False
        for hook in self._commit_hooks:
            hook()

    def abort(self) -> None:
        """Give the step up: the committed state stays, the step's hand-offs are forgotten."""
        self._swapper.abort()
        if self.background is not None:
            self.background.forget()
        for rec in self._params:
            rec.new_step = None
        self.uncommitted = False
        self._schedule.forget()
        self._inputs.clear()
        for hook in self._abort_hooks:
            hook()
