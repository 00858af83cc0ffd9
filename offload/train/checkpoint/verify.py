"""A checkpoint checked against its checksums, without loading it (``python -m offload.checkpoint verify
CKPT``): every rank's state file against its own, its tensor files, header and data, a chunk at a time
(memory: one chunk, 8 MiB), and the files written beside them."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from offload.storage import resolve_tag
from offload.storage.file_checksums import verify_file
from offload.train.checkpoint.files import require_file, states_file
from offload.train.checkpoint.states_file import read_states_file, verify_side_files

__all__ = ["VerifiedFile", "checkpoint_tag_dir", "verify_checkpoint"]


@dataclass(frozen=True, slots=True)
class VerifiedFile:
    """One file of a checkpoint whose every byte matched its checksums (``verified`` False: a state file
    saved before state files carried a checksum, which has none to match)."""

    path: str
    nbytes: int
    verified: bool = True


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


def verify_checkpoint(path: str | os.PathLike, tag: str | None = None, *,
                      on_file: Callable[[VerifiedFile], None] | None = None) -> list[VerifiedFile]:
    """Check every file of the checkpoint at ``path`` (see `checkpoint_tag_dir`) against its checksum: each
    rank's state file against its own, each tensor file (header and data) against the chunk checksums its
    rank's state file records, and the files written beside them; return the files checked.
    ``on_file`` is called with each file as soon as it has passed (the command prints it), so the files
    that passed are known even when a later one fails. Raises
    tensorio.ChecksumError naming the file, the tensor (or header), the offset and both checksums;
    FileNotFoundError naming a missing file; ValueError naming a checkpoint that records no checksums
    (saved before they were) or a damaged state file. The state files of a checkpoint saved before they
    carried their own checksum (format 1) are listed with ``verified`` False."""
    tag_dir = os.path.abspath(checkpoint_tag_dir(path, tag))
    first = read_states_file(tag_dir, 0)
    try:
        world_size = int(first.value["world_size"])
    except (ValueError, KeyError, TypeError) as error:
        raise ValueError(f"{first.path}: not a checkpoint state file (world_size: {error})") from None
    checked: list[VerifiedFile] = []

    def passed(file: VerifiedFile) -> None:
        checked.append(file)
        if on_file is not None:
            on_file(file)

    for rank in range(world_size):
        states = first if rank == 0 else read_states_file(tag_dir, rank)
        passed(VerifiedFile(states.path, os.path.getsize(states.path), states.verified))
        files = states.tensor_files()
        if all(sums is None for _, sums in files):
            raise ValueError(f"{states.path} records no checksums (the checkpoint was saved before they were): "
                             f"nothing to verify it against")
        for name, sums in files:
            passed(VerifiedFile(os.path.join(tag_dir, name), verify_file(require_file(tag_dir, name), sums)))
    for file, nbytes in verify_side_files(first):
        passed(VerifiedFile(file, nbytes))
    return checked
