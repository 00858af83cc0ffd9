"""tensorio.BufferPool: buffers handed out again only once nothing refers to them, within a byte cap."""

from __future__ import annotations

import mmap

import pytest
import torch

import tensorio

PAGE = mmap.PAGESIZE


def test_a_dropped_buffer_is_handed_out_again():
    pool = tensorio.BufferPool(1 << 20)
    first = pool.take(1000, torch.float32)
    address = first.data_ptr()
    first.fill_(7.0)
    del first
    again = pool.take(1000, torch.float32)
    assert again.data_ptr() == address
    assert pool.reused == 1
    assert again.dtype == torch.float32 and again.shape == (1000,)
    assert address % PAGE == 0


def test_a_buffer_in_use_is_never_handed_out_twice():
    pool = tensorio.BufferPool(1 << 20)
    held = pool.take(1000, torch.float32)
    other = pool.take(1000, torch.float32)
    assert other.data_ptr() != held.data_ptr()
    assert pool.reused == 0


def test_a_view_keeps_its_buffer_in_use():
    pool = tensorio.BufferPool(1 << 20)
    buffer = pool.take(4096, torch.uint8)
    address = buffer.data_ptr()
    view = buffer[100:200].view(torch.int32)
    del buffer
    assert pool.take(4096, torch.uint8).data_ptr() != address
    del view
    assert pool.take(4096, torch.uint8).data_ptr() == address


def test_a_buffer_being_read_into_is_not_reused_until_the_read_is_done(tmp_path):
    path = tmp_path / "data.bin"
    payload = torch.arange(1 << 18, dtype=torch.int32)
    path.write_bytes(payload.numpy().tobytes())
    pool = tensorio.BufferPool(4 << 20)
    with tensorio.AioHandle() as handle:
        buffer = pool.take(payload.numel(), torch.int32)
        address = buffer.data_ptr()
        future = handle.read(buffer, str(path))
        del buffer  # the request still holds it
        other = pool.take(payload.numel(), torch.int32)
        assert other.data_ptr() != address
        future.result()
        del future
    again = pool.take(payload.numel(), torch.int32)  # done: free again, holding what was read
    assert again.data_ptr() == address
    assert torch.equal(again, payload)


def test_sizes_are_matched_in_whole_pages():
    pool = tensorio.BufferPool(1 << 20)
    first = pool.take(PAGE - 10, torch.uint8)
    address = first.data_ptr()
    del first
    second = pool.take(PAGE // 4, torch.float32)  # the same single page
    assert second.data_ptr() == address and second.numel() == PAGE // 4
    del second
    assert pool.take(PAGE + 1, torch.uint8).data_ptr() != address  # two pages: another buffer


def test_the_cap_bounds_what_the_pool_keeps():
    pool = tensorio.BufferPool(2 * PAGE)
    outside = pool.take(3 * PAGE, torch.uint8)  # more than the cap: made outside the pool
    assert pool.held_bytes == 0
    assert outside.data_ptr() % PAGE == 0 and outside.numel() == 3 * PAGE
    held = pool.take(PAGE, torch.uint8)
    assert pool.held_bytes == PAGE
    big = pool.take(2 * PAGE, torch.uint8)  # the page in use cannot be freed: outside again
    assert pool.held_bytes == PAGE
    del held, big
    pooled = pool.take(2 * PAGE, torch.uint8)  # the idle page is freed to make room
    assert pool.held_bytes == 2 * PAGE
    del pooled
    small = pool.take(PAGE, torch.uint8)  # the idle two pages make room for one
    assert pool.held_bytes == PAGE and pool.reused == 0
    assert small.numel() == PAGE


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError, match="max_bytes"):
        tensorio.BufferPool(-1)
    with pytest.raises(ValueError, match="num_elem"):
        tensorio.BufferPool(PAGE).take(-1)


def test_without_reference_counts_every_buffer_is_new(monkeypatch):
    monkeypatch.setattr(tensorio._pool, "_use_count", None)  # a torch without the private call
    pool = tensorio.BufferPool(1 << 20)
    first = pool.take(1000, torch.float32)
    first_address = first.data_ptr()
    second = pool.take(1000, torch.float32)
    assert second.data_ptr() != first_address and second.numel() == 1000
    assert pool.reused == 0 and pool.held_bytes == 0
