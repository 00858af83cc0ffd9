"""A checkpoint checked against the checksums its JSON records, without loading it
(``python -m offload.checkpoint verify CKPT``): every rank's tensor files, header and data, a chunk at a
time (memory: one chunk, 8 MiB)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from offload.storage import resolve_tag
from offload.storage.file_checksums import verify_file
from offload.train.checkpoint.files import (client_file, optimizer_file, params_file, read_checksums, require_file,
                                            states_file)

__all__ = ["VerifiedFile", "checkpoint_tag_dir", "verify_checkpoint"]


@dataclass(frozen=True, slots=True)
class VerifiedFile:
    """One tensor file whose every byte matched its checksums."""

    path: str
    nbytes: int


def checkpoint_tag_dir(path: str | os.PathLike, tag: str | None = None) -> Path:
    """The tag directory of a checkpoint given as a tag directory itself or as the save_dir holding it (``tag``,
    or the one ``latest`` names). Raises FileNotFoundError / NotADirectoryError / ValueError naming ``path``
    when it is neither."""
    path = Path(path)
    if path.is_dir() and tag is None and (path / states_file(0)).is_file():
        return path
    if path.is_file():
        raise NotADirectoryError(f"{path} is a file, not a checkpoint; pass the save_dir of engine.save_checkpoint "
                                 f"or one of its tag directories")
    if path.is_dir() and tag is None and not (path / "latest").exists():
        raise ValueError(f"{path} is not a checkpoint: it holds neither {states_file(0)} (a tag directory) nor "
                         f"`latest` (a save_dir); pass the save_dir of engine.save_checkpoint, or --tag")
    return resolve_tag(path, tag)


def verify_checkpoint(path: str | os.PathLike, tag: str | None = None) -> list[VerifiedFile]:
    """Check every tensor file of the checkpoint at ``path`` (see `checkpoint_tag_dir`) against its checksums;
    return the files checked. Raises tensorio.ChecksumError naming the file, the tensor (or header), the offset
    and both checksums; FileNotFoundError naming a missing file; ValueError naming a checkpoint that records no
    checksums (saved before they were) or a damaged JSON file."""
    tag_dir = str(checkpoint_tag_dir(path, tag))
    with open(require_file(tag_dir, states_file(0)), encoding="utf-8") as file:
        try:
            world_size = int(json.load(file)["world_size"])
        except (ValueError, KeyError, TypeError) as error:
            raise ValueError(f"{os.path.join(tag_dir, states_file(0))}: not a checkpoint state file ({error})") from None
    checked = []
    for rank in range(world_size):
        records = read_checksums(tag_dir, rank)
        if not records:
            raise ValueError(f"{os.path.join(tag_dir, states_file(rank))} records no checksums (the checkpoint was "
                             f"saved before they were): nothing to verify it against")
        for name in (params_file(rank), optimizer_file(rank), client_file(rank)):
            file = os.path.join(tag_dir, name)
            if name == client_file(rank) and file not in records:
                continue  # no client tensors
            if file not in records:
                raise ValueError(f"{os.path.join(tag_dir, states_file(rank))}: records no checksums for {name}")
            checked.append(VerifiedFile(file, verify_file(require_file(tag_dir, name), records[file])))
    return checked
