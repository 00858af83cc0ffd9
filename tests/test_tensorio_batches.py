"""Batched submission and completion: runs of pieces, the ring written and read in whole batches,
every byte count still checked, and no hang with many requests in flight."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tensorio
from tensorio import AioHandle, TensorIOError
from tensorio._plan import plan_pieces, plan_runs


def as_bytes(tensor: torch.Tensor) -> bytes:
    return tensor.reshape(-1).view(torch.uint8).numpy().tobytes()


@settings(max_examples=200, deadline=None)
@given(offset=st.integers(0, 1 << 30), nbytes=st.integers(0, 1 << 22), buf_addr=st.integers(0, 1 << 30),
       block_size=st.integers(1, 512).map(lambda k: k * 512), direct=st.booleans())
def test_runs_are_the_pieces_in_at_most_three_runs(offset, nbytes, buf_addr, block_size, direct):
    runs = plan_runs(offset=offset, nbytes=nbytes, buf_addr=buf_addr, block_size=block_size, direct=direct,
                     align=4096)
    assert len(runs) <= 3 and all(run.length > 0 for run in runs)
    assert sum(run.count for run in runs) == len(plan_pieces(offset=offset, nbytes=nbytes, buf_addr=buf_addr,
                                                             block_size=block_size, direct=direct, align=4096))
    assert [p for run in runs for p in run.pieces()] == plan_pieces(
        offset=offset, nbytes=nbytes, buf_addr=buf_addr, block_size=block_size, direct=direct, align=4096)


@pytest.mark.parametrize("backend", ["io_uring", "threads"])
def test_1024_requests_in_flight_finish(disk_dir, backend):
    if backend == "io_uring" and not tensorio.probe_io_uring()[0]:
        pytest.skip(tensorio.probe_io_uring()[1])
    data = tensorio.aligned_tensor(1024 * 8192, torch.uint8)
    data.copy_(torch.randint(0, 256, (data.numel(),), dtype=torch.uint8, generator=torch.Generator().manual_seed(3)))
    path = disk_dir / "many.bin"
    with AioHandle(block_size=4096, queue_depth=4, backend=backend) as handle:
        writes = [handle.write(data[i * 8192:(i + 1) * 8192], path, i * 8192) for i in range(1024)]
        assert [f.result() for f in writes] == [8192] * 1024
        back = tensorio.aligned_tensor(data.numel(), torch.uint8)
        reads = [handle.read(back[i * 8192:(i + 1) * 8192], path, i * 8192) for i in range(1024)]
        assert [f.result() for f in reads] == [8192] * 1024
    assert path.read_bytes() == as_bytes(data)  # an independent reader
    assert as_bytes(back) == as_bytes(data)


@pytest.mark.parametrize("file_bytes", [5 * 4096, 5 * 4096 + 100])
@pytest.mark.parametrize("direct", [True, False], ids=["direct", "buffered"])
def test_a_file_ending_inside_a_batch_is_a_named_short_read(disk_dir, file_bytes, direct):
    # Pieces of one batch past the end of the file complete short or empty: the read fails, naming it.
    path = disk_dir / "short.bin"
    path.write_bytes(os.urandom(file_bytes))
    back = tensorio.aligned_tensor(16 * 4096, torch.uint8)
    with AioHandle(block_size=4096, queue_depth=16, direct=direct) as handle:
        with pytest.raises(TensorIOError) as info:
            handle.read(back, path).result()
    assert "short read" in str(info.value) and str(path) in str(info.value)
    assert f"the file is {file_bytes} bytes long" in str(info.value)


def test_the_ring_wraps_around_between_batches(disk_dir):
    if not tensorio.probe_io_uring()[0]:
        pytest.skip(tensorio.probe_io_uring()[1])
    import liburing as L

    from tensorio._ring import OP_READ, RingQueues

    path = disk_dir / "ring.bin"
    content = os.urandom(12 * 512)
    path.write_bytes(content)
    buffer = bytearray(len(content))
    address = torch.frombuffer(buffer, dtype=torch.uint8).data_ptr()
    ring = L.Ring()
    L.io_uring_queue_init(4, ring)
    fd = os.open(path, os.O_RDONLY)
    try:
        queues = RingQueues(L, ring)  # its self-test used one entry: the batches below cross the end
        seen = []
        for first in (0, 3, 6, 9):
            queues.push_run(OP_READ, fd, first * 512, address + first * 512, 512, 3, len(content), 100 + first)
            assert queues.submit() == 3
            done = []
            while len(done) < 3:
                batch = queues.completions()
                done += list(zip(batch["tag"].tolist(), batch["res"].tolist()))
                queues.release(len(batch))
            seen += sorted(done)
    finally:
        os.close(fd)
        L.io_uring_queue_exit(ring)
    assert seen == [(100 + first + i, 512) for first in (0, 3, 6, 9) for i in range(3)]
    assert bytes(buffer) == content


def test_a_run_whose_last_piece_is_short_moves_exactly_its_bytes(disk_dir):
    # block size 12 KiB over 40 KiB: pieces of 12, 12, 12 and 4 KiB, one batch, the last one shorter.
    data = tensorio.aligned_tensor(40 * 1024, torch.uint8)
    data.copy_(torch.randint(0, 256, (data.numel(),), dtype=torch.uint8, generator=torch.Generator().manual_seed(4)))
    path = disk_dir / "run.bin"
    path.write_bytes(b"\xaa" * (48 * 1024))
    with AioHandle(block_size=12 * 1024, queue_depth=8, direct=True) as handle:
        assert handle.write(data, path, 4096).result() == data.numel()
        back = tensorio.aligned_tensor(data.numel(), torch.uint8)
        assert handle.read(back, path, 4096).result() == data.numel()
    on_disk = path.read_bytes()
    assert on_disk[:4096] == b"\xaa" * 4096 and on_disk[4096 + data.numel():] == b"\xaa" * 4096
    assert on_disk[4096:4096 + data.numel()] == as_bytes(data) == as_bytes(back)
