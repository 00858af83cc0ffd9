"""Swap files of killed processes (issue 14): a process killed with SIGKILL leaves its swap files;
they are listed as stale (with their size and process) by `stale_swap_files` and by
``python -m offload.swapfiles``, a running process's files never are, and the next engine started in
the directory removes them with a log line. A relative nvme_path survives an os.chdir."""

from __future__ import annotations

import errno
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from offload.storage.swapfile import SwapFile, is_swap_file_name, stale_swap_files
from offload.swapfiles import main as swapfiles_main
from offload.train.engine import initialize
from tensorio import AioConfig
from test_engine import engine_config, mlp, mlp_batches, mlp_loss

pytestmark = pytest.mark.subprocess

REPO = Path(__file__).resolve().parent.parent
TESTS = Path(__file__).resolve().parent

# A child that makes swap files, prints their paths on one line and waits (on stdin) to be killed.
_SWAP_FILE_HOLDER = textwrap.dedent(
    """
    import sys, torch
    from offload.storage import SwapFile
    from tensorio import AioConfig
    swap = SwapFile(sys.argv[1], AioConfig(), kind="params")
    swap.write(torch.ones(3 * 1024), swap.allocate(3 * 4096)).result()
    print(swap.path, flush=True)
    sys.stdin.read()
    """
)

_ENGINE_HOLDER = textwrap.dedent(
    """
    import os, sys
    from test_engine import engine_config, mlp, mlp_batches, mlp_loss
    from offload.train.engine import initialize
    engine, *_ = initialize(model=mlp(), config=engine_config(sys.argv[1], "nvme", "nvme", gradient_clipping=1.0))
    for batch in mlp_batches(2):
        engine.backward(mlp_loss(engine, batch))
        engine.step()
    print(" ".join(sorted(os.path.join(sys.argv[1], name) for name in os.listdir(sys.argv[1]))), flush=True)
    sys.stdin.read()
    """
)


def _start(script, directory):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(TESTS)])}
    child = subprocess.Popen([sys.executable, "-c", script, str(directory)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True, env=env)
    line = child.stdout.readline()
    assert line, f"the child exited with {child.wait()} before making its swap files"
    return child, line.split()


def _kill(child):
    child.send_signal(signal.SIGKILL)
    child.wait()
    assert child.returncode == -signal.SIGKILL
    child.stdin.close()
    child.stdout.close()


def _command(*args):
    done = subprocess.run([sys.executable, "-m", "offload.swapfiles", *map(str, args)], capture_output=True,
                          text=True, env={**os.environ, "PYTHONPATH": str(REPO)}, cwd=REPO)
    return done.returncode, done.stdout, done.stderr


def _swap_files(directory):
    return sorted(str(path) for path in Path(directory).iterdir() if is_swap_file_name(path.name))


def test_a_killed_process_swap_file_is_listed_as_stale_and_reclaimed_by_the_next_swap_file(disk_dir, caplog):
    child, (path,) = _start(_SWAP_FILE_HOLDER, disk_dir)
    try:
        assert _swap_files(disk_dir) == [path]
        assert stale_swap_files(disk_dir) == []  # its process runs and holds the lock
        status, out, _ = _command(disk_dir)
        assert (status, out) == (0, f"0 stale swap files (0.0 MB) in {disk_dir}; 1 of running processes left alone\n")
    finally:
        _kill(child)
    (stale,) = stale_swap_files(disk_dir)
    assert (stale.path, stale.pid, stale.reason) == (path, child.pid, f"process {child.pid} is not running")
    assert stale.nbytes >= 3 * 4096
    status, out, _ = _command(disk_dir)
    assert status == 0
    assert out.splitlines() == [f"{path}  {stale.nbytes / 1e6:.1f} MB  process {child.pid} is not running",
                                f"1 stale swap file ({stale.nbytes / 1e6:.1f} MB) in {disk_dir}; 0 of running "
                                f"processes left alone; --remove deletes it"]
    with caplog.at_level(logging.WARNING, logger="offload"):
        swap = SwapFile(disk_dir, AioConfig(), kind="params")
    try:
        assert _swap_files(disk_dir) == [swap.path]
        assert [r.getMessage() for r in caplog.records] == [
            f"removed the stale swap file {path} ({stale.nbytes / 1e6:.1f} MB): process {child.pid} is not running"]
    finally:
        swap.close()
    assert _swap_files(disk_dir) == []


def test_the_command_removes_stale_files_and_leaves_a_running_process_files(disk_dir):
    running, (live_path,) = _start(_SWAP_FILE_HOLDER, disk_dir)
    try:
        killed, (stale_path,) = _start(_SWAP_FILE_HOLDER, disk_dir)  # (a later one would reclaim it)
        _kill(killed)
        status, out, err = _command(disk_dir, "--remove")
        assert status == 0, err
        assert out.splitlines()[-1].endswith(": 1 removed; 1 of running processes left alone")
        assert f"removed the stale swap file {stale_path}" in err
        assert _swap_files(disk_dir) == [live_path]
    finally:
        _kill(running)
    assert swapfiles_main([str(disk_dir), "--remove"]) == 0
    assert _swap_files(disk_dir) == []


def test_the_command_refuses_a_directory_it_cannot_list(tmp_path):
    status, out, err = _command(tmp_path / "missing")
    assert (status, out) == (2, "")
    assert err == f"python -m offload.swapfiles: {tmp_path / 'missing'} does not exist\n"
    (tmp_path / "file").write_text("x")
    assert _command(tmp_path / "file")[2] == f"python -m offload.swapfiles: {tmp_path / 'file'} is not a directory\n"


def test_a_killed_engine_swap_files_are_stale_and_the_next_engine_reclaims_them(disk_dir, caplog):
    child, paths = _start(_ENGINE_HOLDER, disk_dir)
    try:
        assert {"adam", "params"} <= {Path(p).name.split("-")[1] for p in paths}  # and grads, on some step paths
        assert all(f"-{child.pid}-" in Path(p).name for p in paths)
        assert stale_swap_files(disk_dir) == []
        # an engine started beside a running one leaves its files alone
        with caplog.at_level(logging.WARNING, logger="offload"):
            engine, *_ = initialize(model=mlp(), config=engine_config(disk_dir, "nvme", "nvme"))
        engine.close()
        assert not [r for r in caplog.records if "stale" in r.getMessage()]
        assert _swap_files(disk_dir) == paths
    finally:
        _kill(child)
    stale = stale_swap_files(disk_dir)
    assert [(s.path, s.pid) for s in stale] == [(p, child.pid) for p in paths]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="offload"):
        engine, *_ = initialize(model=mlp(), config=engine_config(disk_dir, "nvme", "nvme", gradient_clipping=1.0))
    try:
        removed = sorted(r.getMessage() for r in caplog.records if "stale" in r.getMessage())
        assert removed == [f"removed the stale swap file {s.path} ({s.nbytes / 1e6:.1f} MB): process {child.pid} "
                           f"is not running" for s in stale]
        assert not set(paths) & set(_swap_files(disk_dir))
        assert len(_swap_files(disk_dir)) >= 2  # this engine's own
        engine.backward(mlp_loss(engine, mlp_batches(1)[0]))
        engine.step()
    finally:
        engine.close()
    assert _swap_files(disk_dir) == []


def test_a_reused_pid_or_an_exited_unreaped_process_does_not_keep_a_file_alive(disk_dir):
    other = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        old = disk_dir / f"offload-params-{other.pid}-0123abcd.swp"
        old.write_bytes(b"x" * 4096)
        started = time.time() - 60
        os.utime(old, (started, started))  # last written a minute before its pid's process started
        (stale,) = stale_swap_files(disk_dir)
        assert stale.reason == (f"process {other.pid} is not running (pid {other.pid} now names a process started "
                                f"after the file's last write)")
        os.utime(old)  # written just now: that process may own it
        assert stale_swap_files(disk_dir) == []
        other.send_signal(signal.SIGKILL)
        os.waitid(os.P_PID, other.pid, os.WEXITED | os.WNOWAIT)  # dead, not reaped: a zombie
        (stale,) = stale_swap_files(disk_dir)
        assert stale.reason == f"process {other.pid} has exited (its parent has not reaped it yet)"
    finally:
        other.kill()
        other.wait()
    mine = disk_dir / f"offload-params-{os.getpid()}-0123abcd.swp"
    mine.write_bytes(b"")
    assert [s.path for s in stale_swap_files(disk_dir)] == [str(old)]  # this process's files are never stale


@pytest.mark.parametrize("clipping", [0.0, 1.0], ids=["updates in backward", "chunked step"])
def test_a_relative_nvme_path_survives_a_chdir(disk_dir, tmp_path, monkeypatch, clipping):
    monkeypatch.chdir(disk_dir.parent)
    config = engine_config(disk_dir.name, "nvme", "nvme", gradient_clipping=clipping)
    engine, *_ = initialize(model=mlp(), config=config)
    try:
        assert {"params", "adam"} <= {Path(p).name.split("-")[1] for p in _swap_files(disk_dir)}
        monkeypatch.chdir(tmp_path)  # the relative path now names nothing
        assert not Path(disk_dir.name).exists()
        for batch in mlp_batches(3):
            engine.backward(mlp_loss(engine, batch))
            engine.step()
        engine.save_checkpoint("ckpt")
        engine.load_checkpoint("ckpt")
        engine.backward(mlp_loss(engine, mlp_batches(4)[3]))
        engine.step()
        assert list(tmp_path.iterdir()) == [tmp_path / "ckpt"]  # nothing made in the new working directory
    finally:
        engine.close()
    assert _swap_files(disk_dir) == []
    assert list(disk_dir.iterdir()) == []
