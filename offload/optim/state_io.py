"""The optimizer state in and out: torch's state dicts, and streamed saves and loads, one sub-group in memory
at a time (`OptimizerState`). The state sits in sub-groups (`SubGroupPlan`): resident regions in RAM, or
slots of the swap file read through the `StateSwapper`; a load writes the offloaded part to the
uncommitted slots and the resident part to a staging copy, and commits both only once every read and
write succeeded (and the caller's ``before_commit`` agreed): a failed load leaves the committed state.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import torch

from offload.optim.kernel import ParamState
from offload.optim.subgroups import SubGroupPlan
from offload.optim.swapper import StateSwapper, Where
from offload.storage.host_copy import host_copy


class OptimizerState:
    """Reads and writes the state of ``owner`` (an `OffloadAdam`, whose param groups it packs and loads).
    Callers make sure no update is under way first (`OffloadAdam` joins its thread before each call)."""

    def __init__(self, owner: torch.optim.Optimizer, params: list[ParamState], plans: list[SubGroupPlan],
                 resident: dict[int, list[torch.Tensor]], swapper: StateSwapper, abort: Callable[[], None]) -> None:
        self.owner, self.params, self.plans, self.resident, self.swapper = owner, params, plans, resident, swapper
        self.abort = abort
        """Gives the step up (a failed load leaves the committed state)."""


    def state_dict(self) -> dict[str, Any]:
        """torch.optim.AdamW's state dict, gathered in RAM one sub-group read at a time."""
        state: dict[int, dict[str, torch.Tensor]] = {}
        for index, keys in self._state_keys().items():
            rec = self.params[index]
            state[index] = {"step": rec.step.clone()}
            for key in keys:
                state[index][key] = torch.zeros(rec.param.shape, dtype=torch.float32)

        def put(index: int, key: str, first: int, values: torch.Tensor) -> None:
            state[index][key].view(-1)[first:first + values.numel()] = values
        self._stream_state(put)
        return {"state": state, "param_groups": self._packed_groups()}

    def layout(self) -> dict[str, int]:
        """``"<parameter index>.<key>"`` -> elements, for each parameter with state (`OffloadAdam.state_layout`)."""
        return {f"{index}.{key}": self.params[index].param.numel()
                for index, keys in self._state_keys().items() for key in keys}

    def save(self, write: Callable[[str, int, torch.Tensor], None]) -> dict[str, Any]:
        """Stream the state to ``write``; return the step counts and param groups (`OffloadAdam.save_state`)."""
        self._stream_state(lambda index, key, first, values: write(f"{index}.{key}", first, values))
        return {"steps": {rec.index: float(rec.step) for rec in self.params if rec.step is not None},
                "param_groups": self._packed_groups()}

    def load_saved(self, saved: Mapping[str, Any], layout: Mapping[str, int],
                   read: Callable[[str, int, int], torch.Tensor], before_commit: Callable[[], None] | None = None) -> None:
        """Load what `save` wrote, checked before anything changes (`OffloadAdam.load_state`)."""
        groups = saved["param_groups"]
        self._check_groups(groups)
        steps = {int(index): step for index, step in saved["steps"].items()}
        for index in steps:
            if not 0 <= index < len(self.params):
                raise ValueError(f"the saved state has state for parameter {index}, this optimizer has "
                                 f"{len(self.params)} parameters")
            rec = self.params[index]
            for key in ("exp_avg", "exp_avg_sq"):
                if layout.get(f"{index}.{key}") != rec.param.numel():
                    raise ValueError(f"the saved state of {rec.name()} has no {key} of {rec.param.numel()} elements")

        def get(index: int, key: str, start: int, stop: int) -> torch.Tensor | None:
            return read(f"{index}.{key}", start, stop) if f"{index}.{key}" in layout else None
        self._load(groups, steps, get, before_commit)

    def _state_keys(self) -> dict[int, tuple[str, ...]]:
        return {rec.index: ("exp_avg", "exp_avg_sq", "master_param") if rec.master else ("exp_avg", "exp_avg_sq")
                for rec in self.params if rec.step is not None}

    def _stream_state(self, put: Callable[[int, str, int, torch.Tensor], None]) -> None:
        """``put(index, key, first element, values)`` for every run of state, one sub-group at a time."""
        with_state = {rec.index for rec in self.params if rec.step is not None}
        for plan, regions in self._each_state():
            for member in plan.members:
                if member.param not in with_state:
                    continue
                for key, region in zip(("exp_avg", "exp_avg_sq", "master_param"), regions):
                    put(member.param, key, member.start, region[member.offset:member.offset + member.numel])

    def _each_state(self):
        """Yield (plan, state regions) for every sub-group; offloaded ones are read into a buffer, the next
        one's read started (where a buffer is free without waiting) while the caller uses this one."""
        offloaded = [plan for plan in self.plans if plan.offloaded]
        following = {plan.index: after for plan, after in zip(offloaded, offloaded[1:])}
        ahead = None
        try:
            for plan in self.plans:
                if not plan.offloaded:
                    yield plan, self.resident[plan.index]
                    continue
                rec = self.swapper.records[plan.index]
                ahead = None
                try:
                    regions = self.swapper.read_now(rec)
                    after = following.get(plan.index)
                    if after is not None and self.swapper.free_buffers > 0:
                        ahead = self.swapper.records[after.index]
                        if ahead.where is Where.ON_DISK:
                            self.swapper.start_read(ahead)  # overlaps the caller's use of this one
                    yield plan, regions
                finally:
                    self.swapper.evict(rec)
        finally:
            if ahead is not None and ahead.where is not Where.ON_DISK:  # left early: let the read ahead go
                self.swapper.evict(ahead)

    def _packed_groups(self) -> list[dict[str, Any]]:
        groups, start = [], 0
        for group in self.owner.param_groups:
            packed = {k: v for k, v in group.items() if k != "params"}
            packed["params"] = list(range(start, start + len(group["params"])))
            start += len(group["params"])
            groups.append(packed)
        return groups

    def _check_groups(self, saved_groups: list[Mapping[str, Any]]) -> None:
        if len(saved_groups) != len(self.owner.param_groups):
            raise ValueError(f"the state dict has {len(saved_groups)} param groups, this optimizer {len(self.owner.param_groups)}")
        for g, (saved, ours) in enumerate(zip(saved_groups, self.owner.param_groups)):
            if len(saved["params"]) != len(ours["params"]):
                raise ValueError(f"param group {g} has {len(saved['params'])} parameters in the state dict, "
                                 f"{len(ours['params'])} here")
            if saved.get("amsgrad", False):
                raise ValueError(f"param group {g} of the state dict has amsgrad=True, which OffloadAdam does not support")

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load a torch-format state dict, checked before anything changes (`OffloadAdam.load_state_dict`)."""
        saved_groups = state_dict["param_groups"]
        self._check_groups(saved_groups)
        # 1. Map the saved indices onto ours and check every entry before anything changes.
        saved_to_ours = {s: o for sg, og in zip(saved_groups, self._packed_groups())
                         for s, o in zip(sg["params"], og["params"])}
        entries: dict[int, Mapping[str, Any]] = {}
        for key, entry in state_dict["state"].items():
            if key not in saved_to_ours:
                raise ValueError(f"the state dict has state for parameter {key!r}, which no param group lists")
            rec = self.params[saved_to_ours[key]]
            for name in ("exp_avg", "exp_avg_sq"):
                if name not in entry or entry[name].numel() != rec.param.numel():
                    raise ValueError(f"the state of {rec.name()} has no {name} of {rec.param.numel()} elements")
            entries[rec.index] = entry

        def get(index: int, key: str, start: int, stop: int) -> torch.Tensor | None:
            entry = entries[index]
            return entry[key].reshape(-1)[start:stop] if key in entry else None
        self._load(saved_groups, {index: float(entry["step"]) for index, entry in entries.items()}, get)

    def _load(self, saved_groups: list[Mapping[str, Any]], steps: Mapping[int, float],
              get: Callable[[int, str, int, int], torch.Tensor | None],
              before_commit: Callable[[], None] | None = None) -> None:
        """Checked state in: offloaded sub-groups to the uncommitted slots, the in-RAM ones to a staging copy;
        then ``before_commit()`` (may raise: nothing committed); then the slots commit, the staged copies
        replace the in-RAM state, and the step counts and hyperparameters are set. Any error before the
        commit (a read's ChecksumError, a write's TensorIOError) leaves the committed state as it was."""
        staged: dict[int, list[torch.Tensor]] = {}
        try:
            for plan in self.plans:
                if plan.offloaded:
                    rec = self.swapper.records[plan.index]
                    # `fill` writes every element: the state on disk is not read (it may be what failed).
                    regions = self.swapper.blank(rec) if rec.where is Where.ON_DISK else self.swapper.read_now(rec)
                    fill(plan, regions, steps, get, self.params)
                    self.swapper.start_write(rec)
                else:  # a copy (memory: this sub-group's state once more) until every rank's load is known good
                    staged[plan.index] = [torch.empty_like(region) for region in self.resident[plan.index]]
                    fill(plan, staged[plan.index], steps, get, self.params)
            self.swapper.drain()
            if before_commit is not None:
                before_commit()
        except BaseException:
            self.abort()
            raise
        self.swapper.commit()
        for index, regions in staged.items():
            for region, values in zip(self.resident[index], regions):
                host_copy(region, values)
        for rec in self.params:
            step = steps.get(rec.index)
            rec.step = None if step is None else torch.tensor(float(step), dtype=torch.float32)
        for saved, ours in zip(saved_groups, self.owner.param_groups):
            params = ours["params"]
            ours.clear()
            ours.update({k: v for k, v in saved.items() if k != "params"})
            ours["params"] = params


def load_reads(plans: list[SubGroupPlan], steps: Mapping[int, float],
               layout: Mapping[str, int]) -> list[list[tuple[str, int, int]]]:
    """The reads `fill` asks for, in its order, per sub-group: ``(name, start, stop)`` each (what a loader may
    start ahead of `OptimizerState.load_saved`'s calls)."""
    keys = ("exp_avg", "exp_avg_sq", "master_param")
    return [[(f"{member.param}.{key}", member.start, member.start + member.numel)
             for member in plan.members if member.param in steps
             for key in keys[:plan.regions] if f"{member.param}.{key}" in layout]
            for plan in plans]


def fill(plan: SubGroupPlan, regions: list[torch.Tensor], steps: Mapping[int, float],
          get: Callable[[int, str, int, int], torch.Tensor | None], params: list[ParamState]) -> None:
    """Write loaded state into every element of a sub-group's state regions, asking ``get`` in `load_reads`'
    order: each member's runs (zeros for parameters without state), and the padding between and after the
    runs zeroed, so ``regions`` may hold anything before (`StateSwapper.blank`). Copies on this thread
    (`host_copy`)."""
    end = 0  # the first element of the regions not written yet (members lie in offset order)
    for member in plan.members:
        if member.offset < end:
            raise RuntimeError(f"internal error: sub-group {plan.index}'s members overlap or are out of order")
        start, stop = member.start, member.start + member.numel
        for key, region in zip(("exp_avg", "exp_avg_sq", "master_param"), regions):
            region[end:member.offset].zero_()  # padding: fewer than MEMBER_ALIGN elements
            run = region[member.offset:member.offset + member.numel]
            values = get(member.param, key, start, stop) if member.param in steps else None
            if member.param not in steps:
                run.zero_()
            elif values is not None:
                host_copy(run, values)
            else:  # a 16-bit parameter's state from torch's AdamW: the master copy is the parameter
                run.copy_(params[member.param].param.detach().reshape(-1)[start:stop])
        end = member.offset + member.numel
    for region in regions:
        region[end:].zero_()  # the regions' padding to whole pages
