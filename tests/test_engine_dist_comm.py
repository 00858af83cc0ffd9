"""The collectives of one training step at world size 2, counted by kind inside each rank (torch.distributed's
functions wrapped): one all-gather per module, not per parameter, one gradient reduction per bucket, and
gradients reduced in ``communication_data_type`` (under bf16: bf16, half the bytes of fp32), with the
losses of world size 1 within bf16's tolerance."""

from __future__ import annotations

import contextlib
import gc
import json
import os

import pytest
import torch
import torch.distributed as dist

from offload.device import SimulatedDevice
from offload.train.engine import initialize
from test_engine_dist import _free_port, batches, config, gpt2

pytestmark = pytest.mark.multiprocess

transformers = pytest.importorskip("transformers")

_WRAPPED = ("all_gather", "all_gather_into_tensor", "all_gather_single", "all_reduce", "reduce_scatter",
            "reduce_scatter_tensor", "reduce_scatter_single", "broadcast", "all_gather_object")
_GATHERS = {"all_gather", "all_gather_into_tensor", "all_gather_single"}


@contextlib.contextmanager
def counted(calls: list):
    """Append (kind, elements, dtype) of each outermost torch.distributed collective called inside to ``calls``
    (one deprecated name calling its newer one counts once); the tensor is the one sent or reduced."""
    originals = {name: getattr(dist, name) for name in _WRAPPED if hasattr(dist, name)}
    depth = [0]

    def wrap(name, original):
        def wrapper(*args, **kwargs):
            if depth[0] == 0:
                sent = args[1] if name in {"all_gather", "all_gather_into_tensor", "all_gather_single",
                                           "reduce_scatter_tensor", "reduce_scatter_single"} else args[0]
                if isinstance(sent, torch.Tensor):
                    calls.append((name, sent.numel(), str(sent.dtype).removeprefix("torch.")))
                else:
                    calls.append((name, 0, "object"))
            depth[0] += 1
            try:
                return original(*args, **kwargs)
            finally:
                depth[0] -= 1
        return wrapper

    for name, original in originals.items():
        setattr(dist, name, wrap(name, original))
    try:
        yield calls
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)


def train_and_count(rank: int, world_size: int, tmp: str, out: str, half: str | None, comm: str | None,
                    simulated: bool) -> None:
    """Four steps on this rank's share of each global batch (parameters and optimizer state in memory,
    no clipping); the collectives of step 2's forward, backward and step counted apart. Rank 0 writes
    the losses, the counts and what the model's modules predict to ``out`` (JSON)."""
    if world_size > 1:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        os.environ["LOCAL_RANK"] = str(rank)  # as torchrun sets it: each rank takes simgpu:LOCAL_RANK
    device = SimulatedDevice(seed=rank, max_delay_s=0.0002) if simulated else "cpu"
    cfg = config(tmp, "cpu", "cpu", world_size, 1, 0.0)
    if half is not None:
        cfg[half] = {"enabled": True}
    if comm is not None:
        cfg["communication_data_type"] = comm
    model = gpt2()
    threshold = cfg["zero_optimization"]["stage3_param_persistence_threshold"]
    gathered = [[p for p in m.parameters(recurse=False) if p.numel() > threshold] for m in model.modules()]
    expected = {"modules": sum(1 for params in gathered if params), "parameters": sum(map(len, gathered)),
                # backward needs the weights that matmuls saved: GPT-2's four Conv1D per block and the tied
                # lm_head; neither the embeddings (their backward takes no weight) nor any bias
                "saved_modules": sum(isinstance(m, transformers.pytorch_utils.Conv1D) for m in model.modules()) + 1}
    engine, *_ = initialize(model=model, config=cfg, compute_device=device)
    losses, counts = [], {}
    for step, batch in enumerate(batches(4)):
        share = batch.chunk(world_size)[rank]
        phases = {"forward": [], "backward": [], "step": []}
        with counted(phases["forward"]) if step == 1 else contextlib.nullcontext():
            loss = engine(share, labels=share).loss
        with counted(phases["backward"]) if step == 1 else contextlib.nullcontext():
            engine.backward(loss)
        with counted(phases["step"]) if step == 1 else contextlib.nullcontext():
            engine.step()
        if step == 1:
            counts = phases
            ahead = engine.param_store.ahead
            expected["ahead"] = {"issued": ahead.issued, "used": ahead.used}
        total = loss.detach().float()
        if world_size > 1:
            dist.all_reduce(total)
        losses.append(total.item() / world_size)
    engine.close()
    if rank == 0:
        with open(out, "w", encoding="utf-8") as file:
            json.dump({"losses": losses, "counts": counts, "expected": expected}, file)
    if simulated:
        device.synchronize()
        device.raise_faults()
        device.close()
        del engine, device
        gc.collect()  # device buffers collectives used, freed before gloo's teardown (docs/engine.md)
    if world_size > 1:
        dist.destroy_process_group()


def run_at(disk_dir, monkeypatch, world_size: int, name: str, half: str | None = None, comm: str | None = None,
           simulated: bool = False) -> dict:
    """`train_and_count` at ``world_size`` (1: in this process); rank 0's results."""
    out = str(disk_dir / f"{name}.json")
    if world_size == 1:
        train_and_count(0, 1, str(disk_dir), out, half, comm, simulated)
    else:
        monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
        monkeypatch.setenv("MASTER_PORT", str(_free_port()))
        if simulated:  # a node of one simulated device per rank
            monkeypatch.setenv("OFFLOAD_SIMGPU_COUNT", str(world_size))
        from ranks import run_ranks

        run_ranks(train_and_count, [(r, world_size, str(disk_dir), out, half, comm, simulated) for r in range(world_size)],
                  timeout=180)
    with open(out, encoding="utf-8") as file:
        return json.load(file)


def _gradient_reductions(calls: list) -> list:
    """The calls that reduce gradients: of floating tensors (not the ranks' integer flags)."""
    return [call for call in calls if call[0] in {"all_reduce", "reduce_scatter_tensor", "reduce_scatter_single"}
            and call[2] in {"float32", "bfloat16", "float16"}]


@pytest.mark.parametrize("simulated", [False, pytest.param(True, marks=pytest.mark.simulated)], ids=["cpu", "simulated"])
def test_one_all_gather_per_module_and_one_reduction_per_bucket(disk_dir, monkeypatch, simulated):
    """fp32 at two ranks: forward all-gathers once per module that has partitioned parameters (fewer calls
    than parameters), backward once per module whose weight a matmul saved; every gradient goes in one
    bucket (``reduce_bucket_size`` larger than the model), reduced by one call in fp32 (an all-reduce
    over gloo from host memory; a reduce-scatter on the device)."""
    result = run_at(disk_dir, monkeypatch, 2, "fp32", simulated=simulated)
    counts, expected = result["counts"], result["expected"]
    forward = [call for call in counts["forward"] if call[0] in _GATHERS]
    backward = [call for call in counts["backward"] if call[0] in _GATHERS]
    assert expected["modules"] < expected["parameters"]
    assert len(forward) == expected["modules"], forward
    assert len(backward) == expected["saved_modules"], backward
    # Step 1 records the order; in step 2 each gather but the forward's and the backward's first (the tied
    # weight lm_head still holds when the forward's last gather issues ahead) was issued ahead and taken.
    after_step_two = expected["modules"] + expected["saved_modules"] - 2
    assert expected["ahead"] == {"issued": after_step_two, "used": after_step_two}, expected
    assert {call[0] for call in forward + backward} == {"all_gather_single"}
    reductions = _gradient_reductions(counts["backward"])
    assert [(kind, dtype) for kind, _, dtype in reductions] == [
        ("reduce_scatter_single" if simulated else "all_reduce", "float32")]
    assert not _gradient_reductions(counts["forward"]) and not _gradient_reductions(counts["step"])
    # After the update, the parameters kept whole (under the persistence threshold) are regathered together.
    assert len([call for call in counts["step"] if call[0] in _GATHERS]) == 1


@pytest.mark.parametrize("simulated", [False, pytest.param(True, marks=pytest.mark.simulated)], ids=["cpu", "simulated"])
def test_bf16_reduces_in_bf16_half_the_bytes_and_matches_one_rank(disk_dir, monkeypatch, simulated):
    """Under bf16, gradients are reduced in bf16 by default (``communication_data_type`` fp32: in fp32, twice
    the bytes, in the same calls), and two ranks' losses equal one rank's within bf16's rounding."""
    one = run_at(disk_dir, monkeypatch, 1, "one", half="bf16", simulated=simulated)
    two = run_at(disk_dir, monkeypatch, 2, "two", half="bf16", simulated=simulated)
    wide = run_at(disk_dir, monkeypatch, 2, "wide", half="bf16", comm="fp32", simulated=simulated)
    narrow, full = (_gradient_reductions(r["counts"]["backward"]) for r in (two, wide))
    assert {dtype for _, _, dtype in narrow} == {"bfloat16"} and {dtype for _, _, dtype in full} == {"float32"}
    assert [call[:2] for call in narrow] == [call[:2] for call in full]
    assert 2 * sum(numel * 2 for _, numel, _ in narrow) == sum(numel * 4 for _, numel, _ in full)
    # bf16 rounds each op at about 4e-3; the sum over ranks rounded to bf16 moved the losses by 2e-4 at most here.
    torch.testing.assert_close(torch.tensor(two["losses"]), torch.tensor(one["losses"]), rtol=2e-3, atol=0)
    torch.testing.assert_close(torch.tensor(wide["losses"]), torch.tensor(one["losses"]), rtol=2e-3, atol=0)


def test_four_ranks_in_bf16_gather_per_module_and_match_one_rank(disk_dir, monkeypatch):
    """Four ranks over gloo (one sample each) under bf16: the same one all-gather per module, one bf16 bucket
    reduced, and one rank's losses within bf16's rounding (three sums over ranks rounded instead of one)."""
    one = run_at(disk_dir, monkeypatch, 1, "one", half="bf16")
    four = run_at(disk_dir, monkeypatch, 4, "four", half="bf16")
    counts, expected = four["counts"], four["expected"]
    assert len([call for call in counts["forward"] if call[0] in _GATHERS]) == expected["modules"]
    assert len([call for call in counts["backward"] if call[0] in _GATHERS]) == expected["saved_modules"]
    assert [(kind, dtype) for kind, _, dtype in _gradient_reductions(counts["backward"])] == [("all_reduce", "bfloat16")]
    torch.testing.assert_close(torch.tensor(four["losses"]), torch.tensor(one["losses"]), rtol=2e-3, atol=0)
