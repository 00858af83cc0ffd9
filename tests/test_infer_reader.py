"""The safetensors reader: aligned windows (pure), tensors read in place with O_DIRECT and compared
with safetensors' own loader, and every checkpoint-file error by name."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from offload.storage.safetensors_reader import (
    SafetensorsCheckpoint,
    SafetensorsError,
    TensorEntry,
    plan_windows,
    read_windows,
    tensor_views,
    windows_nbytes,
)
from tensorio import AioHandle, TensorIOError, locked_tensor

PAGE = 4096


def _entry(name, offset, nbytes, path="f"):
    return TensorEntry(name, path, torch.uint8, (nbytes,), offset, nbytes)


# ---- plan_windows: pure ---------------------------------------------------------------------------


def test_contiguous_tensors_share_one_window():
    entries = [_entry("a", 8 + 100, 5000), _entry("b", 8 + 5100, 1), _entry("c", 8 + 5101, 4096 * 10 + 1)]
    windows = plan_windows(entries, {"f": 10**6})
    assert len(windows) == 1
    (w,) = windows
    assert w.offset == 0 and w.nbytes % PAGE == 0 and w.offset + w.nbytes >= entries[-1].end
    assert [e.name for e in w.entries] == ["a", "b", "c"]


def test_distant_tensors_get_their_own_windows_and_aligned_buffer_offsets():
    entries = [_entry("a", 24, 4095), _entry("far", 3 * PAGE + 8, 1), _entry("next", 6 * PAGE - 1, 2), _entry("touching", 7 * PAGE + 1, 1)]
    windows = plan_windows(entries, {"f": 10 * PAGE})
    assert [[e.name for e in w.entries] for w in windows] == [["a"], ["far"], ["next", "touching"]]
    for w in windows:
        assert w.offset % PAGE == 0 and w.buffer_offset % PAGE == 0
        for e in w.entries:
            assert w.offset <= e.offset and e.end <= w.offset + w.nbytes
    assert windows[2].nbytes == 3 * PAGE  # straddles a page boundary, then touches the next window
    assert windows_nbytes(windows) == sum(-(-w.nbytes // PAGE) * PAGE for w in windows)


def test_window_clipped_at_end_of_file_and_files_kept_apart():
    entries = [_entry("x", 8, 4096 * 2 + 3, "g"), _entry("y", 8, 10, "f")]
    windows = plan_windows(entries, {"g": 8 + 4096 * 2 + 3, "f": 18})
    assert [(w.path, w.offset, w.nbytes) for w in windows] == [("g", 0, 8 + 4096 * 2 + 3), ("f", 0, 18)]
    assert windows[1].buffer_offset == 3 * PAGE


def test_no_entries_no_windows():
    assert plan_windows([], {}) == [] and windows_nbytes([]) == 0


# ---- reading, against safetensors' own loader -----------------------------------------------------


def _awkward_tensors():
    gen = torch.Generator().manual_seed(0)
    return {
        "a.one_byte": torch.tensor([7], dtype=torch.uint8),
        "b.page_minus_one": torch.randint(0, 255, (4095,), dtype=torch.uint8, generator=gen),
        "c.bf16": torch.randn(3, 1000, generator=gen).to(torch.bfloat16),
        "d.fp32_big": torch.randn(4096 * 10 + 1, generator=gen),
        "e.int64": torch.arange(5, dtype=torch.int64),
        "f.scalar": torch.tensor(3.5),
        "g.empty": torch.zeros(0, 4),
        "h.fp16": torch.randn(17, 3, generator=gen).half(),
    }


@pytest.mark.parametrize("where", ["disk", "tmpfs"])
def test_reads_every_tensor_as_safetensors_does(where, disk_dir, tmpfs_dir):
    directory = disk_dir if where == "disk" else tmpfs_dir
    path = directory / "model.safetensors"
    save_file(_awkward_tensors(), str(path), metadata={"format": "pt"})
    with AioHandle() as handle:
        ckpt = SafetensorsCheckpoint(directory, handle)
        windows = ckpt.windows(sorted(ckpt.entries))
        buffer = locked_tensor(windows_nbytes(windows))
        for future in read_windows(handle, windows, buffer):
            future.result()
        views = tensor_views(windows, buffer)
    assert ckpt.metadata[str(path)] == {"format": "pt"}
    with safe_open(str(path), "pt") as independent:
        assert sorted(views) == sorted(independent.keys())
        for name in views:
            expected = independent.get_tensor(name)
            assert views[name].dtype == expected.dtype and views[name].shape == expected.shape, name
            assert torch.equal(views[name], expected), name


def test_sharded_checkpoint_with_index(disk_dir):
    tensors = _awkward_tensors()
    names = sorted(tensors)
    shards = {"s1.safetensors": names[:3], "s2.safetensors": names[3:]}
    for file, members in shards.items():
        save_file({n: tensors[n] for n in members}, str(disk_dir / file))
    weight_map = {n: f for f, members in shards.items() for n in members}
    (disk_dir / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with AioHandle() as handle:
        ckpt = SafetensorsCheckpoint(disk_dir, handle)
        assert ckpt.files == sorted(str(disk_dir / f) for f in shards)
        windows = ckpt.windows(names)
        buffer = locked_tensor(windows_nbytes(windows))
        for future in read_windows(handle, windows, buffer):
            future.result()
    views = tensor_views(windows, buffer)
    for name in names:
        assert torch.equal(views[name], tensors[name]), name
    assert ckpt.dominant_dtype() == torch.float32


def test_buffer_too_small_is_refused(disk_dir):
    save_file({"x": torch.zeros(5000)}, str(disk_dir / "model.safetensors"))
    with AioHandle() as handle:
        ckpt = SafetensorsCheckpoint(disk_dir, handle)
        with pytest.raises(ValueError, match="at least"):
            read_windows(handle, ckpt.windows(["x"]), torch.zeros(10, dtype=torch.uint8))


# ---- errors, by name ------------------------------------------------------------------------------


def test_missing_shard_names_the_file_and_the_index(disk_dir):
    save_file({"a": torch.zeros(3)}, str(disk_dir / "s1.safetensors"))
    (disk_dir / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"a": "s1.safetensors", "b": "s2.safetensors"}}))
    with AioHandle() as handle, pytest.raises(FileNotFoundError, match=r"s2\.safetensors is missing.*index\.json"):
        SafetensorsCheckpoint(disk_dir, handle)


def test_truncated_file_names_the_file_and_the_tensor(disk_dir):
    path = disk_dir / "model.safetensors"
    save_file({"a": torch.zeros(3), "big": torch.zeros(10000)}, str(path))
    os.truncate(path, os.path.getsize(path) - 1)
    with AioHandle() as handle, pytest.raises(SafetensorsError, match=r"model\.safetensors is truncated.*'big'"):
        SafetensorsCheckpoint(disk_dir, handle)


def test_file_truncated_after_opening_fails_the_read_naming_the_file(disk_dir):
    path = disk_dir / "model.safetensors"
    save_file({"big": torch.zeros(100000)}, str(path))
    with AioHandle() as handle:
        ckpt = SafetensorsCheckpoint(disk_dir, handle)
        os.truncate(path, 5000)
        windows = ckpt.windows(["big"])
        futures = read_windows(handle, windows, locked_tensor(windows_nbytes(windows)))
        with pytest.raises(TensorIOError, match="short read.*model.safetensors"):
            for future in futures:
                future.result(timeout=30)


def test_bad_header_and_missing_checkpoint(disk_dir):
    (disk_dir / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!" + b"\0" * 100)
    with AioHandle() as handle:
        with pytest.raises(SafetensorsError, match="not valid JSON"):
            SafetensorsCheckpoint(disk_dir, handle)
        with pytest.raises(FileNotFoundError, match="no such file or directory"):
            SafetensorsCheckpoint(disk_dir / "nope", handle)
        (disk_dir / "model.safetensors").unlink()
        with pytest.raises(FileNotFoundError, match="no model.safetensors"):
            SafetensorsCheckpoint(disk_dir, handle)


def test_index_disagreeing_with_a_shard_is_refused(disk_dir):
    save_file({"a": torch.zeros(3)}, str(disk_dir / "s1.safetensors"))
    (disk_dir / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"b": "s1.safetensors"}}))
    with AioHandle() as handle, pytest.raises(SafetensorsError, match="lists tensor 'b'"):
        SafetensorsCheckpoint(disk_dir, handle)
