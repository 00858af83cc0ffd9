"""Updates during backward: `BackwardUpdates` hands sub-groups from backward hooks to a
`BackgroundWorker` thread.

`OffloadAdam(overlap_backward=True)` updates each sub-group as soon as its gradients are final. Doing
that inside the hook would stop the backward pass whenever a sub-group's state is still being read;
handing it to a thread lets backward go on while the state streams in.
"""

from __future__ import annotations

import functools
import queue
import threading
import time
from typing import Any, Callable

import torch

from offload.at_exit import end_at_exit
from offload.optim.kernel import ParamState, StepInputs, check_grads
from offload.optim.schedule import SwapSchedule, Update
from offload.optim.subgroups import SubGroupPlan
from offload.optim.threads import limit_this_thread, update_thread_count
from offload.optim.transaction import StepTransaction


class BackgroundWorker:
    """Runs submitted calls on one daemon thread, in submission order, under ``torch.no_grad()``, its
    OpenMP kernels on half of torch's threads (`offload.optim.threads`).

    Once a call raises, the calls after it are skipped until `join` has reported the error.
    """

    def __init__(self, name: str) -> None:
        self._name = name
        self._queue: queue.SimpleQueue[tuple[Callable[..., Any], tuple[Any, ...]] | None] = queue.SimpleQueue()
        self._done = threading.Condition()
        self._pending = 0
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        """Set by `stop`: the queued calls are skipped."""

    def submit(self, fn: Callable[..., Any], *args: Any) -> None:
        """Queue ``fn(*args)``; it runs after every call submitted before it."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name=self._name, daemon=True)
            self._thread.start()
            end_at_exit(self, BackgroundWorker.stop)  # a script that raised during backward (offload/at_exit.py)
        with self._done:
            self._pending += 1
        self._queue.put((fn, args))

    @property
    def has_backlog(self) -> bool:
        """Whether calls are queued behind the one running (approximate, as seen from any thread)."""
        return not self._queue.empty()

    @property
    def failed(self) -> bool:
        """Whether a call raised and `join` has not reported it yet."""
        return self._error is not None

    def join(self) -> None:
        """Wait until every submitted call has run; re-raise the first error of those calls, if any."""
        with self._done:
            self._done.wait_for(lambda: self._pending == 0)
            error, self._error = self._error, None
        if error is not None:
            raise error

    def wait_until(self, done: Callable[[], bool]) -> None:
        """Wait until ``done()`` is true or no call is left to run; checked after each call ends.

        Unlike `join`, never raises: an error stays for `join` to report.
        """
        with self._done:
            self._done.wait_for(lambda: self._pending == 0 or done())

    def wake(self) -> None:
        """Let `wait_until` check its condition again now, not only when the running call ends."""
        with self._done:
            self._done.notify_all()

    def close(self) -> None:
        """Let the queued calls run, then stop the thread (errors left unreported are dropped)."""
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None
        self._error = None

    def stop(self) -> None:
        """Let the running call end, skip the queued ones, and stop the thread (at exit: offload/at_exit.py)."""
        self._stopping = True
        self.close()
        self._stopping = False

    def _loop(self) -> None:
        limit_this_thread(update_thread_count())
        while (item := self._queue.get()) is not None:
            fn, args = item
            try:
                if self._error is None and not self._stopping:
                    with torch.no_grad():
                        fn(*args)
            except BaseException as error:  # reported by join(), on the caller's thread
                self._error = error
            finally:
                del item, fn, args  # drop references to the caller's objects before waiting again
                with self._done:
                    self._pending -= 1
                    self._done.notify_all()


class BackwardUpdates:
    """The updates of `OffloadAdam(overlap_backward=True)` during backward: hooks hand each sub-group
    whose gradients are all final to one worker thread, which reads its state, updates it and
    writes it back while backward goes on.

    Threads, and who may touch what (the locking rule):

    - *Hook side*, the caller's thread only (autograd's hooks, ``step``): ``in_backward``,
      ``_waiting``, ``_handed``, ``_hooks``.
    - *Hand-off*, both threads at any time: ``_ready``, ``_on_updated``, only under ``_lock``; the
      gradients passed to ``grad_ready`` (`StepInputs`, under its own lock).
    - *Worker side*: ``_runs_left``, ``_dependents``, ``worker_wait``, and the optimizer's step state
      (the `SwapSchedule` and its swapper, the `StepTransaction`). While the worker has calls queued
      it alone touches them; the caller's thread touches them only after `join`
      (``BackgroundWorker.join`` waits on a condition, which orders the worker's writes before the
      caller's reads). Every path of ``OffloadAdam`` that reads them (``step``, ``state_dict``,
      ``load_state_dict``, ``close``) joins first (`StepTransaction.sync`).
    - ``join_wait``: the caller's thread only.

    What it uses of the optimizer is what its constructor takes: the parameters' records and sub-group
    plans, the swap schedule, the step transaction, the step's inputs, ``update(plan, regions)`` (the
    kernel with the step's hyperparameters) and ``begin_step(grad_scale)`` (reads them).
    """

    def __init__(self, params: list[ParamState], plans: list[SubGroupPlan], *, schedule: SwapSchedule,
                 transaction: StepTransaction, inputs: StepInputs, update: Update,
                 begin_step: Callable[[float], None]) -> None:
        self._params, self._plans = params, plans
        self._schedule, self._transaction, self._inputs = schedule, transaction, inputs
        self._update, self._begin_step = update, begin_step
        self.worker = BackgroundWorker("offload-adam-updates")
        self.worker_wait = 0.0
        """Swap-file wait time spent on the worker thread (not the caller's)."""
        self.join_wait = 0.0
        """Time the caller's thread spent waiting for the worker."""
        # hook side
        self.in_backward = False
        self._waiting: dict[int, int] = {}  # per offloaded sub-group: gradients not yet final
        self._handed: set[int] = set()  # parameters whose gradient was handed over in this backward
        # hand-off, under lock
        self._lock = threading.Lock()
        self._ready: list[int] = []  # sub-groups handed over, not yet picked by the worker
        self._on_updated: dict[int, Callable[[torch.Tensor], Any]] = {}  # grad_ready's callbacks, by parameter
        # worker side
        self._runs_left: dict[int, int] = {}  # per parameter: offloaded sub-groups not yet updated
        self._dependents: list = []  # the callbacks' writes: the step commits only once they succeeded
        self._hooks = [param.param.register_post_accumulate_grad_hook(functools.partial(self.grad_ready, param.index))
                       for param in params
                       if param.param.requires_grad and any(plans[i].offloaded for i, _ in param.runs)]

    # ---- the caller's thread ------------------------------------------------------------------------

    def grad_ready(self, index: int, param: torch.Tensor, on_updated: Callable | None = None) -> None:
        """Parameter ``index``'s gradient is final (its post-accumulate-grad hook, or the engine): hand
        the sub-groups whose gradients are now all final to the worker. Raises the worker's error, if
        it had one, and ValueError for a bad gradient (after forgetting the step)."""
        if self.worker.failed:
            self._transaction.sync()  # raises that error, after aborting the step
        if not self.in_backward:
            self.begin(1.0)
        if index in self._handed:
            raise RuntimeError(f"{self._params[index].name()} got a second gradient in one backward (with "
                               f"overlap_backward each parameter is updated once per backward, as soon as its "
                               f"gradient is final); a parameter shared by two reentrant activation-checkpoint "
                               f"segments does this: use use_reentrant=False")
        self._handed.add(index)
        if on_updated is not None:
            with self._lock:
                self._on_updated[index] = on_updated
        for plan_index, _ in self._params[index].runs:
            plan = self._plans[plan_index]
            if not plan.offloaded:
                continue
            self._waiting[plan_index] -= 1
            if self._waiting[plan_index] == 0:
                try:
                    check_grads(plan, self._params, functools.partial(self._inputs.grad_of, states=self._params))
                except ValueError:
                    self.worker.close()  # let the work in flight finish, then forget the step
                    self._transaction.abort()
                    raise
                with self._lock:
                    self._ready.append(plan_index)
                self.worker.submit(self.in_worker, self._update_next_ready)

    def begin(self, grad_scale: float) -> None:
        """A step begins (`OffloadAdam.start_step`, or its first `grad_ready`): read its hyperparameters,
        count the gradients each offloaded sub-group waits for, and let the worker finish the previous
        step's writes and start reading state."""
        if self.in_backward:
            raise RuntimeError("a step is under way (gradients were handed over and step() has not run yet)")
        if self.worker.failed:
            self._transaction.sync()  # raises that error, after aborting the step
        self._begin_step(grad_scale)
        self.in_backward = True
        self._waiting = {p.index: sum(1 for m in p.members if self._params[m.param].param.requires_grad)
                         for p in self._plans if p.offloaded}
        self._handed = set()
        self.worker.submit(self._begin_backward)

    def wait_until(self, done: Callable[[], bool]) -> None:
        """Wait until ``done()`` is true or the worker has run everything handed over (checked as each
        call ends, and when a callback wakes it). Never raises."""
        self.worker.wait_until(done)

    def join(self) -> None:
        """Wait for every call handed to the worker (sync point); re-raise its first error."""
        start = time.perf_counter()
        try:
            self.worker.join()
        finally:
            self.join_wait += time.perf_counter() - start

    def run_callbacks(self) -> None:
        """``step()``, after a join: the callbacks of parameters updated there, not during backward."""
        with self._lock:
            callbacks, self._on_updated = self._on_updated, {}
        for index, callback in callbacks.items():
            self._add_dependent(callback(self._params[index].param))

    def wait_dependents(self) -> None:
        """After a join: wait for the writes the callbacks started; raise the first one's error."""
        dependents, self._dependents = self._dependents, []
        for future in dependents:
            future.result()

    def dependents_done(self) -> bool:
        """After a join: whether every write the callbacks started has finished (never waits)."""
        return all(future.done() for future in self._dependents)

    def forget(self) -> None:
        """After a join (or a failed one): drop this step's hand-offs; wait for the callbacks' writes,
        errors ignored (never forget a write the kernel may still be doing)."""
        with self._lock:
            self._on_updated = {}
            self._ready.clear()
        for future in self._dependents:
            future.exception()
        self._dependents = []
        self.in_backward = False

    def close(self) -> None:
        """Remove the hooks (the worker thread stops with `stop`)."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    def stop(self) -> None:
        """Let the queued calls run, then stop the worker thread."""
        self.worker.close()

    # ---- the worker thread --------------------------------------------------------------------------

    def in_worker(self, fn: Callable[..., None], *args: Any) -> None:
        """Run ``fn`` on the worker, counting its swap-file waits apart from the caller's."""
        swapper = self._schedule.swapper
        before = swapper.wait_seconds
        try:
            fn(*args)
        finally:
            self.worker_wait += swapper.wait_seconds - before

    def _begin_backward(self) -> None:
        """First hook of a backward: finish the last step's writes, start reading."""
        schedule = self._schedule
        self.in_worker(self._transaction.finish_write_behind)
        schedule.swapper.drop_spares()
        self._runs_left = {rec.index: len(rec.runs) for rec in self._params
                           if rec.runs and all(self._plans[i].offloaded for i, _ in rec.runs)}
        self.in_worker(schedule.prefetch, schedule.order)

    def _update_next_ready(self) -> None:
        """Update one of the sub-groups handed over, those whose state is already in memory first
        (`StateSwapper.readiness`): when a parameter cut into many sub-groups becomes ready at once,
        the ones still on disk are read while the others are updated."""
        swapper = self._schedule.swapper
        with self._lock:
            index = min(self._ready, key=lambda i: swapper.readiness(swapper.records[i]))
            self._ready.remove(index)
        self._update_and_release(index)

    def _update_and_release(self, index: int) -> None:
        """Update one sub-group handed over, then free its gradients. Then, until the next sub-group is
        handed over, keep reading ahead as writes finish and give their memory back, so that the state
        of the sub-groups whose gradients come last (a tied embedding's) is in memory when they do."""
        schedule = self._schedule
        schedule.update_offloaded(index, schedule.order, self._update)
        self._release_grads(self._plans[index])
        while not self.worker.has_backlog and schedule.next_unread() is not None:
            schedule.prefetch(schedule.order)
            if schedule.next_unread() is None or not schedule.swapper.finish_oldest_write():
                return

    def _release_grads(self, plan: Any) -> None:
        """Free the gradients ``plan`` finished with, and read ahead into them.

        A gradient is taken from its parameter (``.grad`` becomes None, as in PyTorch's
        optimizer-in-backward recipe) once every sub-group holding part of the parameter has been
        updated, and its memory is lent to the swapper for state read ahead: later sub-groups' state
        streams in without any new allocation, in memory a plain optimizer would still be holding.
        """
        for member in plan.members:
            left = self._runs_left.get(member.param)
            if left is None:
                continue
            self._runs_left[member.param] = left - 1
            if left != 1:
                continue
            param = self._params[member.param].param
            given = self._inputs.take_given(member.param)
            if given is not None:
                self._schedule.swapper.add_spare(given)
            elif param.grad is not None:
                self._schedule.swapper.add_spare(param.grad)
                param.grad = None
            with self._lock:
                callback = self._on_updated.pop(member.param, None)
            if callback is not None:
                self._add_dependent(callback(param))
                self.worker.wake()  # a caller in wait_until may go on now

    def _add_dependent(self, future: Any) -> None:
        if future is not None:
            self._dependents.append(future)
