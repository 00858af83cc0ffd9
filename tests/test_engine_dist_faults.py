"""A failure on one rank inside a step, agreed by every rank (offload/train/step/agree.py): two ranks over
gloo, a fault injected on rank 1 only (an I/O error, a flipped bit in its swap file) in the middle of step 3.
Every rank raises the same error naming rank 1 and its error, no rank is left waiting in a collective,
both roll step 3 back (their parameters are those after step 2), and resuming every rank from the last
checkpoint gives the losses of a run without the fault."""

from __future__ import annotations

import contextlib
import errno
import os
import socket

import pytest
import torch

from offload.train.engine import initialize
from tensorio.testing import Fail, FlipBit, inject_faults
from test_engine import engine_config, mlp, mlp_batches, mlp_loss, parameters_now, train

pytestmark = pytest.mark.multiprocess

WORLD = 2
BATCHES = mlp_batches(4)

# gradient_clipping 0: the updates run during backward (the fault is injected in step 3's backward and
# step); 1.0: in the next forward (injected from step 3's step() to the end of that forward, where its
# update runs); with half the optimizer state in memory: the chunked step after backward (injected in
# step 3's backward and step).
MODES = {"in backward": ({}, "backward"), "in the next forward": ({"gradient_clipping": 1.0}, "update"),
         "after backward": ({"gradient_clipping": 1.0, "ratio": 0.5}, "backward")}
FAULTS = {"EIO": lambda: Fail(errno.EIO, n=1, op="read"),
          "flipped bit": lambda: FlipBit(n=1, path=lambda p: "offload-adam" in os.path.basename(p))}
"""The flip is in the optimizer state: a corrupt parameter could not be read back to check the rollback."""


def _share(batch, rank):
    x, y = batch
    return x.chunk(WORLD)[rank], y.chunk(WORLD)[rank]


def _engine(directory, mode):
    extra = dict(MODES[mode][0])
    ratio = extra.pop("ratio", 1.0)
    config = engine_config(directory, "nvme", "nvme", micro=4 // WORLD, **extra)
    config["zero_optimization"]["offload_optimizer"]["ratio"] = ratio
    engine, *_ = initialize(model=mlp(), config=config)
    return engine


def _rank(rank, tmp, mode, fault, out):
    torch.distributed.init_process_group("gloo", rank=rank, world_size=WORLD)
    batches = [_share(b, rank) for b in BATCHES]
    result = {}
    try:
        # The run without a fault.
        os.makedirs(os.path.join(tmp, f"clean{rank}"))
        engine = _engine(os.path.join(tmp, f"clean{rank}"), mode)
        result["clean"] = train(engine, batches, mlp_loss)
        result["agreements"] = engine._ctx.agreement.agreements
        engine.close()
        # The same run, with a fault on rank 1 in step 3.
        os.makedirs(os.path.join(tmp, f"faulty{rank}"))
        engine = _engine(os.path.join(tmp, f"faulty{rank}"), mode)
        assert engine._ctx.agreement.active
        train(engine, batches[:2], mlp_loss)
        engine.save_checkpoint(os.path.join(tmp, "ckpt"))
        before = parameters_now(engine)
        rule = FAULTS[fault]()
        phase = MODES[mode][1]
        injected = inject_faults(rule) if rank == 1 else contextlib.nullcontext()
        try:
            loss = mlp_loss(engine, batches[2])
            with contextlib.ExitStack() as stack:
                if phase == "backward" or fault == "flipped bit":  # the optimizer state is read in backward
                    stack.enter_context(injected)
                engine.backward(loss)
                if phase == "update" and fault == "EIO":  # the parameters' reads for step 3's update
                    stack.enter_context(injected)
                engine.step()
                if phase == "update":  # step 3's update runs in this forward
                    mlp_loss(engine, batches[3])
        except Exception as error:  # noqa: BLE001 - the test asserts on it
            result["error"] = (type(error).__name__, str(error), repr(error.__cause__))
        result["hits"] = rule.hits
        result["steps"] = engine.global_steps
        result["failure"] = engine.stats().failure.value
        after = parameters_now(engine)
        result["rolled back"] = before.keys() == after.keys() and all(torch.equal(before[n], after[n]) for n in before)
        with pytest.raises(RuntimeError, match="cannot save a checkpoint") if result["failure"] in (
                "corrupt", "partly updated", "another rank needs a load") else contextlib.nullcontext():
            engine.save_checkpoint(os.path.join(tmp, "mixed"))
        engine.load_checkpoint(os.path.join(tmp, "ckpt"))
        result["resumed"] = train(engine, batches[2:], mlp_loss)
        engine.close()
    finally:
        torch.save(result, f"{out}.{rank}")
        torch.distributed.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("fault", list(FAULTS))
@pytest.mark.parametrize("mode", list(MODES))
def test_a_fault_on_one_rank_is_given_up_on_every_rank(disk_dir, mode, fault, monkeypatch):
    from ranks import run_ranks

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(_free_port()))
    out = str(disk_dir / "result")
    # The timeout only keeps a regression from hanging the suite: the assertions are on what each rank did.
    run_ranks(_rank, [(r, str(disk_dir), mode, fault, out) for r in range(WORLD)], timeout=300)
    zero, one = (torch.load(f"{out}.{r}") for r in range(WORLD))
    assert one["hits"] == 1 and zero["hits"] == 0
    for result in (zero, one):
        kind, message, _ = result["error"]
        assert kind == "RanksFailed" and "failed on rank 1 (rank 1: " in message, message
        assert ("ChecksumError" if fault == "flipped bit" else "TensorIOError") in message, message
        assert result["steps"] == 2  # step 3 was given up on both
        assert result["resumed"] == result["clean"][2:]
    assert "Error" in one["error"][2] and zero["error"][2] == "None"  # rank 1's own error is the cause
    # What agreeing costs while nothing fails: one all-reduce of a flag per forward, backward and step, one
    # more where the update runs in the next forward (before the backward, where it commits) or after
    # backward (before and after the chunked update).
    per_step = {"in backward": 3, "in the next forward": 4, "after backward": 4}[mode]
    assert zero["agreements"] == one["agreements"] == per_step * len(BATCHES)
    if mode != "after backward":  # the fast paths roll step 3 back whole on both ranks
        assert zero["rolled back"] and one["rolled back"]
