"""Which configuration to recommend: the lightest of those tied with the best, and why.

Configurations whose round trip lies within the disk's noise of the best cannot be told apart by
the sweep, so the highest figure among them is luck. Of the tied ones the choice is the lightest:
fewest threads, then lowest queue depth (both cost memory and CPU the training needs), then the
least CPU per GB (within ``CPU_TOLERANCE``: CPU figures are noisy too), then the fewest settings
away from the defaults, and last the highest figure. Pure functions of the measurements.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from tensorio import AioConfig

__all__ = ["CPU_TOLERANCE", "Candidate", "Choice", "candidates", "choose", "lightest", "tied_with_best"]

CPU_TOLERANCE = 0.10
"""CPU per GB within this fraction of the lowest counts as equally low."""

#: The defaults a configuration is compared with last; "auto" picks io_uring where it runs.
_DEFAULT = AioConfig()
_DEFAULT_BACKENDS = ("auto", "io_uring")


@dataclass(frozen=True, slots=True)
class Candidate:
    """One configuration as the choice sees it."""

    config: AioConfig
    bw_bytes: float
    """The goal's figure, summed over the disks it was measured on: the round trip's bytes per second, or
    the engine's workload's where the sweep measured it (`PointResult.goal_bw_bytes`)."""
    cpu_ms_per_gb: float | None = None
    """CPU milliseconds (user + system) per GB moved, averaged over directions and disks; None if unknown."""
    label: str = ""
    """How reports name it ("io_uring bs=1M qd=8 t=1 ss=F oe=T"); the settings as JSON when empty."""

    @property
    def name(self) -> str:
        """``label``, or the settings as JSON."""
        return self.label or json.dumps(self.config.to_dict(), sort_keys=True)


@dataclass(frozen=True, slots=True)
class Choice:
    """The recommended configuration, the best one, those tied with it, and the reason in one sentence."""

    chosen: Candidate
    best: Candidate
    tied: tuple[Candidate, ...]
    """Every candidate within ``noise`` of the best, the best first (the best alone when none is)."""
    noise: float
    reason: str
    cpu_noise: float | None = None
    """How far apart CPU figures of one configuration lay (None: unknown, `CPU_TOLERANCE` applied)."""

    @property
    def config(self) -> AioConfig:
        """The chosen configuration."""
        return self.chosen.config


def candidates(disks: Sequence[Sequence[Any]], label: Callable[[AioConfig], str] | None = None) -> list[Candidate]:
    """One `Candidate` per configuration measured on every disk (each disk a list of `PointResult`s):
    round trips summed over the disks, CPU per GB averaged. ``label(config)`` names them."""
    by_key: dict[str, list[Any]] = {}
    for points in disks:
        for p in points:
            by_key.setdefault(json.dumps(p.config.to_dict(), sort_keys=True), []).append(p)
    out = []
    for measured in by_key.values():
        if len(measured) != len(disks):
            continue  # not on every disk: a sum over fewer disks is not comparable
        cpu = [p.cpu_ms_per_gb for p in measured if p.cpu_ms_per_gb is not None]
        config = measured[0].config
        out.append(Candidate(config=config, bw_bytes=sum(p.goal_bw_bytes for p in measured),
                             cpu_ms_per_gb=sum(cpu) / len(cpu) if cpu else None,
                             label=label(config) if label else ""))
    return out


def tied_with_best(cands: Sequence[Candidate], noise: float) -> list[Candidate]:
    """The candidates within ``noise`` (a fraction) of the highest figure, highest first.

    Raises ValueError for no candidates or a negative noise.
    """
    if not cands:
        raise ValueError("no configurations measured")
    if noise < 0:
        raise ValueError(f"noise {noise} is negative")
    ranked = sorted(cands, key=lambda c: c.bw_bytes, reverse=True)
    floor = ranked[0].bw_bytes * (1 - noise)
    return [c for c in ranked if c.bw_bytes >= floor]


def _off_default(config: AioConfig) -> int:
    return sum((config.block_size != _DEFAULT.block_size, config.single_submit != _DEFAULT.single_submit,
                config.overlap_events != _DEFAULT.overlap_events, config.backend not in _DEFAULT_BACKENDS))


def lightest(tied: Sequence[Candidate], cpu_noise: float | None = None) -> tuple[Candidate, list[str]]:
    """The lightest of ``tied`` and the criteria that narrowed them down, as phrases.

    Fewest threads, then lowest queue depth, then least CPU per GB (those within ``cpu_noise`` of
    the lowest, and at least within `CPU_TOLERANCE`, count as lowest; those without a CPU figure are
    kept), then fewest settings off the defaults, then the highest figure. A criterion is named only
    where it set some candidates aside. Raises ValueError for none.
    """
    if not tied:
        raise ValueError("no configurations to choose from")
    left, why = list(tied), []

    def keep(kept: list[Candidate], phrase: str) -> None:
        nonlocal left
        if len(kept) < len(left):
            why.append(phrase)
        left = kept

    threads = min(c.config.thread_count for c in left)
    keep([c for c in left if c.config.thread_count == threads], f"the fewest threads ({threads})")
    depth = min(c.config.queue_depth for c in left)
    keep([c for c in left if c.config.queue_depth == depth], f"the lowest queue depth ({depth})")
    known = [c.cpu_ms_per_gb for c in left if c.cpu_ms_per_gb is not None]
    if known:
        tolerance = max(CPU_TOLERANCE, cpu_noise or 0.0)
        ceiling = min(known) * (1 + tolerance)
        keep([c for c in left if c.cpu_ms_per_gb is None or c.cpu_ms_per_gb <= ceiling],
             f"the least CPU per GB ({min(known):.0f} ms, within {tolerance:.0%})")
    off = min(_off_default(c.config) for c in left)
    keep([c for c in left if _off_default(c.config) == off], "the fewest settings off the defaults")
    keep(sorted(left, key=lambda c: (-c.bw_bytes, c.name))[:1], "the highest figure of those left")
    return left[0], why


def choose(cands: Sequence[Candidate], noise: float, *, cpu_noise: float | None = None) -> Choice:
    """The lightest candidate of those within ``noise`` of the best, with the reason in one sentence:
    "tied within 6%: chose X (3.10 GB/s) because of the 5 tied with the best (Y, 3.26 GB/s) it has
    the fewest threads (1) and the lowest queue depth (8)".

    ``cpu_noise`` is how far apart CPU figures of one configuration lie (see `lightest`). Raises
    ValueError for no candidates or a negative noise.
    """
    tied = tied_with_best(cands, noise)
    best = tied[0]
    if len(tied) == 1:
        return Choice(chosen=best, best=best, tied=(best,), noise=noise, cpu_noise=cpu_noise,
                      reason=f"none within {noise:.0%} of the best: chose {best.name} "
                             f"({best.bw_bytes / 1e9:.2f} GB/s), the best")
    chosen, why = lightest(tied, cpu_noise)
    figure = f"{chosen.name} ({chosen.bw_bytes / 1e9:.2f} GB/s)"
    if chosen is best:
        because = f"it is the best and, of the {len(tied)} tied, has {_join(why)}" if why else "it is the best"
    else:
        because = (f"of the {len(tied)} tied with the best ({best.name}, {best.bw_bytes / 1e9:.2f} GB/s) it has "
                   f"{_join(why)}")
    return Choice(chosen=chosen, best=best, tied=tuple(tied), noise=noise, cpu_noise=cpu_noise,
                  reason=f"tied within {noise:.0%}: chose {figure} because {because}")


def _join(phrases: list[str]) -> str:
    return phrases[0] if len(phrases) == 1 else ", ".join(phrases[:-1]) + " and " + phrases[-1]
