"""The largest integer for which a condition holds, where it holds up to a point and not past it."""

from __future__ import annotations

from collections.abc import Callable


def largest_where(holds: Callable[[int], bool], low: int, high: int) -> int:
    """The largest value in [``low``, ``high``) for which ``holds`` is true, found by halving. ``holds(low)``
    is taken as true (not called) and ``holds(high)`` as false; ``holds`` must be true up to some value and
    false after it (what fits only gets harder as a size grows)."""
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if holds(middle) else (low, middle)
    return low
