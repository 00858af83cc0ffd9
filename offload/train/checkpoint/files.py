"""The files of one checkpoint tag and its small state, as JSON plus tensors (nothing pickled).

Per rank ``r`` (5 digits), in ``save_dir/<tag>/`` (see `offload.train.checkpoint.rank_state`)::

    rank<r>_params.safetensors     this rank's parameter partitions, flat, by parameter name
    rank<r>_optimizer.safetensors  this rank's optimizer state, flat fp32, "<index>.<key>"
    rank<r>_states.json            counters, loss scale, schedule, optimizer steps and param groups,
                                   the parameters' names and shapes, and the caller's ``client_state``
    rank<r>_client.safetensors     tensors of ``client_state``, when it holds any
"""

from __future__ import annotations

import json
import math
import os
from typing import Any, Mapping

import torch

from tensorio import DIRECT_ALIGN

__all__ = ["FORMAT", "RANK_FILE_ALIGN", "client_file", "decode_state", "encode_state", "optimizer_file", "params_file",
           "read_checksums", "read_states", "require_file", "states_file", "write_json"]

FORMAT = 1
"""Version of the rank<r>_states.json layout."""

RANK_FILE_ALIGN = DIRECT_ALIGN
"""The rank files' tensor data starts at a multiple of this in the file (safetensors' header padded
with spaces): a tensor whose offset in the data is a multiple of it too (sizes of 4096 bytes'
multiples before it) is read with O_DIRECT into a page-aligned buffer and written out from there, by
the offline consolidation, without a copy."""

_TENSOR = "__tensor__"
"""Key of the JSON object that stands for a tensor of rank<r>_client.safetensors."""


def params_file(rank: int) -> str:
    """Name of ``rank``'s parameter partitions file."""
    return f"rank{rank:05d}_params.safetensors"


def optimizer_file(rank: int) -> str:
    """Name of ``rank``'s optimizer state file."""
    return f"rank{rank:05d}_optimizer.safetensors"


def states_file(rank: int) -> str:
    """Name of ``rank``'s JSON state file."""
    return f"rank{rank:05d}_states.json"


def client_file(rank: int) -> str:
    """Name of ``rank``'s file of client_state tensors."""
    return f"rank{rank:05d}_client.safetensors"


def require_file(directory: str, name: str) -> str:
    """``directory/name``; raises FileNotFoundError naming it when it is not a file."""
    path = os.path.join(directory, name)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: missing from the checkpoint; it is incomplete (copy it whole) or not a "
                                f"checkpoint of this engine")
    return path


def write_json(path: str, value: Any) -> None:
    """Write ``value`` as indented JSON to ``path``: a temporary file beside it, fsynced and renamed
    over it, so that readers see the old file or the new one. Raises OSError from the file system."""
    temporary = f"{path}.tmp-{os.getpid()}"
    try:
        with open(temporary, "w", encoding="utf-8") as file:
            json.dump(value, file, indent=2, sort_keys=True)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    finally:
        if os.path.exists(temporary):
            os.unlink(temporary)


def read_states(path: str, rank: int) -> dict[str, Any]:
    """``rank``'s state (rank<r>_states.json with its client tensors) of the checkpoint in ``path``.

    Raises FileNotFoundError naming the missing file, ValueError naming the file for one that is not
    a state file of this format or a pickled state of an earlier version (never unpickled),
    SafetensorsError naming a bad client tensors file.
    """
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    states = os.path.join(path, states_file(rank))
    if not os.path.exists(states):
        pickled = os.path.join(path, f"rank{rank:05d}_states.pt")
        if os.path.exists(pickled):
            raise ValueError(f"{pickled}: a checkpoint of an earlier version, whose state is pickled; it is not "
                             f"loaded, because unpickling a file can run any code. Load it with that version and "
                             f"save it again")
        require_file(path, states_file(rank))
    try:
        with open(states, encoding="utf-8") as file:
            encoded = json.load(file)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"{states}: not a checkpoint state file ({error}); the file is damaged or truncated") from None
    if not isinstance(encoded, dict) or encoded.pop("format", None) != FORMAT:
        raise ValueError(f"{states}: not a checkpoint state file of format {FORMAT}")
    client = os.path.join(path, client_file(rank))
    record = (encoded.get("checksums") or {}).get(client_file(rank))
    if record is not None and os.path.exists(client):
        from offload.storage.file_checksums import FileChecksums, verify_file
        verify_file(client, FileChecksums.from_json(record, f"{states}: checksums of {client_file(rank)}"))
    try:
        tensors = load_file(client) if os.path.exists(client) else {}
    except SafetensorError as error:
        raise ValueError(f"{client}: not a readable safetensors file ({error}); the file is damaged or truncated") from None
    state = decode_state(encoded, tensors)
    for group in state["optimizer"]["param_groups"]:
        if isinstance(group.get("betas"), list):
            group["betas"] = tuple(group["betas"])  # as torch.optim keeps them
    return state


def read_checksums(path: str, rank: int) -> dict[str, Any]:
    """The checksums ``rank`` recorded for its tensor files (`offload.storage.file_checksums`), by path; empty
    for a checkpoint saved before they were recorded. Raises ValueError naming the JSON file for a damaged record."""
    from offload.storage.file_checksums import FileChecksums

    states = os.path.join(path, states_file(rank))
    try:
        with open(require_file(path, states_file(rank)), encoding="utf-8") as file:
            records = json.load(file).get("checksums") or {}
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as error:
        raise ValueError(f"{states}: not a checkpoint state file ({error}); the file is damaged or truncated") from None
    if not isinstance(records, dict):
        raise ValueError(f"{states}: \"checksums\" is not an object; the file is damaged")
    return {os.path.join(path, name): FileChecksums.from_json(record, f"{states}: checksums of {name}")
            for name, record in records.items()}


def encode_state(state: Any, path: str = "state") -> tuple[Any, dict[str, torch.Tensor]]:
    """``state`` as JSON values, with each tensor replaced by a reference into the returned dict.

    Raises TypeError naming the entry (``path`` and the keys below it) that is neither.
    """
    tensors: dict[str, torch.Tensor] = {}

    def encode(value: Any, where: str) -> Any:
        if value is None or isinstance(value, (bool, int, str)):
            return value
        if isinstance(value, float):
            return value if math.isfinite(value) else {"__float__": repr(value)}
        if isinstance(value, torch.Tensor):
            name = f"t{len(tensors)}"
            tensors[name] = value.detach().cpu().contiguous()
            return {_TENSOR: name}
        if isinstance(value, Mapping):
            out = {}
            for key, item in value.items():
                if not isinstance(key, (str, int)) or isinstance(key, bool):
                    raise TypeError(f"{where}: key {key!r} is a {type(key).__name__}; checkpoints keep str "
                                    f"and int keys only (nothing is pickled)")
                out[str(key)] = encode(item, f"{where}[{key!r}]")
            return out
        if isinstance(value, (list, tuple)):
            return [encode(item, f"{where}[{i}]") for i, item in enumerate(value)]
        raise TypeError(f"{where} is a {type(value).__name__}; checkpoints keep JSON values (dict, list, str, "
                        f"int, float, bool, None) and tensors only, so that loading one never runs code")
    return encode(state, path), tensors


def decode_state(encoded: Any, tensors: Mapping[str, torch.Tensor]) -> Any:
    """The inverse of `encode_state` (tuples come back as lists)."""
    if isinstance(encoded, list):
        return [decode_state(item, tensors) for item in encoded]
    if isinstance(encoded, dict):
        if set(encoded) == {_TENSOR}:
            return tensors[encoded[_TENSOR]]
        if set(encoded) == {"__float__"}:
            return float(encoded["__float__"])
        return {key: decode_state(item, tensors) for key, item in encoded.items()}
    return encoded
