"""The sweep's pure parts: grids, the plan with its reference point, picking the best, percentiles. No disk
involved (sizes: test_tensorio_units.py; the choice among tied points: test_bench_choose.py)."""

from __future__ import annotations

import pytest

from bench.measure import Measurement, PointResult, _percentile
from bench.sweep import GRIDS, Grid, best_points, choose_config, config_key, reference_config, sweep_plan
from tensorio import AioConfig

MiB = 1 << 20


def _point(bs: int, write_gbs: float, read_gbs: float, backend: str = "io_uring") -> PointResult:
    def m(rw: str, gbs: float) -> Measurement:
        bw = int(gbs * 1e9)
        return Measurement(rw=rw, bw_bytes=bw, iops=bw / bs, clat_ns_p50=1, clat_ns_p99=2, clat_ns_mean=1.5,
                           bw_bytes_samples=[bw], io_bytes=MiB, request_bytes=MiB)

    return PointResult(config=AioConfig(block_size=bs, backend=backend), backend=backend, direct=True,
                       write=m("write", write_gbs), read=m("read", read_gbs))


def test_grid_crosses_every_knob_for_io_uring_and_sweeps_threads_once():
    grid = Grid(block_sizes=(4096, MiB), queue_depths=(1, 8), thread_counts=(1, 2, 4),
                single_submit=(False, True), overlap_events=(True, False))
    configs = grid.configs(backends=["io_uring", "threads"])
    uring = [c for c in configs if c.backend == "io_uring"]
    threads = [c for c in configs if c.backend == "threads"]
    assert len(uring) == 2 * 2 * 3 * 2 * 2 and len(threads) == 2 * 2 * 3
    assert len({config_key(c) for c in configs}) == len(configs)
    assert all(not c.single_submit and c.overlap_events for c in threads)


def test_grid_leaves_out_backends_that_cannot_run():
    configs = GRIDS["quick"].configs(backends=["threads"], direct=True)
    assert {c.backend for c in configs} == {"threads"} and len(configs) == 8
    assert all(c.direct is True for c in configs)


def test_named_grids_fit_their_sizes():
    for name, grid in GRIDS.items():
        assert max(grid.block_sizes) <= 16 * MiB <= grid.size, name  # whole blocks in the default request
    assert len(GRIDS["quick"].configs(backends=["io_uring", "threads"])) == 16


def test_best_points_by_direction_and_round_trip():
    fast_write, fast_read, balanced = _point(4096, 4.0, 0.5), _point(8192, 1.0, 3.0), _point(MiB, 2.5, 2.0)
    best = best_points([fast_write, fast_read, balanced])
    assert best["write"] is fast_write and best["read"] is fast_read and best["both"] is balanced
    assert balanced.both_bw_bytes == pytest.approx(2 / (1 / 2.5e9 + 1 / 2.0e9))
    with pytest.raises(ValueError):
        best_points([])


def test_without_noise_the_choice_is_the_best_over_all_disks():
    disk1 = [_point(4096, 3.0, 3.0), _point(MiB, 2.0, 2.0)]
    disk2 = [_point(4096, 0.5, 0.5), _point(MiB, 2.0, 2.0)]
    assert choose_config([disk1], 0.0).config.block_size == 4096
    assert choose_config([disk1, disk2], 0.0).config.block_size == MiB  # 4.0 GB/s summed beats 3.5
    only_on_one = [_point(8192, 9.0, 9.0)]  # measured on one disk of two: its sum does not compare
    assert choose_config([disk1 + only_on_one, disk2], 0.0).config.block_size == MiB


def test_the_reference_is_the_grids_point_closest_to_the_defaults():
    for name, grid in GRIDS.items():
        configs = grid.configs(backends=["io_uring", "threads"])
        ref = reference_config(configs)
        assert ref in configs and ref.thread_count == 1 and ref.backend == "io_uring", name
    assert reference_config(GRIDS["quick"].configs(backends=["io_uring"])).queue_depth == 8
    assert reference_config(GRIDS["default"].configs(backends=["io_uring"])).block_size == MiB


@pytest.mark.parametrize("points", [1, 2, 16, 120])
def test_the_plan_measures_every_point_once_and_the_reference_first_last_and_between(points):
    configs = [AioConfig(block_size=4096 * (i + 1)) for i in range(points)]
    plan = sweep_plan(configs, references=5)
    assert [s.config for s in plan if s.kind == "point"] == configs
    refs = [i for i, s in enumerate(plan) if s.kind == "reference"]
    assert len(refs) == 5 and refs[0] == 0 and refs[-1] == len(plan) - 1
    assert [plan[i].slot for i in refs] == list(range(5))
    assert len({s.key for s in plan}) == len(plan)  # a resumed sweep tells every step apart
    if points >= 8:
        gaps = [b - a for a, b in zip(refs, refs[1:])]
        assert max(gaps) - min(gaps) <= 1  # evenly spread
    with pytest.raises(ValueError, match="at least 2"):
        sweep_plan(configs, references=1)


def test_percentile_nearest_rank():
    values = list(range(1, 101))
    assert _percentile(values, 50) == 50 and _percentile(values, 99) == 99 and _percentile(values, 100) == 100
    assert _percentile([7], 50) == 7 and _percentile([7], 99) == 7


# ---- the chart -------------------------------------------------------------------------------------

def test_chart_keeps_every_point_inside_its_axes_marks_the_chosen_and_draws_fio():
    """The demo's case: the best point (2 threads, 1 MiB) is far above anything in the 1-thread panel
    that the row's shared axis used to be sized by; fio's line at each block size; the title as given."""
    pytest.importorskip("matplotlib")
    from bench.chart import plot_sweep
    from bench.sweep import FioCurvePoint

    def point(bs, tc, qd, write_gbs, read_gbs):
        p = _point(bs, write_gbs, read_gbs)
        p.config = AioConfig(block_size=bs, queue_depth=qd, thread_count=tc)
        return p

    points = [point(bs, tc, qd, w, r) for bs, tc, qd, w, r in [
        (128 << 10, 1, 8, 0.4, 0.6), (MiB, 1, 8, 0.5, 0.7), (128 << 10, 1, 32, 0.5, 0.8), (MiB, 1, 32, 0.6, 0.9),
        (128 << 10, 2, 8, 1.0, 1.5), (MiB, 2, 8, 2.0, 2.5), (128 << 10, 2, 32, 1.2, 1.6), (MiB, 2, 32, 3.32, 4.1)]]
    chosen = choose_config([points], 0.0).config
    assert (chosen.block_size, chosen.thread_count, chosen.queue_depth) == (MiB, 2, 32)
    fio = [FioCurvePoint(rw=rw, block_size=bs, thread_count=tc, queue_depth=32, bw_bytes=int(gbs * 1e9))
           for rw, gbs in (("write", 3.5), ("read", 4.6)) for bs in (128 << 10, MiB) for tc in (1, 2)]
    fig = plot_sweep(points, None, "/mnt/nvme/swap (ext4), 128M per pass", chosen=chosen, fio_curve=fio)

    axes = fig.axes
    assert len(axes) == 4
    for ax in axes:
        bottom, top = ax.get_ylim()
        drawn = [y for line in ax.get_lines() for y in line.get_ydata()]
        assert drawn and bottom <= min(drawn) and max(drawn) < top, ax.get_title()
        fio_lines = [line for line in ax.get_lines() if line.get_label().startswith("fio")]
        assert len(fio_lines) == 1 and list(fio_lines[0].get_xdata()) == [128 << 10, MiB], ax.get_title()
    marked = {(ax.get_title(), int(line.get_xdata()[0]), round(float(line.get_ydata()[0]), 2))
              for ax in axes for line in ax.get_lines() if line.get_label() == "chosen"}
    assert marked == {("write, 2 threads", MiB, 3.32), ("read, 2 threads", MiB, 4.1)}
    assert fig.get_suptitle().startswith("/mnt/nvme/swap (ext4), 128M per pass\nchosen (star): io_uring 1M qd 32")
