"""A flipped bit anywhere in a checkpoint the engine wrote (a tensor's data, a safetensors header, the state
file, config.json) is refused by every way into it, naming the file: ``load_checkpoint`` (the engine unchanged
after), ``consolidate``, ``verify`` and the checkpoint's own ``zero_to_fp32.py``; whether the checkpoint is named
by a relative path, an absolute one or has been moved to another folder, from a working directory that is not
the checkpoint's. (The trainers' resumes: tests/test_integration_*.py.)"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from checkpoint_flips import FLIPS, WHAT, copy_elsewhere, flip, relative
from offload.checkpoint import main as checkpoint_command
from tensorio import ChecksumError
from test_checksums_checkpoint import _engine, _step
from test_engine import gpt2_batches

BATCHES = gpt2_batches(3)
WAYS = ("relative", "absolute", "moved")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A save_dir holding a checkpoint after 2 steps, and the losses of a fresh engine's first two steps."""
    tmp = tmp_path_factory.mktemp("entry")
    engine = _engine(tmp)
    fresh = [_step(engine, batch) for batch in BATCHES[:2]]
    engine.save_checkpoint(tmp / "ck")
    engine.close()
    return tmp / "ck", fresh


@pytest.fixture
def damaged(saved, request, tmp_path, monkeypatch):
    """(the save_dir as the test names it, the flipped file, what the error names) for a flip of the kind and a
    way of naming the checkpoint given as ``request.param``; the working directory is another folder."""
    kind, way = request.param
    save_dir = copy_elsewhere(saved[0], tmp_path / "store" if way != "moved" else tmp_path)
    if way == "moved":  # checked where it was written, then moved to another folder and renamed
        assert checkpoint_command(["verify", str(save_dir)]) == 0
        (tmp_path / "moved").mkdir()
        save_dir = save_dir.rename(tmp_path / "moved" / "elsewhere")
    path, _ = flip(save_dir / "global_step2", kind)
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")
    return (str(save_dir) if way == "absolute" else relative(save_dir)), path, WHAT[kind]


CASES = [pytest.param((kind, way), id=f"{kind}-{way}") for kind in FLIPS for way in WAYS]


@pytest.mark.parametrize("damaged", CASES, indirect=True)
def test_load_checkpoint_refuses_it_and_the_engine_trains_on_unchanged(damaged, saved, disk_dir, aio_backend):
    argument, path, what = damaged
    engine = _engine(disk_dir, aio_backend)
    try:
        assert _step(engine, BATCHES[0]) == saved[1][0]
        before = dict(engine.full_parameters())
        with pytest.raises(ChecksumError, match=f"checksum mismatch \\({what}.*\\): {path}"):
            engine.load_checkpoint(argument)
        assert all(torch.equal(value, before[name]) for name, value in engine.full_parameters())
        assert engine.global_steps == 1
        assert _step(engine, BATCHES[1]) == saved[1][1]  # as if never asked to load
    finally:
        engine.close()


@pytest.mark.parametrize("damaged", CASES, indirect=True)
def test_verify_and_consolidate_refuse_it(damaged, tmp_path, capsys):
    argument, path, what = damaged
    assert checkpoint_command(["verify", argument]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "checksum mismatch (" + what in err and str(path) in err
    out = tmp_path / "hf"
    assert checkpoint_command(["consolidate", argument, str(out), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "checksum mismatch (" + what in err and str(path) in err
    assert not (out / "model.safetensors").exists() and not (out / "config.json").exists()


@pytest.mark.subprocess
@pytest.mark.parametrize("damaged", [pytest.param((kind, "relative"), id=kind) for kind in FLIPS], indirect=True)
def test_the_checkpoints_own_zero_to_fp32_refuses_it(damaged, tmp_path):
    argument, path, what = damaged
    script = f"{argument}/global_step2/zero_to_fp32.py"
    run = subprocess.run([sys.executable, script, str(tmp_path / "hf")], capture_output=True, text=True)
    assert run.returncode == 2, run.stderr
    assert "checksum mismatch (" + what in run.stderr and str(path) in run.stderr
    assert not (tmp_path / "hf" / "model.safetensors").exists()
