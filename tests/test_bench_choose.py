"""Statistics that choose (bench/stats.py, bench/choose.py): spread and intervals, the disk's noise, the
configurations tied with the best and the lightest of them, on synthetic measurements. No disk."""

from __future__ import annotations

import random
import statistics

import pytest

from bench.choose import CPU_TOLERANCE, Candidate, choose, lightest, tied_with_best
from bench.measure import Measurement, PointResult
from bench.stats import confidence_interval, disk_noise, pair_difference, relative_spread, round_trip, summarize
from bench.sweep import choose_config, config_label, pooled, sweep_noise
from tensorio import AioConfig

MiB = 1 << 20


def _cand(gbs: float, *, t: int = 1, qd: int = 8, cpu: float | None = 100.0, **settings) -> Candidate:
    config = AioConfig(thread_count=t, queue_depth=qd, **{"backend": "io_uring", **settings})
    return Candidate(config=config, bw_bytes=gbs * 1e9, cpu_ms_per_gb=cpu, label=config_label(config))


def _point(write: list[float], read: list[float], *, t: int = 1, qd: int = 8, bs: int = MiB,
           cpu_us_per_io: float = 50.0, backend: str = "io_uring") -> PointResult:
    """A point with the given GB/s of each repeat."""
    def m(rw: str, samples: list[float]) -> Measurement:
        bw = [int(s * 1e9) for s in samples]
        median = sorted(bw)[len(bw) // 2]
        return Measurement(rw=rw, bw_bytes=median, iops=median / bs, clat_ns_p50=1, clat_ns_p99=2, clat_ns_mean=1.5,
                           bw_bytes_samples=bw, io_bytes=16 * MiB, request_bytes=16 * MiB, cpu_us_per_io=cpu_us_per_io)

    config = AioConfig(block_size=bs, queue_depth=qd, thread_count=t, backend=backend)
    return PointResult(config=config, backend=backend, direct=True, write=m("write", write), read=m("read", read))


# ---- spread, intervals, noise ----------------------------------------------------------------------

def test_summary_of_repeats():
    s = summarize([10.0, 11.0, 12.0])
    assert (s.n, s.median, s.mean) == (3, 11.0, 11.0)
    assert s.spread == pytest.approx(2 / 11)
    half = 4.303 * 1.0 / 3 ** 0.5  # Student's t for 2 degrees of freedom, sd 1
    assert (s.low, s.high) == (pytest.approx(11 - half), pytest.approx(11 + half))
    one = summarize([5.0])
    assert (one.low, one.high, one.spread) == (5.0, 5.0, 0.0)
    assert summarize([0.1, 1.0, 5.0]).low == 0.0  # a rate's interval does not go below 0
    assert confidence_interval([0.1, 1.0, 5.0])[0] < 0  # the plain interval does
    many = [10.0 + (i % 2) for i in range(40)]  # 39 degrees of freedom, beyond the table: 1.96
    low, high = confidence_interval(many)
    assert high - low == pytest.approx(2 * 1.96 * statistics.stdev(many) / 40 ** 0.5)
    with pytest.raises(ValueError):
        relative_spread([])


def test_round_trip_pairs_each_repeats_write_with_its_read():
    assert round_trip([4.0, 2.0], [4.0, 6.0]) == [4.0, 3.0]
    with pytest.raises(ValueError, match="2 writes and 1 reads"):
        round_trip([1.0, 2.0], [1.0])


def test_two_measurements_differ_by_up_to_2_77_deviations_95_times_in_100():
    assert pair_difference([90.0, 100.0, 110.0]) == pytest.approx(1.96 * 2 ** 0.5 * 10 / 100)
    assert pair_difference([5.0, 5.0]) == 0.0
    with pytest.raises(ValueError, match="at least 2"):
        pair_difference([1.0])
    rng = random.Random(7)  # the bound holds for draws of one normal distribution
    draws = [rng.gauss(100, 5) for _ in range(4000)]
    bound = pair_difference(draws)
    pairs = [abs(a - b) / 100 for a, b in zip(draws[::2], draws[1::2])]
    assert 0.93 < sum(d <= bound for d in pairs) / len(pairs) < 0.97


def test_noise_is_the_larger_of_the_references_drift_and_the_repeats_spread():
    drifting = disk_noise([100.0, 106.0, 103.0, 101.0], [0.02, 0.03, 0.10])
    expected = pair_difference([100.0, 106.0, 103.0, 101.0])
    assert drifting.relative == pytest.approx(expected) and drifting.repeat_spread == pytest.approx(0.03)
    assert drifting.reference_spread == pytest.approx(6 / 102)
    assert drifting.describe("io_uring bs=1M") == (
        f"noise {expected:.0%}: io_uring bs=1M measured 4 times through the sweep at 0.00-0.00 GB/s, so two "
        f"measurements of a configuration lie up to {expected:.0%} apart (95 times in 100); repeats of a point "
        f"3% apart at the median")
    steady_reference = disk_noise([100.0, 100.5], [0.07, 0.08, 0.09])
    assert steady_reference.relative == pytest.approx(0.08)
    assert disk_noise([100.0], []).relative == 0.0 and "noise unknown" in disk_noise([100.0], []).describe()
    with_cpu = disk_noise([100.0, 104.0], [], reference_cpu=[60.0, 80.0, 70.0])
    assert with_cpu.cpu == pytest.approx(pair_difference([60.0, 80.0, 70.0]))
    assert with_cpu.describe().endswith("; its CPU per GB up to 40% apart")


def test_a_sweeps_noise_comes_from_its_reference_and_its_points():
    references = [_point([4.0] * 3, [2.0] * 3), _point([4.4] * 3, [2.2] * 3)]  # round trip 2.67, then 2.93
    points = [_point([4.0, 4.2, 4.4], [2.0, 2.0, 2.0])]
    noise = sweep_noise(points, references)
    assert noise.reference_spread == pytest.approx(0.1 / 1.05)
    assert noise.reference_difference == pytest.approx(pair_difference([r.both_bw_bytes for r in references]))
    assert noise.repeat_spread == pytest.approx(points[0].both_summary.spread)
    assert sweep_noise([_point([4.0], [2.0])], references).repeat_spread is None  # one repeat: no spread


# ---- ties and the lightest ---------------------------------------------------------------------------

def test_tied_are_those_within_the_noise_of_the_best():
    best, near, out = _cand(3.00), _cand(2.83), _cand(2.81)
    assert tied_with_best([out, near, best], 0.06) == [best, near]  # 2.82 is the floor
    assert tied_with_best([out, near, best], 0.0) == [best]
    with pytest.raises(ValueError):
        tied_with_best([], 0.06)
    with pytest.raises(ValueError):
        tied_with_best([best], -0.1)


def test_the_lightest_has_fewest_threads_then_lowest_depth():
    heavy = _cand(3.3, t=2, qd=32)
    one_thread_deep = _cand(3.2, t=1, qd=32)
    one_thread_shallow = _cand(3.1, t=1, qd=8, cpu=150.0)  # more CPU, but depth comes first
    chosen, why = lightest([heavy, one_thread_deep, one_thread_shallow])
    assert chosen is one_thread_shallow
    assert why == ["the fewest threads (1)", "the lowest queue depth (8)"]


def test_cpu_per_gb_decides_beyond_its_tolerance_and_the_defaults_within_it():
    uring = _cand(3.0, cpu=100.0)
    threads_cheaper = _cand(3.1, cpu=100.0 * (1 - CPU_TOLERANCE) - 1, backend="threads")
    assert lightest([uring, threads_cheaper])[0] is threads_cheaper
    threads_close = _cand(3.1, cpu=100.0 * (1 + CPU_TOLERANCE / 2), backend="threads")
    chosen, why = lightest([threads_close, uring])
    assert chosen is uring and why == ["the fewest settings off the defaults"]  # "auto" picks io_uring
    big_blocks = _cand(3.2, block_size=4 * MiB)
    flags = _cand(3.2, single_submit=True)
    assert lightest([big_blocks, flags, uring])[0] is uring  # 1M, single_submit false: the defaults
    unknown_cpu = _cand(3.2, cpu=None, block_size=4 * MiB)
    assert lightest([unknown_cpu, uring])[0] is uring  # no CPU figure is kept, then the defaults decide
    twin = _cand(3.05)
    chosen, why = lightest([uring, twin])
    assert chosen is twin and why == ["the highest figure of those left"]


def test_cpu_figures_within_the_cpus_own_noise_count_as_equal():
    """CPU per GB of one configuration moved 30% over a sweep: a 20% lower figure is no reason to leave
    the defaults; a 40% lower one is."""
    uring = _cand(3.0, cpu=100.0)
    threads = _cand(3.0, cpu=80.0, backend="threads")
    assert lightest([uring, threads])[0] is threads  # the 10% floor alone
    chosen, why = lightest([uring, threads], cpu_noise=0.30)
    assert chosen is uring and why == ["the fewest settings off the defaults"]
    assert lightest([uring, _cand(3.0, cpu=60.0, backend="threads")], cpu_noise=0.30)[0].config.backend == "threads"
    choice = choose([_cand(3.0, t=2), uring, threads], 0.05, cpu_noise=0.30)
    assert choice.config == uring.config and choice.cpu_noise == 0.30


def test_the_report_says_tied_within_and_why():
    best = _cand(3.26, t=2, qd=32)
    deep = _cand(3.20, t=1, qd=32)
    light = _cand(3.10, t=1, qd=8)
    choice = choose([best, light, deep, _cand(2.0, t=1, qd=4)], 0.06)
    assert choice.config == light.config and choice.best is best and choice.tied == (best, deep, light)
    assert choice.reason == (f"tied within 6%: chose {light.label} (3.10 GB/s) because of the 3 tied with the best "
                             f"({best.label}, 3.26 GB/s) it has the fewest threads (1) and the lowest queue depth (8)")
    alone = choose([best, _cand(2.0)], 0.06)
    assert alone.config == best.config and alone.reason.startswith("none within 6% of the best: chose")
    best_and_lightest = choose([_cand(3.3, t=1), _cand(3.2, t=2)], 0.06)
    assert best_and_lightest.reason.endswith("because it is the best and, of the 2 tied, has the fewest threads (1)")


def test_noisy_sweeps_of_one_plateau_choose_the_same_config_where_the_maximum_wanders():
    """Six sweeps of a disk whose true round trips form a plateau, each figure off by up to 4%: the best
    point changes from sweep to sweep, the choice within a noise of 10% does not."""
    truth = {(1, 8): 3.00, (1, 32): 3.05, (2, 8): 3.08, (2, 32): 3.10, (1, 4): 2.40}
    rng = random.Random(54)
    maxima, chosen = set(), set()
    for _ in range(6):
        cands = [_cand(gbs * rng.uniform(0.96, 1.04), t=t, qd=qd) for (t, qd), gbs in truth.items()]
        maxima.add(max(cands, key=lambda c: c.bw_bytes).label)
        chosen.add(choose(cands, 0.10).chosen.label)
    assert len(maxima) > 1
    assert chosen == {_cand(1.0, t=1, qd=8).label}


def test_choose_config_sums_disks_and_takes_cpu_per_gb_from_the_points():
    cheap = _point([4.0] * 3, [2.0] * 3, qd=8, cpu_us_per_io=50.0)
    dear = _point([4.0] * 3, [2.0] * 3, qd=8, bs=4 * MiB, cpu_us_per_io=500.0)
    assert cheap.cpu_ms_per_gb == pytest.approx(50.0 / MiB * 1e9 / 1e3)
    choice = choose_config([[cheap, dear], [cheap, dear]], 0.05)
    assert choice.config == cheap.config and choice.best.bw_bytes == pytest.approx(2 * cheap.both_bw_bytes)


def test_the_reference_configurations_figure_pools_all_its_measurements():
    grid = _point([4.0, 4.1, 4.2], [1.0, 1.1, 1.2], cpu_us_per_io=30.0)  # measured at a bad moment
    again = [_point([5.0, 5.1, 5.2], [2.0, 2.1, 2.2], cpu_us_per_io=c) for c in (50.0, 60.0, 70.0)]
    merged = pooled(grid, again)
    assert merged.write.bw_bytes_samples == [*grid.write.bw_bytes_samples, *(s for p in again for s in
                                                                            p.write.bw_bytes_samples)]
    assert merged.write.bw_bytes == int(5.05e9) and merged.read.bw_bytes == int(2.05e9)  # medians of 12 passes
    assert merged.write.cpu_us_per_io == 55.0 and merged.write.clat_ns_p99 == grid.write.clat_ns_p99
    assert merged.both_summary.n == 12 and len(grid.write.bw_bytes_samples) == 3  # the input is not changed
    with pytest.raises(ValueError, match="the point's configuration"):
        pooled(grid, [_point([1.0], [1.0], qd=32)])
