"""What an engine holds is given back by close() (issue 14): descriptors, threads, swap files, and
locked memory, also while the caller still holds the optimizer that initialize returned."""

from __future__ import annotations

import gc
import os
import threading

import pytest

from offload.train.engine import initialize
from test_engine import engine_config, mlp, mlp_batches, mlp_loss


def _vmlck_kb() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmLck:"))


def _pinned_engine(disk_dir, clipping):
    config = engine_config(disk_dir, "nvme", "nvme", gradient_clipping=clipping)
    config["zero_optimization"]["offload_optimizer"]["pin_memory"] = True
    config["zero_optimization"]["offload_param"]["pin_memory"] = True
    engine, optimizer, _, _ = initialize(model=mlp(), config=config)
    for batch in mlp_batches(2):
        engine.backward(mlp_loss(engine, batch))
        engine.step()
    return engine, optimizer


@pytest.mark.parametrize("clipping", [0.0, 1.0], ids=["updates in backward", "chunked step"])
def test_close_gives_back_descriptors_threads_and_files_and_dropping_it_locked_memory(disk_dir, clipping):
    gc.collect()
    fds, threads, locked = len(os.listdir("/proc/self/fd")), threading.active_count(), _vmlck_kb()
    engine, optimizer = _pinned_engine(disk_dir, clipping)
    assert _vmlck_kb() > locked  # the optimizer's buffers are locked (else this test shows nothing)
    engine.close()
    assert os.listdir(disk_dir) == []
    assert len(os.listdir("/proc/self/fd")) == fds
    assert threading.active_count() == threads
    del engine, optimizer
    gc.collect()
    assert _vmlck_kb() <= locked


def test_close_unlocks_the_optimizer_buffers_while_the_caller_keeps_the_optimizer(disk_dir):
    gc.collect()
    locked = _vmlck_kb()
    engine, optimizer = _pinned_engine(disk_dir, 0.0)
    engine.close()
    gc.collect()
    assert _vmlck_kb() <= locked, "locked memory still held after engine.close()"
