"""Pure planning of the optimizer's sub-groups: which parameter elements each one updates, where.

No tensors, no disk: a function of the parameters' sizes, the sub-group size and the share kept on
NVMe, so it is tested on its own (tests/test_offload_adam_subgroups.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from tensorio import AioConfig

from offload.config.swap import SwapConfig

#: A parameter split across sub-groups is cut at multiples of this many elements. Torch's fused
#: CPU Adam kernel runs whole vectors of 64 elements and a scalar tail, so cuts on such multiples
#: give bit-for-bit the result of updating the whole parameter at once. 1024 fp32 elements is one
#: 4096-byte page, which also keeps each state region page-aligned.
SPLIT_ALIGN = 1024

#: Members are packed at multiples of 16 elements (64 bytes, one cache line) inside a region.
MEMBER_ALIGN = 16

#: Bytes per element of each state region (exp_avg, exp_avg_sq, master copy: all fp32).
STATE_ITEMSIZE = 4


def host_memory_bytes() -> int:
    """The memory this process may ever hold, in bytes, from which the swap sizes are chosen: the
    machine's physical memory, or a memory cgroup's limit where smaller (`offload.device.host_memory`)."""
    from offload.device import host_memory

    return host_memory().total


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


#: The fastest sub-group size chosen is at most this many elements (and at least SPLIT_ALIGN).
MAX_CHOSEN_SUB_GROUP = 1 << 24

#: Swap buffers may take at most this share of the host's memory when their size is chosen here.
BUFFER_SHARE = 16


def linked_groups(plans: Sequence[SubGroupPlan], param_count: int) -> list[list[int]]:
    """Parameter indices updated together: those sharing a sub-group of ``plans``, transitively (a
    parameter's update waits for the gradients of its whole group), each group sorted, in order."""
    parent = list(range(param_count))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i
    for plan in plans:
        first = root(plan.members[0].param)
        for member in plan.members[1:]:
            parent[root(member.param)] = first
    groups: dict[int, list[int]] = {}
    for i in range(param_count):
        groups.setdefault(root(i), []).append(i)
    return sorted(groups.values())


def choose_sub_group_size(numels: Sequence[int], *, grad_itemsize: int = 4, buffer_count: int,
                          host_bytes: int, state_itemsize: int = 12) -> int:
    """The sub-group size OffloadAdam and the engine use when the user chose none (pure).

    With the updates overlapping backward, state read ahead lives in the memory of applied gradients
    (`offload.optim.spare`), cut into regions of ``4 * sub_group_size`` bytes, each of which must fit in
    one freed gradient: a sub-group no larger than the parameter typical of the model (the
    element-weighted median of ``numels``, times ``grad_itemsize / 4``) lets most gradients hold state.
    Much smaller sub-groups only add kernel calls and requests. The size is that, rounded down to a power
    of two, between SPLIT_ALIGN and MAX_CHOSEN_SUB_GROUP, and halved while ``buffer_count`` buffers of
    its state (``state_itemsize`` bytes an element) would take more than 1/BUFFER_SHARE of ``host_bytes``.

    A size fixed above the typical parameter (4 Mi on GPT-2 small: 16 MiB regions, which no freed
    gradient but the embedding's can hold) sends the read-ahead back to the fixed buffers, so the
    updates wait on reads and less memory is saved (docs/optimizer_offload.md has the figures).
    """
    sizes = sorted(n for n in numels if n > 0)
    total = sum(sizes)
    median, seen = SPLIT_ALIGN, 0
    for n in sizes:
        seen += n
        if 2 * seen >= total:
            median = n
            break
    target = max(SPLIT_ALIGN, min(MAX_CHOSEN_SUB_GROUP, median * grad_itemsize // STATE_ITEMSIZE))
    size = 1 << (target.bit_length() - 1)  # a power of two, so a multiple of SPLIT_ALIGN
    while size > SPLIT_ALIGN and buffer_count * state_itemsize * size > host_bytes // BUFFER_SHARE:
        size //= 2
    return size


def choose_buffer_count(*, overlap_backward: bool) -> int:
    """The swap buffer count when the user chose none: 3 when the updates overlap backward (one being
    updated, one read ahead, one written behind; further read-ahead goes into applied gradients'
    memory, so a fourth buffer would only add memory), else 4 (DeepSpeed's)."""
    return 3 if overlap_backward else 4


def chosen_swap_config(trainable_numels: Sequence[int], *, grad_itemsize: int, buffer_count: int | None,
                       sub_group_size: int | None, overlap_backward: bool, pin_memory: bool, pipeline_read: bool,
                       pipeline_write: bool, aio: AioConfig) -> SwapConfig:
    """OffloadAdam's swap settings, with the sizes the user left None chosen: ``buffer_count`` by
    `choose_buffer_count`, ``sub_group_size`` the typical trainable parameter's size within this host's
    memory (`choose_sub_group_size`). Raises ValueError (naming the key) for a bad setting."""
    if buffer_count is None:
        buffer_count = choose_buffer_count(overlap_backward=overlap_backward)
    if sub_group_size is None:
        sub_group_size = choose_sub_group_size(trainable_numels, grad_itemsize=grad_itemsize,
                                               buffer_count=buffer_count, host_bytes=host_memory_bytes())
    return SwapConfig(buffer_count=buffer_count, pin_memory=pin_memory, pipeline_read=pipeline_read,
                      pipeline_write=pipeline_write, sub_group_size=sub_group_size, aio=aio)
