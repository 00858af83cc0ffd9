"""Prompts that join a batch together, split by length into forwards whose padding is bounded.

A forward left-pads every row to its longest, so 64 prompts of 4 to 32 tokens in one forward compute
64 x 32 positions where 64 x 18 are real. Where the prefill is compute-bound (on the CPU) that padding
is time; each forward of its own costs a read of the streamed weights instead. `length_groups` takes
the fewest forwards that keep the padding within a bound, and of those the least padded: pure
arithmetic on the lengths, tested without an engine.
"""

from __future__ import annotations

from typing import Sequence

__all__ = ["length_groups", "padded_positions"]


def padded_positions(lengths: Sequence[int], groups: Sequence[range]) -> int:
    """The positions the forwards of ``groups`` (ranges of indices into ``lengths``) compute: each group's
    rows times its longest length."""
    return sum(len(group) * max(lengths[i] for i in group) for group in groups if len(group))


def length_groups(lengths: Sequence[int], max_padding: float) -> list[range]:
    """Split ``lengths`` (ascending: the tokens of each row in one forward) into consecutive ranges, a
    forward each, such that the padding (positions computed beyond the real ones) is at most
    ``max_padding`` times the real positions: the fewest such ranges, and of those the least padded.
    Rows of equal length are never split. Raises ValueError for lengths not ascending or below 1, or
    ``max_padding`` below 0."""
    if max_padding < 0:
        raise ValueError(f"max_padding: expected a fraction of at least 0, got {max_padding!r}")
    if any(n < 1 for n in lengths) or any(b < a for a, b in zip(lengths, lengths[1:])):
        raise ValueError(f"lengths: expected ascending lengths of at least 1, got {list(lengths)}")
    count = len(lengths)
    if not count:
        return []
    allowed = (1 + max_padding) * sum(lengths)
    # Cuts only where the length grows. best[k][j]: the fewest positions of the first j rows in k forwards.
    cuts = [j for j in range(1, count) if lengths[j] > lengths[j - 1]] + [count]
    best = {0: (0, None)}  # rows covered -> (positions, the previous cut), for the current number of forwards
    history = []
    for _ in range(len(cuts)):
        step = {}
        for end in cuts:
            options = [(positions + (end - start) * lengths[end - 1], start)
                       for start, (positions, _) in best.items() if start < end]
            if options:
                step[end] = min(options)
        history.append(step)
        if count in step and step[count][0] <= allowed:
            break
        best = step
    groups, end = [], count
    for step in reversed(history):
        start = step[end][1]
        groups.append(range(start, end))
        end = start
    return groups[::-1]
