"""How fast each drive of a striped swap file is, as the integer weights of its stripes.

A `StripedSwapFile` over drives of unequal speed must give each drive a share of every request in
proportion to its speed, or every request waits for the slowest drive's part (striped traffic is then at
most D x the slowest drive, not the sum). The speeds are measured once per file system and process
(`measured_weights`), all the new file systems together (`probe_speeds`): a probe file on each, then rounds
that write then read `probe_bytes` (two queues' worth of the swap file's requests) on each drive in turn,
with the swap file's own settings (O_DIRECT where the file system has it) but no checksums (`probe_config`:
hashing costs the CPU the same per byte whatever drive the byte goes to, so it is no part of a drive's
speed), taking each drive's fastest write and fastest read (other work only ever slows a round down). The
drives alternate within the rounds, so that a burst of other traffic falls on every drive alike. About a
quarter of a second for a disk and a tmpfs. `stripe_weights` turns the speeds into small integers (pure):
drives within `EQUAL_WITHIN` of each other count as equal, so that a probe's noise never makes a lopsided
layout of identical drives, and a cycle holds at most `MAX_CYCLE` stripe units.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import threading
import time
from typing import Callable, Sequence

import torch

from tensorio import AioConfig, aligned_tensor

from offload.storage.swapfile import SwapFile

__all__ = ["EQUAL_WITHIN", "MAX_CYCLE", "MAX_PROBE_BYTES", "PROBE_BYTES", "PROBE_MIN_ROUNDS", "PROBE_ROUNDS",
           "PROBE_SECONDS", "measured_weights", "probe_bytes", "probe_config", "probe_speeds",
           "stripe_weights"]

log = logging.getLogger(__name__)

PROBE_BYTES = 16 << 20
"""The fewest bytes a round of the probe writes then reads on each drive: two queues' worth at tensorio's
default settings (8 pieces of 1 MiB in flight), so that a round keeps the queue full past its first batch and
times the drive's rate, not one batch's latency (`probe_bytes`)."""

MAX_PROBE_BYTES = 64 << 20
"""The most bytes of a round, however deep the swap file's queues."""

PROBE_ROUNDS = 8
"""Rounds of the probe (each drive written then read once per round), at most."""

PROBE_MIN_ROUNDS = 3
"""Rounds of the probe at least, however long they take."""

PROBE_SECONDS = 0.5
"""No round starts after this many seconds of rounds (once `PROBE_MIN_ROUNDS` are done): a slow drive is
measured in fewer rounds rather than for longer."""

MAX_CYCLE = 16
"""Most stripe units in a cycle (every drive's run once): 16 MiB of 1 MiB units, a request's size."""

EQUAL_WITHIN = 1.3
"""Drives whose measured speeds are closer than this ratio (chained, slowest to fastest) get equal weights."""

CLOSE_ENOUGH = 1.03
"""A cycle this close to the best one's time per byte is as good: the smallest such cycle is taken (shorter
runs share each request more evenly, and a probe is not this precise)."""

_speeds: dict[tuple[int, str], float] = {}
"""(file system's st_dev, the probe's aio settings) -> bytes/s measured, once per process."""
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


def probe_config(aio: AioConfig) -> AioConfig:
    """The settings the probe runs with: the swap file's ``aio`` (backend, O_DIRECT, pieces, queue depth,
    threads) without checksums, so that it times the drive and not the CPU's hashing."""
    return dataclasses.replace(aio, verify=False)


def probe_bytes(aio: AioConfig) -> int:
    """Bytes of each round of the probe for a swap file of ``aio``: two queues' worth (``block_size x
    queue_depth x thread_count`` in flight), at least `PROBE_BYTES` and at most `MAX_PROBE_BYTES`."""
    in_flight = aio.block_size * aio.queue_depth * aio.thread_count
    return min(max(PROBE_BYTES, 2 * in_flight), MAX_PROBE_BYTES)


def probe_speeds(directories: Sequence[str | os.PathLike], aio: AioConfig, *, nbytes: int | None = None,
                 rounds: int = PROBE_ROUNDS, min_rounds: int = PROBE_MIN_ROUNDS, seconds: float = PROBE_SECONDS,
                 key: str = "nvme_path") -> list[float]:
    """Bytes/s of each of ``directories`` (one per drive), measured together through tensorio with
    `probe_config` of ``aio``: a probe file on each (preallocated, written once untimed to start its I/O
    workers and lay out its blocks), then up to ``rounds`` rounds (no new one after ``seconds`` of rounds,
    once ``min_rounds`` are done), each writing then reading ``nbytes`` (default `probe_bytes`) on every
    drive in turn, round ``r`` starting at drive ``r % len(directories)``. A drive's speed is ``2 *
    nbytes`` over its fastest write plus its fastest read: other work (other processes' I/O and CPU use)
    only slows a round down. The files are removed at the end. Raises as `SwapFile` does (naming ``key``)
    and TensorIOError (an OSError) for a failed request."""
    aio = probe_config(aio)
    nbytes = probe_bytes(aio) if nbytes is None else nbytes
    files: list[SwapFile] = []
    try:
        for directory in directories:
            files.append(SwapFile(directory, aio, kind="probe", key=key))
        data = aligned_tensor(nbytes, torch.uint8).fill_(0x5A)
        offsets = []
        for file in files:
            offsets.append(file.allocate(nbytes))
            file.preallocate()
            file.write(data, offsets[-1]).result()  # warm-up: the handle's workers start, the blocks are written
        writes = [math.inf] * len(files)
        reads = [math.inf] * len(files)
        start = time.perf_counter()
        for done in range(rounds):
            if done >= min_rounds and time.perf_counter() - start >= seconds:
                break
            for index in [(done + i) % len(files) for i in range(len(files))]:
                file, offset = files[index], offsets[index]
                began = time.perf_counter()
                file.write(data, offset).result()
                written = time.perf_counter()
                file.read(data, offset).result()
                writes[index] = min(writes[index], written - began)
                reads[index] = min(reads[index], time.perf_counter() - written)
        return [2 * nbytes / max(w + r, 1e-9) for w, r in zip(writes, reads)]
    finally:
        for file in files:
            file.close()


def measured_weights(directories: Sequence[str | os.PathLike], aio: AioConfig, *, key: str = "nvme_path",
                     probe: Callable[[str, AioConfig], float] | None = None) -> tuple[int, ...]:
    """The stripe weights of ``directories`` (`stripe_weights` of their speeds). Each file system is probed
    once per process and probe settings (`probe_config`: ``aio.verify`` makes no difference), the ones not
    measured yet together (`probe_speeds`, the drives alternating); directories on one file system share its
    figure, so they get equal weights. ``probe(directory, aio)`` replaces the measurement (one call per
    file system), and then nothing is kept.

    Where a probe fails (a full or failing drive), the drives are taken as equal and a warning says why: the
    swap file's own checks then name the drive. Logs the speeds and the weights where it measured."""
    paths = [os.path.abspath(os.fspath(d)) for d in directories]
    try:
        devices = [os.stat(path).st_dev for path in paths]
        first: dict[int, str] = {}  # a directory per file system, in the order given
        for device, path in zip(devices, paths):
            first.setdefault(device, path)
        if probe is not None:
            speeds, measured = {device: probe(path, aio) for device, path in first.items()}, True
        else:
            speeds, measured = _cached_speeds(first, aio, key)
    except OSError as error:
        log.warning("%s: could not measure the drives' speeds (%s); striping evenly over %s", key, error,
                    ", ".join(paths))
        return (1,) * len(paths)
    figures = [speeds[device] for device in devices]
    weights = stripe_weights(figures)
    drives = ", ".join(f"{path} ({speed / 1e9:.2f} GB/s)" for path, speed in zip(paths, figures))
    (log.info if measured else log.debug)("%s: striping over %s with weights %s", key, drives,
                                          ":".join(map(str, weights)))
    return weights


def _cached_speeds(paths: dict[int, str], aio: AioConfig, key: str) -> tuple[dict[int, float], bool]:
    """(bytes/s of each file system of ``paths`` (st_dev -> a directory on it), whether any was measured now)."""
    settings = repr(probe_config(aio))
    with _speeds_lock:  # one probe at a time, and each file system only once
        missing = [device for device in paths if (device, settings) not in _speeds]
        if missing:
            for device, speed in zip(missing, probe_speeds([paths[d] for d in missing], aio, key=key)):
                _speeds[device, settings] = speed
        return {device: _speeds[device, settings] for device in paths}, bool(missing)
