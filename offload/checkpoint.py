"""Crash-safe checkpoint directories in DeepSpeed's layout, and atomic safetensors files.

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

import json
import os
import shutil
import struct
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Mapping, Sequence

import torch
import torch.distributed as dist

__all__ = ["LATEST", "atomic_checkpoint", "resolve_tag", "save_tensors_safetensors"]

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


def save_tensors_safetensors(
    path: str | os.PathLike, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None
) -> None:
    """Write ``tensors`` to ``path`` in the safetensors format, atomically (see `atomic_safetensors`):
    readers see the old file or the new one, never a partial one. Any layout works (views, shared
    memory).

    Raises FileNotFoundError if the parent directory is missing, TypeError naming a key whose value is
    not a tensor or a metadata entry that is not str to str; the temporary file is removed on any error.
    """
    for name, tensor in tensors.items():
        if not isinstance(name, str) or not isinstance(tensor, torch.Tensor):
            raise TypeError(f"tensors[{name!r}]: expected a str key and a torch.Tensor, got {type(tensor).__name__}")
    with atomic_safetensors(path, {name: (t.dtype, t.shape) for name, t in tensors.items()}, metadata) as out:
        for name, tensor in tensors.items():
            out.write(name, tensor)


@contextmanager
def atomic_safetensors(path: str | os.PathLike, layout: Mapping[str, tuple[torch.dtype, Sequence[int]]],
                       metadata: Mapping[str, str] | None = None) -> Iterator["SafetensorsWriter"]:
    """A `SafetensorsWriter` on a hidden temporary file beside ``path``, fsynced and renamed over
    ``path`` when the block ends without an error; on an error the temporary file is removed and
    ``path`` is untouched. Raises FileNotFoundError if the parent directory is missing."""
    path = Path(path)
    if not path.parent.is_dir():
        raise FileNotFoundError(f"{path}: directory {path.parent} does not exist; create it first")
    descriptor, temporary = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(descriptor)
    try:
        with SafetensorsWriter(temporary, layout, metadata) as out:
            yield out
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


_SAFETENSORS_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
                       torch.int64: "I64", torch.int32: "I32", torch.uint8: "U8", torch.bool: "BOOL"}


class SafetensorsWriter:
    """Write a safetensors file piece by piece, so that a checkpoint larger than RAM can be saved.

    The header (each tensor's dtype, shape and place, and ``metadata``) is written when the file is
    opened, from ``layout`` (name -> (dtype, shape)), tensors back to back in that order; `write` then puts any
    run of a tensor's elements in place, in any order, so that only that run has to be in memory.
    Every element must be written before `close` (unwritten ones read as zeros). The file is what
    ``safetensors.torch.save_file`` would make of the same tensors, up to their order, and loads with
    ``safetensors.torch.load_file`` or ``safe_open``. Not atomic by itself: write it inside
    `atomic_checkpoint`'s directory, or to a temporary name that you rename.

    Raises TypeError for a dtype safetensors cannot store, ValueError for a write outside a tensor or
    of another dtype (naming the tensor), OSError from the file system.
    """

    def __init__(self, path: str | os.PathLike, layout: Mapping[str, tuple[torch.dtype, Sequence[int]]],
                 metadata: Mapping[str, str] | None = None) -> None:
        header: dict[str, object] = {}
        for key, value in (metadata or {}).items():
            if not isinstance(key, str) or not isinstance(value, str):
                raise TypeError(f"metadata[{key!r}]: safetensors metadata maps str to str, got {type(value).__name__}")
        if metadata:
            header["__metadata__"] = dict(metadata)
        self._places: dict[str, tuple[torch.dtype, int, int]] = {}
        end = 0
        for name, (dtype, shape) in layout.items():
            if dtype not in _SAFETENSORS_DTYPES:
                raise TypeError(f"tensor {name!r}: dtype {dtype} cannot be stored in safetensors")
            numel = 1
            for size in shape:
                numel *= int(size)
            nbytes = numel * torch.empty((), dtype=dtype).element_size()
            header[name] = {"dtype": _SAFETENSORS_DTYPES[dtype], "shape": [int(s) for s in shape],
                            "data_offsets": [end, end + nbytes]}
            self._places[name] = (dtype, end, numel)
            end += nbytes
        encoded = json.dumps(header, separators=(",", ":")).encode()
        encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned, as safetensors writes it
        self._data = 8 + len(encoded)
        self.path = os.fspath(path)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            _pwrite_all(self._fd, struct.pack("<Q", len(encoded)) + encoded, 0)
            os.ftruncate(self._fd, self._data + end)
        except BaseException:
            os.close(self._fd)
            raise

    def write(self, name: str, values: torch.Tensor, first: int = 0) -> None:
        """Put ``values`` (flattened) into tensor ``name`` from its element ``first`` on."""
        if name not in self._places:
            raise ValueError(f"{self.path}: no tensor {name!r} in the layout")
        dtype, start, numel = self._places[name]
        flat = values.detach().reshape(-1)
        if flat.dtype != dtype:
            raise ValueError(f"{self.path}: tensor {name!r} is {dtype}, got {flat.dtype} values")
        if first < 0 or first + flat.numel() > numel:
            raise ValueError(f"{self.path}: elements {first}..{first + flat.numel()} are outside tensor {name!r} "
                             f"of {numel} elements")
        raw = flat.contiguous().view(torch.uint8).numpy()
        _pwrite_all(self._fd, raw, self._data + start + first * flat.element_size())

    def close(self) -> None:
        """Flush the file to the disk (fsync) and close it."""
        if self._fd >= 0:
            try:
                os.fsync(self._fd)
            finally:
                os.close(self._fd)
                self._fd = -1

    def __enter__(self) -> "SafetensorsWriter":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _pwrite_all(fd: int, data, offset: int) -> None:
    view = memoryview(data).cast("B")
    while view:
        written = os.pwrite(fd, view, offset)
        view, offset = view[written:], offset + written


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
                _fsync_dir(save_dir)


def _move_into_place(staging: Path, save_dir: Path, tag: str) -> None:
    target = save_dir / tag
    if target.exists():
        # rename-aside: POSIX rename cannot replace a non-empty directory
        replaced = save_dir / f"{_REPLACED}{tag}"
        os.rename(target, replaced)
        os.rename(staging, target)
        _fsync_dir(save_dir)
        shutil.rmtree(replaced)
    else:
        os.rename(staging, target)
        _fsync_dir(save_dir)


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
    _fsync_dir(save_dir)


def _fsync_tree(root: Path) -> None:
    """fsync every file and directory under ``root``. With several ranks in one staging directory,
    another rank's temporary file may be renamed away meanwhile: its writer fsyncs what it became."""
    for directory, _, files in os.walk(root, topdown=False):
        for name in files:
            try:
                _fsync_file(os.path.join(directory, name))
            except FileNotFoundError:
                continue
        _fsync_dir(Path(directory))


def _fsync_file(path: str | os.PathLike) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def _fsync_dir(path: Path) -> None:
    descriptor = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
