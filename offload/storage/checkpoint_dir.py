"""Crash-safe checkpoint directories in DeepSpeed's layout.

Layout of ``save_dir``::

    save_dir/<tag>/...          one complete checkpoint per tag (files of the caller's choosing)
    save_dir/latest             the newest tag, as text (no newline), as DeepSpeed writes it
    save_dir/.staging-<tag>-*   a save in progress; removed by the next save
    save_dir/.replaced-<tag>    the old contents of <tag> while a save replaces it; restored or removed
                                by the next save
    save_dir/.latest-*          a ``latest`` being written; removed by the next save
    save_dir/.lock              exists while a save runs: the saving process (rank 0 of a group) holds
                                an exclusive ``flock`` on it and wrote "<pid> <host>" into it; removed
                                when the save ends (a killed saver leaves it, unlocked, for the next)

A tag directory and ``latest`` only ever appear complete: files are written to the hidden staging
directory, fsynced, and renamed into place; ``latest`` is replaced with ``os.replace`` after the tag is
in place. One save (by one process or one process group) runs in a ``save_dir`` at a time: a second
one is refused (`CheckpointInUseError`) instead of removing the first one's staging directory as a
leftover. A tag that is a symbolic link or a file is refused, never followed or removed.
"""

from __future__ import annotations

import errno
import fcntl
import os
import shutil
import socket
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import torch
import torch.distributed as dist

from offload.device import collective_device

__all__ = ["LATEST", "CheckpointInUseError", "atomic_checkpoint", "fsync_dir", "resolve_tag"]

LATEST = "latest"
_STAGING = ".staging-"
_REPLACED = ".replaced-"
_LATEST_TMP = ".latest-"
_LOCK = ".lock"


class CheckpointInUseError(RuntimeError):
    """Another process is saving into the same checkpoint folder (it holds ``save_dir/.lock``)."""


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

    Saves into one ``save_dir`` are serialized by an exclusive ``flock`` on ``save_dir/.lock``, held by
    the saving process (rank 0 of the group with ``all_ranks``) from before it clears leftovers until
    the tag is in place or the save failed; a save that finds it held is refused, so that two runs
    cannot remove each other's staging directories.

    Raises ValueError for a tag that is empty, hidden (starts with "."), "latest", or holds a path
    separator; CheckpointInUseError naming ``save_dir`` and the holder's pid when another process is
    saving there; FileExistsError naming the path when ``save_dir/<tag>`` is a symbolic link or a
    file and IsADirectoryError when ``save_dir/latest`` is a directory (nothing is followed or
    removed); OSError from the file system (for example ENOSPC), with nothing made visible.
    """
    save_dir = Path(save_dir)
    _check_tag(tag)
    distributed = all_ranks and dist.is_available() and dist.is_initialized()
    leader = not distributed or dist.get_rank(group) == 0
    where = f"checkpoint {save_dir / tag}"
    error: BaseException | None = None
    lock: int | None = None  # rank 0's descriptor of save_dir/.lock, held until the save has ended

    # 1. rank 0 locks the folder, clears what earlier crashes left and creates the staging directory
    staging = None
    if leader:
        try:
            save_dir.mkdir(parents=True, exist_ok=True)
            lock = _lock(save_dir)
            _check_target(save_dir, tag, update_latest)
            _clean_leftovers(save_dir)
            staging = tempfile.mkdtemp(prefix=f"{_STAGING}{tag}-", dir=save_dir)
        except BaseException as exc:
            error = exc
    try:
        if distributed:
            staging = _from_rank_zero(staging, group)
        if error is not None:
            raise error
        if staging is None:
            raise RuntimeError(f"{where}: rank 0 could not start the save (see its error)")

        # 2. every rank writes and fsyncs; sync point: all ranks agree whether all of them succeeded
        try:
            yield Path(staging)
            _fsync_tree(Path(staging))
        except BaseException as exc:
            error = exc
        failed = _failed_anywhere(error is not None, distributed, group)

        # 3. rank 0 renames it into place and updates latest (or removes it), then unlocks the folder;
        #    sync point: nobody returns before that
        if leader:
            if failed:
                shutil.rmtree(staging, ignore_errors=True)
            else:
                try:
                    _move_into_place(Path(staging), save_dir, tag)
                    if update_latest:
                        _write_latest(save_dir, tag)
                except BaseException as exc:
                    shutil.rmtree(staging, ignore_errors=True)
                    error = exc
            held, lock = lock, None
            _unlock(save_dir, held)
        commit_failed = _failed_anywhere(not failed and error is not None, distributed, group)
        if failed:
            if error is not None:
                raise error
            raise RuntimeError(f"{where} was not saved: another rank failed while writing it (see its error)")
        if error is not None:
            raise error
        if commit_failed:
            raise RuntimeError(f"{where} was not saved: rank 0 could not move it into place (see its error)")
    finally:
        if lock is not None:
            _unlock(save_dir, lock)


def resolve_tag(load_dir: str | os.PathLike, tag: str | None = None, *, tag_argument: str = "tag=") -> Path:
    """The directory of checkpoint ``tag`` in ``load_dir``, or of the tag ``latest`` names when ``tag``
    is None.

    Raises FileNotFoundError when ``load_dir``, ``latest`` or the tag directory is missing (naming the
    save_dirs inside ``load_dir`` when it is a folder of them, as a Trainer's output_dir is),
    NotADirectoryError when ``load_dir`` is not a directory, ValueError when ``latest`` is empty or
    names a bad tag; each message names the path and the tags that exist, and ``tag_argument`` is how
    the caller's user passes a tag (a command says "--tag").
    """
    load_dir = Path(load_dir)
    if not load_dir.exists():
        raise FileNotFoundError(
            f"checkpoint directory {load_dir} does not exist; pass the save_dir the checkpoint was saved to"
        )
    if not load_dir.is_dir():
        raise NotADirectoryError(f"checkpoint directory {load_dir} is not a directory; pass the save_dir itself")
    source = tag_argument.split()[0]
    if tag is None:
        latest = load_dir / LATEST
        if not latest.is_file():
            inner = sorted((entry for entry in load_dir.iterdir() if (entry / LATEST).is_file()), key=_step_order)
            if inner:  # a folder of save_dirs (a Trainer's output_dir: checkpoint-10, checkpoint-20, ...)
                raise FileNotFoundError(
                    f"{load_dir} is not a checkpoint but holds {len(inner)}: {', '.join(e.name for e in inner)}; "
                    f"pass one of them as the checkpoint directory, such as {inner[-1]}"
                )
            raise FileNotFoundError(
                f"{latest} does not exist, so there is no newest checkpoint to load; pass {tag_argument} (tags in "
                f"{load_dir}: {_tags(load_dir)}) or save a checkpoint first"
            )
        tag = latest.read_text().strip()
        if not tag:
            raise ValueError(f"{latest} is empty; write the tag to load into it or pass {tag_argument} "
                             f"({_tags(load_dir)})")
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
    flag = torch.tensor([float(failed)], device=collective_device(group))  # NCCL: a device tensor; gloo: a CPU one
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    return bool(flag.item())


def _step_order(entry: Path) -> tuple[int, str]:
    """Sort key: checkpoint-10 before checkpoint-9 would be wrong; by the trailing number, then the name."""
    digits = entry.name[len(entry.name.rstrip("0123456789")):]
    return (int(digits) if digits else -1, entry.name)


def _tags(directory: Path) -> str:
    tags = sorted(entry.name for entry in directory.iterdir() if entry.is_dir() and not entry.name.startswith("."))
    return ", ".join(tags) if tags else "none"


def _ignore_vanished(function, path, exc_info) -> None:
    if not issubclass(exc_info[0], FileNotFoundError):
        raise exc_info[1]


def _lock(save_dir: Path) -> int:
    """Take ``save_dir``'s save lock; return the descriptor that holds it.

    Raises CheckpointInUseError naming the folder and the holder's pid when another process holds it.
    """
    path = save_dir / _LOCK
    while True:
        descriptor = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(descriptor, 200, 0).decode(errors="replace").split()
            os.close(descriptor)
            who = f"process {holder[0]} on {holder[1]}" if len(holder) == 2 else "another process"
            raise CheckpointInUseError(
                f"checkpoint folder {save_dir} is being saved to by {who}, which holds {path}; two runs saving "
                f"into one folder would remove each other's staging directories: save into another folder, "
                f"or save again once that save has ended"
            ) from None
        except BaseException:
            os.close(descriptor)
            raise
        # the previous holder removes the file before it unlocks: a lock taken on the file it removed
        # is a lock nobody else sees, so take the one on the file that is there now
        try:
            current = os.stat(path, follow_symlinks=False)
        except FileNotFoundError:
            current = None
        opened = os.fstat(descriptor)
        if current is not None and (current.st_dev, current.st_ino) == (opened.st_dev, opened.st_ino):
            break
        os.close(descriptor)
    try:
        os.ftruncate(descriptor, 0)
        os.pwrite(descriptor, f"{os.getpid()} {socket.gethostname()}\n".encode(), 0)
    except BaseException:
        _unlock(save_dir, descriptor)
        raise
    return descriptor


def _unlock(save_dir: Path, descriptor: int) -> None:
    """Remove ``save_dir/.lock`` while holding it, then let it go (an opener that raced sees it gone).
    Never raises: a lock file that could not be removed is taken by the next save like a killed one's,
    and the other ranks are waiting for this one at the next sync point."""
    try:
        (save_dir / _LOCK).unlink(missing_ok=True)
    except OSError:
        pass
    finally:
        os.close(descriptor)


def _check_target(save_dir: Path, tag: str, update_latest: bool) -> None:
    """Refuse a tag path that a save could only replace by following or removing what is not its own."""
    target = save_dir / tag
    if target.is_symlink():
        raise FileExistsError(
            errno.EEXIST,
            f"checkpoint {target} is a symbolic link (to {os.readlink(target)}); a save replaces the tag's "
            f"directory and neither follows nor removes links: remove the link or save under another tag",
        )
    if target.exists() and not target.is_dir():
        raise FileExistsError(
            errno.EEXIST,
            f"checkpoint {target} is a file, not a checkpoint directory; remove it or save under another tag",
        )
    latest = save_dir / LATEST
    if update_latest and latest.is_dir() and not latest.is_symlink():
        raise IsADirectoryError(
            errno.EISDIR, f"{latest} is a directory; it must be a file naming the newest tag: remove or rename it"
        )


def _remove(entry: Path) -> None:
    """Remove a file, a link (not what it points to) or a directory tree."""
    if entry.is_symlink() or not entry.is_dir():
        entry.unlink(missing_ok=True)
    else:
        shutil.rmtree(entry, onerror=_ignore_vanished)


def _clean_leftovers(save_dir: Path) -> None:
    """Remove what interrupted saves left; only under the folder's save lock (no other save runs)."""
    for entry in save_dir.iterdir():
        if entry.name.startswith((_STAGING, _LATEST_TMP)):
            # a staging directory's rank may still be removing it after its failed save
            _remove(entry)
        elif entry.name.startswith(_REPLACED):
            # a crash between the two renames of a replacement: the old contents are whole, the new are
            # not in place, so put the old back; a crash after the second rename: the old are garbage
            tag_dir = save_dir / entry.name[len(_REPLACED):]
            if os.path.lexists(tag_dir):
                _remove(entry)
            else:
                os.rename(entry, tag_dir)
                fsync_dir(save_dir)


def _move_into_place(staging: Path, save_dir: Path, tag: str) -> None:
    target = save_dir / tag
    _check_target(save_dir, tag, update_latest=False)  # again: made since the save started?
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
