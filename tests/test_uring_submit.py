"""The io_uring backend's submission through liburing's C function (`RingSubmit`, GIL released)."""

from __future__ import annotations

import threading

import pytest
import torch

import tensorio
from tensorio import AioHandle

if not tensorio.probe_io_uring()[0]:
    pytest.skip(f"io_uring unavailable: {tensorio.probe_io_uring()[1]}", allow_module_level=True)

import liburing as L  # noqa: E402  (after the probe: the package may be missing)

from tensorio._uring import RingSubmit  # noqa: E402


@pytest.fixture
def ring():
    ring = L.Ring()
    L.io_uring_queue_init(8, ring)
    yield ring
    L.io_uring_queue_exit(ring)


def test_submit_hands_every_prepared_entry_to_the_kernel(ring):
    submit = RingSubmit(L, ring)
    for batch in ([11, 12, 13], [21], [31, 32, 33, 34, 35, 36, 37, 38]):
        for tag in batch:
            sqe = L.io_uring_get_sqe(ring)
            L.io_uring_prep_nop(sqe)
            L.io_uring_sqe_set_data64(sqe, tag)
        assert submit() == len(batch)
        cqe, seen = L.Cqe(), []
        for _ in batch:
            L.io_uring_wait_cqe(ring, cqe)
            seen.append(cqe[0].user_data)
            assert cqe[0].res == 0
            L.io_uring_cqe_seen(ring, cqe[0])
        assert sorted(seen) == batch
    assert submit() == 0  # nothing prepared: nothing submitted


def test_an_uninitialised_ring_is_refused():
    with pytest.raises(RuntimeError, match="Ring layout"):
        RingSubmit(L, L.Ring())


@pytest.mark.parametrize("single_submit", [False, True])
def test_bytes_equal_with_python_threads_competing(disk_dir, single_submit):
    # Many small pieces over two rings (hundreds of submissions) while two threads run Python bytecode
    # all along, so that the workers take and drop the GIL around every submission.
    stop = threading.Event()
    spins = [0, 0]

    def spin(i: int) -> None:
        while not stop.is_set():
            spins[i] += 1

    busy = [threading.Thread(target=spin, args=(i,)) for i in range(2)]
    for thread in busy:
        thread.start()
    gen = torch.Generator().manual_seed(5)
    tensors = [torch.randint(0, 256, (40000 + 4097 * i,), dtype=torch.uint8, generator=gen) for i in range(16)]
    try:
        with AioHandle(block_size=4096, queue_depth=4, thread_count=2, single_submit=single_submit,
                       backend="io_uring") as handle:
            writes = [handle.write(t, disk_dir / f"f{i % 3}.bin", (i // 3) * 200704) for i, t in enumerate(tensors)]
            assert [w.result() for w in writes] == [t.numel() for t in tensors]
            backs = [torch.zeros_like(t) for t in tensors]
            reads = [handle.read(b, disk_dir / f"f{i % 3}.bin", (i // 3) * 200704) for i, b in enumerate(backs)]
            assert [r.result() for r in reads] == [t.numel() for t in tensors]
    finally:
        stop.set()
        for thread in busy:
            thread.join()
    for i, (tensor, back) in enumerate(zip(tensors, backs)):
        with open(disk_dir / f"f{i % 3}.bin", "rb") as f:  # independent reader
            f.seek((i // 3) * 200704)
            assert f.read(tensor.numel()) == tensor.numpy().tobytes()
        assert torch.equal(back, tensor)
    assert min(spins) > 0


def test_the_next_pieces_go_in_before_the_completions_are_reaped(disk_dir, monkeypatch):
    """When completions are posted, the worker first fills and submits the slots they free (O_DIRECT
    pieces of the request under way), then reaps them: the disk is not left idle behind the bookkeeping.
    Bytes equal both ways, and the ring never holds more pieces than twice its depth."""
    from tensorio import _uring

    prefilled, most = [], [0]
    fill, reap = _uring._Worker._fill, _uring._Worker._reap

    def counted_fill(self, freed=0, *, spans_only=False):
        pushed = fill(self, freed, spans_only=spans_only)
        if spans_only:
            prefilled.append(pushed)
        most[0] = max(most[0], self._inflight)
        return pushed

    def checked_reap(self):
        most[0] = max(most[0], self._inflight)
        return reap(self)
    monkeypatch.setattr(_uring._Worker, "_fill", counted_fill)
    monkeypatch.setattr(_uring._Worker, "_reap", checked_reap)
    data = tensorio.aligned_tensor(8 << 20, torch.uint8).random_(0, 256)
    back = torch.empty_like(data)
    with AioHandle(block_size=16 << 10, queue_depth=8, backend="io_uring") as handle:
        handle.write(data, disk_dir / "f.bin", 0).result()
        handle.read(back, disk_dir / "f.bin", 0).result()
    assert torch.equal(back, data)
    assert sum(prefilled) > 0  # pieces went in ahead of a reap
    assert most[0] <= 2 * 8
