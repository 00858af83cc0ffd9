"""The checkpoint save's O_DIRECT writes and the verified load's read-ahead.

The writer (`SafetensorsWriter` with a tensorio handle) must write the bytes the buffered writer writes, with
the same checksums, whatever the sizes (1, 4095, 4096 * 10 + 1 bytes: a last partial page) and the order of
the runs; fall back to the buffered way, saying why, where O_DIRECT is refused; name the file when a write
fails. The engine's save writes the same files either way, and a failed write leaves the previous checkpoint.
The load keeps several partitions and optimizer ranges in flight (`ReadAhead`), counted, not timed, and
writes each on-disk partition to its staged slot from the buffer it was read into.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import random

import pytest
import torch
from safetensors import safe_open

from offload.storage import LATEST, SafetensorsWriter
from offload.storage import direct_writes
from offload.storage.slotted import SlottedRegion
from offload.train.checkpoint import reader as reader_module
from offload.train.checkpoint.reader import PendingRead, ReadAhead
from offload.train.engine import initialize
from tensorio import AioHandle, TensorIOError
from tensorio.testing import Fail, inject_faults
from test_engine import engine_config, gpt2, gpt2_batches, gpt2_loss

SIZES = {"one": 1, "page_less_one": 4095, "pages_and_one": 4096 * 10 + 1, "empty": 0, "floats": 3001, "page": 4096}


def _layout_and_values():
    g = torch.Generator().manual_seed(0)
    layout, values = {}, {}
    for name, n in SIZES.items():
        dtype = torch.float32 if name == "floats" else torch.uint8
        layout[name] = (dtype, (n,))
        values[name] = torch.randn(n, generator=g) if dtype == torch.float32 else \
            torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)
    return layout, values


def _runs(values, shuffle):
    """Each tensor cut into a few runs (name, first, stop); all runs shuffled across tensors when ``shuffle``."""
    rng = random.Random(1)
    runs = []
    for name, tensor in values.items():
        n = tensor.numel()
        edges = [0, *sorted(rng.sample(range(1, n), min(3, n - 1))), n] if n > 1 else [0, n]
        runs += [(name, a, b) for a, b in zip(edges, edges[1:]) if b > a]
    if shuffle:
        rng.shuffle(runs)
    return runs


def _buffered_file(path, layout, values):
    with SafetensorsWriter(path, layout, {"k": "v"}, data_align=4096, checksums=True) as out:
        for name, tensor in values.items():
            out.write(name, tensor)
    return out.checksums


@pytest.mark.parametrize("shuffle", [False, True])
def test_direct_writes_make_the_buffered_writers_bytes_and_checksums(disk_dir, shuffle):
    layout, values = _layout_and_values()
    expected = _buffered_file(disk_dir / "buffered.safetensors", layout, values)
    with AioHandle(block_size=8192, queue_depth=4) as handle:
        with SafetensorsWriter(disk_dir / "direct.safetensors", layout, {"k": "v"}, data_align=4096, checksums=True,
                               handle=handle, preallocate=True) as out:
            staged = out._direct
            for name, first, stop in _runs(values, shuffle):
                source = values[name][first:stop].clone()
                out.write(name, source, first)
                source.fill_(0)  # the caller's buffer is free once write returns
    assert out.direct and out.buffered_reason is None
    assert staged.requests >= (1 if not shuffle else 4)
    written = (disk_dir / "direct.safetensors").read_bytes()  # an independent reader: the file's bytes
    assert written == (disk_dir / "buffered.safetensors").read_bytes()
    assert len(written) % 4096 != 0  # the last partial page was written in place
    assert out.checksums == expected
    with safe_open(disk_dir / "direct.safetensors", "pt") as file:
        assert file.metadata() == {"k": "v"}
        for name, tensor in values.items():
            assert torch.equal(file.get_tensor(name), tensor)


def test_small_chunks_keep_a_bounded_number_of_writes_in_flight(disk_dir):
    """`StagedWrites` with every chunk in flight: `put` waits for the oldest, whose chunk is then free again, and
    runs that follow each other share a chunk; the file's bytes are the runs'."""
    rng = random.Random(2)
    expected = bytes(rng.randrange(256) for _ in range(3 * 8192 + 4097))
    runs, at = [], 100
    while at < len(expected):  # runs back to back from an unaligned offset, with a gap at [5000, 5100)
        stop = min(len(expected), at + rng.randrange(1, 9000), 5000 if at < 5000 else len(expected))
        runs.append((at, stop))
        at = 5100 if stop == 5000 else stop
    path = disk_dir / "staged.bin"
    with open(path, "wb") as file:
        file.truncate(len(expected))
    with AioHandle(block_size=4096, queue_depth=2) as handle:
        fd, reason = direct_writes.open_direct(str(path))
        assert fd is not None, reason
        staged = direct_writes.StagedWrites(handle, fd, str(path), chunk_bytes=8192, chunks=2)
        for first, stop in runs:
            staged.put(torch.frombuffer(bytearray(expected[first:stop]), dtype=torch.uint8), first)
        staged.finish()
    # [100, 5000) in one chunk; then chunks at 4096, 12288, 20480 and 28672 (the last byte: a partial page)
    assert staged.fd == -1 and staged.most_in_flight == 2 and staged.requests == 5
    assert path.read_bytes() == bytes(100) + expected[100:5000] + bytes(100) + expected[5100:]


def _refuse_direct_opens(monkeypatch):
    """The checkpoint's file system without O_DIRECT: O_DIRECT opens of its files fail with EINVAL, as there
    (the swap files, elsewhere, keep theirs)."""
    real = os.open

    def fake_open(path, flags, *args, **kwargs):
        if flags & os.O_DIRECT and os.fspath(path).endswith(".safetensors"):
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL), path)
        return real(path, flags, *args, **kwargs)
    monkeypatch.setattr(os, "open", fake_open)


def test_a_file_system_without_o_direct_takes_the_buffered_way_and_says_why(disk_dir, monkeypatch, caplog):
    layout, values = _layout_and_values()
    expected = _buffered_file(disk_dir / "buffered.safetensors", layout, values)
    _refuse_direct_opens(monkeypatch)
    with caplog.at_level(logging.DEBUG, logger="offload"), AioHandle() as handle:
        with SafetensorsWriter(disk_dir / "fallback.safetensors", layout, {"k": "v"}, data_align=4096,
                               checksums=True, handle=handle) as out:
            for name, first, stop in _runs(values, True):
                out.write(name, values[name][first:stop], first)
    assert not out.direct and "refuses O_DIRECT" in out.buffered_reason and "EINVAL" in out.buffered_reason
    assert "written through the page cache" in caplog.text and "fallback.safetensors" in caplog.text
    assert (disk_dir / "fallback.safetensors").read_bytes() == (disk_dir / "buffered.safetensors").read_bytes()
    assert out.checksums == expected


def test_a_failed_direct_write_names_the_file(disk_dir):
    layout, values = _layout_and_values()
    path = disk_dir / "full.safetensors"
    with AioHandle() as handle, inject_faults(Fail(errno.ENOSPC, op="write", path=lambda p: p.startswith("fd "))):
        with pytest.raises(TensorIOError) as caught:
            with SafetensorsWriter(path, layout, data_align=4096, handle=handle) as out:
                for name, tensor in values.items():
                    out.write(name, tensor)
    assert caught.value.errno == errno.ENOSPC and str(path) in str(caught.value) and "disk is full" in str(caught.value)
    assert out._fd == -1 and out._direct.fd == -1  # every descriptor closed


def test_preallocation_names_the_file_when_the_disk_is_full(disk_dir, monkeypatch):
    layout, _ = _layout_and_values()

    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(OSError) as caught:
        SafetensorsWriter(disk_dir / "big.safetensors", layout, data_align=4096, preallocate=True)
    assert caught.value.errno == errno.ENOSPC and caught.value.filename == str(disk_dir / "big.safetensors")
    assert "bytes free" in str(caught.value)


# ---- the engine's save ----------------------------------------------------------------------------------

def _engine(tmp):
    engine, *_ = initialize(model=gpt2(0.0), config=engine_config(tmp, "nvme", "nvme", micro=2))
    for batch in gpt2_batches(2):
        engine.backward(gpt2_loss(engine, batch))
        engine.step()
    return engine


def _tensor_files(tag):
    return {name: (tag / name).read_bytes() for name in sorted(os.listdir(tag)) if name.endswith(".safetensors")}


def test_the_engine_saves_the_same_files_with_o_direct_and_without(disk_dir, monkeypatch, caplog):
    """Tensor data, headers and the checksums the JSON records are the buffered save's; both load."""
    engine = _engine(disk_dir)
    try:
        direct = engine.save_checkpoint(disk_dir / "ckpt", tag="direct")
        with monkeypatch.context() as patch, caplog.at_level(logging.DEBUG, logger="offload"):
            _refuse_direct_opens(patch)
            buffered = engine.save_checkpoint(disk_dir / "ckpt", tag="buffered")
        assert "refuses O_DIRECT" in caplog.text and "rank00000_optimizer.safetensors" in caplog.text
        files = _tensor_files(disk_dir / "ckpt" / "direct")
        assert files == _tensor_files(disk_dir / "ckpt" / "buffered") and len(files) == 2
        sums = [json.loads((disk_dir / "ckpt" / tag / "rank00000_states.json").read_bytes())["checksums"]
                for tag in ("direct", "buffered")]
        assert sums[0] == sums[1]
        before = dict(engine.full_parameters())
        for path in (direct, buffered):
            engine.load_checkpoint(os.path.dirname(path), tag=os.path.basename(path))
            assert all(torch.equal(t, before[name]) for name, t in engine.full_parameters())
    finally:
        engine.close()


def test_a_save_whose_direct_write_fails_leaves_the_previous_checkpoint(disk_dir):
    engine = _engine(disk_dir)
    try:
        engine.save_checkpoint(disk_dir / "ckpt", tag="good")
        reference = dict(engine.full_parameters())
        engine.backward(gpt2_loss(engine, gpt2_batches(3)[2]))
        engine.step()
        with inject_faults(Fail(errno.ENOSPC, op="write", path=lambda p: p.startswith("fd "))):
            with pytest.raises(OSError) as caught:
                engine.save_checkpoint(disk_dir / "ckpt", tag="bad")
        assert caught.value.errno == errno.ENOSPC and "rank00000_params.safetensors" in str(caught.value)
        assert sorted(os.listdir(disk_dir / "ckpt")) == ["good", LATEST]
        engine.load_checkpoint(disk_dir / "ckpt")
        assert all(torch.equal(t, reference[name]) for name, t in engine.full_parameters())
    finally:
        engine.close()


# ---- the load's read-ahead ------------------------------------------------------------------------------

def test_the_load_reads_ranges_ahead_stages_partitions_without_a_copy_and_loads_what_was_saved(disk_dir, monkeypatch):
    """While one partition or optimizer range is handed over, the next ones' reads have been started: counted
    through the reader (starts and hand-overs), not timed. An on-disk partition is written to its staged slot
    from the buffer it was read into (no copy in between)."""
    engine = _engine(disk_dir)
    try:
        engine.save_checkpoint(disk_dir / "ckpt")
        before = dict(engine.full_parameters())
        events, read_into, staged_from = [], set(), []
        read, result = reader_module.CheckpointReader.read, PendingRead.result
        stage = SlottedRegion.stage

        def counted_read(self, kind, name, start, stop, **kwargs):
            pending = read(self, kind, name, start, stop, **kwargs)
            pending.kind = kind
            events.append(("start", kind))
            return pending

        def counted_result(self):
            events.append(("take", getattr(self, "kind", "")))
            values = result(self)
            read_into.add(values.data_ptr())
            return values

        def recorded_stage(self, pair, values, **kwargs):
            staged_from.append(values.data_ptr())
            return stage(self, pair, values, **kwargs)
        monkeypatch.setattr(reader_module.CheckpointReader, "read", counted_read)
        monkeypatch.setattr(PendingRead, "result", counted_result)
        engine.backward(gpt2_loss(engine, gpt2_batches(3)[2]))
        engine.step()
        monkeypatch.setattr(SlottedRegion, "stage", recorded_stage)
        engine.load_checkpoint(disk_dir / "ckpt")
        assert all(torch.equal(t, before[name]) for name, t in engine.full_parameters())
    finally:
        engine.close()
    assert staged_from and all(address in read_into for address in staged_from)  # no copy between
    for kind, least in (("params", 2), ("optimizer", 3)):
        ahead, started, taken = 0, 0, 0
        for what, of in events:
            if of != kind:
                continue
            started += what == "start"
            taken += what == "take"
            ahead = max(ahead, started - taken)
        assert taken > 10 and started == taken, kind  # every range read once, none left over
        assert ahead >= least, f"at most {ahead} {kind} reads in flight: read one at a time"


class _FakeRead:
    def __init__(self, key, log):
        self.key, self.log, self.waited = key, log, False

    def result(self):
        self.log.append(("take", self.key))
        return self.key

    def wait(self):
        self.waited = True


def test_read_ahead_keeps_its_bounds_and_takes_any_order():
    log, made = [], {}

    def start(key):
        log.append(("start", key))
        made[key] = _FakeRead(key, log)
        return made[key]
    sizes = {"a": 10, "b": 10, "c": 10, "d": 30, "e": 10, "f": 10}
    ahead = ReadAhead(list(sizes), start, sizes.__getitem__, depth=2, max_bytes=25)
    assert ahead.take("a") == "a"
    assert log == [("start", "a"), ("start", "b"), ("start", "c"), ("take", "a")]  # two ahead, 20 bytes
    assert ahead.take("b") == "b"  # d (30 bytes) would pass 25 beside c: not yet
    assert [key for what, key in log if what == "start"] == ["a", "b", "c"]
    ahead.take("c")  # nothing ahead: d is started though larger than the bound
    assert ("start", "d") in log and ("start", "e") not in log
    assert ahead.take("f") == "f"  # out of the planned order: read then
    assert ahead.most_ahead == 2
    ahead.close()
    assert made["d"].waited  # started, never taken: waited for before its buffer could be reused
