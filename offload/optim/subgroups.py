"""Pure planning of the optimizer's sub-groups: which parameter elements each one updates, where.

No tensors, no disk: a function of the parameters' sizes, the sub-group size and the share kept on
NVMe, so it is tested on its own (tests/test_offload_adam_subgroups.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

#: A parameter split across sub-groups is cut at multiples of this many elements. Torch's fused
#: CPU Adam kernel runs whole vectors of 64 elements and a scalar tail, so cuts on such multiples
#: give bit-for-bit the result of updating the whole parameter at once. 1024 fp32 elements is one
#: 4096-byte page, which also keeps each state region page-aligned.
SPLIT_ALIGN = 1024

#: Members are packed at multiples of 16 elements (64 bytes, one cache line) inside a region.
MEMBER_ALIGN = 16

#: Bytes per element of each state region (exp_avg, exp_avg_sq, master copy: all fp32).
STATE_ITEMSIZE = 4


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


@dataclass(frozen=True, slots=True)
class ParamSpec:
    """What the planner needs of one parameter."""

    numel: int
    """Elements of the parameter (1 for a 0-d tensor)."""

    master: bool
    """True for 16-bit parameters, which get an fp32 master copy in the state."""


@dataclass(frozen=True, slots=True)
class Member:
    """A contiguous run of one parameter's elements inside a sub-group."""

    param: int
    """Index of the parameter over all param groups, in order (torch's state_dict index)."""

    start: int
    """First element of the parameter (in its flattened view) that this run covers."""

    numel: int
    """Elements in the run."""

    offset: int
    """Element offset of the run inside each state region of the sub-group."""


@dataclass(frozen=True, slots=True)
class SubGroupPlan:
    """One sub-group: members of one param group, all 16-bit or all not, updated by one kernel call.

    Its state is ``regions`` fp32 regions of ``region`` elements each, back to back:
    exp_avg, exp_avg_sq and, for 16-bit parameters, the fp32 master copy.
    """

    index: int
    group: int
    members: tuple[Member, ...]
    region: int
    master: bool
    offloaded: bool

    @property
    def numel(self) -> int:
        """Parameter elements the sub-group updates."""
        return sum(m.numel for m in self.members)

    @property
    def regions(self) -> int:
        """State regions: 2 (exp_avg, exp_avg_sq), or 3 with the fp32 master copy."""
        return 3 if self.master else 2

    @property
    def state_bytes(self) -> int:
        """Bytes of the sub-group's state: a multiple of 4096."""
        return self.regions * self.region * STATE_ITEMSIZE


def plan_subgroups(groups: Sequence[Sequence[ParamSpec]], sub_group_size: int,
                   nvme_fraction: float) -> list[SubGroupPlan]:
    """Cut the parameters of each param group into sub-groups of at most ``sub_group_size`` elements.

    Parameters are taken in order; a sub-group never spans two param groups nor mixes 16-bit with
    32-bit parameters; a parameter larger than the room left is cut at multiples of SPLIT_ALIGN.
    Each region holds at most ``sub_group_size`` elements, padded up to a multiple of SPLIT_ALIGN.
    Sub-groups are offloaded in order until ``nvme_fraction`` of all elements is offloaded.

    Raises ValueError when ``sub_group_size`` is below SPLIT_ALIGN or the fraction is outside [0, 1].
    """
    if isinstance(sub_group_size, bool) or not isinstance(sub_group_size, int) or sub_group_size < SPLIT_ALIGN:
        raise ValueError(f"sub_group_size: {sub_group_size!r} is not allowed; use an integer >= {SPLIT_ALIGN}")
    if not 0.0 <= nvme_fraction <= 1.0:
        raise ValueError(f"nvme_offload_fraction: {nvme_fraction!r} is not allowed; use a number in [0.0, 1.0]")
    cut = sub_group_size // SPLIT_ALIGN * SPLIT_ALIGN
    raw: list[tuple[int, bool, list[Member], int]] = []  # (group, master, members, used elements)
    param = 0
    for group_index, specs in enumerate(groups):
        current: list[Member] | None = None
        used, master = 0, False
        for spec in specs:
            start = 0
            while start < spec.numel:
                offset = _round_up(used, MEMBER_ALIGN)
                remaining = spec.numel - start
                if current is None or master != spec.master or remaining > sub_group_size - offset:
                    current, used, master, offset = [], 0, spec.master, 0
                    raw.append((group_index, master, current, 0))
                take = remaining if remaining <= sub_group_size - offset else cut
                current.append(Member(param=param, start=start, numel=take, offset=offset))
                used = offset + take
                raw[-1] = (group_index, master, current, used)
                start += take
            param += 1
    total = sum(m.numel for _, _, members, _ in raw for m in members)
    plans: list[SubGroupPlan] = []
    offloaded_so_far = 0
    for index, (group_index, master, members, used) in enumerate(raw):
        numel = sum(m.numel for m in members)
        offload = total > 0 and offloaded_so_far < nvme_fraction * total
        if offload:
            offloaded_so_far += numel
        plans.append(SubGroupPlan(index=index, group=group_index, members=tuple(members),
                                  region=_round_up(used, SPLIT_ALIGN), master=master, offloaded=offload))
        assert numel <= sub_group_size
    return plans
