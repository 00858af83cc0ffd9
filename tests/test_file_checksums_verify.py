"""`verify_file` (a checkpoint's or a generation cache's safetensors file against its checksum record): every
chunk checked as tensorio reads it, several in flight; a flipped byte is named with its tensor and chunk, a
file cut short is named before anything is read, on the disk (O_DIRECT) and on a tmpfs (buffered)."""

from __future__ import annotations

import json
import os
import tempfile

import pytest
import torch

import offload.storage.file_checksums as file_checksums
from offload.storage.file_checksums import FileChecksums, verify_file
from offload.storage.safetensors_writer import atomic_safetensors
from tensorio import ChecksumError
from tensorio.testing import flip_bit

CHUNK = 64 << 10  # many chunks per tensor, more than are read ahead


@pytest.fixture(params=["disk", "tmpfs"])
def directory(request, disk_dir):
    if request.param == "disk":
        return disk_dir
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no tmpfs at /dev/shm")
    path = tempfile.mkdtemp(dir="/dev/shm")
    request.addfinalizer(lambda: __import__("shutil").rmtree(path, ignore_errors=True))
    return path


def _written(directory, monkeypatch) -> tuple[str, FileChecksums, dict[str, torch.Tensor]]:
    monkeypatch.setattr(file_checksums, "CHUNK", CHUNK)
    tensors = {"a": torch.randn(1000, 77), "b": torch.arange(3).to(torch.int8),  # odd sizes: unaligned offsets
               "c": torch.randn(300, 1001).to(torch.bfloat16), "empty": torch.zeros(0)}
    path = os.path.join(directory, "model.safetensors")
    with atomic_safetensors(path, {n: (t.dtype, tuple(t.shape)) for n, t in tensors.items()}, checksums=True) as out:
        for name, tensor in tensors.items():
            out.write(name, tensor)
    record = FileChecksums.from_json(json.loads(json.dumps(out.checksums.to_json())), path)
    assert record.chunk == CHUNK and len(record.tensors["a"]) > file_checksums.VERIFY_AHEAD
    return path, record, tensors


def test_a_good_file_is_checked_whole(directory, monkeypatch):
    path, record, tensors = _written(directory, monkeypatch)
    header = 8 + int.from_bytes(open(path, "rb").read(8), "little")
    assert verify_file(path, record) == header + sum(t.nbytes for t in tensors.values())


def test_a_flipped_byte_is_named_with_its_tensor_and_chunk(directory, monkeypatch):
    path, record, tensors = _written(directory, monkeypatch)
    header = 8 + int.from_bytes(open(path, "rb").read(8), "little")
    offsets = json.loads(open(path, "rb").read(header)[8:])
    start = header + offsets["c"]["data_offsets"][0]
    flip_bit(path, start + 3 * CHUNK + 5)  # chunk 3 of tensor c
    with pytest.raises(ChecksumError, match=rf"\(tensor 'c'\): {path} at offset {start + 3 * CHUNK}, length {CHUNK};"):
        verify_file(path, record)


def test_a_file_cut_short_is_named_before_it_is_read(directory, monkeypatch):
    path, record, _ = _written(directory, monkeypatch)
    os.truncate(path, os.path.getsize(path) - 10)
    with pytest.raises(OSError, match=r"tensor '.*' at offset \d+ its header places there; the file is truncated"):
        verify_file(path, record)


@pytest.mark.bench
def test_the_file_verify_benchmark_runs_end_to_end_and_leaves_nothing(disk_dir, capsys):
    from benchmarks import file_verify

    figures = file_verify.main(["--dir", str(disk_dir), "--size", "64M", "--rounds", "1"])
    assert figures["verify_s"] > 0 and figures["read_s"] > 0 and figures["bytes"] > 64 << 20
    assert "verify_file" in capsys.readouterr().out
    assert list(disk_dir.iterdir()) == []
