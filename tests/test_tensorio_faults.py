"""tensorio.testing: faults injected where the backend takes requests reach tensorio's real error paths."""

from __future__ import annotations

import errno
import threading

import pytest
import torch

import tensorio
from tensorio import AioHandle, TensorIOError
from tensorio._threads import ThreadBackend
from tensorio._uring import UringBackend
from tensorio.testing import Delay, Fail, FailNth, RequestInfo, ShortTransfer, inject_faults


@pytest.fixture(params=["threads", "io_uring"])
def handle(request):
    if request.param == "io_uring" and not tensorio.probe_io_uring()[0]:
        pytest.skip(f"io_uring unavailable: {tensorio.probe_io_uring()[1]}")
    with AioHandle(block_size=8192, queue_depth=4, backend=request.param) as h:
        yield h


def pattern(numel: int, seed: int = 0) -> torch.Tensor:
    return torch.arange(seed, seed + numel, dtype=torch.int64).remainder(251).to(torch.uint8)


def step(handle, directory) -> None:
    """Four writes and a read, as a piece of training code would issue them."""
    futures = [handle.write(pattern(20000, i), directory / f"s{i}.bin", 4096 * i) for i in range(4)]
    for f in futures:
        f.result()
    handle.read(torch.empty(20000, dtype=torch.uint8), directory / "s1.bin", 4096).result()


def test_count_the_requests_of_a_step(disk_dir, handle):
    with inject_faults() as faults:
        step(handle, disk_dir)
        handle.write(torch.empty(0), disk_dir / "empty.bin").result()  # no bytes: not a request
    assert faults.count == 5
    assert faults.requests[0] == RequestInfo("write", str(disk_dir / "s0.bin"), 0, 20000)
    assert faults.requests[4] == RequestInfo("read", str(disk_dir / "s1.bin"), 4096, 20000)


def test_enospc_on_the_nth_write(disk_dir, handle):
    rule = FailNth(3, errno.ENOSPC, op="write")
    with inject_faults(rule):
        futures = [handle.write(pattern(10000), disk_dir / f"w{i}.bin", 100) for i in range(5)]
        errors = [f.exception() for f in futures]
    assert [e is None for e in errors] == [True, True, False, True, True]
    err = errors[2]
    assert isinstance(err, TensorIOError) and err.errno == errno.ENOSPC
    assert err.path == str(disk_dir / "w2.bin") and err.offset == 100
    assert f"write failed: {disk_dir / 'w2.bin'} at offset 100" in str(err) and "the disk is full" in str(err)
    assert (rule.matched, rule.hits) == (5, 1)


def test_each_request_of_a_step_fails_in_turn(disk_dir, handle):
    with inject_faults() as counted:
        step(handle, disk_dir)
    for n in range(1, counted.count + 1):
        with inject_faults(FailNth(n, errno.EIO)):
            with pytest.raises(TensorIOError) as info:
                step(handle, disk_dir)
        seen = counted.requests[n - 1]
        assert (info.value.errno, info.value.path, info.value.offset) == (errno.EIO, seen.path, seen.offset)
        assert "the device reported an I/O error" in str(info.value)


def test_every_request_on_matching_paths_fails_through_wait(disk_dir, handle):
    rule = Fail(errno.EIO, path=lambda p: p.endswith("bad.bin"))
    with inject_faults(rule):
        assert handle.async_pwrite(pattern(5000), str(disk_dir / "good.bin")) == 0
        assert handle.async_pwrite(pattern(5000), str(disk_dir / "bad.bin")) == 0
        with pytest.raises(TensorIOError) as info:
            handle.wait()
        assert info.value.path == str(disk_dir / "bad.bin")
        with pytest.raises(TensorIOError):
            handle.sync_pread(torch.empty(10, dtype=torch.uint8), str(disk_dir / "bad.bin"))
    assert rule.hits == 2
    assert (disk_dir / "good.bin").read_bytes() == pattern(5000).numpy().tobytes()


def test_a_failed_piece_moves_no_data(disk_dir, handle):
    with inject_faults(FailNth(1, errno.ENOSPC)):
        with pytest.raises(TensorIOError):
            handle.write(pattern(4096), disk_dir / "nothing.bin").result()
    assert (disk_dir / "nothing.bin").read_bytes() == b""  # created by the open, never written


@pytest.mark.parametrize("nbytes", [None, 1000])
def test_short_transfers_are_continued(disk_dir, handle, nbytes):
    data = tensorio.locked_tensor(5 * 8192 + 77, torch.uint8)
    data.copy_(pattern(data.numel(), 3))
    path = disk_dir / "short.bin"
    rule = ShortTransfer(nbytes=nbytes)
    with inject_faults(rule):
        assert handle.write(data, path, 4096).result() == data.numel()
        back = torch.empty_like(data)
        assert handle.read(back, path, 4096).result() == data.numel()
    assert rule.hits == 2
    assert path.read_bytes()[4096:] == data.numpy().tobytes()  # an independent reader
    assert torch.equal(back, data)


def test_a_delayed_request_completes_once_the_event_is_set(disk_dir, handle):
    release = threading.Event()
    with inject_faults(Delay(release, path=lambda p: p.endswith("slow.bin"))):
        slow = handle.write(pattern(50000), disk_dir / "slow.bin")
        fast = handle.write(pattern(50000), disk_dir / "fast.bin")
        assert fast.result(timeout=30) == 50000
        with pytest.raises(TimeoutError):
            slow.result(timeout=0.2)
        assert not (disk_dir / "slow.bin").stat().st_size  # not started: no data moved yet
        release.set()
        assert slow.result(timeout=30) == 50000
    assert (disk_dir / "slow.bin").read_bytes() == pattern(50000).numpy().tobytes()


def test_held_requests_are_released_by_close_and_by_the_end_of_the_injection(disk_dir, handle):
    never = threading.Event()
    with AioHandle(backend="threads") as other:
        with inject_faults(Delay(never)):
            held = handle.write(pattern(100), disk_dir / "a.bin")
            other_held = other.write(pattern(100), disk_dir / "b.bin")
            other.close()  # close() finishes every started request
            assert other_held.done() and not held.done()
        assert held.result(timeout=30) == 100


def test_handles_made_before_the_injection_are_covered_and_the_patch_is_removed(disk_dir, handle):
    originals = (ThreadBackend.submit, UringBackend.submit, ThreadBackend.close, UringBackend.close)
    with inject_faults(FailNth(1)) as outer:
        with inject_faults() as inner:
            with pytest.raises(TensorIOError):
                handle.write(pattern(10), disk_dir / "x.bin").result()
    assert outer.count == inner.count == 1
    assert (ThreadBackend.submit, UringBackend.submit, ThreadBackend.close, UringBackend.close) == originals
    assert handle.write(pattern(10), disk_dir / "x.bin").result() == 10


@pytest.mark.parametrize(
    "make, words",
    [
        (lambda: FailNth(0), "counts requests from 1"),
        (lambda: Fail(errno=0), "positive error number"),
        (lambda: Fail(op="append"), "op must be"),
        (lambda: ShortTransfer(nbytes=0), "nbytes must be"),
    ],
)
def test_bad_rules_are_refused(make, words):
    with pytest.raises(ValueError, match=words):
        make()
    with pytest.raises(TypeError, match="inject_faults takes"):
        with inject_faults("FailNth(1)"):
            pass
