"""Bit-exact round trips, checked against an independent reader and writer (numpy / plain files)."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

import tensorio
from tensorio import AioHandle

BACKENDS = ["threads", "io_uring"]
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int8, torch.uint8, torch.int64]
SIZES = [1, 511, 4095, 4096, (1 << 20) + 3]


def random_tensor(numel: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (numel * torch.empty((), dtype=dtype).element_size(),), dtype=torch.uint8,
                        generator=gen)
    return raw.view(dtype)


def as_bytes(tensor: torch.Tensor) -> bytes:
    return tensor.reshape(-1).view(torch.uint8).numpy().tobytes()


@pytest.fixture(params=BACKENDS)
def backend(request):
    if request.param == "io_uring" and not tensorio.probe_io_uring()[0]:
        pytest.skip(f"io_uring unavailable: {tensorio.probe_io_uring()[1]}")
    return request.param


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("numel", SIZES)
def test_round_trip_dtypes_and_sizes(disk_dir, backend, dtype, numel):
    tensor = random_tensor(numel, dtype)
    path = disk_dir / "t.bin"
    with AioHandle(backend=backend) as handle:
        assert handle.backend_name == backend
        assert handle.write(tensor, path).result() == len(as_bytes(tensor))
        assert path.read_bytes() == as_bytes(tensor)  # independent reader
        if dtype not in (torch.bfloat16,):
            on_disk = np.fromfile(path, dtype=tensor.numpy().dtype)
            assert np.array_equal(on_disk.view(np.uint8), tensor.numpy().view(np.uint8))
        back = torch.empty_like(tensor)
        handle.read(back, path).result()
    assert as_bytes(back) == as_bytes(tensor)


@pytest.mark.parametrize("offset", [0, 512, 4096, 7, 4097, 12345])
@pytest.mark.parametrize("single_submit", [False, True])
@pytest.mark.parametrize("overlap_events", [False, True])
@pytest.mark.parametrize("thread_count", [1, 3])
@pytest.mark.parametrize("direct", ["auto", False], ids=["direct-auto", "buffered"])
def test_options_and_offsets(disk_dir, backend, offset, single_submit, overlap_events, thread_count, direct):
    # Small blocks and queues so one request is many pieces and more pieces than the queues hold; without
    # O_DIRECT every piece goes through the page cache (io_uring batches them as it does direct ones).
    tensor = random_tensor(3 * 8192 + 1001, torch.uint8, seed=offset)
    path = disk_dir / "t.bin"
    before = os.urandom(offset + tensor.numel() + 5000)
    path.write_bytes(before)  # independent writer: the bytes around the request must survive
    with AioHandle(block_size=4096, queue_depth=2, single_submit=single_submit, overlap_events=overlap_events,
                   thread_count=thread_count, backend=backend, direct=direct) as handle:
        handle.write(tensor, path, offset).result()
        expected = before[:offset] + as_bytes(tensor) + before[offset + tensor.numel():]
        assert path.read_bytes() == expected
        back = torch.zeros_like(tensor)
        handle.read(back, str(path), offset).result()
    assert as_bytes(back) == as_bytes(tensor)


def test_write_extends_a_file_and_leaves_the_gap_zero(disk_dir, backend):
    tensor = random_tensor(5000, torch.uint8)
    path = disk_dir / "t.bin"
    with AioHandle(backend=backend) as handle:
        handle.write(tensor, path, 10000).result()
    data = path.read_bytes()
    assert data == bytes(10000) + as_bytes(tensor)
    assert os.stat(path).st_mode & 0o777 == 0o600


@pytest.mark.parametrize("kind", ["locked", "plain", "locked-view-aligned", "locked-view-odd", "plain-view-odd"])
def test_locked_plain_and_views(disk_dir, backend, kind):
    numel = (1 << 20) + 17
    base = tensorio.locked_tensor(numel + 4096, torch.float32) if kind.startswith("locked") else \
        torch.empty(numel + 4096, dtype=torch.float32)
    start = {"locked": 0, "plain": 0, "locked-view-aligned": 1024, "locked-view-odd": 1, "plain-view-odd": 3}[kind]
    view = base[start:start + numel]
    view.copy_(random_tensor(numel, torch.float32, seed=start))
    path = disk_dir / "t.bin"
    with AioHandle(block_size=1 << 18, backend=backend) as handle:
        handle.write(view, path, 4096).result()
        assert path.read_bytes()[4096:] == as_bytes(view)
        target = tensorio.locked_tensor(numel + 8, torch.float32)[5:5 + numel]  # unaligned destination
        handle.read(target, path, 4096).result()
    assert as_bytes(target) == as_bytes(view)


def test_64_mib(disk_dir, backend):
    tensor = tensorio.locked_tensor(16 << 20, torch.float32)
    tensor.copy_(random_tensor(16 << 20, torch.float32, seed=64))
    path = disk_dir / "t.bin"
    with AioHandle(backend=backend, queue_depth=4, thread_count=2) as handle:
        handle.write(tensor, path).result()
        assert np.array_equal(np.fromfile(path, dtype=np.float32).view(np.uint32), tensor.numpy().view(np.uint32))
        back = tensorio.locked_tensor(16 << 20, torch.float32)
        handle.read(back, path).result()
    assert as_bytes(back) == as_bytes(tensor)


@pytest.mark.slow
def test_over_2_gib(disk_dir, backend):
    # Linux moves at most 0x7FFFF000 bytes per call: everything past that point must survive.
    numel = (1 << 31) + 12345
    tensor = tensorio.aligned_tensor(numel, torch.uint8)
    tensor[::4096] = 7
    tensor[-20000:] = torch.arange(20000, dtype=torch.int64).remainder(251).to(torch.uint8)
    path = disk_dir / "big.bin"
    with AioHandle(block_size=8 << 20, queue_depth=8, backend=backend) as handle:
        assert handle.write(tensor, path).result() == numel
        assert os.path.getsize(path) == numel
        with open(path, "rb") as f:
            f.seek(0x7FFFF000 - 4096)
            assert f.read(8192) == as_bytes(tensor[0x7FFFF000 - 4096:0x7FFFF000 + 4096])
            f.seek(numel - 20000)
            assert f.read() == as_bytes(tensor[-20000:])
        back = tensorio.aligned_tensor(numel, torch.uint8)
        assert handle.read(back, path).result() == numel
    assert as_bytes(back) == as_bytes(tensor)


def test_many_requests_in_flight_across_files(disk_dir, backend):
    tensors = [random_tensor(70000 + 4096 * i, torch.uint8, seed=i) for i in range(24)]
    with AioHandle(block_size=8192, queue_depth=2, thread_count=2, backend=backend) as handle:
        writes = [handle.write(t, disk_dir / f"f{i % 5}.bin", (i // 5) * 200000) for i, t in enumerate(tensors)]
        assert [f.result() for f in writes] == [t.numel() for t in tensors]
        backs = [torch.empty_like(t) for t in tensors]
        reads = [handle.read(b, disk_dir / f"f{i % 5}.bin", (i // 5) * 200000) for i, b in enumerate(backs)]
        for future in reads:
            future.result()
    for tensor, back in zip(tensors, backs):
        assert as_bytes(tensor) == as_bytes(back)


def test_empty_tensor_is_a_no_op(disk_dir, backend):
    with AioHandle(backend=backend) as handle:
        assert handle.write(torch.empty(0), disk_dir / "e.bin").result() == 0
        assert handle.read(torch.empty(0), disk_dir / "e.bin").result() == 0


def test_tmpfs_falls_back_to_buffered_io(tmpfs_dir, backend, caplog):
    tensor = random_tensor(12345, torch.float16)
    with AioHandle(backend=backend) as handle:
        handle.write(tensor, tmpfs_dir / "a.bin", 3).result()
        handle.write(tensor, tmpfs_dir / "b.bin").result()
        back = torch.empty_like(tensor)
        handle.read(back, tmpfs_dir / "a.bin", 3).result()
    assert as_bytes(back) == as_bytes(tensor)
    assert (tmpfs_dir / "b.bin").read_bytes() == as_bytes(tensor)
    assert tensorio.probe_direct(tmpfs_dir)[0] is False


def test_direct_true_refused_on_tmpfs(tmpfs_dir):
    with AioHandle(direct=True, backend="threads") as handle:
        with pytest.raises(tensorio.TensorIOError, match="O_DIRECT is unavailable"):
            handle.write(torch.zeros(10), tmpfs_dir / "x.bin")


def test_buffers_are_released_after_their_requests(disk_dir, backend):
    # liburing's Iovec keeps whatever buffer it was built from alive; tensorio must not leak that way.
    import gc
    import weakref

    with AioHandle(block_size=4096, backend=backend) as handle:
        handle.write(torch.zeros(5 * 4096, dtype=torch.uint8), disk_dir / "w.bin").result()
        refs = []
        for _ in range(3):
            tensor = torch.empty(5 * 4096, dtype=torch.uint8)
            handle.read(tensor, disk_dir / "w.bin").result()
            handle.write(tensor[1:], disk_dir / "x.bin", 3).result()  # staged and buffered pieces too
            refs.append(weakref.ref(tensor))
            del tensor
        gc.collect()
        assert [r() for r in refs] == [None, None, None]
