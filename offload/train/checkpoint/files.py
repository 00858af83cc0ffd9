"""The files of one checkpoint tag and its small state, as JSON plus tensors (nothing pickled).

Per rank ``r`` (5 digits), in ``save_dir/<tag>/`` (see `offload.train.checkpoint.rank_state`)::

    rank<r>_params.safetensors     this rank's parameter partitions, flat, by parameter name
    rank<r>_optimizer.safetensors  this rank's optimizer state, flat fp32, "<index>.<key>"
    rank<r>_states.json            counters, loss scale, schedule, optimizer steps and param groups,
                                   the parameters' names and shapes, and the caller's ``client_state``
    rank<r>_client.safetensors     tensors of ``client_state``, when it holds any

The state file's own format and checksum, and the checksums it records for the others:
`offload.train.checkpoint.states_file`.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any, Mapping

import torch

from tensorio import DIRECT_ALIGN

__all__ = ["RANK_FILE_ALIGN", "client_file", "decode_state", "encode_state", "optimizer_file", "params_file",
           "require_file", "states_file", "write_json"]

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
