"""A failure outside the ranks' agreement stops every rank (offload/train/step/stop.py): two ranks over gloo,
one of them failing in step 2 where the engine cannot absorb it: the user's model raising in its forward or
in its backward, or the learning-rate schedule raising in step(). The rank that failed raises its own error;
the other, which would otherwise wait in its next collective until gloo's 30-minute timeout, raises
RanksStopped naming that rank, the call, the step and the error; both then refuse to step, save or load;
and a new engine (in the same default process group: the engine's group was its own), resumed from the
checkpoint taken before, gives the losses of a run without the fault."""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist

from offload.train.engine import initialize
from test_engine import engine_config, mlp, mlp_batches, mlp_loss, train

pytestmark = pytest.mark.multiprocess

WORLD = 2
BATCHES = mlp_batches(4)
MESSAGES = {"forward": "bad batch", "backward": "bad gradient", "step": "bad schedule"}


class Fault:
    """Raises ValueError once, on this rank, where it is armed: the model's forward (after its first layer),
    its backward (the gradient of that layer's output) or the learning-rate schedule's step."""

    def __init__(self) -> None:
        self.armed: str | None = None

    def fire(self, where: str) -> None:
        if self.armed == where:
            self.armed = None
            raise ValueError(MESSAGES[where])

    def after_layer(self, module, args, output):
        if self.armed == "ended":  # the process ends, as one killed does: no record, no exception
            os._exit(3)
        self.fire("forward")
        if self.armed == "backward":
            output.register_hook(lambda grad: self.fire("backward"))

    def lr_factor(self, step: int) -> float:
        self.fire("step")
        return 1.0


MODES = {"in backward": {}, "in the next forward": {"gradient_clipping": 1.0},
         "after backward": {"gradient_clipping": 1.0, "ratio": 0.5}}
"""Where the update runs: the fault meets each update path's own state (step 1's update runs in step 2's
forward on the second; the third steps after backward, in chunks)."""


def _engine(directory: str, fault: Fault, mode: str = "in backward"):
    os.makedirs(directory)
    model = mlp()
    model[1].register_forward_hook(fault.after_layer)
    extra = dict(MODES[mode])
    ratio = extra.pop("ratio", 1.0)
    config = engine_config(directory, "nvme", "nvme", micro=4 // WORLD, **extra)
    config["zero_optimization"]["offload_optimizer"]["ratio"] = ratio

    def schedule(optimizer):
        return torch.optim.lr_scheduler.LambdaLR(optimizer, fault.lr_factor)

    engine, *_ = initialize(model=model, config=config, lr_scheduler=schedule)
    return engine


def _attempt(call) -> tuple[str, str, list[str]] | None:
    try:
        call()
    except Exception as error:  # noqa: BLE001 - the test asserts on it
        return type(error).__name__, str(error), list(getattr(error, "__notes__", []))
    return None


def refused_calls(engine, tmp: str, rank: int, ckpt: str) -> list:
    """What a stopped engine's step, save and load raise (`_attempt` of each)."""
    return [_attempt(call) for call in (
        engine.step, lambda: engine.save_checkpoint(os.path.join(tmp, f"after{rank}")),
        lambda: engine.load_checkpoint(ckpt))]


def resumed_losses(tmp: str, rank: int, fault: Fault, ckpt: str, batches, mode: str = "in backward") -> list:
    """The losses of a new engine resumed from ``ckpt`` over ``batches``. The stopped engine's group was its
    own, so the default group is still whole on every rank (the barrier proves it)."""
    dist.barrier()
    engine = _engine(os.path.join(tmp, f"resumed{rank}"), fault, mode)
    engine.load_checkpoint(ckpt)
    losses = train(engine, batches, mlp_loss)
    engine.close()
    return losses


def _rank(rank, tmp, mode, where, failing, port, out):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    batches = [(x.chunk(WORLD)[rank], y.chunk(WORLD)[rank]) for x, y in BATCHES]
    ckpt = os.path.join(tmp, "ckpt")
    fault = Fault()
    result = {}
    try:
        engine = _engine(os.path.join(tmp, f"clean{rank}"), fault, mode)
        result["clean"] = train(engine, batches, mlp_loss)
        engine.close()
        # The same run; in step 2 the fault fires on the failing rank only.
        engine = _engine(os.path.join(tmp, f"faulty{rank}"), fault, mode)
        train(engine, batches[:1], mlp_loss)
        engine.save_checkpoint(ckpt)
        fault.armed = where if rank == failing else None
        result["error"] = _attempt(lambda: train(engine, batches[1:], mlp_loss))
        result["steps"] = engine.global_steps
        result["failure"] = engine.stats().failure.value
        result["refused"] = refused_calls(engine, tmp, rank, ckpt)
        engine.close()
        result["resumed"] = resumed_losses(tmp, rank, fault, ckpt, batches[1:], mode)
    finally:
        torch.save(result, f"{out}.{rank}")
        if dist.is_initialized():
            dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize(("mode", "where", "failing"), [
    *((mode, where, 1) for mode in MODES for where in ("forward", "backward")),
    ("in backward", "step", 1), ("in backward", "forward", 0)])
def test_a_failure_outside_the_agreement_stops_every_rank(disk_dir, mode, where, failing):
    from ranks import run_ranks

    out = str(disk_dir / "result")
    port = _free_port()
    # The timeout only keeps a regression from hanging the suite (the other rank would wait 30 minutes in
    # its collective): the assertions are on what each rank raised.
    run_ranks(_rank, [(r, str(disk_dir), mode, where, failing, port, out) for r in range(WORLD)], timeout=300)
    results = [torch.load(f"{out}.{r}") for r in range(WORLD)]
    failed, other = results[failing], results[1 - failing]
    record = f"rank {failing} failed in {where} at step 2: ValueError: {MESSAGES[where]}"
    # The rank that failed raises its own error, with a note; the other names it.
    kind, message, notes = failed["error"]
    assert (kind, message) == ("ValueError", MESSAGES[where])
    assert any(record in note and "every rank was stopped" in note for note in notes), notes
    kind, message, _ = other["error"]
    assert kind == "RanksStopped" and message.startswith(record), message
    # After a failure in step 2's step(), after its commit, the other rank stopped in step 3's forward.
    stopped_in = "forward" if where == "step" else where
    assert f"this rank ({1 - failing}) stopped in its {stopped_in}" in message, message
    assert "make a new engine on every rank and resume it with load_checkpoint(" in message, message
    # No rank committed step 2 unless both did: the failure in step() came after its commit.
    assert failed["steps"] == 1
    assert other["steps"] == (2 if where == "step" else 1)
    for result in results:
        assert result["failure"] == "stopped"
        for refusal in result["refused"]:  # step, save and load, each refused at once with the record
            kind, message, _ = refusal
            assert kind == "Refused" and record in message and "make a new engine on every rank" in message, message
        assert result["resumed"] == result["clean"][1:]


def _rank_that_ends(rank, tmp, port, out):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    batches = [(x.chunk(WORLD)[rank], y.chunk(WORLD)[rank]) for x, y in BATCHES]
    fault = Fault()
    result = {}
    try:
        engine = _engine(os.path.join(tmp, f"r{rank}"), fault)
        train(engine, batches[:1], mlp_loss)
        fault.armed = "ended" if rank == 1 else None
        result["error"] = _attempt(lambda: train(engine, batches[1:], mlp_loss))
        result["refused"] = _attempt(engine.step)
        engine.close()
    finally:
        torch.save(result, f"{out}.{rank}")
        dist.destroy_process_group()


def test_a_rank_whose_process_ends_stops_the_others(disk_dir):
    """Rank 1's process ends in the middle of step 2's forward (as a killed one does), recording nothing:
    rank 0's collective fails at once (the connection closes) and it raises that error, with a note saying
    another rank probably ended, then refuses to step."""
    from ranks import run_ranks

    out, port = str(disk_dir / "result"), _free_port()
    with pytest.raises(AssertionError, match="rank 1: exit code 3") as ended:  # the hang guard would say "killed"
        run_ranks(_rank_that_ends, [(r, str(disk_dir), port, out) for r in range(WORLD)], timeout=300)
    assert "rank 0" not in str(ended.value)  # rank 0 exited 0
    result = torch.load(f"{out}.0")
    kind, message, notes = result["error"]
    assert kind == "RuntimeError" and "gloo" in message and "by peer" in message, message  # closed, or reset
    assert any("a collective of this rank (0) failed in forward at step 2" in note and "another rank probably ended"
               in note for note in notes), notes
    kind, message, _ = result["refused"]
    assert kind == "Refused" and "cannot call step(): rank 0 failed in forward at step 2: RuntimeError" in message
