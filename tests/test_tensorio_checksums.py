"""tensorio's checksums: a write's ``checksum=`` chunks hash what is on the disk (checked against an
independent read of the file), a read's ``verify=`` passes good bytes, reads a flipped chunk once more
and raises ChecksumError naming it when it stays wrong, and bad arguments are refused before any I/O."""

from __future__ import annotations

import logging
import threading

import pytest
import torch
import xxhash

import tensorio
from tensorio import AioHandle, ChecksumError, Checksums, TensorIOError
from tensorio.testing import FlipBit, flip_bit, inject_faults


@pytest.fixture(params=["threads", "io_uring", "io_uring-buffered"])
def handle(request):
    backend, _, buffered = request.param.partition("-")  # buffered: every piece through the page cache
    if backend == "io_uring" and not tensorio.probe_io_uring()[0]:
        pytest.skip(f"io_uring cannot run here: {tensorio.probe_io_uring()[1]}")
    with AioHandle(block_size=1 << 16, queue_depth=4, backend=backend, direct=False if buffered else "auto") as h:
        yield h


@pytest.mark.parametrize("nbytes,chunk,offset", [(1, 1, 0), (4095, 1000, 4096), (4096 * 10 + 1, 4096, 13),
                                                (3 << 20, 1 << 20, 0)])
def test_write_checksums_hash_the_bytes_on_disk(handle, disk_dir, nbytes, chunk, offset):
    path = disk_dir / "f.bin"
    data = tensorio.aligned_tensor(nbytes, torch.uint8).random_(0, 256)
    future = handle.write(data, path, offset, checksum=chunk)
    assert future.result() == nbytes
    sums = future.checksums
    on_disk = path.read_bytes()[offset:offset + nbytes]
    assert sums == Checksums(tuple(xxhash.xxh3_64_intdigest(on_disk[i:i + chunk]) for i in range(0, nbytes, chunk)),
                             chunk, nbytes)
    back = torch.empty_like(data)
    assert handle.read(back, path, offset, verify=sums).result() == nbytes
    assert torch.equal(back, data)


def test_a_flipped_bit_is_named_and_a_transient_one_is_read_again(handle, disk_dir, caplog):
    path = disk_dir / "f.bin"
    data = tensorio.aligned_tensor(3 << 16, torch.uint8).random_(0, 256)
    written = handle.write(data, path, 0, checksum=1 << 16)
    written.result()
    sums = written.checksums
    back = torch.empty_like(data)
    with caplog.at_level(logging.WARNING, logger="tensorio"), inject_faults(FlipBit(transient=True, byte=70000)):
        handle.read(back, path, 0, verify=sums, what="chunk test").result()
    assert torch.equal(back, data) and "the second read is good" in caplog.text
    flip = FlipBit(byte=(2 << 16) + 5, bit=7)
    with inject_faults(flip), pytest.raises(ChecksumError) as raised:
        handle.read(back, path, 0, verify=sums, what="chunk test").result()
    error = raised.value
    assert (error.path, error.offset, error.length, error.what) == (str(path), 2 << 16, 1 << 16, "chunk test")
    assert error.expected == sums.values[2] != error.actual == xxhash.xxh3_64_intdigest(path.read_bytes()[2 << 16:])
    assert isinstance(error, TensorIOError) and str(error).startswith("checksum mismatch (chunk test): ")
    assert f"expected {error.expected:016x}, read {error.actual:016x} twice" in str(error)
    assert flip.flipped == [(str(path), (2 << 16) + 5)]


def test_verify_a_range_inside_a_larger_read(handle, disk_dir):
    path = disk_dir / "f.bin"
    data = tensorio.aligned_tensor(3 * 4096, torch.uint8).random_(0, 256)
    handle.write(data, path, 0).result()
    inner = tensorio.checksum_chunks(memoryview(data.numpy()), 1000, start=100, nbytes=5000)
    handle.read(torch.empty_like(data), path, 0, verify=inner).result()
    with inject_faults(FlipBit(byte=3000)), pytest.raises(ChecksumError) as raised:
        handle.read(torch.empty_like(data), path, 0, verify=inner).result()
    assert (raised.value.offset, raised.value.length) == (2100, 1000)
    flip_bit(path, 3000)  # put back
    with inject_faults(FlipBit(byte=9000)):  # outside the verified range: not checked
        handle.read(torch.empty_like(data), path, 0, verify=inner).result()


def test_bad_checksum_arguments_are_refused_before_any_io(handle, disk_dir):
    path = disk_dir / "f.bin"
    data = torch.zeros(100, dtype=torch.uint8)
    for bad in (0, -1, True, 1.5):
        with pytest.raises(ValueError, match="checksum is a chunk size in bytes"):
            handle.write(data, path, checksum=bad)
    with pytest.raises(ValueError, match="verify must be Checksums of a range inside the 100-byte buffer"):
        handle.read(data, path, verify=Checksums((1, 2), 64, 128))
    with pytest.raises(ValueError, match="3 values for 100 bytes in chunks of 64"):
        Checksums((1, 2, 3), 64, 100)
    assert not path.exists()


def test_landed_ranges_in_any_order_hash_as_each_chunk_at_once():
    """`LandingHashes` feeds each chunk its bytes in order whatever order the ranges land in (pieces that
    cross chunks, a range ahead of its chunk's next byte waiting for the bytes before it)."""
    import random

    from tensorio._landing import LandingHashes

    data = memoryview(bytes(random.Random(1).randbytes(10_000)))
    start, chunk, nbytes = 100, 1500, 9000
    hashes = LandingHashes(data, chunk, nbytes, start)
    pieces = [(first, min(first + 700, 10_000)) for first in range(0, 10_000, 700)]
    random.Random(2).shuffle(pieces)
    fed = []
    for first, end in pieces:
        for index in hashes.land(first, end):
            while (taken := hashes.take(index)) is not None:
                fed.append(taken)
                hashes.feed(index, *taken)
    expected = tensorio.checksum_chunks(data, chunk, start, nbytes)
    assert tuple(hashes.values) == expected.values
    assert sorted(fed) == sorted(set(fed)) and sum(end - first for first, end in fed) == nbytes


def test_checksum_work_is_done_piece_by_piece_as_the_bytes_land(handle, disk_dir, monkeypatch):
    """A checksummed request's chunks are hashed (write) or verified (read) as its pieces land, in the I/O
    threads, not as one hash of each whole chunk after the last byte: every byte is hashed once, in more
    ranges than there are chunks, and `close` returns with every future resolved."""
    from tensorio._landing import LandingHashes

    fed = []
    real = LandingHashes.feed

    def recorded(self, index, first, end):
        fed.append((threading.current_thread().name, end - first))
        return real(self, index, first, end)
    monkeypatch.setattr(LandingHashes, "feed", recorded)
    path = disk_dir / "f.bin"
    data = tensorio.aligned_tensor(4 << 20, torch.uint8).random_(0, 256)
    written = handle.write(data, path, 0, checksum=1 << 20)
    assert written.result() == 4 << 20
    assert written.checksums == tensorio.checksum_chunks(memoryview(data.numpy()), 1 << 20)
    backs = [torch.empty_like(data) for _ in range(4)]
    futures = [handle.read(back, path, 0, verify=written.checksums) for back in backs]
    handle.close()
    assert all(future.done() for future in futures) and [f.result() for f in futures] == [4 << 20] * 4
    assert all(torch.equal(back, data) for back in backs)
    assert sum(size for _, size in fed) == 5 * (4 << 20)  # the write's bytes and each read's, once
    assert len(fed) >= 2 * 5 * 4  # 20 chunks of 16 pieces, fed a few pieces at a time (not whole, after the fact)
    assert all(name.startswith("tensorio-") for name, _ in fed), {name for name, _ in fed}


def test_a_failing_hash_fails_its_request_and_hangs_nothing(handle, disk_dir, monkeypatch):
    """An exception inside the hashing of landed bytes fails that request with a TensorIOError naming it
    (the future resolves, the handle goes on serving others)."""
    from tensorio._landing import LandingHashes

    path = disk_dir / "f.bin"
    data = tensorio.aligned_tensor(1 << 20, torch.uint8).random_(0, 256)
    written = handle.write(data, path, 0, checksum=1 << 18)
    written.result()

    def broken(self, index, first, end):
        raise MemoryError("no room to hash")
    monkeypatch.setattr(LandingHashes, "feed", broken)
    with pytest.raises(TensorIOError, match="checksum failed .*no room to hash") as raised:
        handle.read(torch.empty_like(data), path, 0, verify=written.checksums).result(timeout=60)
    assert raised.value.path == str(path)
    monkeypatch.undo()
    back = torch.empty_like(data)
    assert handle.read(back, path, 0, verify=written.checksums).result(timeout=60) == 1 << 20
    assert torch.equal(back, data)


def test_checksum_totals_count_every_byte_hashed_and_its_cpu_time(handle, disk_dir):
    """`tensorio.checksum_totals` grows by the bytes a checksummed write and a verified read hash (not by
    a plain transfer's), with the CPU time they took."""
    path = disk_dir / "f.bin"
    data = tensorio.aligned_tensor(2 << 20, torch.uint8).random_(0, 256)
    before = tensorio.checksum_totals()
    handle.write(data, path, 0).result()
    handle.read(torch.empty_like(data), path, 0).result()
    assert tensorio.checksum_totals() == before
    written = handle.write(data, path, 0, checksum=1 << 20)
    written.result()
    handle.read(torch.empty_like(data), path, 0, verify=written.checksums).result()
    after = tensorio.checksum_totals()
    assert after.nbytes - before.nbytes == 2 * (2 << 20) and after.cpu_seconds > before.cpu_seconds
