"""Gradient norm and clipping: against torch.nn.utils.clip_grad_norm_ in one process, and over two gloo
ranks holding partitions of the same gradients."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from offload.params.partition import partition_bounds
from offload.train.grads.clip import clip_grad_norm_, grad_norm
from ranks import run_ranks

SIZES = [(1,), (4095,), (3, 4096 * 10 + 1), (7, 5)]


def make_grads(seed, scale=1.0, dtype=torch.float32):
    generator = torch.Generator().manual_seed(seed)
    return [(torch.randn(size, generator=generator) * scale).to(dtype) for size in SIZES]


@pytest.mark.parametrize("scale, max_norm", [(1.0, 1.0), (1.0, 1e4), (1e-3, 0.5), (50.0, 2.0)])
def test_matches_torch_at_world_size_one(scale, max_norm):
    ours = make_grads(0, scale)
    params = [torch.nn.Parameter(torch.zeros_like(grad)) for grad in ours]
    for param, grad in zip(params, ours):
        param.grad = grad.clone()
    expected = torch.nn.utils.clip_grad_norm_(params, max_norm)
    norm = clip_grad_norm_(ours, max_norm)
    assert norm == pytest.approx(expected.item(), rel=1e-6)
    for param, grad in zip(params, ours):
        torch.testing.assert_close(grad, param.grad, rtol=1e-6, atol=0)


@pytest.mark.parametrize("max_norm", [0.5, 1e4])
def test_loss_scaled_gradients_are_unscaled_and_clipped_in_one_pass(max_norm):
    plain = make_grads(5, 3.0)
    scaled = [grad * 1024.0 for grad in plain]
    expected = clip_grad_norm_(plain, max_norm)
    assert clip_grad_norm_(scaled, max_norm, loss_scale=1024.0) == pytest.approx(expected, rel=1e-6)
    for ours, reference in zip(scaled, plain):
        torch.testing.assert_close(ours, reference, rtol=1e-6, atol=0)


def test_below_max_norm_leaves_gradients_untouched():
    grads = make_grads(1)
    before = [grad.clone() for grad in grads]
    norm = clip_grad_norm_(grads, 1e9)
    assert norm == pytest.approx(math.sqrt(sum(float((g.double() ** 2).sum()) for g in before)), rel=1e-6)
    assert all(torch.equal(a, b) for a, b in zip(grads, before))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_gradients_are_normed_in_float32(dtype):
    # 4096 elements of 300 in fp16: the squares (9e4 each) would overflow fp16, the norm does not
    grads = [torch.full((4096,), 300.0, dtype=dtype)]
    norm = clip_grad_norm_(grads, 1.0)
    assert norm == pytest.approx(300.0 * 64)
    assert grads[0].float().norm().item() == pytest.approx(1.0, rel=1e-2)


@pytest.mark.parametrize("bad, check", [(math.inf, math.isinf), (math.nan, math.isnan)])
def test_non_finite_norm_is_returned_and_nothing_is_scaled(bad, check):
    grads = make_grads(2, 100.0)
    grads[1][17] = bad
    before = [grad.clone() for grad in grads]
    assert check(clip_grad_norm_(grads, 1.0))
    for grad, old in zip(grads, before):
        torch.testing.assert_close(grad, old, equal_nan=True, rtol=0, atol=0)


def test_float64_gradients_keep_their_precision():
    # 1e100 is far beyond float32; its square still fits in float64
    grads = [torch.full((3,), 1e100, dtype=torch.float64), torch.tensor([1.0], dtype=torch.float64)]
    assert clip_grad_norm_(grads, 1.0) == pytest.approx(math.sqrt(3) * 1e100)
    assert grads[0][0].item() == pytest.approx(1 / math.sqrt(3))


def test_no_gradients_and_none_entries():
    assert grad_norm([]) == 0.0
    assert grad_norm([None, torch.tensor([3.0, 4.0]), None]) == 5.0
    assert clip_grad_norm_([None], 1.0) == 0.0


@pytest.mark.parametrize("value", [0, -1.0, math.inf, math.nan])
def test_bad_max_norm_or_loss_scale_is_refused(value):
    with pytest.raises(ValueError, match="max_norm"):
        clip_grad_norm_(make_grads(3), value)
    with pytest.raises(ValueError, match="loss_scale"):
        clip_grad_norm_(make_grads(3), 1.0, loss_scale=value)


def _partition_worker(rank, tmp_path, world_size):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=rank, world_size=world_size)
    try:
        partitions = []
        for grad in make_grads(4, 10.0):
            flat = grad.flatten()
            start, end = partition_bounds(flat.numel(), world_size, rank, 8)
            # this rank's slice, zero-padded past the end of the tensor, as the engine partitions it
            part = torch.zeros(end - start)
            owned = flat[start:end]
            part[: owned.numel()] = owned
            partitions.append(part)
        norm = clip_grad_norm_(partitions, 1.0)
        torch.save({"norm": norm, "partitions": partitions}, tmp_path / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.multiprocess
def test_partitions_over_two_ranks_give_the_norm_of_the_whole(tmp_path):
    world_size = 2
    run_ranks(_partition_worker, [(rank, tmp_path, world_size) for rank in range(world_size)])
    results = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(world_size)]

    whole = make_grads(4, 10.0)
    params = [torch.nn.Parameter(torch.zeros_like(grad)) for grad in whole]
    for param, grad in zip(params, whole):
        param.grad = grad
    expected = torch.nn.utils.clip_grad_norm_(params, 1.0).item()
    assert expected > 1.0  # so the partitions were scaled
    for result in results:
        assert result["norm"] == pytest.approx(expected, rel=1e-6)
    for index, param in enumerate(params):
        joined = torch.cat([result["partitions"][index] for result in results])
        torch.testing.assert_close(joined[: param.numel()], param.grad.flatten(), rtol=1e-6, atol=0)
        assert not joined[param.numel():].any()
