"""WarmupLR and WarmupDecayLR against DeepSpeed's formulas, worked out by hand."""

from __future__ import annotations

import math

import pytest
import torch

from offload.config import SchedulerConfig
from offload.train.schedulers import WarmupDecayLR, WarmupLR, build_scheduler


def sgd(groups=1):
    return torch.optim.SGD([{"params": [torch.zeros(1, requires_grad=True)]} for _ in range(groups)], lr=0.5)


def rates(scheduler, steps):
    """The optimizer's rate before the first step(), then after each of ``steps`` step() calls."""
    seen = [scheduler.optimizer.param_groups[0]["lr"]]
    for _ in range(steps):
        scheduler.step()
        seen.append(scheduler.optimizer.param_groups[0]["lr"])
    return seen


def test_log_warmup_then_hold():
    scheduler = WarmupLR(sgd(), warmup_min_lr=0.1, warmup_max_lr=0.5, warmup_num_steps=10)
    expected = [0.1] + [0.1 + 0.4 * math.log(i + 1) / math.log(10) for i in range(10)] + [0.5, 0.5]
    assert rates(scheduler, 12) == pytest.approx(expected, rel=1e-12)
    # spot checks of the formula: iteration 0 is the minimum, iteration 9 reaches the maximum
    assert expected[1] == 0.1 and expected[10] == pytest.approx(0.5)
    assert expected[4] == pytest.approx(0.1 + 0.4 * 0.602059991327962)  # log(4) / log(10)


def test_linear_warmup():
    scheduler = WarmupLR(sgd(), warmup_min_lr=0.0, warmup_max_lr=1.0, warmup_num_steps=4, warmup_type="linear")
    assert rates(scheduler, 6) == [0.0, 0.0, 0.25, 0.5, 0.75, 1.0, 1.0]


def test_warmup_of_fewer_than_two_steps_counts_as_two():
    scheduler = WarmupLR(sgd(), warmup_min_lr=0.0, warmup_max_lr=1.0, warmup_num_steps=0, warmup_type="linear")
    assert rates(scheduler, 3) == [0.0, 0.0, 0.5, 1.0]


def test_decay_after_warmup_reaches_min_at_total_steps():
    scheduler = WarmupDecayLR(sgd(), total_num_steps=8, warmup_min_lr=0.0, warmup_max_lr=1.0, warmup_num_steps=4,
                              warmup_type="linear")
    # iterations 0-3 warm up, then (8 - i) / (8 - 4) for i = 4..8, then 0
    assert rates(scheduler, 11) == [0.0, 0.0, 0.25, 0.5, 0.75, 1.0, 0.75, 0.5, 0.25, 0.0, 0.0, 0.0]


def test_decay_with_log_warmup_and_a_floor():
    scheduler = WarmupDecayLR(sgd(), total_num_steps=12, warmup_min_lr=0.02, warmup_max_lr=0.1, warmup_num_steps=2)
    seen = rates(scheduler, 13)
    assert seen[:3] == pytest.approx([0.02, 0.02, 0.1])  # log(2) / log(2) at iteration 1
    assert seen[3:] == pytest.approx([0.02 + 0.08 * (12 - i) / 10 for i in range(2, 12)] + [0.02])


def test_per_group_rates():
    scheduler = WarmupLR(sgd(groups=2), warmup_min_lr=[0.0, 1.0], warmup_max_lr=[1.0, 3.0], warmup_num_steps=2,
                         warmup_type="linear")
    scheduler.step()
    scheduler.step()
    assert scheduler.get_last_lr() == [0.5, 2.0]
    assert [group["lr"] for group in scheduler.optimizer.param_groups] == [0.5, 2.0]


def test_state_dict_resumes_the_schedule():
    reference = WarmupDecayLR(sgd(), total_num_steps=20, warmup_num_steps=5)
    rates(reference, 7)
    optimizer = sgd()
    resumed = WarmupDecayLR(optimizer, total_num_steps=20, warmup_num_steps=5)
    resumed.load_state_dict(reference.state_dict())
    assert resumed.state_dict() == {"last_batch_iteration": 6}
    assert optimizer.param_groups[0]["lr"] == reference.get_last_lr()[0]
    assert rates(resumed, 5)[1:] == rates(reference, 5)[1:]


def test_explicit_iteration_and_a_scheduler_resumed_by_argument():
    scheduler = WarmupLR(sgd(), warmup_num_steps=10, last_batch_iteration=4)
    with pytest.raises(RuntimeError, match="step"):
        scheduler.get_last_lr()
    scheduler.step()
    assert scheduler.get_last_lr() == pytest.approx([1e-3 * math.log(6) / math.log(10)])
    scheduler.step(20)
    assert scheduler.get_last_lr() == [1e-3]


def test_build_from_config():
    config = SchedulerConfig.from_dict({"type": "WarmupDecayLR", "params": {
        "warmup_min_lr": 0.0, "warmup_max_lr": 0.2, "warmup_num_steps": 2, "total_num_steps": 4,
        "warmup_type": "linear"}})
    scheduler = build_scheduler(config, sgd())
    assert type(scheduler) is WarmupDecayLR
    assert rates(scheduler, 5) == pytest.approx([0.0, 0.0, 0.1, 0.2, 0.1, 0.0])
    plain = build_scheduler(SchedulerConfig.from_dict({"type": "WarmupLR"}), sgd())
    assert type(plain) is WarmupLR and plain.warmup_type == "log" and plain.warmup_num_steps == 1000


@pytest.mark.parametrize(
    "kwargs, key",
    [({"warmup_type": "cosine"}, "warmup_type"), ({"warmup_num_steps": -1}, "warmup_num_steps"),
     ({"warmup_min_lr": [0.1, 0.2]}, "warmup_min_lr"), ({"warmup_max_lr": math.nan}, "warmup_max_lr")],
)
def test_bad_arguments_are_named(kwargs, key):
    with pytest.raises(ValueError, match=key):
        WarmupLR(sgd(), **kwargs)


def test_decay_must_not_end_before_the_warmup():
    with pytest.raises(ValueError, match="total_num_steps"):
        WarmupDecayLR(sgd(), total_num_steps=5, warmup_num_steps=6)
