"""Crash-safe checkpoint directories in DeepSpeed's layout.

Layout of ``save_dir``::

    save_dir/<tag>/...          one complete checkpoint per tag (files of the caller's choosing)
    save_dir/latest             the newest tag, as text (no newline), as DeepSpeed writes it
    save_dir/.staging-<tag>-*   a save in progress; removed by the next save
    save_dir/.replaced-<tag>    the old contents of <tag> while a save replaces it; restored or removed
                                by the next save
    save_dir/.latest-*          a ``latest`` being written; removed by the next save

A tag directory and ``latest`` only ever appear complete: files are written to the hidden staging
directory, fsynced, and renamed into place; ``latest`` is replaced with ``os.replace`` after the tag is
in place. One save (by one process or one process group) runs in a ``save_dir`` at a time.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import torch
import torch.distributed as dist

__all__ = ["LATEST", "atomic_checkpoint", "fsync_dir", "resolve_tag"]

LATEST = "latest"
_STAGING = ".staging-"
_REPLACED = ".replaced-"
_LATEST_TMP = ".latest-"


@contextmanager
def atomic_checkpoint(
    save_dir: str | os.PathLike,
    tag: str,
    *,
    update_latest: bool = True,
    all_ranks: bool = False,
    group: dist.ProcessGroup | None = None,
) -> Iterator[Path]:
    """Write a checkpoint into the directory this yields; on a clean exit it becomes ``save_dir/<tag>``
    in one rename (replacing an existing ``<tag>``), then ``latest`` names ``tag`` (unless
    ``update_latest`` is false). On an exception nothing becomes visible and the staging directory is
    removed; after a crash (even SIGKILL) the previous checkpoints and ``latest`` are intact, and the
    next save removes what the crash left. ``save_dir`` is created if missing.

    By default one process saves (with several ranks, call it on one rank only). With ``all_ranks`` and
    an initialized process group, every rank of ``group`` (default: the world) must enter with the same
    ``save_dir`` and ``tag``, on a file system they all see. They all get the same staging directory
    (rank 0 of the group creates it and commits it); the commit waits until every rank has left the
    block, and every rank returns only after the tag is in place. If any rank fails, nothing becomes
    visible and every rank raises: the failing one its own error, the others RuntimeError. Without a
    process group, ``all_ranks`` changes nothing.

    Each rank fsyncs every file and directory under the staging directory before the commit; write
    files there only (no symlinks out of it).

    Raises ValueError for a tag that is empty, hidden (starts with "."), "latest", or holds a path
    separator; OSError from the file system (for example ENOSPC), with nothing made visible.
    """
    save_dir = Path(save_dir)
    _check_tag(tag)
    distributed = all_ranks and dist.is_available() and dist.is_initialized()
    leader = not distributed or dist.get_rank(group) == 0
    where = f"checkpoint {save_dir / tag}"
    error: BaseException | None = None

    # 1. rank 0 clears what earlier crashes left and creates the staging directory
    staging = None
    if leader:
        try:
            save_dir.mkdir(parents=True, exist_ok=True)
            _clean_leftovers(save_dir)
            staging = tempfile.mkdtemp(prefix=f"{_STAGING}{tag}-", dir=save_dir)
        except BaseException as exc:
            error = exc
    if distributed:
        staging = _from_rank_zero(staging, group)
    if error is not None:
        raise error
    if staging is None:
        raise RuntimeError(f"{where}: rank 0 could not create the staging directory; see its error")

    # 2. every rank writes and fsyncs; sync point: all ranks agree whether all of them succeeded
    try:
        yield Path(staging)
        _fsync_tree(Path(staging))
    except BaseException as exc:
        error = exc
    if _failed_anywhere(error is not None, distributed, group):
        if leader:
            shutil.rmtree(staging, ignore_errors=True)
        if error is not None:
            raise error
        raise RuntimeError(f"{where} was not saved: another rank failed while writing it (see its error)")

    # 3. rank 0 renames it into place and updates latest; sync point: nobody returns before that
    if leader:
        try:
            _move_into_place(Path(staging), save_dir, tag)
            if update_latest:
                _write_latest(save_dir, tag)
        except BaseException as exc:
            shutil.rmtree(staging, ignore_errors=True)
            error = exc
    if _failed_anywhere(error is not None, distributed, group) and error is None:
        raise RuntimeError(f"{where} was not saved: rank 0 could not move it into place (see its error)")
    if error is not None:
        raise error


def resolve_tag(load_dir: str | os.PathLike, tag: str | None = None) -> Path:
    """The directory of checkpoint ``tag`` in ``load_dir``, or of the tag ``latest`` names when ``tag``
    is None.

    Raises FileNotFoundError when ``load_dir``, ``latest`` or the tag directory is missing,
    NotADirectoryError when ``load_dir`` is not a directory, ValueError when ``latest`` is empty or
    names a bad tag; each message names the path and the tags that exist.
    """
    load_dir = Path(load_dir)
    if not load_dir.exists():
        raise FileNotFoundError(
            f"checkpoint directory {load_dir} does not exist; pass the save_dir the checkpoint was saved to"
        )
    if not load_dir.is_dir():
        raise NotADirectoryError(f"checkpoint directory {load_dir} is not a directory; pass the save_dir itself")
    source = "tag="
    if tag is None:
        latest = load_dir / LATEST
        if not latest.is_file():
            raise FileNotFoundError(
                f"{latest} does not exist, so there is no newest checkpoint to load; pass tag= (tags in "
                f"{load_dir}: {_tags(load_dir)}) or save a checkpoint first"
            )
        tag = latest.read_text().strip()
        if not tag:
            raise ValueError(f"{latest} is empty; write the tag to load into it or pass tag= ({_tags(load_dir)})")
        source = f"{latest}"
    _check_tag(tag)
    path = load_dir / tag
    if not path.is_dir():
        replaced = load_dir / f"{_REPLACED}{tag}"
        hint = (
            f"; a save that replaced it was interrupted and left its previous contents in {replaced}: the next "
            f"save restores it, or rename that directory to {path}"
            if replaced.is_dir() else ""
        )
        raise FileNotFoundError(
            f"checkpoint {path} (named by {source}) does not exist{hint}; tags in {load_dir}: {_tags(load_dir)}"
        )
    return path


def _check_tag(tag: str) -> None:
    if (
        not isinstance(tag, str) or not tag or tag.startswith(".") or tag == LATEST
        or "/" in tag or os.sep in tag or "\0" in tag
    ):
        raise ValueError(
            f"checkpoint tag {tag!r} is not allowed; use a non-empty name without path separators that does "
            f"not start with '.' and is not {LATEST!r}, such as 'global_step100'"
        )


def _from_rank_zero(value: str | None, group: dist.ProcessGroup | None) -> str | None:
    message = [value]
    dist.broadcast_object_list(message, src=0 if group is None else dist.get_global_rank(group, 0), group=group)
    return message[0]


def _failed_anywhere(failed: bool, distributed: bool, group: dist.ProcessGroup | None) -> bool:
    if not distributed:
        return failed
    # NCCL reduces only device tensors; gloo and others take CPU ones
    flag = torch.tensor([float(failed)], device="cuda" if dist.get_backend(group) == "nccl" else "cpu")
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    return bool(flag.item())


def _tags(directory: Path) -> str:
    tags = sorted(entry.name for entry in directory.iterdir() if entry.is_dir() and not entry.name.startswith("."))
    return ", ".join(tags) if tags else "none"


def _ignore_vanished(function, path, exc_info) -> None:
    if not issubclass(exc_info[0], FileNotFoundError):
        raise exc_info[1]


def _clean_leftovers(save_dir: Path) -> None:
    for entry in save_dir.iterdir():
        if entry.name.startswith(_STAGING):
            # another process (a rank cleaning up its failed save) may be removing it at the same time
            shutil.rmtree(entry, onerror=_ignore_vanished)
        elif entry.name.startswith(_LATEST_TMP):
            entry.unlink(missing_ok=True)
        elif entry.name.startswith(_REPLACED):
            # a crash between the two renames of a replacement: the old contents are whole, the new are
            # not in place, so put the old back; a crash after the second rename: the old are garbage
            tag_dir = save_dir / entry.name[len(_REPLACED):]
            if tag_dir.exists():
                shutil.rmtree(entry)
            else:
                os.rename(entry, tag_dir)
                fsync_dir(save_dir)


def _move_into_place(staging: Path, save_dir: Path, tag: str) -> None:
    target = save_dir / tag
    if target.exists():
        # rename-aside: POSIX rename cannot replace a non-empty directory
        replaced = save_dir / f"{_REPLACED}{tag}"
        os.rename(target, replaced)
        os.rename(staging, target)
        fsync_dir(save_dir)
        shutil.rmtree(replaced)
    else:
        os.rename(staging, target)
        fsync_dir(save_dir)


def _write_latest(save_dir: Path, tag: str) -> None:
    descriptor, temporary = tempfile.mkstemp(prefix=_LATEST_TMP, dir=save_dir)
    try:
        with os.fdopen(descriptor, "w") as file:
            file.write(tag)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, save_dir / LATEST)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    fsync_dir(save_dir)


def _fsync_tree(root: Path) -> None:
    """fsync every file and directory under ``root``. With several ranks in one staging directory,
    another rank's temporary file may be renamed away meanwhile: its writer fsyncs what it became."""
    for directory, _, files in os.walk(root, topdown=False):
        for name in files:
            try:
                _fsync_file(os.path.join(directory, name))
            except FileNotFoundError:
                continue
        fsync_dir(Path(directory))


def _fsync_file(path: str | os.PathLike) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def fsync_dir(path: Path) -> None:
    """fsync a directory, so that the entries renamed into it survive a crash."""
    descriptor = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
