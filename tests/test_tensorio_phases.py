"""tensorio.phase_timer: a transfer's CPU time by phase of the io_uring worker, with the bytes intact."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import tensorio

KiB = 1 << 10


@pytest.fixture
def uring():
    ok, why = tensorio.probe_io_uring()
    if not ok:
        pytest.skip(why)


def test_a_timed_transfer_moves_the_bytes_and_splits_the_worker_cpu(uring, disk_dir):
    size = 64 * KiB * 7 + 4096  # a run of whole pieces and a short last one
    tensor = tensorio.locked_tensor(size, torch.uint8)
    tensor.copy_(torch.randint(0, 256, (size,), dtype=torch.uint8))
    path = str(disk_dir / "data.bin")
    with tensorio.AioHandle(block_size=64 * KiB, queue_depth=4, backend="io_uring", direct=True) as handle:
        with tensorio.phase_timer(handle) as timer:
            for write in (True, False):
                back = tensor if write else tensorio.locked_tensor(size, torch.uint8)
                ns = timer.transfer(back, path, write=write)
                assert set(ns) == {*tensorio.PHASES, "worker"}
                assert all(ns[phase] >= 0 for phase in tensorio.PHASES), ns
                assert ns["fill"] > 0 and ns["submit"] > 0 and ns["reap"] > 0, ns  # the worker's phases were timed
                assert ns["worker"] == ns["fill"] + ns["submit"] + ns["reap"] + ns["wait"]
        assert np.array_equal(np.fromfile(path, dtype=np.uint8), tensor.numpy())  # an independent reader
        assert torch.equal(back, tensor)
        with pytest.raises(RuntimeError, match="phase_timer context has exited"):
            timer.transfer(tensor, path, write=True)
        handle.write(tensor, path).result()  # the untimed worker runs on after the context
        handle.read(back.zero_(), path).result()
        assert torch.equal(back, tensor)


def test_only_a_one_worker_io_uring_handle_is_timed(uring):
    for kwargs in ({"backend": "threads"}, {"backend": "io_uring", "thread_count": 2}):
        with tensorio.AioHandle(**kwargs) as handle:
            with pytest.raises(ValueError, match="make it with backend='io_uring', thread_count=1"):
                with tensorio.phase_timer(handle):
                    pass
