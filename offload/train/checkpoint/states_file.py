"""A rank's ``rank<r>_states.json``, the one file of a checkpoint that holds its own checksum, and through it
the checksums of every other file of the tag.

Format 2 (written since the state files carry a checksum) starts with a fixed head and the file's own
xxh3-64 in 16 hex digits::

    {"format": 2, "states_checksum": "0123456789abcdef", "global_steps": ..., "checksums": {...}, ...}

The checksum hashes the file's bytes with those 16 digits read as ``0000000000000000``: every byte of the
file is covered, whitespace included, and a flipped byte anywhere (the head too) is refused before the
JSON is used. The JSON then records, by file name inside the tag folder (so that a checkpoint moved or
copied elsewhere still verifies):

- ``checksums``: each tensor file of the rank (`offload.storage.file_checksums` records; every params and
  optimizer file must have one, the client file one when it exists);
- ``files`` (rank 0): the whole-file checksums of ``config.json``, ``generation_config.json`` (a model that
  generates) and ``zero_to_fp32.py`` written beside.

Format 1 (before): no checksum of its own; loaded with a warning that its bytes are not verified.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

from tensorio import ChecksumError, checksum

from offload.storage.file_checksums import FileChecksums, verify_file
from offload.train.checkpoint.files import (client_file, decode_state, optimizer_file, params_file, require_file,
                                            states_file)

__all__ = ["FORMAT", "StatesFile", "decoded_state", "read_states", "read_states_file", "states_bytes",
           "verify_side_files", "whole_file_checksum"]

FORMAT = 2
"""Version of the rank<r>_states.json layout written now (1: before the file carried its own checksum)."""

_HEAD = b'{"format": 2, "states_checksum": "'
_ZERO = b"0" * 16


def states_bytes(value: dict[str, Any]) -> bytes:
    """The bytes of a format-2 state file holding ``value`` (JSON values; NaN and infinities allowed),
    with its own checksum in its head."""
    body = json.dumps(value, allow_nan=True).encode()
    rest = body[1:]  # b'"key": ..., ...}' (b"}" when empty)
    data = bytearray(_HEAD + _ZERO + b'"' + (b", " if rest != b"}" else b"") + rest)
    data[len(_HEAD):len(_HEAD) + 16] = b"%016x" % checksum(bytes(data))
    return bytes(data)


def whole_file_checksum(path: str | os.PathLike) -> tuple[int, int]:
    """(xxh3-64, bytes) of the whole file at ``path`` (small files: read at once)."""
    with open(path, "rb") as file:
        data = file.read()
    return checksum(data), len(data)


@dataclass(frozen=True)
class StatesFile:
    """One rank's state file as read: ``value`` without its format and own checksum; ``verified`` when its
    bytes matched that checksum (format 2), False for a format-1 file, which has none."""

    path: str
    rank: int
    value: dict[str, Any]
    verified: bool

    @property
    def directory(self) -> str:
        """The tag folder holding the file."""
        return os.path.dirname(self.path)

    def checksums(self) -> dict[str, FileChecksums]:
        """The tensor files' checksum records, by file name (empty for a checkpoint saved before they were).
        Raises ValueError naming this file for a damaged record."""
        records = self.value.get("checksums") or {}
        if not isinstance(records, dict):
            raise ValueError(f"{self.path}: \"checksums\" is not an object; the file is damaged")
        return {str(name): FileChecksums.from_json(record, f"{self.path}: checksums of {name}")
                for name, record in records.items()}

    def tensor_files(self) -> list[tuple[str, FileChecksums | None]]:
        """(file name, its checksums) of every tensor file of this rank that exists or must exist: params and
        optimizer always, client when recorded or present. The checksums are None only for a checkpoint
        saved before they were. Raises ValueError naming this file when its format says a file must have
        checksums and it records none (never a silent skip)."""
        records = self.checksums()
        names = [params_file(self.rank), optimizer_file(self.rank)]
        client = client_file(self.rank)
        if client in records or os.path.exists(os.path.join(self.directory, client)):
            names.append(client)
        out = []
        for name in names:
            sums = records.get(name)
            if sums is None and (self.verified or records):
                raise ValueError(f"{self.path}: records no checksums for {name}, which a checkpoint of this "
                                 f"format must have; the file does not belong to this checkpoint")
            out.append((name, sums))
        return out

    def side_files(self) -> dict[str, int]:
        """Rank 0's whole-file checksums of the files written beside the rank files, by name."""
        records = self.value.get("files") or {}
        try:
            return {str(name): int(value, 16) for name, value in records.items()}
        except (AttributeError, TypeError, ValueError) as error:
            raise ValueError(f"{self.path}: \"files\" is not a record of checksums ({error}); the file is "
                             f"damaged") from None


def read_states_file(directory: str | os.PathLike, rank: int) -> StatesFile:
    """``rank``'s state file in the tag folder ``directory``, its bytes checked against their own checksum.

    Raises FileNotFoundError naming a missing file (ValueError for the pickled state of an earlier version,
    never unpickled); tensorio.ChecksumError naming the file when a byte changed since it was written;
    ValueError naming the file for one that is not a state file of format 1 or 2."""
    directory = os.fspath(directory)
    path = os.path.join(directory, states_file(rank))
    if not os.path.exists(path):
        pickled = os.path.join(directory, f"rank{rank:05d}_states.pt")
        if os.path.exists(pickled):
            raise ValueError(f"{pickled}: a checkpoint of an earlier version, whose state is pickled; it is not "
                             f"loaded, because unpickling a file can run any code. Load it with that version and "
                             f"save it again")
        require_file(directory, states_file(rank))
    with open(path, "rb") as file:
        raw = file.read()
    verified = raw.startswith(_HEAD)
    if verified:
        where = slice(len(_HEAD), len(_HEAD) + 16)
        actual = checksum(raw[:where.start] + _ZERO + raw[where.stop:])
        if raw[where] != b"%016x" % actual:  # the digits as written: "F" for "f" is a flipped bit too
            try:
                expected = int(raw[where], 16)
            except ValueError:
                expected = 0
            raise ChecksumError(path=path, offset=0, length=len(raw), expected=expected, actual=actual,
                                what="the checkpoint's state file")
    try:
        value = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"{path}: not a checkpoint state file ({error}); the file is damaged or truncated") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path}: not a checkpoint state file (not a JSON object)")
    version = value.pop("format", None)
    own = value.pop("states_checksum", None)
    if version == FORMAT and not verified:
        raise ValueError(f"{path}: a state file of format {FORMAT} must begin with its own checksum and does not; "
                         f"the file is damaged")
    if version not in (1, FORMAT) or (version == 1 and own is not None):
        raise ValueError(f"{path}: not a checkpoint state file of format 1 or {FORMAT} (format {version!r}); the "
                         f"file is damaged or from another program")
    return StatesFile(path, rank, value, verified)


def verify_side_files(states: StatesFile) -> list[tuple[str, int]]:
    """Check the files rank 0 recorded beside the rank files (config.json, ...) against their
    whole-file checksums; return (path, bytes) of each. Raises FileNotFoundError naming a recorded file that
    is missing, tensorio.ChecksumError naming one whose bytes changed."""
    checked = []
    for name, expected in states.side_files().items():
        path = require_file(states.directory, name)
        actual, nbytes = whole_file_checksum(path)
        if actual != expected:
            raise ChecksumError(path=path, offset=0, length=nbytes, expected=expected, actual=actual,
                                what="a file of the checkpoint")
        checked.append((path, nbytes))
    return checked


def read_states(directory: str | os.PathLike, rank: int) -> dict[str, Any]:
    """``rank``'s state (its state file with its client tensors, both checked against their checksums) of
    the checkpoint in the tag folder ``directory``; the records of checksums are left out.

    Raises what `read_states_file` raises; tensorio.ChecksumError naming the client tensors file for a
    flipped byte in it, ValueError naming it for one that is not a safetensors file, FileNotFoundError
    naming it when its checksums are recorded and it is missing.
    """
    return decoded_state(read_states_file(directory, rank))


def decoded_state(states: StatesFile) -> dict[str, Any]:
    """The state ``states`` holds, with its client tensors (checked against their checksums) in place: what
    `read_states` returns, from a state file already read."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    rank = states.rank
    encoded = dict(states.value)
    encoded.pop("checksums", None)
    encoded.pop("files", None)
    tensors = {}
    for name, sums in states.tensor_files():
        if name != client_file(rank):
            continue
        client = require_file(states.directory, name)
        if sums is not None:
            verify_file(client, sums)
        try:
            tensors = load_file(client)
        except SafetensorError as error:
            raise ValueError(f"{client}: not a readable safetensors file ({error}); the file is damaged or "
                             f"truncated") from None
    state = decode_state(encoded, tensors)
    for group in state["optimizer"]["param_groups"]:
        if isinstance(group.get("betas"), list):
            group["betas"] = tuple(group["betas"])  # as torch.optim keeps them
    return state
