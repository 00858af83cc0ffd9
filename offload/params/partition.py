"""Partition arithmetic: how a flattened parameter of ``numel`` elements splits over data-parallel ranks.

Pure functions of their arguments (no process group, no disk). Layout: the flat parameter is padded at
its end to ``padded_numel`` elements, a multiple of ``world_size * alignment``, and rank r holds the
slice ``partition_bounds(...)`` of that padded tensor: every rank holds the same number of elements,
a multiple of ``alignment``. The padding sits at the end of the last partitions; ``owned_numel`` says
how many leading elements of a rank's partition are real.
"""

from __future__ import annotations


def _check(numel: int, world_size: int, alignment: int, rank: int | None = None) -> None:
    for name, value, minimum in (("numel", numel, 0), ("world_size", world_size, 1), ("alignment", alignment, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise ValueError(f"{name}: {value!r} is not allowed; use an integer >= {minimum}")
    if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size):
        raise ValueError(f"rank: {rank!r} is not allowed; use an integer from 0 to world_size - 1 = {world_size - 1}")


def partition_numel(numel: int, world_size: int, alignment: int = 1) -> int:
    """Elements every rank holds: ceil(numel / world_size) rounded up to a multiple of ``alignment``.

    Raises ValueError for a negative numel, or a world_size or alignment below 1.
    """
    _check(numel, world_size, alignment)
    per_rank = -(-numel // world_size)
    return -(-per_rank // alignment) * alignment


def padded_numel(numel: int, world_size: int, alignment: int = 1) -> int:
    """Length of the padded flat parameter: ``partition_numel * world_size``.

    Raises ValueError as ``partition_numel`` does.
    """
    return partition_numel(numel, world_size, alignment) * world_size


def partition_bounds(numel: int, world_size: int, rank: int, alignment: int = 1) -> tuple[int, int]:
    """(start, end) of ``rank``'s partition in the padded flat parameter; ``end`` may pass ``numel``.

    Raises ValueError as ``partition_numel`` does, or for a rank outside [0, world_size).
    """
    _check(numel, world_size, alignment, rank)
    size = partition_numel(numel, world_size, alignment)
    return rank * size, (rank + 1) * size


def owned_numel(numel: int, world_size: int, rank: int, alignment: int = 1) -> int:
    """Real (not padding) elements in ``rank``'s partition: its first ``owned_numel`` elements.

    Raises ValueError as ``partition_bounds`` does.
    """
    start, end = partition_bounds(numel, world_size, rank, alignment)
    return max(0, min(end, numel) - start)
