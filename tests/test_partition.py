"""Partition arithmetic, checked on its own: no process group, no disk."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from offload.params.partition import owned_numel, padded_numel, partition_bounds, partition_numel

numels = st.integers(min_value=0, max_value=10**12)
world_sizes = st.integers(min_value=1, max_value=4096)
alignments = st.sampled_from([1, 2, 8, 64, 256, 2048, 1 << 20])


@given(numel=numels, world_size=world_sizes, alignment=alignments)
def test_partitions_tile_the_padded_tensor(numel, world_size, alignment):
    size = partition_numel(numel, world_size, alignment)
    bounds = [partition_bounds(numel, world_size, rank, alignment) for rank in range(min(world_size, 64))]
    assert bounds[0][0] == 0
    for (start, end), (next_start, _) in zip(bounds, bounds[1:]):
        assert end - start == size
        assert end == next_start
    last_start, last_end = partition_bounds(numel, world_size, world_size - 1, alignment)
    assert last_end == padded_numel(numel, world_size, alignment)
    assert last_start == padded_numel(numel, world_size, alignment) - size


@given(numel=numels, world_size=world_sizes, alignment=alignments)
def test_padding_is_less_than_one_aligned_row(numel, world_size, alignment):
    padded = padded_numel(numel, world_size, alignment)
    size = partition_numel(numel, world_size, alignment)
    assert size % alignment == 0
    assert padded == size * world_size
    assert numel <= padded < numel + world_size * alignment
    assert size >= -(-numel // world_size)


@given(numel=st.integers(min_value=0, max_value=5000), world_size=st.integers(min_value=1, max_value=40),
       alignment=st.sampled_from([1, 3, 8, 512]))
def test_every_element_owned_exactly_once(numel, world_size, alignment):
    owner = [None] * numel
    for rank in range(world_size):
        start, end = partition_bounds(numel, world_size, rank, alignment)
        owned = owned_numel(numel, world_size, rank, alignment)
        assert 0 <= owned <= end - start
        for index in range(start, start + owned):
            assert owner[index] is None
            owner[index] = rank
        # everything after the owned prefix is padding, beyond the real elements
        assert start + owned == min(max(start, numel), end)
    assert None not in owner
    assert sum(owned_numel(numel, world_size, r, alignment) for r in range(world_size)) == numel


@pytest.mark.parametrize(
    "numel, world_size, alignment, size",
    [(0, 1, 1, 0), (0, 8, 4, 0), (1, 1, 1, 1), (1, 4, 1, 1), (4095, 4, 1, 1024), (4096 * 10 + 1, 2, 4096, 24576),
     (10, 3, 1, 4), (10, 3, 8, 8)],
)
def test_awkward_sizes(numel, world_size, alignment, size):
    assert partition_numel(numel, world_size, alignment) == size
    assert owned_numel(numel, world_size, world_size - 1, alignment) == max(0, numel - (world_size - 1) * size)


def test_single_rank_owns_everything():
    assert partition_bounds(4095, 1, 0) == (0, 4095)
    assert owned_numel(4095, 1, 0) == 4095
    assert partition_bounds(4095, 1, 0, alignment=4096) == (0, 4096)


@pytest.mark.parametrize(
    "call, name",
    [
        (lambda: partition_numel(-1, 2), "numel"),
        (lambda: partition_numel(10, 0), "world_size"),
        (lambda: partition_numel(10, 2, 0), "alignment"),
        (lambda: partition_numel(10.0, 2), "numel"),
        (lambda: partition_bounds(10, 2, 2), "rank"),
        (lambda: partition_bounds(10, 2, -1), "rank"),
        (lambda: owned_numel(10, 2, True), "rank"),
    ],
)
def test_bad_arguments_are_named(call, name):
    with pytest.raises(ValueError, match=rf"^{name}: "):
        call()
