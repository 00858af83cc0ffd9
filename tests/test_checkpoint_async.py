"""Asynchronous checkpoint saves (``save_checkpoint(..., async_save=True)``): the checkpoint holds the step it
was asked at while training goes on, one save at a time, a failure is raised at the next call with
``latest`` unchanged, and a kill at any point leaves the previous checkpoint loadable.

The background save is held at a chosen point by a gate (an event its thread waits for), so each test
decides what training does meanwhile; nothing waits for wall-clock time."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch

from offload.storage import LATEST, CheckpointInUseError, SafetensorsWriter
from offload.storage.slotted import SlotPin
from offload.train.checkpoint.background import CheckpointSaveError
from offload.train.checkpoint.rank_state import sized_partitions
from offload.train.checkpoint.verify import verify_checkpoint
from offload.train.engine import initialize
from test_engine import (assert_same_tensors, engine_config, gpt2, gpt2_batches, gpt2_loss, mlp, mlp_batches, mlp_loss,
                         parameters_now, train)

REPO = Path(__file__).resolve().parent.parent
MODELS = {"mlp": (mlp, mlp_batches, mlp_loss), "gpt2": (gpt2, gpt2_batches, gpt2_loss)}


def optimizer_state(engine):
    with sized_partitions(engine.records):  # on-disk partitions get their size while the state is read
        return engine.optimizer.state_dict()


def assert_same_optimizer_state(a, b):
    assert a["state"].keys() == b["state"].keys()
    for index, entry in a["state"].items():
        for key, value in entry.items():
            assert torch.equal(value, b["state"][index][key]), (index, key)


class Gate:
    """Holds the background save before its first tensor write until `open` (or until a step has to wait
    for the save's pinned slots, when ``open_when_training_waits``); `writes` counts the writes it let by."""

    def __init__(self, monkeypatch, *, open_when_training_waits: bool = False) -> None:
        self.event, self.training_waited, self.writes = threading.Event(), threading.Event(), 0
        write, wait = SafetensorsWriter.write, SlotPin.wait
        gate = self

        def gated_write(self, name, values, first=0):
            if threading.current_thread().name.startswith("offload-checkpoint"):
                gate.event.wait()
                gate.writes += 1
            return write(self, name, values, first)

        def pin_wait(self, pair, slot):
            if pair.pin is self and self.slots.get(id(pair)) == slot:
                gate.training_waited.set()
                if open_when_training_waits:
                    gate.event.set()
            return wait(self, pair, slot)

        monkeypatch.setattr(SafetensorsWriter, "write", gated_write)
        monkeypatch.setattr(SlotPin, "wait", pin_wait)

    def open(self) -> None:
        self.event.set()


@pytest.mark.parametrize("model,param,opt", [("mlp", "nvme", "nvme"), ("gpt2", "nvme", "nvme"), ("mlp", "none", "cpu"),
                                             ("gpt2", "cpu", "nvme")])
def test_the_checkpoint_holds_the_step_it_was_asked_at_while_training_goes_on(model, param, opt, disk_dir, tmp_path,
                                                                              monkeypatch):
    """Saved at step N, written while steps N+1.. run: the loaded parameters and optimizer state are step N's.
    On NVMe, step N+1 runs while the save has written nothing, and step N+2 finds the slots it writes still
    pinned (the gate opens only then): without the pin it would overwrite what the save has not read."""
    make, batches, loss = MODELS[model]
    config = engine_config(disk_dir, param, opt, micro=2)
    engine, *_ = initialize(model=make(), config=config)
    data = batches(6)
    train(engine, data[:2], loss)
    params, state = parameters_now(engine), optimizer_state(engine)
    gate = Gate(monkeypatch, open_when_training_waits=True)
    path = engine.save_checkpoint(tmp_path, async_save=True)
    status = engine.checkpoint_in_flight()
    assert status is not None and status.tag == "global_step2" and status.bytes_written == 0 < status.total_bytes
    train(engine, data[2:3], loss)  # step N+1: the save has written nothing yet
    assert gate.writes == 0 and not (tmp_path / LATEST).exists()
    train(engine, data[3:], loss)  # N+2..: may write only slots the save has read
    gate.open()
    assert engine.wait_for_checkpoint() == path
    assert engine.checkpoint_in_flight() is None
    if param == "nvme":
        assert gate.training_waited.is_set()  # the pin was met: the test exercised it
    assert engine.global_steps == 6
    assert (tmp_path / LATEST).read_text() == "global_step2"
    assert len(verify_checkpoint(tmp_path)) >= 3
    fresh, *_ = initialize(model=make(), config=config)
    loaded, _ = fresh.load_checkpoint(tmp_path)
    assert loaded == path and fresh.global_steps == 2
    assert_same_tensors(params, parameters_now(fresh))
    assert_same_optimizer_state(state, optimizer_state(fresh))
    # and the engine that went on trained from its own state, not the checkpoint's
    assert not all(torch.equal(params[name], t) for name, t in parameters_now(engine).items())
    engine.close()
    fresh.close()


def test_the_config_key_makes_saves_asynchronous_and_close_waits(disk_dir, tmp_path, monkeypatch):
    """``"checkpoint": {"async_save": true}``: a plain ``save_checkpoint`` (as the trainers call it) returns with
    the save in flight; ``close()`` waits for it, and what it wrote loads."""
    config = engine_config(disk_dir, "nvme", "nvme", checkpoint={"async_save": True})
    engine, *_ = initialize(model=mlp(), config=config)
    train(engine, mlp_batches(2), mlp_loss)
    params = parameters_now(engine)
    gate = Gate(monkeypatch)
    engine.save_checkpoint(tmp_path)
    assert engine.checkpoint_in_flight() is not None and gate.writes == 0
    gate.open()
    engine.close()  # waits
    assert (tmp_path / LATEST).read_text() == "global_step2"
    fresh, *_ = initialize(model=mlp(), config=engine_config(disk_dir, "nvme", "nvme"))
    fresh.load_checkpoint(tmp_path)
    assert_same_tensors(params, parameters_now(fresh))
    fresh.close()


def test_a_save_requested_while_one_is_in_flight_waits_or_is_refused(disk_dir, tmp_path, monkeypatch):
    """Never two writers in one folder: with ``wait=False`` the second save is refused, naming the one in
    flight; otherwise it waits until the first has committed, then saves."""
    engine, *_ = initialize(model=mlp(), config=engine_config(disk_dir, "nvme", "nvme"))
    train(engine, mlp_batches(2), mlp_loss)
    gate = Gate(monkeypatch)
    first = engine.save_checkpoint(tmp_path, tag="first", async_save=True)
    with pytest.raises(CheckpointInUseError, match=r"first is still being saved in the background.*wait=True"):
        engine.save_checkpoint(tmp_path, tag="second", wait=False)
    committed_when_second_began = []
    original = SafetensorsWriter.__init__

    def noting(self, path, *args, **kwargs):  # the second save's first file: was the first one committed?
        if "second" in os.fspath(path) or ".staging-second" in os.fspath(path):
            committed_when_second_began.append((tmp_path / "first").is_dir())
        original(self, path, *args, **kwargs)

    monkeypatch.setattr(SafetensorsWriter, "__init__", noting)
    second = threading.Thread(target=engine.save_checkpoint, args=(tmp_path,), kwargs={"tag": "second"})
    second.start()
    assert engine.checkpoint_in_flight().tag == "first"  # still held at its gate: the second one waits
    gate.open()
    second.join()
    assert committed_when_second_began and all(committed_when_second_began)
    assert (tmp_path / LATEST).read_text() == "second" and (tmp_path / "first").is_dir()
    assert engine.wait_for_checkpoint() == first
    verify_checkpoint(tmp_path, "first")
    verify_checkpoint(tmp_path, "second")
    engine.close()


@pytest.mark.parametrize("failing", ["rank00000_params.safetensors", "rank00000_optimizer.safetensors"])
def test_a_disk_full_during_the_save_is_raised_at_the_next_forward_naming_the_file(failing, disk_dir, tmp_path,
                                                                                monkeypatch):
    """ENOSPC in the background: the next forward (the first call of a step) raises CheckpointSaveError naming
    the file, before anything changes; ``latest`` still names the previous checkpoint, nothing of the failed one is visible, the pinned
    slots were let go (training goes on) and the next save works."""
    engine, *_ = initialize(model=mlp(), config=engine_config(disk_dir, "nvme", "nvme"))
    data = mlp_batches(6)
    train(engine, data[:2], mlp_loss)
    engine.save_checkpoint(tmp_path, tag="good")
    train(engine, data[2:3], mlp_loss)
    write = SafetensorsWriter.write
    failed = threading.Event()

    def full(self, name, values, first=0):
        if self.path.endswith(failing) and threading.current_thread().name.startswith("offload-checkpoint"):
            failed.set()
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return write(self, name, values, first)

    monkeypatch.setattr(SafetensorsWriter, "write", full)
    engine.save_checkpoint(tmp_path, tag="bad", async_save=True)
    engine._saves.wait()  # the test's sync point: the save has ended (failed)
    assert failed.is_set()
    params, state, steps = parameters_now(engine), optimizer_state(engine), engine.global_steps
    with pytest.raises(CheckpointSaveError, match=rf"bad failed: OSError: .*No space left.*{failing}") as caught:
        mlp_loss(engine, data[3])
    assert isinstance(caught.value.__cause__, OSError) and caught.value.__cause__.errno == errno.ENOSPC
    assert engine.global_steps == steps  # raised before the step changed anything
    assert_same_tensors(params, parameters_now(engine))
    assert_same_optimizer_state(state, optimizer_state(engine))
    assert (tmp_path / LATEST).read_text() == "good"
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".")) == ["good", LATEST]
    monkeypatch.setattr(SafetensorsWriter, "write", write)
    train(engine, data[4:], mlp_loss)  # raised once; no slot is left pinned
    engine.save_checkpoint(tmp_path, tag="after", async_save=True)
    engine.wait_for_checkpoint()
    assert (tmp_path / LATEST).read_text() == "after"
    verify_checkpoint(tmp_path)
    engine.close()


_KILLED = textwrap.dedent(
    """
    import os, sys, threading
    sys.path.insert(0, sys.argv[3])
    import offload.storage.checkpoint_dir as checkpoint_dir
    import offload.train.checkpoint.rank_state as rank_state
    from offload.storage import SafetensorsWriter
    from offload.train.engine import initialize
    from test_engine import engine_config, mlp, mlp_batches, mlp_loss, train

    scratch, save_dir, point = sys.argv[1], sys.argv[2], sys.argv[4]
    stop = threading.Event()

    def say(line):  # one write per line: the save's thread and training's print at the same moment
        os.write(1, (line + "\\n").encode())

    def reached(where):
        if where == point and threading.current_thread().name.startswith("offload-checkpoint"):
            say("at " + where)
            stop.wait()  # killed here

    write, move, states = SafetensorsWriter.write, checkpoint_dir._move_into_place, rank_state.states_bytes
    def gated_write(self, name, values, first=0):
        reached("params" if self.path.endswith("params.safetensors") else "optimizer")
        return write(self, name, values, first)
    def gated_move(*args):
        reached("commit")
        return move(*args)
    def gated_states(encoded):
        reached("states")
        return states(encoded)
    SafetensorsWriter.write, checkpoint_dir._move_into_place, rank_state.states_bytes = gated_write, gated_move, gated_states

    engine, *_ = initialize(model=mlp(), config=engine_config(scratch, "nvme", "nvme"))
    data = mlp_batches(5)
    train(engine, data[:2], mlp_loss)
    engine.save_checkpoint(save_dir, tag="previous")
    train(engine, data[2:3], mlp_loss)
    engine.save_checkpoint(save_dir, tag="killed", async_save=True)
    train(engine, data[3:4], mlp_loss)  # training goes on meanwhile
    say("trained")
    stop.wait()
    """
)


@pytest.mark.parametrize("point", ["params", "optimizer", "states", "commit"])
def test_a_kill_during_the_save_leaves_the_previous_checkpoint_and_latest_loadable(point, disk_dir, tmp_path):
    """SIGKILL while the background save writes the partitions, the optimizer state, the state file, or just
    before the commit's rename: ``latest`` still names the previous checkpoint, which verifies and loads, and
    the next save clears what the kill left."""
    save_dir = tmp_path / "ckpt"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    child = subprocess.Popen([sys.executable, "-c", _KILLED, str(disk_dir), str(save_dir), str(REPO / "tests"), point],
                             stdout=subprocess.PIPE, text=True, env=env)
    try:
        seen = {child.stdout.readline().strip() for _ in range(2)}  # the save is held at the point; training went on
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=60)
    assert seen == {f"at {point}", "trained"}
    assert child.returncode == -signal.SIGKILL
    assert (save_dir / LATEST).read_text() == "previous"
    assert not (save_dir / "killed").exists()
    verify_checkpoint(save_dir)
    engine, *_ = initialize(model=mlp(), config=engine_config(disk_dir, "nvme", "nvme"))
    loaded, _ = engine.load_checkpoint(save_dir)
    assert loaded.endswith("previous") and engine.global_steps == 2
    train(engine, mlp_batches(1), mlp_loss)
    engine.save_checkpoint(save_dir, tag="next", async_save=True)
    engine.wait_for_checkpoint()
    assert sorted(p.name for p in save_dir.iterdir()) == [LATEST, "next", "previous"]  # the leftovers are gone
    engine.close()


def _two_rank_async(rank: int, scratch: str, save_dir: str, port: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    torch.distributed.init_process_group("gloo", rank=rank, world_size=2)
    try:
        config = engine_config(os.path.join(scratch, f"r{rank}"), "nvme", "nvme", micro=2)
        os.makedirs(config["zero_optimization"]["offload_param"]["nvme_path"], exist_ok=True)
        engine, *_ = initialize(model=mlp(), config=config)
        data = [tuple(t.chunk(2)[rank] for t in batch) for batch in mlp_batches(5)]
        train(engine, data[:2], mlp_loss)
        params = parameters_now(engine)
        engine.save_checkpoint(save_dir, async_save=True)
        train(engine, data[2:], mlp_loss)  # the ranks' background collectives run beside training's
        engine.wait_for_checkpoint()
        fresh, *_ = initialize(model=mlp(), config=config)
        fresh.load_checkpoint(save_dir)
        assert_same_tensors(params, parameters_now(fresh))
        assert fresh.global_steps == 2
        engine.close()
        fresh.close()
    finally:
        torch.distributed.destroy_process_group()


def test_two_ranks_save_asynchronously_while_they_train(disk_dir, tmp_path):
    """Two ranks over gloo: the background saves agree in a group of their own, the commit waits for both
    ranks' files, and the checkpoint holds the step it was asked at."""
    from ranks import run_ranks
    from test_engine_dist import _free_port

    port = str(_free_port())
    run_ranks(_two_rank_async, [(rank, str(disk_dir), str(tmp_path / "ckpt"), port) for rank in range(2)], timeout=600)
    assert (tmp_path / "ckpt" / LATEST).read_text() == "global_step2"
    verify_checkpoint(tmp_path / "ckpt")
