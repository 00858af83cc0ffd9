"""Spread, confidence intervals and a disk's noise: pure functions of measured samples.

A point's figure is the median of its repeats; how far the repeats lie apart (``spread``) and where
their mean lies with 95% confidence (``confidence_interval``, Student's t) say how much to trust it.
The disk's ``noise`` is how far apart two measurements of one configuration lie during a sweep: the
larger of what the reference point (measured again at even intervals through the sweep) says of
that 95 times in 100 (``pair_difference``) and the median spread of the points' repeats.
Configurations closer than that to the best cannot be told apart.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["Noise", "Summary", "confidence_interval", "disk_noise", "pair_difference", "relative_spread", "round_trip",
           "summarize"]

#: Student's t at 97.5% (a two-sided 95% interval) for 1 to 30 degrees of freedom; 1.96 beyond.
_T_975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145,
          2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048,
          2.045, 2.042)


@dataclass(frozen=True, slots=True)
class Summary:
    """The repeats of one figure: how many, their median and mean, the 95% interval of the mean, and
    their spread."""

    n: int
    median: float
    mean: float
    low: float
    """Lower end of the 95% confidence interval of the mean (the value itself for one sample), never
    below 0: the figures are rates."""
    high: float
    spread: float
    """(max - min) / median: 0.07 when the repeats lie within 7% of each other; 0 for one sample."""


def relative_spread(values: Sequence[float]) -> float:
    """(max - min) / median of ``values``; 0 for fewer than two. Raises ValueError for none or a
    median of 0."""
    if not values:
        raise ValueError("no values")
    median = statistics.median(values)
    if median <= 0:
        raise ValueError(f"median {median} is not positive")
    return (max(values) - min(values)) / median if len(values) > 1 else 0.0


def confidence_interval(values: Sequence[float]) -> tuple[float, float]:
    """The two-sided 95% confidence interval of the mean of ``values`` (Student's t); the value itself
    for one. Raises ValueError for none."""
    if not values:
        raise ValueError("no values")
    mean = statistics.fmean(values)
    if len(values) == 1:
        return mean, mean
    df = len(values) - 1
    t = _T_975[df - 1] if df <= len(_T_975) else 1.96
    half = t * statistics.stdev(values) / math.sqrt(len(values))
    return mean - half, mean + half


def summarize(values: Sequence[float]) -> Summary:
    """Median, mean, 95% interval (from 0 up) and spread of ``values`` (see `Summary`). Raises ValueError
    for none."""
    low, high = confidence_interval(values)
    return Summary(n=len(values), median=statistics.median(values), mean=statistics.fmean(values), low=max(0.0, low),
                   high=high, spread=relative_spread(values))


def round_trip(write: Sequence[float], read: Sequence[float]) -> list[float]:
    """The round-trip rate of each repeat: the harmonic mean of its write and its read (the two
    passes of one repeat are paired in order). Raises ValueError for unequal lengths."""
    if len(write) != len(read):
        raise ValueError(f"{len(write)} writes and {len(read)} reads: a round trip pairs one of each")
    return [2 / (1 / w + 1 / r) for w, r in zip(write, read)]


def pair_difference(values: Sequence[float]) -> float:
    """How far apart two measurements of one thing may lie, as a fraction of their median, 95 times in
    100: 1.96 x sqrt(2) x the standard deviation of ``values`` over their median (the difference of two
    draws has sqrt(2) times their deviation). Raises ValueError for fewer than two values or a median
    that is not positive."""
    if len(values) < 2:
        raise ValueError(f"{len(values)} value(s): at least 2 are needed for a deviation")
    median = statistics.median(values)
    if median <= 0:
        raise ValueError(f"median {median} is not positive")
    return 1.96 * math.sqrt(2) * statistics.stdev(values) / median


@dataclass(frozen=True, slots=True)
class Noise:
    """How far one configuration's figure moves on this disk during a sweep, as a fraction."""

    relative: float
    """The noise: the larger of ``reference_difference`` and ``repeat_spread`` (0 when neither is known)."""
    reference: tuple[float, ...] = ()
    """The reference point's figure each time it was measured, in order."""
    reference_spread: float | None = None
    """(max - min) / median of ``reference``; None for fewer than two measurements."""
    reference_difference: float | None = None
    """`pair_difference` of ``reference``: two measurements of one configuration lie this far apart 95
    times in 100; None for fewer than two measurements."""
    repeat_spread: float | None = None
    """The median over the points of their repeats' spread; None with one repeat per point."""
    cpu: float | None = None
    """`pair_difference` of the reference's CPU per GB over the sweep: how far apart two CPU figures of
    one configuration lie; None for fewer than two measurements."""

    def describe(self, reference_label: str = "the reference point") -> str:
        """One line: the noise and where it comes from."""
        parts = []
        if self.reference_difference is not None:
            parts.append(f"{reference_label} measured {len(self.reference)} times through the sweep at "
                         f"{min(self.reference) / 1e9:.2f}-{max(self.reference) / 1e9:.2f} GB/s, so two "
                         f"measurements of a configuration lie up to {self.reference_difference:.0%} apart "
                         f"(95 times in 100)")
        if self.repeat_spread is not None:
            parts.append(f"repeats of a point {self.repeat_spread:.0%} apart at the median")
        if not parts:
            return "noise unknown (one measurement of everything: use --repeats 2 or more)"
        cpu = f"; its CPU per GB up to {self.cpu:.0%} apart" if self.cpu is not None else ""
        return f"noise {self.relative:.0%}: " + "; ".join(parts) + cpu


def disk_noise(reference: Sequence[float], repeat_spreads: Sequence[float],
               reference_cpu: Sequence[float] = ()) -> Noise:
    """The disk's `Noise` from the reference point's figures over the sweep and each point's spread, and
    the CPU's from the reference's CPU per GB (``reference_cpu``, in the same order)."""
    enough = len(reference) > 1
    reference_difference = pair_difference(reference) if enough else None
    repeat_spread = statistics.median(repeat_spreads) if repeat_spreads else None
    known = [s for s in (reference_difference, repeat_spread) if s is not None]
    cpu = pair_difference(reference_cpu) if len(reference_cpu) > 1 and min(reference_cpu) > 0 else None
    return Noise(relative=max(known, default=0.0), reference=tuple(reference),
                 reference_spread=relative_spread(reference) if enough else None,
                 reference_difference=reference_difference, repeat_spread=repeat_spread, cpu=cpu)
