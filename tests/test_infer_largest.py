"""`largest_where`: the halving search that the plan's longest fitting length and the block schedule's
micro-batch size both use."""

from __future__ import annotations

import pytest

from offload.infer.largest import largest_where
from offload.infer.schedule import micro_batch_size


@pytest.mark.parametrize("limit", [0, 1, 2, 7, 63, 99, 100])
def test_the_largest_value_that_holds_is_found_with_few_calls(limit):
    calls = []

    def holds(value: int) -> bool:
        calls.append(value)
        return value <= limit

    assert largest_where(holds, 0, 101) == limit
    assert len(calls) <= 7  # log2(101) rounded up, never a step at a time
    assert all(0 < value < 101 for value in calls)  # the ends are taken as given, never asked


def test_micro_batch_size_halves_to_the_largest_size_within_the_limit_then_to_a_divisor():
    per_sequence = 10
    assert micro_batch_size(100_000, lambda size: size * per_sequence, 10 * 333, None) == 250  # 333 fit; 250 divides
    assert micro_batch_size(12, lambda size: size * per_sequence, 10, None) == 1
    assert micro_batch_size(12, lambda size: size * per_sequence, 10 ** 6, None) == 12
    assert micro_batch_size(12, lambda size: size * per_sequence, 10, 5) == 4  # requested, lowered to a divisor
