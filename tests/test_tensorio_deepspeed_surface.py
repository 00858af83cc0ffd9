"""The aio_handle surface, exercised the way DeepSpeed users call it.

Return values are those of DeepSpeed's aio_handle (csrc/aio/py_lib/deepspeed_py_io_handle.cpp and
py_ds_aio.cpp); where DeepSpeed returns -1 or goes on silently, tensorio raises.
"""

from __future__ import annotations

import os

import pytest
import torch

import tensorio
from tensorio import AioHandle, TensorIOError


@pytest.fixture(params=["threads", "io_uring"])
def handle(request):
    if request.param == "io_uring" and not tensorio.probe_io_uring()[0]:
        pytest.skip(f"io_uring unavailable: {tensorio.probe_io_uring()[1]}")
    with AioHandle(1 << 20, 8, False, True, 1, backend=request.param) as h:
        yield h


def test_constructor_and_getters():
    with AioHandle(block_size=262144, queue_depth=32, single_submit=True, overlap_events=False,
                   thread_count=2, backend="threads") as h:
        got = (h.get_block_size(), h.get_queue_depth(), h.get_single_submit(), h.get_overlap_events(),
               h.get_intra_op_parallelism(), h.get_thread_count(), h.get_alignment())
        assert got == (262144, 32, True, False, 2, 2, 1024)  # alignment: DeepSpeed's 512 x parallelism
        assert [type(v) for v in got] == [int, int, bool, bool, int, int, int]
    with AioHandle(intra_op_parallelism=3, backend="threads") as h:
        assert h.get_thread_count() == 3
    with pytest.raises(ValueError, match="aio.queue_depth"):
        AioHandle(queue_depth=0)


def test_async_writes_then_one_wait(disk_dir, handle):
    buffers = [handle.new_cpu_locked_tensor(300_000 + i, torch.empty(0, dtype=torch.float16)) for i in range(6)]
    for i, buf in enumerate(buffers):
        buf.copy_(torch.arange(buf.numel(), dtype=torch.float32).remainder(1000 + i).to(torch.float16))
        assert buf.dtype == torch.float16 and buf.data_ptr() % 4096 == 0
        assert handle.async_pwrite(buf, str(disk_dir / f"p{i}.swp")) == 0
    assert handle.wait() == 6
    assert handle.wait() == 0
    back = [torch.empty_like(b) for b in buffers]
    for i, buf in enumerate(back):
        assert handle.async_pread(buf, str(disk_dir / f"p{i}.swp")) == 0
    assert handle.wait() == 6
    for a, b in zip(buffers, back):
        assert torch.equal(a, b)
    for buf in buffers:
        handle.free_cpu_locked_tensor(buf)


def test_sync_calls_return_one(disk_dir, handle):
    src = torch.randn(12345)
    assert handle.sync_pwrite(src, str(disk_dir / "s.swp")) == 1
    dst = torch.empty_like(src)
    assert handle.sync_pread(dst, str(disk_dir / "s.swp")) == 1
    assert torch.equal(src, dst)
    assert handle.sync_pwrite(buffer=src, filename=str(disk_dir / "s.swp"), file_offset=8192) == 1
    assert handle.sync_pread(buffer=dst, filename=str(disk_dir / "s.swp"), file_offset=8192) == 1
    assert torch.equal(src, dst)


def test_sync_call_also_waits_for_pending_async_ones(disk_dir, handle):
    # DeepSpeed's synchronous calls wait for everything queued and return that count.
    a, b = torch.randn(5000), torch.randn(7000)
    assert handle.async_pwrite(a, str(disk_dir / "a.swp")) == 0
    assert handle.async_pwrite(a, str(disk_dir / "a2.swp")) == 0
    assert handle.sync_pwrite(b, str(disk_dir / "b.swp")) == 3
    assert handle.wait() == 0
    back = torch.empty_like(a)
    assert handle.async_pread(back, str(disk_dir / "a2.swp")) == 0
    assert handle.pread(torch.empty_like(b), str(disk_dir / "b.swp"), False, False) == 2
    assert torch.equal(back, a)
    assert handle.pwrite(a, str(disk_dir / "c.swp"), False, True) == 0
    assert handle.pwrite(b, str(disk_dir / "d.swp"), True, False) == 2
    assert handle.wait() == 0


def test_deepspeed_read_and_write_return_zero(disk_dir, handle):
    # DeepSpeed's read/write(buffer, filename, validate, file_offset=0): synchronous, 0 when done,
    # outside wait()'s count. The third argument being a bool is what tells them from ours.
    src = torch.randn(3000)
    path = str(disk_dir / "rw.swp")
    assert handle.write(src, path, False) == 0
    assert handle.write(src, path, True, 16384) == 0
    assert handle.write(src, path, validate=True, file_offset=32768 + 100) == 0
    dst = torch.empty_like(src)
    assert handle.read(dst, path, True, 16384) == 0 and torch.equal(dst, src)
    dst.zero_()
    assert handle.read(dst, path, validate=False, file_offset=32768 + 100) == 0 and torch.equal(dst, src)
    assert handle.wait() == 0
    assert handle.write(src, path, 0).result() == src.numel() * 4  # ours: an int offset, a future


def test_wait_with_nothing_pending_returns_zero(handle):
    assert handle.wait() == 0


def test_offset_writes_through_a_caller_opened_o_direct_fd(disk_dir, handle):
    fd = os.open(disk_dir / "fd.swp", os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
    try:
        chunks = [handle.new_cpu_locked_tensor(1 << 18, torch.empty(0)) for _ in range(4)]
        for i, chunk in enumerate(chunks):
            chunk.fill_(i + 0.5)
            handle.async_pwrite(chunk, fd=fd, file_offset=i * chunk.numel() * 4)
        assert handle.wait() == 4
        odd = torch.arange(1001, dtype=torch.float32)  # unaligned length and memory through the O_DIRECT fd
        assert handle.sync_pwrite(odd, fd=fd, file_offset=4 * (1 << 20) + 12) == 1
        whole = torch.empty(4 << 18)
        assert handle.sync_pread(whole, fd=fd) == 1
        back = torch.empty_like(odd)
        assert handle.sync_pread(back, fd=fd, file_offset=4 * (1 << 20) + 12) == 1
    finally:
        os.close(fd)
    assert torch.equal(whole, torch.cat(chunks))
    assert torch.equal(back, odd)


def test_pread_pwrite_with_validate(disk_dir, handle):
    src = torch.randn(5000)
    path = str(disk_dir / "v.swp")
    assert handle.pwrite(src, path, True, False) == 1
    dst = torch.empty_like(src)
    assert handle.pread(dst, path, True, False) == 1
    assert torch.equal(src, dst)
    assert handle.pread(dst, path, True, True) == 0
    assert handle.wait() == 1
    # Validation catches a buffer that disagrees with the file (changed after the read).
    handle.pread(dst, path, True, True)
    handle.wait()
    dst.view(torch.uint8)[0] ^= 0xFF
    from tensorio._handle import _validate
    with pytest.raises(TensorIOError, match="validation failed: first difference at byte 0"):
        _validate(dst, path, 0)


def test_exactly_one_of_filename_and_fd(handle):
    with pytest.raises(TypeError, match="exactly one of filename= and fd="):
        handle.sync_pread(torch.empty(1))
    with pytest.raises(TypeError, match="exactly one of filename= and fd="):
        handle.sync_pread(torch.empty(1), "x", fd=3)


def test_free_returns_false_for_a_buffer_it_did_not_lock(handle):
    # DeepSpeed's own swapper calls free_cpu_locked_tensor on every buffer it used, locked or not.
    assert handle.free_cpu_locked_tensor(torch.empty(3)) is False
    locked = handle.new_cpu_locked_tensor(4096, torch.empty(0))
    assert handle.free_cpu_locked_tensor(locked[1:]) is False  # a view inside: not a buffer start
    assert handle.free_cpu_locked_tensor(locked) is True
    assert handle.free_cpu_locked_tensor(locked) is False  # already freed
    locked.fill_(1.0)  # unlike DeepSpeed, the memory itself lives as long as the tensor
    with pytest.raises(ValueError, match="not made by locked_tensor"):
        tensorio.free_locked_tensor(torch.empty(3))  # tensorio's own function still refuses


def test_new_cpu_locked_tensor_and_is_pinned(handle):
    t = handle.new_cpu_locked_tensor(1000, torch.empty(0, dtype=torch.bfloat16))
    assert t.shape == (1000,) and t.dtype == torch.bfloat16 and t.data_ptr() % 4096 == 0
    assert handle.is_pinned(t) is True and handle.is_pinned(t[10:20]) is True
    assert handle.is_pinned(torch.empty(1000, dtype=torch.bfloat16)) is False
    with AioHandle(backend="threads") as other:  # the locked buffers are the process's, as in DeepSpeed
        assert other.is_pinned(t) is True
        assert other.free_cpu_locked_tensor(t) is True
    assert handle.is_pinned(t) is False


def test_failures_raise_where_deepspeed_returns_minus_one(disk_dir, handle):
    with pytest.raises(TensorIOError, match="does not exist"):
        handle.sync_pread(torch.empty(10), str(disk_dir / "missing.swp"))
    with pytest.raises(TensorIOError, match="does not exist"):
        handle.async_pread(torch.empty(10), str(disk_dir / "missing.swp"))
    (disk_dir / "short.swp").write_bytes(b"\0" * 100)
    with pytest.raises(TensorIOError, match="short read"):  # DeepSpeed reads short without a word
        handle.sync_pread(torch.empty(100), str(disk_dir / "short.swp"))
    assert handle.wait() == 0


def test_locked_buffers_report_their_state():
    tensor = tensorio.locked_tensor(1000, torch.bfloat16)
    assert tensor.dtype == torch.bfloat16 and tensor.numel() == 1000 and tensor.data_ptr() % 4096 == 0
    status = tensorio.lock_status(tensor)
    assert status in ("mlocked", "cuda-registered") or status.startswith("not locked: ")
    assert tensorio.lock_status(torch.empty(3)).startswith("not locked")
