"""tensorio's host buffers: the huge-page hint on large ones, and faulting memory in ahead (`prefault`)."""

from __future__ import annotations

import os

import psutil
import pytest
import torch

import tensorio

MiB = 1 << 20


def _vm_flags(address: int) -> list[str]:
    """The VmFlags of the mapping of this process that holds ``address``."""
    inside = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                start, end = (int(x, 16) for x in head.split("-"))
                inside = start <= address < end
            elif inside and head == "VmFlags:":
                return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.skipif(not os.path.exists("/sys/kernel/mm/transparent_hugepage/enabled"),
                    reason="the kernel has no transparent huge pages")
def test_large_buffers_ask_for_huge_pages_small_ones_do_not():
    large = tensorio.aligned_tensor(4 * MiB, torch.uint8)
    small = tensorio.aligned_tensor(64 * 1024, torch.uint8)
    assert "hg" in _vm_flags(large.data_ptr())
    assert "hg" not in _vm_flags(small.data_ptr())


def test_prefault_makes_memory_resident_and_keeps_its_bytes():
    tensor = tensorio.aligned_tensor(64 * MiB, torch.uint8)
    tensor[:10] = 7
    before = psutil.Process().memory_info().rss
    assert tensorio.prefault(tensor) is True
    assert psutil.Process().memory_info().rss - before >= 60 * MiB
    assert int(tensor[:10].sum()) == 70 and int(tensor[10:].count_nonzero()) == 0


def test_prefault_shares_a_range_among_threads():
    tensor = tensorio.aligned_tensor(200 * MiB, torch.uint8)
    before = psutil.Process().memory_info().rss
    assert tensorio.prefault(tensor, MiB, 199 * MiB, threads=3) is True  # 50 pieces, three threads
    assert psutil.Process().memory_info().rss - before >= 190 * MiB
    with pytest.raises(ValueError, match="threads must be >= 1, got 0"):
        tensorio.prefault(tensor, threads=0)


def test_prefault_holds_the_memory_map_a_few_mib_at_a_time(monkeypatch):
    """The kernel holds the process's memory map through each MADV_POPULATE_WRITE call, and every
    other thread's mmap/munmap waits for it: no call may cover more than 4 MiB (docs/tensorio.md)."""
    from tensorio import _buffers

    calls = []
    real = _buffers._libc.madvise

    def madvise(address, length, advice):
        calls.append((address, length))
        return real(address, length, advice)

    monkeypatch.setattr(_buffers._libc, "madvise", madvise)
    tensor = tensorio.aligned_tensor(40 * MiB, torch.uint8)
    base = tensor.data_ptr()
    assert tensorio.prefault(tensor, 0, 37 * MiB + 5) is True
    assert max(length for _, length in calls) <= 4 * MiB
    covered = sorted((address - base, address - base + length) for address, length in calls)
    assert covered[0][0] == 0 and covered[-1][1] >= 37 * MiB + 5
    assert all(stop >= start for (_, stop), (start, _) in zip(covered, covered[1:]))  # no gap


def test_locked_buffers_are_resident_and_zero():
    before = psutil.Process().memory_info().rss
    locked = tensorio.locked_tensor(128 * MiB, torch.uint8)
    assert psutil.Process().memory_info().rss - before >= 120 * MiB
    assert int(locked.count_nonzero()) == 0
    tensorio.free_locked_tensor(locked)


def test_prefault_takes_a_byte_range_and_refuses_one_outside_the_tensor():
    tensor = tensorio.aligned_tensor(1 * MiB, torch.float32)  # 4 MiB of storage
    assert tensorio.prefault(tensor, 4096 * 3 + 1, 4096 * 5) is True
    assert tensorio.prefault(tensor, 100, 100) is True
    with pytest.raises(ValueError, match=r"range \[10, 5\) outside the tensor's 4194304 bytes"):
        tensorio.prefault(tensor, 10, 5)
    with pytest.raises(ValueError, match=r"range \[0, 4194305\)"):
        tensorio.prefault(tensor, 0, 4 * MiB + 1)


def test_a_locked_buffer_can_go_while_its_thread_holds_the_status_lock():
    """A garbage collection inside a locked section runs buffers' finalizers on that thread: the
    lock they take must be re-entrant (a plain lock hung the test suite)."""
    from tensorio import _buffers

    table = _buffers.lock_table
    buffer = tensorio.locked_tensor(4096)
    ptr = buffer.data_ptr()
    with table.lock:
        assert table.lock.acquire(blocking=False)  # what the finalizer does, on this thread
        table.lock.release()
        del buffer  # its finalizer runs here
        assert table.get(ptr) is None


def test_a_buffer_mapped_at_a_freed_buffers_address_stays_registered():
    """CPython unmaps a buffer's memory before its finalizer runs (with the GIL released), so another
    thread's new locked buffer can take the address first: the old finalizer leaves the new entry."""
    import gc

    from tensorio import _buffers

    old = tensorio.locked_tensor(4096)
    ptr, nbytes = old.data_ptr(), old.untyped_storage().nbytes()
    newer = ("not locked: a buffer registered at this address after the old one was unmapped", nbytes)
    _buffers.lock_table.add(ptr, newer)  # what the other thread's locked_tensor did
    del old
    gc.collect()
    try:
        assert _buffers.lock_table.get(ptr) is newer
    finally:
        _buffers.lock_table.pop(ptr)
