"""What a handle holds: its threads and rings until it is closed or collected."""

from __future__ import annotations

import gc
import os
import threading

import pytest
import torch

import tensorio
from tensorio import AioHandle

BACKENDS = ["threads", "io_uring"]


@pytest.fixture(params=BACKENDS)
def backend(request):
    if request.param == "io_uring" and not tensorio.probe_io_uring()[0]:
        pytest.skip(f"io_uring unavailable: {tensorio.probe_io_uring()[1]}")
    return request.param


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_dropped_handles_release_their_descriptors_and_threads(disk_dir, backend):
    gc.collect()
    fds, threads = open_fds(), threading.active_count()
    for i in range(300):
        handle = AioHandle(queue_depth=2, backend=backend)
        if i % 30 == 0:  # some of them did I/O first
            handle.write(torch.full((1000,), float(i)), disk_dir / "x.bin").result()
        del handle
    gc.collect()
    # Before: +600 descriptors and +300 threads (io_uring), +600 threads (threads) for good.
    assert open_fds() - fds <= 3
    assert threading.active_count() - threads <= 2


def test_a_dropped_handle_finishes_its_requests_first(disk_dir, backend):
    data = torch.arange(1 << 18, dtype=torch.float32)
    future = AioHandle(block_size=1 << 16, queue_depth=2, backend=backend).write(data, disk_dir / "d.bin")
    gc.collect()
    assert future.result() == data.numel() * 4
    assert (disk_dir / "d.bin").read_bytes() == data.numpy().tobytes()


def test_close_from_a_completion_callback(disk_dir, backend):
    handle = AioHandle(queue_depth=2, backend=backend)
    closed = threading.Event()
    future = handle.write(torch.ones(1000), disk_dir / "c.bin")
    future.add_done_callback(lambda f: (handle.close(), closed.set()))
    assert future.result() == 4000
    assert closed.wait(10)
    with pytest.raises(RuntimeError, match="closed"):
        handle.write(torch.ones(10), disk_dir / "c.bin")
