"""One bit flipped at rest in a checkpoint the engine wrote, by the kind of byte: a tensor's data, a safetensors
header, the rank's state file, a file written beside them. Shared by the tests of every way into a checkpoint
(load, the trainers' resumes, consolidate, zero_to_fp32.py, verify)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from tensorio.testing import flip_bit

FLIPS = ("tensor data", "header", "state file", "config.json")
"""The kinds of byte a flip may hit."""

WHAT = {"tensor data": "tensor '", "header": "the safetensors header", "state file": "the checkpoint's state file",
        "config.json": "a file of the checkpoint"}
"""How a `tensorio.ChecksumError` names what the flipped byte belonged to."""


def tensor_at(path: Path, name: str | None = None) -> tuple[str, int, int]:
    """(name, absolute offset, bytes) of tensor ``name`` (default: the largest) of the safetensors file at ``path``."""
    raw = path.read_bytes()
    length = int.from_bytes(raw[:8], "little")
    entries = {k: v for k, v in json.loads(raw[8:8 + length]).items() if k != "__metadata__"}
    name = name or max(entries, key=lambda k: entries[k]["data_offsets"][1] - entries[k]["data_offsets"][0])
    begin, end = entries[name]["data_offsets"]
    return name, 8 + length + begin, end - begin


def flip(tag: Path, kind: str, rank: int = 0) -> tuple[Path, int]:
    """Flip one bit of ``kind`` (see `FLIPS`) in rank ``rank``'s files of the checkpoint tag folder ``tag``;
    return (the file, the offset) so that the caller can flip it back. The state file's flip turns a digit
    of ``global_steps`` into another digit: the JSON stays valid, only its checksum can tell."""
    if kind == "tensor data":
        path = tag / f"rank{rank:05d}_params.safetensors"
        _, offset, nbytes = tensor_at(path)
        offset += nbytes // 2
    elif kind == "header":
        path, offset = tag / f"rank{rank:05d}_params.safetensors", 20
    elif kind == "state file":
        path = tag / f"rank{rank:05d}_states.json"
        raw = path.read_bytes()
        key = b'"global_steps": '
        offset = raw.index(key) + len(key)
        assert raw[offset:offset + 1].isdigit()
    elif kind == "config.json":
        path = tag / "config.json"
        offset = path.stat().st_size // 2
    else:
        raise ValueError(kind)
    flip_bit(path, offset, 0)
    return path, offset


def copy_elsewhere(tag_or_save_dir: Path, into: Path) -> Path:
    """A copy of a checkpoint folder (a save_dir, or a Trainer's checkpoint-N) in ``into``, under its own name."""
    target = into / tag_or_save_dir.name
    shutil.copytree(tag_or_save_dir, target)
    return target


def relative(path: Path) -> str:
    """``path`` relative to the working directory (with ``..`` where it is elsewhere)."""
    return os.path.relpath(path)
