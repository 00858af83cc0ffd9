"""Offline consolidation: a checkpoint of `Engine.save_checkpoint` (any world size) into full
weights, with DeepSpeed's names (``deepspeed.utils.zero_to_fp32``).

    get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag=None)        -> {name: fp32 tensor}
    convert_zero_checkpoint_to_fp32_state_dict(checkpoint_dir, output_dir)    -> safetensors shards +
                                                                                 index + config.json
    load_state_dict_from_zero_checkpoint(model, checkpoint_dir, tag=None)     -> model, weights loaded

Each parameter's fp32 value is its fp32 master where the engine kept one (fp16/bf16 training: the
optimizer's ``<i>.master_param``), else its partitions (fp32 training; frozen parameters in their
dtype), each rank's partition read from the file that holds it. `convert_zero_checkpoint_to_fp32_state_dict`
streams in runs of 64 MiB: four are read ahead while the ones before are written, both with O_DIRECT
(the page cache is left alone). The rank files' data starts page-aligned (``RANK_FILE_ALIGN``) and so
does the output's, so a run whose tensors before it are whole pages (every fp32 tensor of GPT-2 and
Llama shapes) is written from the buffer it was read into, with no copy; other runs, and every run
of ``--dtype bf16|fp16``, are copied (converted on the way) into one of two 64 MiB write chunks. The
memory is bounded by the read buffers (`_BUFFERS` runs, reused: faulting fresh memory in for every
tensor ran at a tenth of the disk's speed here) and the two chunks, under 1 GB whatever the model's
size or its largest tensor. What it writes is what ``transformers``' ``save_pretrained`` writes: ``model.safetensors``
or ``model-0000i-of-0000n.safetensors`` shards with ``model.safetensors.index.json``, ``format: pt``
metadata, the model's config.json (saved in the checkpoint) and its generation_config.json (saved in the
checkpoint's tag, or, for a checkpoint saved without it, beside the tag, where transformers' Trainer writes
it in a checkpoint-<step> folder), so ``from_pretrained(output_dir)`` loads it. Tied parameters are written once, under their first name, as ``save_pretrained`` does.

Where DeepSpeed differs: ``safe_serialization=False`` would have it write a pickled
``pytorch_model.bin``; pickles run code when loaded, so safetensors are written either way (a log
line says so).
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import json
import logging
import math
import os
import re
import tempfile
from typing import Any, Iterator

import torch
from torch import nn

from tensorio import DIRECT_ALIGN

from offload.storage import resolve_tag
from offload.storage.checkpoint_dir import fsync_dir
from offload.storage.safetensors_writer import DirectSafetensorsWriter
from offload.train.checkpoint.files import write_json
from offload.train.checkpoint.reader import READ_BUFFER_BYTES, CheckpointReader

__all__ = ["consolidated_tensors", "convert_zero_checkpoint_to_fp32_state_dict",
           "get_fp32_state_dict_from_zero_checkpoint", "load_state_dict_from_zero_checkpoint", "parse_size"]

log = logging.getLogger("offload")

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
"""The output dtypes by their command-line names."""

_CHUNK = 16 << 20
"""Elements per read of the streamed copy (64 MiB of fp32)."""

_AHEAD = 4
"""Reads of the streamed copy in flight: the disk always has the next ones queued."""

_WRITES = 3
"""Runs being written straight from their read buffers at a time (`DirectSafetensorsWriter`)."""

_BUFFERS = _AHEAD + 1 + _WRITES
"""Read buffers in use at once: the runs read ahead, the one being handed over, those being written."""

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(value: int | str, key: str = "max_shard_size") -> int:
    """Bytes of ``value``: an int, or "5GB" / "500MB" / "2GiB" (transformers' units: GB is 10^9).
    Raises ValueError naming ``key`` for anything else or a size below 1."""
    if isinstance(value, int) and not isinstance(value, bool):
        size = value
    else:
        match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*", str(value))
        if not match or match.group(2).upper() not in _UNITS:
            raise ValueError(f"{key}: {value!r} is not a size; use bytes or a number with a unit such as 5GB, "
                             f"500MB or 2GiB")
        size = int(float(match.group(1)) * _UNITS[match.group(2).upper()])
    if size < 1:
        raise ValueError(f"{key}: {value!r} is not allowed; use at least 1 byte")
    return size


def consolidated_tensors(checkpoint_dir: str | os.PathLike, tag: str | None = None, *,
                         dtype: torch.dtype = torch.float32, exclude_frozen_parameters: bool = False,
                         reader: CheckpointReader | None = None) -> Iterator[tuple[list[str], torch.Tensor]]:
    """Yield ``(names, full tensor in dtype)`` per parameter, in the model's order, one at a time
    (the next one is read meanwhile). ``names`` holds every name of a tied parameter, first name first.

    Raises FileNotFoundError / SafetensorsError / ValueError naming the file (as `CheckpointReader`),
    ValueError for a checkpoint saved before parameter shapes were recorded, TensorIOError.
    """
    own = reader is None
    reader = reader or CheckpointReader(resolve_tag(checkpoint_dir, tag))
    try:
        sources = _sources(reader, exclude_frozen_parameters)
        pending = _start(reader, sources[0]) if sources else None
        for i, (entry, kind, key) in enumerate(sources):
            values = pending.result()
            pending = _start(reader, sources[i + 1]) if i + 1 < len(sources) else None
            yield list(entry["names"]), values.to(dtype).view(entry["shape"])
    finally:
        if own:
            reader.close()


def get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir: str | os.PathLike, tag: str | None = None,
                                             exclude_frozen_parameters: bool = False) -> dict[str, torch.Tensor]:
    """The whole model's fp32 weights as a state dict, in memory (every name of a tied parameter
    maps to the same tensor), as DeepSpeed's function of this name returns. ``checkpoint_dir`` is
    the ``save_dir`` (``tag`` None: the one ``latest`` names). For a model larger than memory use
    `convert_zero_checkpoint_to_fp32_state_dict`, which streams. Raises as `consolidated_tensors`."""
    state: dict[str, torch.Tensor] = {}
    for names, tensor in consolidated_tensors(checkpoint_dir, tag, exclude_frozen_parameters=exclude_frozen_parameters):
        tensor = tensor.clone() if tensor.untyped_storage().nbytes() != tensor.nbytes else tensor
        for name in names:
            state[name] = tensor
    return state


def load_state_dict_from_zero_checkpoint(model: nn.Module, checkpoint_dir: str | os.PathLike,
                                         tag: str | None = None) -> nn.Module:
    """Load the checkpoint's fp32 weights into ``model`` (a plain module, not an engine's) and return
    it, as DeepSpeed's function of this name does. Raises as `consolidated_tensors`, and
    RuntimeError (``load_state_dict``) for a model of another shape."""
    state = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag)
    model.load_state_dict(state, strict=False)
    return model


def convert_zero_checkpoint_to_fp32_state_dict(checkpoint_dir: str | os.PathLike, output_dir: str | os.PathLike,
                                               max_shard_size: int | str = "5GB", safe_serialization: bool = False,
                                               tag: str | None = None, exclude_frozen_parameters: bool = False, *,
                                               dtype: torch.dtype = torch.float32, progress: bool = False) -> None:
    """Write the checkpoint's weights (fp32, or ``dtype``) into ``output_dir`` as ``save_pretrained``
    does (see the module's docstring), streamed tensor by tensor, with a progress bar on stderr
    when ``progress``. DeepSpeed's signature; ``safe_serialization`` is ignored (always safetensors).
    Each file appears whole or not at all. Returns None, as DeepSpeed does.

    Raises as `consolidated_tensors`, ValueError for a bad ``max_shard_size``, OSError naming the
    output file (ENOSPC, permission denied).
    """
    from tqdm import tqdm

    limit = parse_size(max_shard_size)
    if not safe_serialization:
        log.info("convert_zero_checkpoint_to_fp32_state_dict: writing safetensors (DeepSpeed would write a pickled "
                 "pytorch_model.bin for safe_serialization=False; pickles run code when loaded)")
    output_dir = os.fspath(output_dir)
    os.makedirs(output_dir, exist_ok=True)
    with CheckpointReader(resolve_tag(checkpoint_dir, tag), pool_bytes=_BUFFERS * READ_BUFFER_BYTES) as reader:
        entries = [entry for entry, _, _ in _sources(reader, exclude_frozen_parameters)]
        itemsize = torch.empty((), dtype=dtype).element_size()
        shards = _shards(entries, itemsize, limit)
        names = _shard_names(len(shards))
        total = sum(math.prod(entry["shape"]) * itemsize for entry in entries)
        sources = {entry["name"]: (kind, key) for entry, kind, key in _sources(reader, exclude_frozen_parameters)}
        chunks = _chunks(entries, sources, reader)
        weight_map = {}
        with tqdm(total=total, unit="B", unit_scale=True, desc="consolidating", disable=not progress) as bar:
            for shard, file in zip(shards, names):
                layout = {entry["name"]: (dtype, tuple(entry["shape"])) for entry in shard}
                with _atomic_direct(os.path.join(output_dir, file), layout, reader) as out:
                    for entry in shard:
                        for _ in range(_chunk_count(entry)):
                            values = next(chunks)  # converted to dtype as it is copied for writing
                            out.write(entry["name"], values)
                            bar.update(values.numel() * itemsize)
                        weight_map[entry["name"]] = file
        if len(shards) > 1:
            write_json(os.path.join(output_dir, "model.safetensors.index.json"),
                        {"metadata": {"total_size": total}, "weight_map": weight_map})
        config = reader.model_config()
        if config is not None:
            # transformers reads "dtype" (older versions "torch_dtype"): both say what the weights are
            config["dtype"] = config["torch_dtype"] = str(dtype).removeprefix("torch.")
            write_json(os.path.join(output_dir, "config.json"), config)
        generation = _generation_config(reader.path, checkpoint_dir)
        if generation is not None:
            write_json(os.path.join(output_dir, _GENERATION_CONFIG), generation)
    fsync_dir(output_dir)


_GENERATION_CONFIG = "generation_config.json"


def _generation_config(tag_dir: str | os.PathLike, save_dir: str | os.PathLike) -> dict[str, Any] | None:
    """The model's generation_config.json: the tag's (checked with the checkpoint's other files), else the
    one in ``save_dir`` beside the tag (a Trainer's checkpoint-<step> folder holds the one its
    ``save_model`` wrote), else None. Raises ValueError naming the file when it is not JSON."""
    for directory in (tag_dir, save_dir):
        path = os.path.join(os.fspath(directory), _GENERATION_CONFIG)
        if os.path.isfile(path):
            with open(path, encoding="utf-8") as file:
                try:
                    return json.load(file)
                except json.JSONDecodeError as error:
                    raise ValueError(f"{path}: not a JSON generation config ({error})") from None
    return None


def _sources(reader: CheckpointReader, exclude_frozen: bool) -> list[tuple[dict[str, Any], str, str]]:
    """(parameter entry, file kind, tensor name) per parameter: the fp32 master where there is one."""
    parameters = reader.state.get("parameters")
    if parameters is None:
        raise ValueError(f"{reader.path}: saved by a version that did not record the parameters' shapes; load it "
                         f"into the engine and save it again to consolidate it offline")
    masters = set(reader.names("optimizer"))
    out = []
    for entry in parameters:
        index = entry["optimizer_index"]
        if index is None and exclude_frozen:
            continue
        master = f"{index}.master_param"
        out.append((entry, "optimizer", master) if index is not None and master in masters
                   else (entry, "params", entry["name"]))
    return out


def _chunk_count(entry: dict[str, Any]) -> int:
    return max(1, -(-math.prod(entry["shape"]) // _CHUNK))


def _chunks(entries: list[dict[str, Any]], sources: dict[str, tuple[str, str]],
            reader: CheckpointReader) -> Iterator[torch.Tensor]:
    """Every tensor's elements in runs of at most `_CHUNK`, in order, `_AHEAD` runs read ahead: a
    streamed copy holds a few runs, not whole tensors."""
    def runs() -> Iterator[tuple[str, str, int, int, int]]:
        for entry in entries:
            kind, key = sources[entry["name"]]
            numel = math.prod(entry["shape"])
            for first in range(0, max(numel, 1), _CHUNK):
                yield kind, key, first, min(first + _CHUNK, numel), numel
    pending: collections.deque = collections.deque()
    todo = runs()
    for kind, key, start, stop, numel in itertools.islice(todo, _AHEAD):
        pending.append(reader.read(kind, key, start, stop, numel=numel))
    while pending:
        values = pending.popleft().result()
        for kind, key, start, stop, numel in itertools.islice(todo, 1):
            pending.append(reader.read(kind, key, start, stop, numel=numel))
        yield values


def _start(reader: CheckpointReader, source: tuple[dict[str, Any], str, str]):
    entry, kind, key = source
    numel = math.prod(entry["shape"])
    return reader.read(kind, key, 0, numel, numel=numel)


def _shards(entries: list[dict[str, Any]], itemsize: int, limit: int) -> list[list[dict[str, Any]]]:
    """Parameters in order, cut into shards of at most ``limit`` bytes (a larger tensor is a shard alone)."""
    shards: list[list[dict[str, Any]]] = [[]]
    size = 0
    for entry in entries:
        nbytes = math.prod(entry["shape"]) * itemsize
        if shards[-1] and size + nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append(entry)
        size += nbytes
    return shards


def _shard_names(count: int) -> list[str]:
    if count == 1:
        return ["model.safetensors"]
    return [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]


@contextlib.contextmanager
def _atomic_direct(path: str, layout: dict[str, tuple[torch.dtype, tuple[int, ...]]],
                   reader: CheckpointReader) -> Iterator[DirectSafetensorsWriter]:
    """A `DirectSafetensorsWriter` (format pt, through the reader's handle) on a hidden temporary file
    beside ``path``, renamed over it when the block ends without an error, removed otherwise."""
    descriptor, temporary = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp",
                                             dir=os.path.dirname(path))
    os.close(descriptor)
    try:
        with DirectSafetensorsWriter(temporary, layout, {"format": "pt"}, reader.handle, data_align=DIRECT_ALIGN,
                                     in_flight=_WRITES) as out:
            yield out
        os.replace(temporary, path)
    except BaseException:
        if os.path.exists(temporary):
            os.unlink(temporary)
        raise
