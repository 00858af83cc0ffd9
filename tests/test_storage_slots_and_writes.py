"""offload.storage's two shared mechanisms: the slotted region (A/B slots, commit, rollback) that parameter
partitions and optimizer state both use, and the bounded write queue every swap-file writer uses."""

from __future__ import annotations

import concurrent.futures
import errno

import pytest
import torch

from offload.storage.slotted import SlottedRegion
from offload.storage.swapfile import SwapFile
from offload.storage.write_queue import WriteQueue
from tensorio import AioConfig, TensorIOError, aligned_tensor

N = 3000  # elements: not a whole page, so the slots are padded


def _values(fill: float) -> torch.Tensor:
    values = aligned_tensor(N, torch.float32)
    values.copy_(torch.arange(N, dtype=torch.float32) + fill)
    return values


def _read(region: SlottedRegion, pair) -> torch.Tensor:
    buffer, future = region.read_new(pair, N, torch.float32)
    future.result()
    return buffer


@pytest.fixture
def region(disk_dir):
    swap = SwapFile(disk_dir, AioConfig(), kind="params")
    yield SlottedRegion(swap)
    swap.close()


def test_a_committed_step_reads_back_its_bytes_and_a_fresh_pair_holds_zeros(region):
    first, second = region.add(N * 4), region.add(N * 4)
    assert not first.holds_values and first.slot_bytes % 4096 == 0 and second.offset == first.offset + 2 * first.slot_bytes
    region.write_in_place(first, _values(0.0)).result()
    region.stage(first, _values(1.0)).result()
    assert torch.equal(_read(region, first), _values(1.0))  # reads take the staged slot at once
    region.commit()
    assert not first.staged and first.committed == 1 and not second.holds_values
    assert torch.equal(_read(region, first), _values(1.0))
    # The next step writes the other slot: the one committed before.
    region.stage(second, _values(2.0)).result()
    assert second.staged and region.staged
    region.commit()
    assert torch.equal(_read(region, second), _values(2.0)) and torch.equal(_read(region, first), _values(1.0))


def test_rollback_restores_the_last_committed_slot(region):
    pair = region.add(N * 4)
    region.write_in_place(pair, _values(0.0)).result()
    region.stage(pair, _values(1.0)).result()
    region.commit()
    region.stage(pair, _values(2.0)).result()
    with pytest.raises(RuntimeError, match="not committed yet"):
        pair.spare_offset()  # a gradient may not go where a staged update is
    assert region.rollback() == [pair] and not region.staged
    assert torch.equal(_read(region, pair), _values(1.0))
    assert pair.spare_offset() == pair.slot_offset(1 - pair.committed)
    assert region.rollback() == []


class _Fault:
    """A future that has failed (as an IOFuture whose write hit EIO)."""

    def __init__(self, message: str) -> None:
        self.error = TensorIOError(errno.EIO, message, path="swap", offset=0, length=4)

    def done(self) -> bool:
        return True

    def exception(self) -> BaseException:
        return self.error


def _pending() -> concurrent.futures.Future:
    return concurrent.futures.Future()


def test_the_first_error_is_kept_and_raised_on_drain_after_every_write():
    queue = WriteQueue()
    late = _pending()
    first, second = _Fault("first"), _Fault("second")
    queue.push(first, "a")
    queue.push(second, "b")
    queue.push(late, "c")
    assert [item for item, _ in queue.reap()] == ["a", "b"] and len(queue) == 1  # reap never waits
    late.set_result(4)
    with pytest.raises(TensorIOError, match="first"):
        queue.drain()
    assert len(queue) == 0  # waited for every write before raising
    assert queue.drain() == []  # the error was raised once


def test_trim_bounds_the_writes_in_flight_and_raises_what_it_waited_for():
    queue = WriteQueue()
    done = [_pending() for _ in range(3)]
    for i, future in enumerate(done):
        future.set_result(i)
        queue.push(future, i)
    queue.trim(1)
    assert len(queue) == 1 and queue.drain() == [2]
    queue.push(_Fault("oldest"), "x")
    queue.push(_pending(), "y")
    with pytest.raises(TensorIOError, match="oldest"):
        queue.trim(1)
    assert queue.take_error() is None


def test_abort_leaves_nothing_half_written_to_be_read_as_good(region):
    """A step's staged writes, one of them failed: abort waits for all (errors dropped) and the rollback
    makes reads take the committed values again, whole."""
    pairs = [region.add(N * 4) for _ in range(3)]
    for pair in pairs:
        region.write_in_place(pair, _values(0.0)).result()
    queue = WriteQueue()
    staged = [_values(5.0) for _ in pairs]
    queue.push(region.stage(pairs[0], staged[0]), pairs[0])
    region.stage_offset(pairs[1])
    queue.push(_Fault("disk gone"), pairs[1])  # a write that failed part way
    queue.push(region.stage(pairs[2], staged[2]), pairs[2])
    assert queue.abort() == pairs and len(queue) == 0 and queue.take_error() is None
    assert region.rollback() == pairs
    for pair in pairs:
        assert torch.equal(_read(region, pair), _values(0.0))


def test_several_requests_land_as_one_write_and_a_write_can_be_taken_out():
    """A sub-group's regions are written by several requests: the write is done when all are, and waiting
    for it gives the first failure; its owner may take it out of the queue to wait for it itself."""
    queue = WriteQueue()
    parts = [_pending(), _pending()]
    queue.push(parts, "sub-group 0")
    queue.push(_pending(), "sub-group 1")
    parts[0].set_result(8)
    assert queue.reap() == []  # half written is not written
    parts[1].set_exception(TensorIOError(errno.EIO, "region 1", path="swap", offset=8, length=8))
    assert [(item, str(error)) for item, error in queue.reap()] == [("sub-group 0", str(parts[1].exception()))]
    queue.remove("sub-group 1")
    with pytest.raises(ValueError, match="no write"):
        queue.remove("sub-group 1")
    with pytest.raises(TensorIOError, match="region 1"):
        queue.drain()
