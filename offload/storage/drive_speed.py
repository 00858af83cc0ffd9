"""How fast each drive of a striped swap file is, as the integer weights of its stripes.

A `StripedSwapFile` over drives of unequal speed must give each drive a share of every request in
proportion to its speed, or every request waits for the slowest drive's part (striped traffic is then at
most D x the slowest drive, not the sum). The speeds are measured once per file system and process
(`measured_weights`): a brief write then read of `PROBE_BYTES` through tensorio, with the swap file's
own settings (O_DIRECT where the file system has it, checksums as ``aio.verify`` says), in a swap file of
its own that is removed at once. `stripe_weights` turns the speeds into small integers (pure): drives
within `EQUAL_WITHIN` of each other count as equal, so that a probe's noise never makes a lopsided layout
of identical drives, and a cycle holds at most `MAX_CYCLE` stripe units.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from typing import Callable, Sequence

import torch

from tensorio import AioConfig, aligned_tensor

from offload.storage.swapfile import SwapFile

__all__ = ["EQUAL_WITHIN", "MAX_CYCLE", "PROBE_BYTES", "measured_weights", "probe_speed", "stripe_weights"]

log = logging.getLogger(__name__)

PROBE_BYTES = 8 << 20
"""Bytes the probe writes then reads on each file system: a few tens of milliseconds on a drive of 1 GB/s."""

MAX_CYCLE = 16
"""Most stripe units in a cycle (every drive's run once): 16 MiB of 1 MiB units, a request's size."""

EQUAL_WITHIN = 1.3
"""Drives whose measured speeds are closer than this ratio (chained, slowest to fastest) get equal weights."""

CLOSE_ENOUGH = 1.03
"""A cycle this close to the best one's time per byte is as good: the smallest such cycle is taken (shorter
runs share each request more evenly, and a probe is not this precise)."""

_speeds: dict[tuple[int, str], float] = {}
"""(file system's st_dev, the aio settings) -> bytes/s measured, once per process."""
_speeds_lock = threading.Lock()


def stripe_weights(speeds: Sequence[float], *, max_cycle: int = MAX_CYCLE,
                   equal_within: float = EQUAL_WITHIN) -> tuple[int, ...]:
    """Integer weights for drives of ``speeds`` (any unit, all positive), reduced by their common divisor,
    summing to at most ``max_cycle`` (all ones where there are more drives than that). Pure.

    Speeds are first grouped: sorted, each within ``equal_within`` of the previous one joins its group, and
    a group counts at its mean speed, so drives of one group get one weight. Then, of the roundings
    ``round(T * speed / total)`` (at least 1) for every cycle ``T`` up to ``max_cycle``, each is costed by
    when its slowest drive finishes its share (``max(weight / (cycle * speed))``), and the smallest cycle
    within `CLOSE_ENOUGH` of the best cost wins.

    Raises ValueError for no speeds or a speed that is not a positive finite number."""
    if not speeds or not all(isinstance(s, (int, float)) and math.isfinite(s) and s > 0 for s in speeds):
        raise ValueError(f"stripe_weights: speeds {list(speeds)!r} must be one or more positive numbers")
    grouped = _grouped(speeds, equal_within)
    total = sum(grouped)
    candidates = [(1,) * len(grouped)]  # in order of their cycles
    for cycle in range(len(grouped) + 1, max_cycle + 1):
        weights = tuple(max(1, round(cycle * s / total)) for s in grouped)
        if sum(weights) <= max_cycle:
            candidates.append(weights)
    best = min(_cost(weights, grouped) for weights in candidates)
    chosen = min((w for w in candidates if _cost(w, grouped) <= best * CLOSE_ENOUGH), key=sum)
    common = math.gcd(*chosen)
    return tuple(w // common for w in chosen)


def _grouped(speeds: Sequence[float], equal_within: float) -> list[float]:
    """``speeds`` with each group of near-equal ones (chained in sorted order) replaced by the group's mean."""
    order = sorted(range(len(speeds)), key=lambda i: speeds[i])
    groups: list[list[int]] = []
    for i in order:
        if groups and speeds[i] < speeds[groups[-1][-1]] * equal_within:
            groups[-1].append(i)
        else:
            groups.append([i])
    out = [0.0] * len(speeds)
    for group in groups:
        mean = sum(speeds[i] for i in group) / len(group)
        for i in group:
            out[i] = mean
    return out


def _cost(weights: Sequence[int], speeds: Sequence[float]) -> float:
    """Time per byte of striped traffic: the slowest drive's share over its speed."""
    cycle = sum(weights)
    return max(w / (cycle * s) for w, s in zip(weights, speeds))


def probe_speed(directory: str | os.PathLike, aio: AioConfig, *, nbytes: int = PROBE_BYTES,
                key: str = "nvme_path") -> float:
    """Bytes/s of writing then reading ``nbytes`` in ``directory`` through tensorio with ``aio`` (a swap file
    of its own, preallocated, written once untimed to start its I/O workers, then written and read timed;
    removed at the end). Raises as `SwapFile` does (naming ``key``) and TensorIOError for a failed request."""
    file = SwapFile(directory, aio, kind="probe", key=key)
    try:
        offset = file.allocate(nbytes)
        file.preallocate()
        data = aligned_tensor(nbytes, torch.uint8).fill_(0x5A)
        file.write(data, offset).result()  # warm-up: the handle's workers start, the blocks are written once
        start = time.perf_counter()
        file.write(data, offset).result()
        file.read(data, offset).result()
        return 2 * nbytes / max(time.perf_counter() - start, 1e-9)
    finally:
        file.close()


def measured_weights(directories: Sequence[str | os.PathLike], aio: AioConfig, *, key: str = "nvme_path",
                     probe: Callable[[str, AioConfig], float] | None = None) -> tuple[int, ...]:
    """The stripe weights of ``directories`` (`stripe_weights` of their speeds). Each file system is probed
    once per process and settings (`probe_speed`; directories on one file system share its figure, so they
    get equal weights); ``probe(directory, aio)`` replaces the measurement, and then nothing is kept.

    Where a probe fails (a full or failing drive), the drives are taken as equal and a warning says why: the
    swap file's own checks then name the drive. Logs the speeds and the weights where it measured."""
    paths = [os.path.abspath(os.fspath(d)) for d in directories]
    speeds: dict[int, float] = {}
    measured = probe is not None
    try:
        for path in paths:
            device = os.stat(path).st_dev
            if device in speeds:
                continue
            if probe is not None:
                speeds[device] = probe(path, aio)
            else:
                speeds[device], fresh = _cached_speed(path, aio, device, key)
                measured = measured or fresh
    except OSError as error:
        log.warning("%s: could not measure the drives' speeds (%s); striping evenly over %s", key, error,
                    ", ".join(paths))
        return (1,) * len(paths)
    figures = [speeds[os.stat(path).st_dev] for path in paths]
    weights = stripe_weights(figures)
    drives = ", ".join(f"{path} ({speed / 1e9:.2f} GB/s)" for path, speed in zip(paths, figures))
    (log.info if measured else log.debug)("%s: striping over %s with weights %s", key, drives,
                                          ":".join(map(str, weights)))
    return weights


def _cached_speed(path: str, aio: AioConfig, device: int, key: str) -> tuple[float, bool]:
    """(bytes/s of ``device``'s file system, whether it was measured now)."""
    with _speeds_lock:  # one probe of a file system at a time, and only once
        cache_key = (device, repr(aio))
        if cache_key in _speeds:
            return _speeds[cache_key], False
        _speeds[cache_key] = probe_speed(path, aio, key=key)
        return _speeds[cache_key], True
