"""Phase timers for wall_clock_breakdown, driven by a fake clock."""

from __future__ import annotations

import threading

import pytest

from offload.config import EngineConfig
from offload.train.timers import PhaseTimers


class FakeClock:
    def __init__(self):
        self.now = 100.0
        self.reads = 0

    def __call__(self):
        self.reads += 1
        return self.now


def timed_step(timers, clock, **durations):
    for name, seconds in durations.items():
        with timers.phase(name):
            clock.now += seconds
    return timers.step_done()


def test_summary_every_steps_per_print_steps_with_means_per_step():
    clock, lines = FakeClock(), []
    timers = PhaseTimers(steps_per_print=2, log=lines.append, clock=clock)
    assert timed_step(timers, clock, forward=0.010, backward=0.030) is None
    line = timed_step(timers, clock, forward=0.020, backward=0.050, step=0.001)
    assert line == "step 2 | ms per step over the last 2 steps | forward 15.00 | backward 40.00 | step 0.50"
    assert lines == [line]
    # the next window starts from zero; totals keep growing
    timed_step(timers, clock, forward=0.004)
    line = timed_step(timers, clock, forward=0.004, swap_in=0.1)
    assert line == (
        "step 4 | ms per step over the last 2 steps | forward 4.00 | backward 0.00 | step 0.00 | swap_in 50.00"
    )
    assert timers.totals == pytest.approx({"forward": 0.038, "backward": 0.08, "step": 0.001, "swap_in": 0.1})
    assert timers.steps == 4


def test_nested_phases_count_in_both():
    clock = FakeClock()
    timers = PhaseTimers(steps_per_print=1, log=lambda line: None, clock=clock)
    with timers.phase("forward"):
        clock.now += 1.0
        with timers.phase("swap_in"):
            clock.now += 0.5
    assert timers.totals == {"forward": 1.5, "swap_in": 0.5}


def test_a_phase_that_raises_is_still_counted():
    clock = FakeClock()
    timers = PhaseTimers(clock=clock)
    with pytest.raises(KeyError):
        with timers.phase("step"):
            clock.now += 2.0
            raise KeyError("x")
    assert timers.totals == {"step": 2.0}


def test_disabled_reads_no_clock_and_logs_nothing():
    clock, lines = FakeClock(), []
    timers = PhaseTimers(enabled=False, steps_per_print=1, log=lines.append, clock=clock)
    assert timed_step(timers, clock, forward=1.0) is None
    assert (clock.reads, lines, timers.totals) == (0, [], {})


def test_synchronize_runs_at_both_ends_of_a_phase():
    calls = []
    timers = PhaseTimers(synchronize=lambda: calls.append("sync"), clock=lambda: float(len(calls)))
    with timers.phase("backward"):
        calls.append("work")
    assert calls == ["sync", "work", "sync"]
    assert timers.totals == {"backward": 2.0}


def test_phases_from_several_threads_add_up():
    clock = FakeClock()
    timers = PhaseTimers(clock=clock)
    started = threading.Barrier(5)  # four threads inside their phase, and this one
    finish = threading.Event()

    def swap():
        with timers.phase("swap_out"):
            started.wait()
            finish.wait()

    threads = [threading.Thread(target=swap) for _ in range(4)]
    for thread in threads:
        thread.start()
    started.wait()  # every phase has read its start time
    clock.now += 0.02
    finish.set()
    for thread in threads:
        thread.join()
    assert timers.totals["swap_out"] == pytest.approx(4 * 0.02)


def test_from_config():
    base = {"train_batch_size": 4, "zero_optimization": {"stage": 3}}
    config = EngineConfig.from_dict({**base, "wall_clock_breakdown": True, "steps_per_print": 3}, world_size=1)
    timers = PhaseTimers.from_config(config, log=lambda line: None)
    assert (timers.enabled, timers.steps_per_print) == (True, 3)
    assert not PhaseTimers.from_config(EngineConfig.from_dict(base, world_size=1)).enabled


@pytest.mark.parametrize("steps_per_print", [0, -1, 2.5, True])
def test_bad_steps_per_print_is_refused(steps_per_print):
    with pytest.raises(ValueError, match="steps_per_print"):
        PhaseTimers(steps_per_print=steps_per_print)
