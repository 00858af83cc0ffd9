"""A failure outside the engine's calls stops every rank too (offload/train/step/outside.py): two ranks over
gloo, rank 1's own code failing between step 1 and step 2 while rank 0 goes on to step 2's forward.

Inside ``with engine.stop_on_error():`` (rank 1's data loader raising) rank 1 raises its own error with a
note and rank 0, which would otherwise wait in its forward's collective until gloo's 30-minute timeout,
raises RanksStopped naming rank 1, "the training loop", the step and the error; both then refuse to step,
save and load, put back the ``sys.excepthook`` they chained at close, and a new engine resumed from the
checkpoint of step 1 gives the losses of a run without the fault. An error of an engine call leaving the
block is recorded once. An uncaught exception (rank 1 a Python process of its own, whose exception reaches
the interpreter's top level) makes rank 0 raise RanksStopped naming it rather than a socket error. At world
size 1 nothing changes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from offload.train import RanksStopped
from offload.train.engine import initialize
from offload.train.step.outside import UNCAUGHT, StopOnError, hook_uncaught, stops_ranks
from test_engine import engine_config, mlp, mlp_loss, train
from test_engine_dist_stop import (BATCHES, MESSAGES, WORLD, Fault, _attempt, _engine, _free_port, refused_calls,
                                   resumed_losses)

TESTS = Path(__file__).resolve().parent


def _loader(batches, fails: bool):
    """The user's data loader: on the failing rank it raises before its first batch (after step 1)."""
    if fails:
        raise ValueError("bad data")
    yield from batches


def _rank(rank, tmp, where, port, out):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    batches = [(x.chunk(WORLD)[rank], y.chunk(WORLD)[rank]) for x, y in BATCHES]
    ckpt = os.path.join(tmp, "ckpt")
    fault = Fault()
    before = sys.excepthook
    result = {}
    try:
        engine = _engine(os.path.join(tmp, f"clean{rank}"), fault)
        result["clean"] = train(engine, batches, mlp_loss)
        engine.close()
        engine = _engine(os.path.join(tmp, f"faulty{rank}"), fault)
        result["hooked"] = sys.excepthook is not before
        train(engine, batches[:1], mlp_loss)
        engine.save_checkpoint(ckpt)
        fault.armed = "forward" if rank == 1 and where == "forward" else None

        def loop():
            with engine.stop_on_error():
                train(engine, _loader(batches[1:], rank == 1 and where == "loader"), mlp_loss)

        result["error"] = _attempt(loop)
        result["failure"] = engine.stats().failure.value
        result["refused"] = refused_calls(engine, tmp, rank, ckpt)
        later = ValueError("later")
        result["again"] = engine.stop(later) is later and not hasattr(later, "__notes__")  # once stopped: nothing
        engine.close()
        result["restored"] = sys.excepthook is before
        result["resumed"] = resumed_losses(tmp, rank, fault, ckpt, batches[1:])
    finally:
        torch.save(result, f"{out}.{rank}")
        if dist.is_initialized():
            dist.destroy_process_group()


@pytest.mark.multiprocess
@pytest.mark.parametrize("where", ["loader", "forward"])
def test_an_error_leaving_stop_on_error_stops_every_rank(disk_dir, where):
    from ranks import run_ranks

    out, port = str(disk_dir / "result"), _free_port()
    # The timeout only keeps a regression from hanging the suite (rank 0 would wait 30 minutes in its
    # forward's collective): the assertions are on what each rank raised.
    run_ranks(_rank, [(r, str(disk_dir), where, port, out) for r in range(WORLD)], timeout=300)
    failed, other = (torch.load(f"{out}.{r}") for r in (1, 0))
    message = "bad data" if where == "loader" else MESSAGES["forward"]
    failed_in = "the training loop" if where == "loader" else "forward"
    record = f"rank 1 failed in {failed_in} at step 2: ValueError: {message}"
    kind, text, notes = failed["error"]
    assert (kind, text) == ("ValueError", message)
    (note,) = [note for note in notes if note.startswith("offload:")]  # recorded once, not again by the block
    assert record in note and "every rank was stopped" in note, notes
    kind, text, _ = other["error"]
    assert kind == "RanksStopped" and text.startswith(record), text
    assert "this rank (0) stopped in its forward" in text, text
    for result in (failed, other):
        assert result["hooked"] and result["restored"] and result["again"]
        assert result["failure"] == "stopped"
        for refusal in result["refused"]:  # step, save and load, each refused at once with the record
            kind, text, _ = refusal
            assert kind == "Refused" and record in text and "make a new engine on every rank" in text, text
        assert result["resumed"] == result["clean"][1:]


_RANK1 = """
import sys
sys.path[:0] = [{tests!r}, {repo!r}]
from test_engine_dist_stop_outside import _uncaught_rank
_uncaught_rank(1, {tmp!r}, {port})
"""


def _uncaught_rank(rank, tmp, port, out=None):
    """Step 1, then rank 1 raises at its top level (uncaught: its process ends) and rank 0 goes on."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    batches = [(x.chunk(WORLD)[rank], y.chunk(WORLD)[rank]) for x, y in BATCHES]
    engine = _engine(os.path.join(tmp, f"r{rank}"), Fault())
    train(engine, batches[:1], mlp_loss)
    if rank == 1:
        raise ValueError("bad data")  # no try, no with: sys.excepthook
    result = {"error": _attempt(lambda: train(engine, batches[1:], mlp_loss)), "refused": _attempt(engine.step)}
    engine.close()
    torch.save(result, out)
    dist.destroy_process_group()


@pytest.mark.multiprocess
@pytest.mark.subprocess
def test_an_uncaught_exception_stops_every_rank_naming_it(disk_dir):
    """Rank 1 is a Python process of its own (a forked rank's exceptions never reach sys.excepthook), whose
    exception nothing catches: its hook records it before the process ends, and rank 0's forward raises
    RanksStopped naming it, not the socket error its collective met."""
    from ranks import run_ranks

    out, port = str(disk_dir / "result"), _free_port()
    script = _RANK1.format(tests=str(TESTS), repo=str(TESTS.parent), tmp=str(disk_dir), port=port)
    with subprocess.Popen([sys.executable, "-c", script], stderr=subprocess.PIPE, text=True) as rank1:
        try:
            run_ranks(_uncaught_rank, [(0, str(disk_dir), port, out)], timeout=300)  # timeout: a safety net
        finally:
            _, stderr = rank1.communicate(timeout=300)
    assert rank1.returncode != 0, stderr
    # Its traceback, printed by the hook it chained to, carries the note that every rank was stopped.
    record = f"rank 1 failed in {UNCAUGHT} at step 2: ValueError: bad data"
    assert "ValueError: bad data" in stderr and record in stderr and "every rank was stopped" in stderr, stderr
    result = torch.load(out)
    kind, text, _ = result["error"]
    assert kind == "RanksStopped" and text.startswith(record) and "this rank (0) stopped in its forward" in text, text
    kind, text, _ = result["refused"]
    assert kind == "Refused" and record in text, text


def test_at_world_size_1_nothing_changes(disk_dir):
    """No hook, no note: the error leaves the block as it is, and the engine trains on."""
    before = sys.excepthook
    engine, *_ = initialize(model=mlp(), config=engine_config(disk_dir, micro=4))
    assert sys.excepthook is before
    error = ValueError("bad data")
    with pytest.raises(ValueError, match="bad data") as raised:
        with engine.stop_on_error():
            raise error
    assert raised.value is error and not getattr(error, "__notes__", [])
    assert engine.stop(error) is error
    assert len(train(engine, BATCHES[:1], mlp_loss)) == 1
    engine.close()


def test_what_stops_the_ranks():
    assert stops_ranks(ValueError()) and stops_ranks(KeyboardInterrupt()) and stops_ranks(SystemExit(2))
    assert not stops_ranks(GeneratorExit()) and not stops_ranks(SystemExit(0)) and not stops_ranks(SystemExit())


def test_the_uncaught_hook_stops_then_chains_and_goes(monkeypatch):
    """The hook calls stop before the hook it replaced (which prints the note stop added), holds the engine
    weakly, and is taken out by the function it returns (left inert where another hook came after it)."""
    calls = []
    monkeypatch.setattr(sys, "excepthook", lambda kind, error, tb: calls.append(("previous", error)))

    class Owner:
        def stop(self, error, where):
            calls.append(("stop", error, where))
            return error

    owner, error = Owner(), ValueError("bad data")
    previous = sys.excepthook
    unhook = hook_uncaught(owner.stop)
    assert sys.excepthook is not previous
    sys.excepthook(ValueError, error, None)
    assert calls == [("stop", error, UNCAUGHT), ("previous", error)]
    unhook()
    assert sys.excepthook is previous
    # Another hook chained after ours: ours stays in its chain, inert.
    calls.clear()
    unhook = hook_uncaught(owner.stop)
    ours = sys.excepthook
    later = lambda kind, error, tb: (calls.append(("later", error)), ours(kind, error, tb))  # noqa: E731
    sys.excepthook = later
    unhook()
    assert sys.excepthook is later
    later(ValueError, error, None)
    assert calls == [("later", error), ("previous", error)]
    # Held weakly: the hook of an engine collected does nothing.
    calls.clear()
    sys.excepthook = previous
    hook_uncaught(owner.stop)
    del owner
    sys.excepthook(ValueError, error, None)
    assert calls == [("previous", error)]


def test_stop_on_error_raises_what_stop_returns():
    """Where another rank failed first, stop returns RanksStopped: the block raises it from the error."""
    error, stopped = ValueError("bad data"), RuntimeError("stopped")
    with pytest.raises(RuntimeError, match="stopped") as raised:
        with StopOnError(lambda e, where: stopped, "the training loop"):
            raise error
    assert raised.value.__cause__ is error
    assert issubclass(RanksStopped, RuntimeError)
