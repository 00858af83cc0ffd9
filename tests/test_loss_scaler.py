"""Loss scaling: DeepSpeed's dynamic schedule step by step, the static scale, overflow checks, state."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from offload.config import Fp16Config
from offload.train.grads.loss_scaler import DynamicLossScaler, StaticLossScaler, build_loss_scaler
from ranks import run_ranks


def run(scaler, outcomes):
    """Feed overflow flags ("x" overflow, "." good) and return the scale after each update."""
    scales = []
    for outcome in outcomes:
        scaler.update(outcome == "x")
        scales.append(scaler.loss_scale)
    return scales


def test_starts_at_two_to_the_initial_power_and_scales_the_loss():
    scaler = DynamicLossScaler(initial_scale_power=5)
    assert scaler.loss_scale == 32.0
    assert scaler.scale_loss(torch.tensor(1.5)).item() == 48.0


def test_overflow_lowers_the_scale_only_once_hysteresis_is_used_up():
    scaler = DynamicLossScaler(initial_scale_power=10, hysteresis=3, loss_scale_window=1000)
    # the first two overflows use up hysteresis; from the third on, every overflow halves
    assert run(scaler, "xxxx") == [1024, 1024, 512, 256]
    # good steps in between do not refill hysteresis (only growth does), so the next overflow halves at once
    assert run(scaler, "..x") == [256, 256, 128]


def test_hysteresis_one_halves_on_the_first_overflow():
    scaler = DynamicLossScaler(initial_scale_power=4, hysteresis=1)
    assert run(scaler, "x") == [8]


def test_window_growth_follows_deepspeeds_count():
    scaler = DynamicLossScaler(initial_scale_power=4, loss_scale_window=3)
    # from the start: doubles at update indices 3, 6, 9 (the 4th good step, then every 3rd)
    assert run(scaler, "..........") == [16, 16, 16, 32, 32, 32, 64, 64, 64, 128]


def test_window_counts_from_the_last_overflow_and_growth_refills_hysteresis():
    scaler = DynamicLossScaler(initial_scale_power=4, loss_scale_window=2, hysteresis=2)
    # index 0 overflows (hysteresis 2 -> 1); doubling comes at 0 + 1 + 2 = 3, then 5
    assert run(scaler, "x.....") == [16, 16, 16, 32, 32, 64]
    # hysteresis was refilled by the growth: one overflow is tolerated again, the second halves
    assert run(scaler, "xx") == [64, 32]


def test_consecutive_hysteresis_refills_after_every_good_step():
    scaler = DynamicLossScaler(initial_scale_power=4, hysteresis=2, consecutive_hysteresis=True)
    assert run(scaler, "x.x.x.") == [16, 16, 16, 16, 16, 16]
    assert run(scaler, "xx") == [16, 8]


def test_scale_never_drops_below_the_minimum_and_raises_there():
    scaler = DynamicLossScaler(initial_scale_power=3, hysteresis=1, min_loss_scale=3)
    assert run(scaler, "xx") == [4, 3]
    with pytest.raises(RuntimeError, match="minimum loss scale 3.0"):
        scaler.update(True)


def test_scale_stays_at_the_minimum_without_raising_when_asked():
    scaler = DynamicLossScaler(initial_scale_power=1, hysteresis=1, min_loss_scale=1, raise_at_min_scale=False)
    assert run(scaler, "xxx") == [1, 1, 1]


def test_state_dict_round_trip_continues_the_same_schedule():
    reference = DynamicLossScaler(initial_scale_power=6, loss_scale_window=3, hysteresis=2)
    run(reference, "x..x.")
    restored = DynamicLossScaler(initial_scale_power=6, loss_scale_window=3, hysteresis=2)
    restored.load_state_dict(reference.state_dict())
    assert restored.state_dict() == reference.state_dict()
    tail = "...x.x......"
    assert run(restored, tail) == run(reference, tail)


def test_load_state_dict_names_what_is_missing_or_wrong():
    scaler = DynamicLossScaler()
    with pytest.raises(KeyError, match="iteration"):
        scaler.load_state_dict(StaticLossScaler(8).state_dict())
    bad = {**scaler.state_dict(), "hysteresis_left": 5}
    with pytest.raises(ValueError, match="hysteresis_left"):
        scaler.load_state_dict(bad)
    with pytest.raises(ValueError, match="loss_scale"):
        scaler.load_state_dict({**scaler.state_dict(), "loss_scale": math.inf})


def test_static_scaler_keeps_its_scale_and_round_trips():
    scaler = StaticLossScaler(128.0)
    run(scaler, "xx..x")
    assert scaler.loss_scale == 128.0
    other = StaticLossScaler(1.0)
    other.load_state_dict(scaler.state_dict())
    assert other.loss_scale == 128.0


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
def test_has_overflow_finds_one_bad_element(dtype, bad):
    scaler = DynamicLossScaler()
    grads = [torch.ones(4095, dtype=dtype), None, torch.zeros(1, dtype=dtype)]
    assert not scaler.has_overflow(grads)
    grads[0][4094] = bad
    assert scaler.has_overflow(grads)


@pytest.mark.parametrize("value, dtype", [(65504.0, torch.float16), (1e300, torch.float64)])
def test_values_at_the_top_of_the_range_are_not_an_overflow(value, dtype):
    grads = [torch.full((1000,), value, dtype=dtype)]
    assert not StaticLossScaler(1.0).has_overflow(grads)
    grads[0][999] = math.nan
    assert StaticLossScaler(1.0).has_overflow(grads)


def test_unscale_divides_by_the_scale():
    scaler = DynamicLossScaler(initial_scale_power=3)
    grad = torch.tensor([8.0, -16.0, 0.5])
    scaler.unscale_([grad])
    assert grad.tolist() == [1.0, -2.0, 0.0625]


def test_build_from_config():
    dynamic = build_loss_scaler(Fp16Config(enabled=True, initial_scale_power=12, hysteresis=1, min_loss_scale=2))
    assert isinstance(dynamic, DynamicLossScaler)
    assert (dynamic.loss_scale, dynamic.hysteresis, dynamic.min_loss_scale, dynamic.loss_scale_window) == (
        4096, 1, 2, 1000)
    static = build_loss_scaler(Fp16Config(enabled=True, loss_scale=512))
    assert type(static) is StaticLossScaler and static.loss_scale == 512
    disabled = build_loss_scaler(Fp16Config(enabled=False, loss_scale=512))
    assert type(disabled) is StaticLossScaler and disabled.loss_scale == 1


@pytest.mark.parametrize(
    "kwargs, key",
    [({"initial_scale_power": 65}, "initial_scale_power"), ({"loss_scale_window": 0}, "loss_scale_window"),
     ({"hysteresis": 0}, "hysteresis"), ({"min_loss_scale": 0}, "min_loss_scale")],
)
def test_bad_arguments_are_named(kwargs, key):
    with pytest.raises(ValueError, match=key):
        DynamicLossScaler(**kwargs)


def _overflow_worker(rank, tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=rank, world_size=2)
    try:
        grad = torch.ones(10, dtype=torch.float16)
        if rank == 1:
            grad[3] = math.inf
        (tmp_path / f"rank{rank}").write_text(str(DynamicLossScaler().has_overflow([grad])))
    finally:
        dist.destroy_process_group()


@pytest.mark.multiprocess
def test_an_overflow_on_one_rank_is_seen_by_every_rank(tmp_path):
    run_ranks(_overflow_worker, [(rank, tmp_path) for rank in range(2)])
    assert [(tmp_path / f"rank{rank}").read_text() for rank in range(2)] == ["True", "True"]
