"""`OffloadAdam`: Adam/AdamW whose state lives on NVMe (a chosen share of it) and streams through a few buffers.

Used exactly like ``torch.optim.AdamW`` (``adamw_mode=True``) or ``torch.optim.Adam``. The update is
torch's fused CPU kernel (``torch._fused_adamw_`` / ``torch._fused_adam_``), called per sub-group, so
fp32 parameters match ``torch.optim.AdamW(fused=True)`` bit for bit. See docs/optimizer_offload.md.
"""

from __future__ import annotations

import shutil
import tempfile
import weakref
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch

from tensorio import AioConfig

from offload.config.swap import SwapConfig
from offload.optim.kernel import ParamState, StepInputs, check_hyperparameters, check_params
from offload.optim.overlap import BackgroundWorker, BackwardUpdates
from offload.optim.schedule import SwapSchedule
from offload.optim.state_io import OptimizerState, load_reads
from offload.optim.step import StepRun
from offload.optim.subgroups import (ParamSpec, SubGroupPlan, choose_buffer_count, chosen_swap_config, linked_groups,
                                     plan_subgroups)
from offload.optim.swapper import StateSwapper
from offload.optim.transaction import StepTransaction

__all__ = ["OffloadAdam"]

class OffloadAdam(torch.optim.Optimizer):
    """Adam / AdamW keeping ``nvme_offload_fraction`` of its state on NVMe, the rest in RAM.

    Args:
        params, lr, betas, eps, weight_decay: as for ``torch.optim.AdamW``; param groups work.
        adamw_mode: decoupled weight decay (AdamW) when True, L2 weight decay (Adam) when False.
        nvme_offload_fraction: share of the state kept on NVMe, 0.0 to 1.0 (by sub-group, in order).
        nvme_offload_dir: existing writable directory for the swap file, or a list of them (one per drive:
            the file is striped over them, `offload.storage.StripedSwapFile`); None: a private temporary
            directory, removed by ``close()`` or at exit.
        stripe_weights: with a list ``nvme_offload_dir``, each directory's relative speed (one integer each:
            its stripe units per cycle, `offload.storage.StripeLayout`); None: measured when the file is made.
        buffer_count, pin_memory, pipeline_read, pipeline_write, sub_group_size: the swap settings,
            named as DeepSpeed's ``offload_optimizer`` section names them (see `SwapConfig`). Not given,
            ``sub_group_size`` is chosen from the parameters' sizes and the host's memory and
            ``buffer_count`` is 3 with overlap_backward, else 4 (`choose_sub_group_size`,
            `choose_buffer_count`): the fast settings for most models.
        aio: tensorio settings for the swap file, an `AioConfig` or a dict of its keys.
        overlap_backward: update each offloaded sub-group during ``backward()`` as soon as its
            gradients are final, so that the state's I/O overlaps the backward and forward passes.
            Then every backward is followed by an update: no gradient accumulation, clipping or
            scaling between backward and ``step()`` (``step()`` still must be called), and the
            gradients of fully offloaded parameters are freed (None) once applied.
        spare_limit: with overlap_backward, the most bytes of applied gradients whose memory is
            reused for state read ahead until ``step()`` (None: all of them); past it they are freed.

    Host memory held for offloaded state: ``buffer_count`` buffers of the largest offloaded
    sub-group's state, at most ``buffer_count * 12 * (sub_group_size + 1023)`` bytes (chosen: at most
    1/16 of the host's memory), whatever the
    model's size; with overlap_backward, more state is read ahead only into the memory of gradients
    already applied and freed. 16-bit parameters get an fp32 master copy, part of the state.

    Raises ValueError for amsgrad=True, non-CPU or non-float parameters, parameters on more than one
    device and bad settings (naming the key); FileNotFoundError / PermissionError for a missing or
    unwritable ``nvme_offload_dir``.
    """

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, adamw_mode: bool = True,
                 nvme_offload_fraction: float = 0.0, nvme_offload_dir: str | Sequence[str] | None = None, *,
                 amsgrad: bool = False, maximize: bool = False, buffer_count: int | None = None,
                 pin_memory: bool = True, pipeline_read: bool = True, pipeline_write: bool = True,
                 sub_group_size: int | None = None,
                 aio: AioConfig | Mapping[str, Any] | None = None, overlap_backward: bool = False,
                 spare_limit: int | None = None, stripe_weights: Sequence[int] | None = None) -> None:
        check_hyperparameters(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad)
        fraction = float(nvme_offload_fraction)
        if not 0.0 <= fraction <= 1.0:
            raise ValueError(f"nvme_offload_fraction: {nvme_offload_fraction!r} is not allowed; use 0.0 to 1.0")
        # Checked now, before anything else; the sizes left to us are chosen once the parameters are known.
        SwapConfig(buffer_count=buffer_count if buffer_count is not None else choose_buffer_count(overlap_backward=True),
                   pin_memory=pin_memory, pipeline_read=pipeline_read, pipeline_write=pipeline_write,
                   sub_group_size=sub_group_size if sub_group_size is not None else 1 << 20,
                   aio=aio if aio is not None else AioConfig())
        # The keys of torch.optim.AdamW's param groups, so that state dicts load into either optimizer.
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, amsgrad=False,
                        maximize=maximize, foreach=None, capturable=False, differentiable=False, fused=True,
                        decoupled_weight_decay=bool(adamw_mode))
        self._planned = False
        super().__init__(params, defaults)

        # 1. One record per parameter, checked before anything touches the disk.
        self._params: list[ParamState] = []
        for g, group in enumerate(self.param_groups):
            for p in group["params"]:
                self._params.append(ParamState(param=p, group=g, index=len(self._params)))
        check_params(self._params)
        self._index_of = {id(rec.param): rec.index for rec in self._params}
        self._swap_config = chosen_swap_config(  # the sizes not given: from the parameters and the host's memory
            [r.param.numel() for r in self._params if r.param.requires_grad],
            grad_itemsize=min((r.param.element_size() for r in self._params), default=4),
            buffer_count=buffer_count, sub_group_size=sub_group_size,
            overlap_backward=overlap_backward, pin_memory=pin_memory, pipeline_read=pipeline_read,
            pipeline_write=pipeline_write, aio=aio if aio is not None else AioConfig())
        # 2. Plan the sub-groups (pure), then place their state: in RAM or in the swap file.
        specs = [[ParamSpec(numel=r.param.numel(), master=r.master) for r in self._params if r.group == g]
                 for g in range(len(self.param_groups))]
        self._plans: list[SubGroupPlan] = plan_subgroups(specs, self._swap_config.sub_group_size, fraction)
        self._planned = True
        for plan in self._plans:
            for member in plan.members:
                self._params[member.param].runs.append((plan.index, member))
        self._resident: dict[int, list[torch.Tensor]] = {  # each sub-group's state regions
            p.index: list(torch.zeros(p.regions * p.region, dtype=torch.float32).split(p.region))
            for p in self._plans if not p.offloaded}
        self._tmpdir = None
        if any(p.offloaded for p in self._plans) and nvme_offload_dir is None:
            self._tmpdir = tempfile.mkdtemp(prefix="offload-adam-")
        directory = self._tmpdir or (nvme_offload_dir if isinstance(nvme_offload_dir, (list, tuple)) else
                                     str(nvme_offload_dir) if nvme_offload_dir is not None else "")
        self._swapper = StateSwapper(self._plans, directory, self._swap_config, spare_limit=spare_limit,
                                     stripe_weights=stripe_weights)
        # 3. The step, by job: its inputs (hyperparameters, gradient scale, gradients handed over), the
        #    swap schedule (read-ahead, eviction, the learnt order), the transaction (commit or abort),
        #    and the state I/O of state dicts and checkpoints.
        self._inputs = StepInputs()
        self._schedule = SwapSchedule(self._swapper, self._plans, read_ahead=self._swap_config.read_ahead,
                                      pipeline_write=self._swap_config.pipeline_write)
        self._transaction = StepTransaction(self._swapper, self._params, self._schedule, self._inputs)
        self._state = OptimizerState(self, self._params, self._plans, self._resident, self._swapper,
                                     self._transaction.abort)
        self._run = StepRun(self, self._params, self._plans, self._resident, self._swapper, self._schedule,
                            self._transaction, self._inputs, adamw_mode=bool(adamw_mode))
        # 4. With overlap_backward, hooks hand sub-groups to a worker thread: backward never waits for
        #    I/O. Which fields that thread shares, and the locking rule: `BackwardUpdates`.
        self._background: BackwardUpdates | None = None
        if overlap_backward and any(p.offloaded for p in self._plans):
            self._background = BackwardUpdates(self._params, self._plans, schedule=self._schedule,
                                               transaction=self._transaction, inputs=self._inputs,
                                               update=self._run.update, begin_step=self._run.begin)
            self._transaction.background = self._run.background = self._background
        worker = self._background.worker if self._background is not None else None  # not the optimizer: no cycle
        self._finalizer = weakref.finalize(self, _cleanup, self._swapper, self._tmpdir, worker)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a param group; only during construction (the sub-groups are planned once).

        Raises RuntimeError afterwards: pass every group to the constructor instead.
        """
        if getattr(self, "_planned", False):
            raise RuntimeError("OffloadAdam plans its swap file at construction; pass every param group "
                               "to the constructor instead of calling add_param_group later")
        super().add_param_group(param_group)

    # ---- the step -------------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Update every parameter that has a gradient; return ``closure()``'s loss if given.

        Either the whole step's state is committed or, on failure, none of it: the error (a
        TensorIOError for the swap file, ValueError for a bad gradient) propagates and a reload
        reads the previous state. Parameters of sub-groups updated before the failure keep their
        update (see docs/optimizer_offload.md, "Failures").
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._run.run()
        return loss

    def grad_ready(self, param: torch.Tensor,
                   on_updated: Callable[[torch.Tensor], None] | None = None, *,
                   grad: torch.Tensor | None = None) -> None:
        """Tell the optimizer that ``param.grad`` is final for this step (overlap_backward only).

        The post-accumulate-grad hooks do this for parameters that autograd computes gradients for;
        a caller that sets ``.grad`` itself (the engine, for its partitions) calls this instead.
        ``on_updated(param)`` runs once every element of ``param`` has been updated and its gradient
        freed: on the background thread, or in ``step()`` for sub-groups left to it; not at all if
        the step fails. It may return an IOFuture (the write of ``param`` elsewhere): the step's state
        is then committed only once it succeeded, and aborted, raising its error, if it failed. It
        needs every sub-group of ``param`` offloaded. Raises RuntimeError without
        overlap_backward, ValueError for a tensor this optimizer does not update (or, with
        ``on_updated``, one with state in RAM), and the background thread's error, if it had one.

        ``grad``: the gradient to apply instead of ``param.grad`` (of the parameter's shape; a 16-bit
        parameter may take a float32 one, which ``.grad`` cannot hold: its master copy is updated with it
        at full precision). The optimizer drops it once applied, as it frees ``.grad``.
        """
        if self._background is None:
            raise RuntimeError("grad_ready needs OffloadAdam(overlap_backward=True) with offloaded state")
        index = self._index_of.get(id(param))
        if index is None or self._params[index].param is not param:
            raise ValueError("grad_ready: this tensor is not one of the optimizer's parameters")
        if on_updated is not None and not all(self._plans[i].offloaded for i, _ in self._params[index].runs):
            raise ValueError(f"grad_ready: {self._params[index].name()} has state in RAM; on_updated needs "
                             f"its whole state offloaded (nvme_offload_fraction=1.0)")
        if grad is not None:
            self._inputs.give(index, grad)
        self._background.grad_ready(index, param, on_updated)

    def abandon_step(self) -> None:
        """Forget the last step's uncommitted state after the caller's own part of it failed (the
        engine's parameter write-back): wait for the I/O in flight, errors dropped, and keep the state
        last committed. Never raises."""
        if self._background is not None:
            try:
                self._background.join()
            except BaseException:
                pass  # the step is forgotten either way
        self._transaction.abort()

    def start_step(self, grad_scale: float = 1.0, *, in_order: bool = False) -> None:
        """Begin the step whose gradients `grad_ready` hands over (overlap_backward only; the first
        `grad_ready` of a step begins it with ``grad_scale`` 1 otherwise).

        The step's hyperparameters (lr, betas, eps, weight_decay) are read now, so that a scheduler may
        step before the updates have run; every gradient is multiplied by ``grad_scale`` as it is applied,
        in float32, as ``torch.nn.utils.clip_grad_norm_`` multiplies by its coefficient (the engine passes
        the clip coefficient times the inverse loss scale). ``in_order``: every gradient of the step is
        known already and will be handed over in the learnt order (the engine's step in the next forward),
        so state is read ahead into applied gradients' memory from the front of that order, not, as when
        gradients arrive during backward, from its end (which becomes ready last). Raises RuntimeError
        without overlap_backward or while a step is under way (between its first `grad_ready` and `step`).
        """
        if self._background is None:
            raise RuntimeError("start_step needs OffloadAdam(overlap_backward=True) with offloaded state")
        self._schedule.in_order = in_order
        self._background.begin(float(grad_scale))

    def read_ahead(self, nbytes: int, *, keep_memory: bool = True) -> None:
        """Between steps (overlap_backward): start reading the state of the offloaded sub-groups that come
        first in the learnt order into at most ``nbytes`` of memory, so that the next step's first updates
        find their state in memory (the engine calls it during a backward whose updates run in the next
        forward). The memory is lent like applied gradients' and is free again once those sub-groups are
        written. ``keep_memory``: the same memory every step, kept in between (faulted in once), rather than
        new memory each time, which nothing holds until this call. Never waits; does nothing without
        overlap_backward or while a step is under way."""
        if self._background is None or self._background.in_backward or nbytes <= 0:
            return
        self._background.worker.submit(self._background.in_worker, self._read_ahead, int(nbytes), keep_memory)

    def _read_ahead(self, nbytes: int, keep_memory: bool) -> None:
        """The worker: `read_ahead`."""
        self._transaction.finish_write_behind()  # the last step's writes land (and commit) first
        self._schedule.read_ahead(nbytes, keep_memory=keep_memory)

    def add_step_hooks(self, on_commit: Callable[[], None] | None = None,
                       on_abort: Callable[[], None] | None = None) -> None:
        """Call ``on_commit()`` each time a step's state is committed (every write succeeded; on the
        background thread with overlap_backward, which may commit during the next forward) and
        ``on_abort()`` each time a step is given up (on the caller's thread): the engine commits or rolls
        back its parameter partitions with the optimizer state."""
        self._transaction.add_hooks(on_commit, on_abort)

    def update_groups(self) -> list[list[int]]:
        """Parameter indices (in constructor order) that are updated together: those sharing a
        sub-group, transitively; a parameter's update waits for the gradients of its whole group."""
        return linked_groups(self._plans, len(self._params))

    def overwrites(self, param: torch.Tensor) -> bool:
        """Whether the next update of ``param`` (one of this optimizer's) writes every element of it
        from its fp32 master copy without reading it: a 16-bit parameter whose state exists. Its values
        need not be in memory for that update (the first update copies them into the new master).
        Raises KeyError for a parameter this optimizer does not hold."""
        rec = self._params[self._index_of[id(param)]]
        return rec.master and rec.step is not None

    def is_offloaded(self, param: torch.Tensor) -> bool:
        """Whether all of ``param``'s state (one of this optimizer's) lives in the swap file: every sub-group
        holding part of it is offloaded. With overlap_backward such a parameter's gradient is freed once
        applied; the others keep theirs until ``step()``. Raises KeyError for a parameter this optimizer
        does not hold."""
        index = self._index_of[id(param)]
        return all(plan.offloaded for plan in self._plans for member in plan.members if member.param == index)

    def synchronize(self) -> None:
        """Sync point: wait for the updates handed over and the last step's write-behind, and commit them
        (the step hooks run). Raises the step's error (a TensorIOError for the swap file) after giving
        it up."""
        self._transaction.sync()

    def hold_commits(self) -> None:
        """From now on a step whose writes have landed waits, uncommitted, for `commit_held` (the engine's
        ranks agree first: offload/train/step/agree.py). Reads take its new values meanwhile."""
        self._transaction.hold = True

    def commit_held(self) -> None:
        """Commit the step `hold_commits` held (after `synchronize`); nothing when none is held. Runs the
        commit hooks on this thread."""
        self._transaction.release()

    def raise_if_failed(self) -> None:
        """Raise the background thread's error, if it had one, after giving the step up (overlap_backward)."""
        if self._background is not None and self._background.worker.failed:
            self._transaction.sync()

    @property
    def updates_pending(self) -> bool:
        """Whether gradients were handed over (`grad_ready`) that no ``step()`` has taken yet."""
        return self._background is not None and self._background.in_backward

    @property
    def background_updates(self) -> bool:
        """Whether updates run on the optimizer's own thread (overlap_backward, with state on NVMe)."""
        return self._background is not None

    @property
    def swap_config(self) -> SwapConfig:
        """The swap settings in use, with the sizes chosen where none were given."""
        return self._swap_config

    def wait_for_updates(self, done: Callable[[], bool]) -> None:
        """Wait until ``done()`` is true or the updates handed over so far have all run (checked as
        each one ends): back-pressure for a caller whose memory the pending updates hold. Never raises."""
        if self._background is not None:
            self._background.wait_until(done)

    # ---- state dicts (offload/optim/state_io.py) ---------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """torch.optim.AdamW's state dict: per parameter index 'step', 'exp_avg', 'exp_avg_sq'.

        fp32 tensors of the parameter's shape; 16-bit parameters add 'master_param' (fp32). The whole
        state is gathered in RAM, one sub-group read at a time (`save_state` streams it instead).
        Raises TensorIOError.
        """
        self._transaction.sync()
        return self._state.state_dict()

    def state_layout(self) -> dict[str, int]:
        """The state `save_state` streams: ``"<parameter index>.<key>"`` -> elements (flat fp32), for
        each parameter that has state; keys 'exp_avg', 'exp_avg_sq' and, for 16-bit parameters,
        'master_param'. Waits for the updates in flight first (sync point): an update still running creates
        its parameter's state, which the layout must hold."""
        self._transaction.sync()
        return self._state.layout()

    def save_state(self, write: Callable[[str, int, torch.Tensor], None]) -> dict[str, Any]:
        """Stream the state out without gathering it: ``write(name, first_element, values)`` for each
        run of each `state_layout` tensor, one sub-group in memory at a time. Returns the rest (step
        counts and param groups, small) for `load_state`. Raises TensorIOError and ``write``'s errors.
        """
        self._transaction.sync()
        return self._state.save(write)

    def load_state(self, saved: Mapping[str, Any], layout: Mapping[str, int],
                   read: Callable[[str, int, int], torch.Tensor], before_commit: Callable[[], None] | None = None) -> None:
        """Load state written by `save_state`: ``saved`` is what it returned, ``layout`` the stored
        tensors' sizes (name -> elements), ``read(name, start, stop)`` their elements (fp32).
        ``before_commit()`` runs once every read and write succeeded, before the new state becomes the
        committed one; its error (a checkpoint load that failed on another rank) leaves the previous state.

        Load the model's parameters first (16-bit ones without 'master_param' take it from the
        parameter). All or nothing: raises ValueError for a mismatch (naming the parameter or group)
        before anything changes, and TensorIOError for the swap file, leaving the previous state.
        """
        self._transaction.sync()
        self._state.load_saved(saved, layout, read, before_commit)

    def load_reads(self, saved: Mapping[str, Any], layout: Mapping[str, int]) -> list[list[tuple[str, int, int]]]:
        """The ``read(name, start, stop)`` calls `load_state` will make for ``saved`` and ``layout``, in its order,
        one list per sub-group: a loader starts them ahead (several in flight) and hands them over as asked.
        Pure: reads nothing, changes nothing."""
        steps = {int(index): step for index, step in saved["steps"].items()}
        return load_reads(self._state.plans, steps, layout)

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load a state dict from `state_dict` here or from torch.optim.AdamW / Adam for the same parameters.

        Load the model's parameters first: a 16-bit parameter without 'master_param' gets its master
        copy from the parameter. All or nothing: raises ValueError for a mismatched state dict (naming
        the group or parameter) and TensorIOError for the swap file, leaving the previous state.
        """
        self._transaction.sync()
        self._state.load_state_dict(state_dict)

    # ---- memory and lifetime ----------------------------------------------------------------------------

    def io_wait_seconds(self) -> float:
        """Seconds the calling thread has spent blocked on swap-file I/O since construction.

        The sum over every sync point (waiting for a read to arrive or for a write to free its
        buffer) in ``step()`` or ``state_dict()``; with overlap_backward, the time ``step()`` waited
        for the updates handed to the background thread during backward. The part of the offload's
        cost that compute did not hide.
        """
        if self._background is None:
            return self._swapper.wait_seconds
        return self._swapper.wait_seconds - self._background.worker_wait + self._background.join_wait

    def io_bytes(self) -> dict[str, int]:
        """Bytes read from and written to the optimizer's swap file so far."""
        return self._swapper.io_bytes()

    def swap_stats(self) -> dict[str, Any]:
        """Where the offloaded state is now: ``"sub_groups"`` by place ("on disk", "reading", "resident",
        "writing") and the fixed swap buffers ``"free_buffers"`` of ``"buffer_count"``. Between steps every
        sub-group is on disk (or still being written, with overlap_backward) and every buffer is free."""
        self._transaction.sync()
        return {"sub_groups": self._swapper.where_counts(), "free_buffers": self._swapper.free_buffers,
                "buffer_count": self._swap_config.buffer_count}

    def host_state_bytes(self) -> dict[str, int]:
        """Host memory held for optimizer state: 'resident' (kept in RAM), 'buffers' (swap buffers) and
        'read_ahead' (kept across steps for the state read ahead between steps, `read_ahead`)."""
        return {"resident": sum(r.numel() * 4 for regions in self._resident.values() for r in regions),
                "buffers": self._swapper.buffer_bytes, "read_ahead": self._swapper.kept_bytes}

    @property
    def swapper(self) -> StateSwapper:
        """The `StateSwapper` that moves the offloaded sub-groups' state (one ``records`` entry per sub-group:
        its plan, its two slots in the swap file, where its state is now), for inspection. Calling its
        methods outside the optimizer's own calls breaks the step's commit rule."""
        return self._swapper

    @property
    def update_order(self) -> list[int]:
        """The offloaded sub-groups (``swapper.records`` indices) in the order their updates became ready
        in the last step: the next step's read-ahead (`read_ahead`) follows it. A copy."""
        return list(self._schedule.order)

    @property
    def swap_path(self) -> str | None:
        """The swap file's path, or None when nothing is offloaded."""
        return self._swapper.path if self._swapper.records else None

    def close(self) -> None:
        """Finish the I/O in flight (committing it), remove the hooks, the swap file and a temporary directory."""
        try:
            self._transaction.sync()
        finally:
            if self._background is not None:
                self._background.close()
            self._finalizer()


def _cleanup(swapper: StateSwapper, tmpdir: str | None, background: BackgroundWorker | None) -> None:
    if background is not None:
        background.close()
    swapper.close()
    if tmpdir is not None:
        shutil.rmtree(tmpdir, ignore_errors=True)
