"""Swap files are preallocated at initialize (os.posix_fallocate), so that a full disk is named there with the
file and the bytes it needs, never by a write in the middle of a step; a file system that cannot preallocate
is used as before; a failed reservation leaves no swap file and the model as it was."""

from __future__ import annotations

import errno
import os

import pytest
import torch

from offload.storage.swapfile import SwapFile, is_swap_file_name
from offload.train.engine import initialize
from tensorio import AioConfig
from test_engine import engine_config, mlp, mlp_batches, mlp_loss, train


def _swap_files(directory):
    return sorted(name for name in os.listdir(directory) if is_swap_file_name(name))


def test_initialize_reserves_every_swap_files_blocks(disk_dir):
    engine, *_ = initialize(model=mlp(), config=engine_config(disk_dir, "nvme", "nvme"))
    try:
        names = _swap_files(disk_dir)
        assert {name.split("-")[1] for name in names} == {"params", "adam"}
        for name in names:  # read by an independent reader: the file's size and its allocated blocks
            stat = os.stat(disk_dir / name)
            assert stat.st_size > 0 and stat.st_blocks * 512 >= stat.st_size, name
        train(engine, mlp_batches(2), mlp_loss)
    finally:
        engine.close()


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EDQUOT])
def test_a_full_disk_is_named_at_initialize_and_nothing_is_left(disk_dir, monkeypatch, code):
    def full(fd, offset, length):
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(os, "posix_fallocate", full)
    model = mlp()
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    with pytest.raises(OSError, match=r"swap file .*offload-params-.*\.swp: cannot reserve its [\d,]+ bytes") as raised:
        initialize(model=model, config=engine_config(disk_dir, "nvme", "nvme"))
    assert raised.value.errno == code and "bytes free" in str(raised.value)
    assert _swap_files(disk_dir) == []  # nothing half-written left behind
    assert all(torch.equal(p, before[name]) for name, p in model.named_parameters())


def test_the_optimizer_file_refused_alone_is_removed(disk_dir, monkeypatch):
    """The parameters' file fits, the optimizer's does not: the error names the optimizer's file."""
    real = os.posix_fallocate

    def full_for_adam(fd, offset, length):
        if "offload-adam-" in os.readlink(f"/proc/self/fd/{fd}"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(fd, offset, length)

    monkeypatch.setattr(os, "posix_fallocate", full_for_adam)
    with pytest.raises(OSError, match=r"swap file .*offload-adam-.*\.swp: cannot reserve"):
        initialize(model=mlp(), config=engine_config(disk_dir, "nvme", "nvme"))
    assert _swap_files(disk_dir) == []


@pytest.mark.parametrize("code", [errno.EOPNOTSUPP, errno.EINVAL])
def test_a_file_system_that_cannot_preallocate_trains_as_before(disk_dir, monkeypatch, code):
    def unsupported(fd, offset, length):
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(os, "posix_fallocate", unsupported)
    engine, *_ = initialize(model=mlp(), config=engine_config(disk_dir, "nvme", "nvme"))
    try:
        losses = train(engine, mlp_batches(2), mlp_loss)
        assert all(torch.isfinite(torch.tensor(losses)))
    finally:
        engine.close()


def test_a_failed_reservation_gives_the_file_its_size_back(disk_dir, monkeypatch):
    swap = SwapFile(disk_dir, AioConfig(), kind="params")
    try:
        swap.allocate(3 * 4096 + 1)
        swap.preallocate()
        reserved = os.stat(swap.path).st_size
        assert reserved == 4 * 4096
        swap.allocate(1 << 20)
        monkeypatch.setattr(os, "posix_fallocate", lambda fd, offset, length: (_ for _ in ()).throw(
            OSError(errno.ENOSPC, "No space left on device")))
        with pytest.raises(OSError, match=f"cannot reserve its {4 * 4096 + (1 << 20):,} bytes"):
            swap.preallocate()
        assert os.stat(swap.path).st_size == reserved
    finally:
        swap.close()
