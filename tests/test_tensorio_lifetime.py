"""What a handle holds: its threads and rings until it is closed or collected, and one descriptor per
file (not per request) while requests are in flight."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap
import threading

import pytest
import torch

import tensorio
from tensorio import AioHandle
from tensorio.testing import Delay, inject_faults

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


def test_queued_requests_share_one_descriptor_per_file(disk_dir, backend):
    release = threading.Event()
    data = torch.arange(300 * 25, dtype=torch.int32).reshape(300, 25)
    with AioHandle(block_size=4096, queue_depth=2, backend=backend) as handle:
        handle.write(data[0], disk_dir / "probe.bin").result()  # the directory's O_DIRECT probe, done
        fds = open_fds()
        with inject_faults(Delay(release)):  # every request stays queued until the release
            futures = [handle.write(data[i], disk_dir / f"f{i % 3}.bin", (i // 3) * 100) for i in range(300)]
            futures += [handle.read(torch.empty(25, dtype=torch.int32), disk_dir / "probe.bin") for _ in range(30)]
            # Three files for writing, one for reading, each with an O_DIRECT descriptor and its
            # buffered companion (the 100-byte writes are unaligned): 8 at most, not 330.
            assert open_fds() - fds <= 8
            assert not any(f.done() for f in futures)
            release.set()
            assert sum(f.result() for f in futures) == 330 * 100
        assert open_fds() == fds  # the last request on a file closed it
    for k in range(3):
        expected = data[k::3].numpy().tobytes()
        assert (disk_dir / f"f{k}.bin").read_bytes() == expected


@pytest.mark.subprocess
def test_thousands_of_queued_requests_under_a_low_descriptor_limit(disk_dir, backend):
    # 3,000 requests queued at once on three files with RLIMIT_NOFILE at 512 (before: EMFILE).
    script = textwrap.dedent(f"""
        import os, resource, threading, torch
        from tensorio import AioHandle
        from tensorio.testing import Delay, inject_faults
        resource.setrlimit(resource.RLIMIT_NOFILE, (512, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
        data = torch.arange(3000 * 25, dtype=torch.int32).reshape(3000, 25)
        release = threading.Event()
        with AioHandle(block_size=4096, queue_depth=4, backend={backend!r}) as handle:
            with inject_faults(Delay(release)):
                futures = [handle.write(data[i], os.path.join({str(disk_dir)!r}, f"f{{i % 3}}.bin"), (i // 3) * 100)
                           for i in range(3000)]
                release.set()
                print(sum(f.result() for f in futures))
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == [str(3000 * 100)]
    data = torch.arange(3000 * 25, dtype=torch.int32).reshape(3000, 25)
    for k in range(3):
        assert (disk_dir / f"f{k}.bin").read_bytes() == data[k::3].numpy().tobytes()


def test_a_replaced_file_gets_its_own_descriptor(disk_dir, backend):
    # A name is reused only while it names the same file: here the first request, still queued,
    # keeps writing to the file it opened, and the second one reaches the file now at that name.
    path, other = disk_dir / "p.bin", disk_dir / "other.bin"
    release = threading.Event()
    with AioHandle(backend=backend) as handle:
        with inject_faults(Delay(release, n=1)):
            first = handle.write(torch.full((10,), 1, dtype=torch.uint8), path)
            other.write_bytes(b"\0" * 10)
            os.replace(other, path)
            handle.write(torch.full((10,), 2, dtype=torch.uint8), path).result()
            release.set()
            first.result()
    assert path.read_bytes() == b"\2" * 10
