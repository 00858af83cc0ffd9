"""The sub-group planner, without tensors or disk."""

from __future__ import annotations

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from offload.optim.subgroups import MEMBER_ALIGN, SPLIT_ALIGN, ParamSpec, plan_subgroups

specs = st.lists(st.lists(st.builds(ParamSpec, numel=st.integers(0, 20_000), master=st.booleans()), max_size=6),
                 min_size=1, max_size=3)


@settings(max_examples=200, deadline=None)
@given(groups=specs, size=st.integers(SPLIT_ALIGN, 9000), fraction=st.sampled_from([0.0, 0.3, 0.5, 1.0]))
# Found by Hypothesis: the share offloaded was counted with the members' alignment padding, so it
# stopped just short of the fraction of the parameters' elements.
@example(groups=[[ParamSpec(49, False), ParamSpec(305, False), ParamSpec(631, False)],
                 [ParamSpec(1, True), ParamSpec(48, True), ParamSpec(238, False), ParamSpec(1009, False),
                  ParamSpec(33, False), ParamSpec(26, False)],
                 [ParamSpec(0, False), ParamSpec(152, False), ParamSpec(0, False), ParamSpec(5815, False)]],
         size=1162, fraction=0.3)
def test_plan_covers_every_element_once_within_bounds(groups, size, fraction):
    plans = plan_subgroups(groups, size, fraction)
    flat = [(g, spec) for g, group in enumerate(groups) for spec in group]
    covered = {i: [] for i in range(len(flat))}
    for plan in plans:
        assert plan.numel <= size
        assert plan.region % SPLIT_ALIGN == 0 and plan.region < size + SPLIT_ALIGN
        assert plan.state_bytes % 4096 == 0
        end = 0
        for member in plan.members:
            group, spec = flat[member.param]
            assert group == plan.group and spec.master == plan.master
            assert member.offset % MEMBER_ALIGN == 0 and member.offset >= end
            end = member.offset + member.numel
            assert end <= plan.region
            assert member.start % SPLIT_ALIGN == 0  # cuts only at vector-friendly multiples
            covered[member.param].append((member.start, member.numel))
    for i, (_, spec) in enumerate(flat):
        runs = covered[i]
        assert runs == sorted(runs)
        position = 0
        for start, numel in runs:
            assert start == position and numel > 0
            position += numel
        assert position == spec.numel
    total = sum(p.numel for p in plans)
    offloaded = sum(p.numel for p in plans if p.offloaded)
    if fraction == 0.0 or total == 0:
        assert offloaded == 0
    else:
        assert offloaded >= fraction * total - 1e-9 * total or all(p.offloaded for p in plans if p.numel)
    if fraction == 1.0:
        assert all(p.offloaded for p in plans if p.numel)


def test_offloaded_sub_groups_come_first():
    plans = plan_subgroups([[ParamSpec(4096, False)] * 4], 4096, 0.5)
    assert [p.offloaded for p in plans] == [True, True, False, False]


@pytest.mark.parametrize("size", [0, 1023, 1.5, True])
def test_small_or_odd_sub_group_size_is_rejected(size):
    with pytest.raises(ValueError, match="sub_group_size"):
        plan_subgroups([[ParamSpec(10, False)]], size, 0.0)
