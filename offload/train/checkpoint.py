"""The engine's checkpoints: each rank's partitions, optimizer state and counters, streamed, and
nothing in them that runs code when loaded.

Layout of ``save_dir/<tag>/`` (see docs/engine.md, "Checkpoints"); per rank ``r`` (5 digits):

    rank<r>_params.safetensors     this rank's parameter partitions, flat, by parameter name
    rank<r>_optimizer.safetensors  this rank's optimizer state, flat fp32, "<index>.<key>"
    rank<r>_states.json            counters, loss scale, schedule, optimizer steps and param groups,
                                   and the caller's ``client_state``
    rank<r>_client.safetensors     tensors of ``client_state``, when it holds any

JSON and safetensors only: loading a checkpoint never unpickles, so a checkpoint from someone else
cannot execute anything. ``client_state`` may hold what JSON holds (dicts with str keys, lists,
str, int, float, bool, None) and tensors; tuples come back as lists.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
from typing import Any, Iterator, Mapping

import torch
import torch.distributed as dist

from tensorio import aligned_tensor

from offload.params import ParamRecord, ParamStore
from offload.storage import SafetensorsWriter, atomic_checkpoint, atomic_safetensors, resolve_tag

__all__ = ["decode_state", "encode_state", "load_checkpoint", "save_16bit_model", "save_checkpoint"]

_FORMAT = 1
"""Version of the rank<r>_states.json layout."""

_TENSOR = "__tensor__"
"""Key of the JSON object that stands for a tensor of rank<r>_client.safetensors."""


def params_file(rank: int) -> str:
    return f"rank{rank:05d}_params.safetensors"


def optimizer_file(rank: int) -> str:
    return f"rank{rank:05d}_optimizer.safetensors"


def states_file(rank: int) -> str:
    return f"rank{rank:05d}_states.json"


def client_file(rank: int) -> str:
    return f"rank{rank:05d}_client.safetensors"


def save_checkpoint(save_dir: str | os.PathLike, tag: str, *, rank: int, group: Any, store: ParamStore,
                    optimizer: Any, state: Mapping[str, Any], update_latest: bool = True,
                    exclude_frozen: bool = False) -> str:
    """Write this rank's partitions, optimizer state and ``state`` (JSON-able plus tensors) under
    ``save_dir/tag`` atomically with the other ranks; return the tag's path.

    ``update_latest`` False leaves ``latest`` alone; ``exclude_frozen`` leaves out the partitions of
    parameters that do not require gradients.
    One partition and one optimizer sub-group in memory at a time. Raises TypeError naming the
    entry of ``state`` that is neither JSON nor a tensor (before anything is written), OSError
    naming the file for ENOSPC and the like, TensorIOError for the swap files.
    """
    encoded, tensors = encode_state(dict(state))
    records = store.records
    saved = [rec for rec in records if rec.param.requires_grad or not exclude_frozen]
    # One staging directory for all ranks; the tag commits only once every rank's files are in
    # place, and if any rank fails nothing becomes visible and every rank raises.
    with atomic_checkpoint(save_dir, tag, all_ranks=True, group=group, update_latest=update_latest) as staging:
        # 1. Parameters, one partition at a time.
        layout = {rec.name: (rec.partition.dtype, (rec.partition_numel,)) for rec in saved}
        with _naming_the_file(staging / params_file(rank)) as path, SafetensorsWriter(path, layout) as out:
            for rec in saved:
                out.write(rec.name, store.read_partition(rec))
        # 2. The optimizer state, one sub-group at a time.
        with sized_partitions([rec for rec in records if rec.param.requires_grad]):
            layout = {name: (torch.float32, (numel,)) for name, numel in optimizer.state_layout().items()}
            with _naming_the_file(staging / optimizer_file(rank)) as path, SafetensorsWriter(path, layout) as out:
                encoded["optimizer"] = optimizer.save_state(lambda name, first, values: out.write(name, values, first))
        # 3. The rest, small: JSON, and the client's tensors beside it.
        if tensors:
            with _naming_the_file(staging / client_file(rank)) as path:
                with SafetensorsWriter(path, {k: (t.dtype, t.shape) for k, t in tensors.items()}) as out:
                    for name, tensor in tensors.items():
                        out.write(name, tensor)
        with _naming_the_file(staging / states_file(rank)) as path, open(path, "w") as file:
            json.dump({"format": _FORMAT, **encoded}, file, allow_nan=True)
    return os.path.join(os.fspath(save_dir), tag)


def load_checkpoint(load_dir: str | os.PathLike, tag: str | None, *, rank: int, world_size: int,
                    store: ParamStore, optimizer: Any) -> tuple[str, dict[str, Any]]:
    """Load a checkpoint written by `save_checkpoint` into the partitions and the optimizer; return
    its path and the rest of the state it saved (counters, schedule, client state).

    ``optimizer`` None leaves the optimizer's state as it is. Frozen parameters missing from the
    checkpoint (saved with ``exclude_frozen``) keep their values.
    Raises FileNotFoundError for a missing checkpoint or file (naming it), ValueError when it was
    saved with another world size, for another model, or by a version that pickled its state
    (before any parameter changes).
    """
    from safetensors import safe_open

    path = str(resolve_tag(load_dir, tag))
    state = _read_states(path, rank)
    if state["world_size"] != world_size:
        raise ValueError(f"{path}: saved with {state['world_size']} ranks, loading with {world_size}; "
                         f"resume with the same world size")
    with safe_open(_existing(path, params_file(rank)), framework="pt") as params:
        names = set(params.keys())
        records = [rec for rec in store.records if rec.name in names or rec.param.requires_grad]
        _check_params(path, params, records)
        # 1. Parameters first, one at a time (a few writes in flight): a 16-bit parameter's
        #    optimizer state may take its master copy from it.
        writes: list = []
        for rec in records:
            values = params.get_tensor(rec.name)
            if rec.on_disk:
                staged = aligned_tensor(rec.partition_numel, rec.partition.dtype)  # O_DIRECT from it
                staged.copy_(values)
                writes.append(store.write_partition(rec, staged))  # the request keeps ``staged`` alive
                if len(writes) > 2:
                    writes.pop(0).result()  # sync point: bounds the memory in flight
            else:
                rec.partition.data.copy_(values)
            store.refresh(rec)
        for future in writes:  # sync point
            future.result()
    if optimizer is None:
        state.pop("optimizer")
        return path, state
    # 2. Then the optimizer.
    with sized_partitions([rec for rec in records if rec.param.requires_grad]):
        with safe_open(_existing(path, optimizer_file(rank)), framework="pt") as moments:
            layout = {name: moments.get_slice(name).get_shape()[0] for name in moments.keys()}
            optimizer.load_state(state.pop("optimizer"), layout,
                                 lambda name, start, stop: moments.get_slice(name)[start:stop])
    return path, state


def save_16bit_model(save_dir: str | os.PathLike, save_filename: str, *, rank: int, world_size: int,
                     group: Any, store: ParamStore) -> None:
    """Write the whole model's weights (gathered across ranks, in the training dtype) to
    ``save_dir/save_filename`` as safetensors; rank 0 writes. Every rank must call it.

    One gathered parameter in memory at a time; the file appears whole or not at all. Raises
    ValueError for a ``save_filename`` that is not a plain file name (it would leave ``save_dir``),
    OSError naming the file when it cannot be written.
    """
    if os.path.basename(save_filename) != save_filename or save_filename in ("", ".", ".."):
        raise ValueError(f"save_filename {save_filename!r}: use a plain file name; it is written inside "
                         f"save_dir {os.fspath(save_dir)!r}")
    records = store.records
    writer: Any = contextlib.nullcontext()
    if rank == 0:
        os.makedirs(save_dir, exist_ok=True)
        target = os.path.join(os.fspath(save_dir), save_filename)
        writer = _naming_the_file(target, atomic_safetensors(
            target, {rec.name: (rec.param.dtype, rec.shape) for rec in records}))
    with writer as out:
        for rec in records:  # every rank gathers (a collective); rank 0 writes
            kept = rec.full is not None
            full = store.gather(rec)
            if out is not None:
                out.write(rec.name, full.view(rec.shape))
            if not kept:
                store.release(rec)
    if world_size > 1:
        dist.barrier(group=group)


class sized_partitions:
    """Give on-disk partitions an uninitialised tensor of their size (virtual memory only) meanwhile:
    the optimizer plans and streams its state by its parameters' sizes."""

    def __init__(self, recs: list[ParamRecord]) -> None:
        self.recs = [rec for rec in recs if rec.on_disk and rec.partition.numel() != rec.partition_numel]

    def __enter__(self) -> None:
        for rec in self.recs:
            rec.partition.data = torch.empty(rec.partition_numel, dtype=rec.partition.dtype)

    def __exit__(self, *exc: object) -> None:
        for rec in self.recs:
            rec.partition.data = torch.empty(0, dtype=rec.partition.dtype)


# ---- state as JSON plus tensors -----------------------------------------------------------------------

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


def _read_states(path: str, rank: int) -> dict[str, Any]:
    from safetensors.torch import load_file

    states = os.path.join(path, states_file(rank))
    if not os.path.exists(states):
        pickled = os.path.join(path, f"rank{rank:05d}_states.pt")
        if os.path.exists(pickled):
            raise ValueError(f"{pickled}: a checkpoint of an earlier version, whose state is pickled; it is not "
                             f"loaded, because unpickling a file can run any code. Load it with that version and "
                             f"save it again")
        _existing(path, states_file(rank))
    try:
        with open(states) as file:
            encoded = json.load(file)
    except json.JSONDecodeError as error:
        raise ValueError(f"{states}: not a checkpoint state file ({error})") from None
    if not isinstance(encoded, dict) or encoded.pop("format", None) != _FORMAT:
        raise ValueError(f"{states}: not a checkpoint state file of format {_FORMAT}")
    client = os.path.join(path, client_file(rank))
    tensors = load_file(client) if os.path.exists(client) else {}
    state = decode_state(encoded, tensors)
    for group in state["optimizer"]["param_groups"]:
        if isinstance(group.get("betas"), list):
            group["betas"] = tuple(group["betas"])  # as torch.optim keeps them
    return state


def _check_params(path: str, params: Any, records: list[ParamRecord]) -> None:
    names = set(params.keys())
    if names != {rec.name for rec in records}:
        raise ValueError(f"{path}: the checkpoint's parameters differ from the model's "
                         f"(missing: {sorted({r.name for r in records} - names)[:5]}, "
                         f"unexpected: {sorted(names - {r.name for r in records})[:5]})")
    for rec in records:
        numel = params.get_slice(rec.name).get_shape()[0]
        if numel != rec.partition_numel:
            raise ValueError(f"{path}: parameter {rec.name!r} has {numel} elements, the model "
                             f"{rec.partition_numel} per rank; load it into the same model")


def _existing(directory: str, name: str) -> str:
    path = os.path.join(directory, name)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: missing from the checkpoint; it is incomplete or of another world size")
    return path


@contextlib.contextmanager
def _naming_the_file(path: str | os.PathLike, inner: Any = None) -> Iterator[Any]:
    """Yield ``inner``'s value (or ``path``); an OSError without a file name gets ``path`` as its file name."""
    try:
        if inner is None:
            yield path
        else:
            with inner as value:
                yield value
    except OSError as error:
        if error.filename is None and error.errno is not None:
            raise type(error)(error.errno, error.strerror, os.fspath(path)) from error
        raise
