"""The engine's checkpoints: each rank's partitions, optimizer state and counters, streamed, and
nothing in them that runs code when loaded.

Layout of ``save_dir/<tag>/`` (see docs/engine.md, "Checkpoints"; file names in
`offload.train.checkpoint.files`); per rank ``r`` (5 digits):

    rank<r>_params.safetensors     this rank's parameter partitions, flat, by parameter name
    rank<r>_optimizer.safetensors  this rank's optimizer state, flat fp32, "<index>.<key>"
    rank<r>_states.json            counters, loss scale, schedule, optimizer steps and param groups,
                                   the parameters' names and shapes, and the caller's ``client_state``
    rank<r>_client.safetensors     tensors of ``client_state``, when it holds any

and once: ``config.json`` (the model's, when it has a transformers config), ``generation_config.json``
(when the model can generate, as ``save_pretrained`` writes it) and ``zero_to_fp32.py`` (runs
`offload.train.checkpoint.consolidate` on this tag: ``python zero_to_fp32.py OUTPUT_DIR``).

JSON and safetensors only: loading a checkpoint never unpickles, so a checkpoint from someone else
cannot execute anything. ``client_state`` may hold what JSON holds (dicts with str keys, lists,
str, int, float, bool, None) and tensors; tuples come back as lists.

A checkpoint loads at any world size: each rank reads its partition of every tensor from the saved
ranks' files that hold it (`offload.train.checkpoint.reader`).
"""

from __future__ import annotations

import collections
import contextlib
import copy
import json
import os
import time
from typing import Any, Iterator, Mapping

import torch
import torch.distributed as dist
from torch import nn

from tensorio import AioConfig, AioHandle

from offload.params import ParamRecord, ParamStore
from offload.params.partition import partition_numel
from offload.storage import SafetensorsWriter, atomic_checkpoint, atomic_safetensors, resolve_tag
from offload.storage.host_copy import host_copy
from offload.train.checkpoint.files import (RANK_FILE_ALIGN, client_file, decode_state, encode_state, optimizer_file,
                                            params_file, states_file, write_json)
from offload.train.checkpoint.reader import READ_AHEAD_BYTES, CheckpointReader, PendingRead, ReadAhead
from offload.train.checkpoint.snapshot import Snapshot
from offload.train.checkpoint.states_file import states_bytes, whole_file_checksum
from offload.train.step.agree import StepAgreement
from offload.train.surface import in_optimizer_order

__all__ = ["CheckpointLoad", "CheckpointSave", "decode_state", "encode_state", "model_config", "save_16bit_model", "save_checkpoint"]

CONFIG_NAME = "config.json"
GENERATION_CONFIG_NAME = "generation_config.json"
SCRIPT_NAME = "zero_to_fp32.py"

_SCRIPT = '''#!/usr/bin/env python
"""Consolidate the checkpoint in this directory into one set of weights that from_pretrained loads.

    python zero_to_fp32.py OUTPUT_DIR [--dtype fp32|bf16|fp16] [--max-shard-size 5GB]

The same as `python -m offload.checkpoint consolidate SAVE_DIR OUTPUT_DIR --tag TAG`; needs the
tensorio-offload package (pip install tensorio-offload). Streams tensor by tensor: memory stays
bounded by the largest tensor, whatever the model's size.
"""
import os
import sys

from offload.checkpoint import main

tag_dir = os.path.dirname(os.path.abspath(__file__))
sys.exit(main(["consolidate", os.path.dirname(tag_dir), *sys.argv[1:], "--tag", os.path.basename(tag_dir)]))
'''


def save_checkpoint(save_dir: str | os.PathLike, tag: str, *, rank: int, group: Any, store: ParamStore,
                    optimizer: Any, state: Mapping[str, Any], model: nn.Module | None = None,
                    update_latest: bool = True, exclude_frozen: bool = False, aio: AioConfig | None = None) -> str:
    """Write this rank's partitions, optimizer state and ``state`` (JSON-able plus tensors) under
    ``save_dir/tag`` atomically with the other ranks; rank 0 also writes ``model``'s config.json
    (when it has a transformers config) and zero_to_fp32.py. Return the tag's path.

    ``update_latest`` False leaves ``latest`` alone; ``exclude_frozen`` leaves out the partitions of
    parameters that do not require gradients; ``aio``: the engine's settings (its backend; ``direct`` False
    writes through the page cache), see `CheckpointSave`.
    One partition and one optimizer sub-group in memory at a time. Raises TypeError naming the
    entry of ``state`` that is neither JSON nor a tensor (before anything is written), OSError
    naming the file for ENOSPC and the like, TensorIOError for the swap files.
    """
    job = CheckpointSave(store, optimizer, state, exclude_frozen=exclude_frozen, aio=aio)
    return job.run(save_dir, tag, rank=rank, group=group, model=model, update_latest=update_latest)


class CheckpointSave:
    """One save of this rank's state, prepared on the caller's thread and `run` on any thread.

    ``snapshot`` False reads the live state as `run` goes (the synchronous save: nothing may change it
    meanwhile). ``snapshot`` True fixes the state now (`Snapshot`: swap-file slots pinned, state in memory
    copied), so that `run` may write it from a background thread while training goes on; call `close`
    once it has run or will not (lets the pins go). ``bytes_written`` / ``total_bytes``: its progress.

    The partitions and optimizer state are written with O_DIRECT through a tensorio handle of the save's own
    (``aio``'s backend), from a few page-aligned chunks taken from the swap file's buffer pool, the page cache
    left alone; where the file system refuses O_DIRECT (or ``aio.direct`` is False) through the page cache, the
    same bytes. `write_modes` says which, per file.

    Raises TypeError naming the entry of ``state`` that is neither JSON nor a tensor (here, before
    anything is written), ValueError from `Snapshot` for an optimizer it cannot read.
    """

    def __init__(self, store: ParamStore, optimizer: Any, state: Mapping[str, Any], *, exclude_frozen: bool = False,
                 snapshot: bool = False, aio: AioConfig | None = None) -> None:
        self.store, self.optimizer, self.aio = store, optimizer, aio or AioConfig()
        self.write_modes: dict[str, str] = {}
        """File name -> "O_DIRECT", or "buffered: <why>", for the tensor files `run` wrote."""
        records = store.records
        self.encoded, self.tensors = encode_state({**state, "parameters": _parameter_list(records, optimizer)})
        self.saved = [rec for rec in records if rec.param.requires_grad or not exclude_frozen]
        self.trainable = [rec for rec in records if rec.param.requires_grad]
        self.snapshot: Snapshot | None = None
        self.layout: dict[str, int] | None = None
        if snapshot:  # the caller's values of this moment, whatever changes them later
            self.encoded = copy.deepcopy(self.encoded)
            self.tensors = {name: tensor.clone() for name, tensor in self.tensors.items()}
            with sized_partitions(self.trainable):
                self.layout = optimizer.state_layout()
            self.snapshot = Snapshot(store, optimizer, self.saved)
        self.bytes_written = 0
        self.total_bytes = sum(rec.partition_numel * rec.partition.element_size() for rec in self.saved) + \
            4 * sum((self.layout or {}).values())
        """Bytes of tensors the save writes (optimizer state included once its layout is known)."""

    def run(self, save_dir: str | os.PathLike, tag: str, *, rank: int, group: Any, model: nn.Module | None = None,
            update_latest: bool = True) -> str:
        """Write the checkpoint (see `save_checkpoint`); return the tag's path. Raises OSError naming the
        file (ENOSPC, ...), TensorIOError for the swap files; nothing becomes visible then."""
        encoded, tensors, snapshot = self.encoded, self.tensors, self.snapshot
        # One staging directory for all ranks; the tag commits only once every rank's files are in
        # place, and if any rank fails nothing becomes visible and every rank raises.
        with atomic_checkpoint(save_dir, tag, all_ranks=True, group=group, update_latest=update_latest) as staging, \
                _write_handle(self.aio) as handle:
            # 1. Parameters, one partition at a time.
            # Each tensor file's checksums (hashed as it is written) go into the JSON (docs/reliability.md).
            checksums = encoded["checksums"] = {}
            layout = {rec.name: (rec.partition.dtype, (rec.partition_numel,)) for rec in self.saved}
            with _naming_the_file(staging / params_file(rank)) as path, self._writer(path, layout, handle) as out:
                parts = snapshot.partitions() if snapshot is not None else _partitions_read_ahead(self.store, self.saved)
                for rec, values in parts:
                    self._write(out, rec.name, values)
            checksums[params_file(rank)] = out.checksums.to_json()
            # 2. The optimizer state, one sub-group at a time.
            with sized_partitions(self.trainable if snapshot is None else []):
                if self.layout is None:
                    self.layout = self.optimizer.state_layout()
                    self.total_bytes += 4 * sum(self.layout.values())
                layout = {name: (torch.float32, (numel,)) for name, numel in self.layout.items()}
                with _naming_the_file(staging / optimizer_file(rank)) as path, self._writer(path, layout, handle) as out:
                    stream = snapshot.stream_optimizer if snapshot is not None else self.optimizer.save_state
                    encoded["optimizer"] = stream(lambda name, first, values: self._write(out, name, values, first))
                checksums[optimizer_file(rank)] = out.checksums.to_json()
            # 3. The rest, small: JSON, and the client's tensors beside it.
            if tensors:
                with _naming_the_file(staging / client_file(rank)) as path:
                    with SafetensorsWriter(path, {k: (t.dtype, t.shape) for k, t in tensors.items()}, checksums=True) as out:
                        for name, tensor in tensors.items():
                            out.write(name, tensor)
                checksums[client_file(rank)] = out.checksums.to_json()
            if rank == 0:  # before the state file, which records their checksums
                encoded["files"] = {name: f"{whole_file_checksum(staging / name)[0]:016x}"
                                    for name in _write_beside(staging, model)}
            with _naming_the_file(staging / states_file(rank)) as path, open(path, "wb") as file:
                file.write(states_bytes(encoded))  # its own checksum in its head
        return os.path.join(os.fspath(save_dir), tag)

    def _writer(self, path: Any, layout: dict[str, Any], handle: AioHandle | None) -> SafetensorsWriter:
        """A rank file's writer: checksummed, preallocated, O_DIRECT through ``handle`` where it can."""
        pool = getattr(self.store.swap, "pool", None)  # the engine's I/O buffers, where there is a swap file
        out = SafetensorsWriter(path, layout, data_align=RANK_FILE_ALIGN, checksums=True, handle=handle, pool=pool,
                                preallocate=True)
        self.write_modes[os.path.basename(path)] = "O_DIRECT" if out.direct else \
            f"buffered: {'aio.direct is false' if handle is None else out.buffered_reason}"
        return out

    def _write(self, out: SafetensorsWriter, name: str, values: torch.Tensor, first: int = 0) -> None:
        out.write(name, values, first)
        self.bytes_written += values.numel() * values.element_size()

    def close(self) -> None:
        """Let the snapshot's pinned slots go and drop its copies. Never raises."""
        if self.snapshot is not None:
            self.snapshot.close()


class CheckpointLoad:
    """A checkpoint opened and checked against the model and optimizer; nothing has changed yet.
    `apply` loads it, in one pass. Use as a context manager (closes its files).

    Any world size loads: with another than the one that saved it, each parameter's partition, fp32
    master and moments are cut from the saved ranks' files (the padding past the tensor's end is
    zero, as a fresh partition's).

    Raises (on opening, before anything changes) FileNotFoundError for a missing checkpoint or file
    and SafetensorsError for a truncated or damaged one, each naming it; ValueError naming the file
    when it was saved for another model or by a version that pickled its state. `apply` raises
    tensorio.ChecksumError naming the file, the tensor and the offset for a flipped bit in any byte it reads,
    and leaves the engine's state as it was (see `apply`).

    ``optimizer`` None leaves the optimizer's state as it is. Frozen parameters missing from the
    checkpoint (saved with ``exclude_frozen``) keep their values. ``backend``: tensorio's, for the reads;
    ``group``: the ranks that load together (they agree before any of them commits).
    """

    def __init__(self, load_dir: str | os.PathLike, tag: str | None, *, rank: int, world_size: int,
                 store: ParamStore, optimizer: Any, backend: str = "auto", group: Any = None) -> None:
        self.given = str(resolve_tag(load_dir, tag))
        """The tag's folder as the caller named it (``load_checkpoint`` returns it, as DeepSpeed's does)."""
        self.path = os.path.abspath(self.given)
        """The same, absolute: what the load reads and its messages name."""
        self.rank, self.world_size, self.store, self.optimizer = rank, world_size, store, optimizer
        self.group = group
        self.verified_bytes, self.verify_seconds = 0, 0.0
        """What `apply` read and checked against the checksums (each byte once), and how long its pass took."""
        self.committed = False
        """`apply` got past the point where every rank's bytes were good and the new state became the
        committed one: an error after it (none is expected) leaves a load part way."""
        self.reader = CheckpointReader(self.path, backend=backend)
        try:
            self.state = dict(self.reader.rank_state(rank))
            self.saved_world_size = self.reader.world_size
            self._trainable = (_optimizer_order(store.records, optimizer) if optimizer is not None else
                               [rec for rec in store.records if rec.param.requires_grad])
            self._check_params()
            if optimizer is not None:
                self._check_optimizer()
        except BaseException:
            self.reader.close()
            raise

    def __enter__(self) -> "CheckpointLoad":
        return self

    def __exit__(self, *exc: object) -> None:
        self.reader.close()

    def apply(self) -> dict[str, Any]:
        """Load the partitions, then the optimizer state, reading every byte once; return the rest of the
        saved state (counters, schedule, client state).

        One pass, verify and apply together, all or nothing (docs/reliability.md, "Loading a checkpoint"):
        each read is checked against its checksums as it lands and goes where the new state is *staged*,
        never over the live one: an on-disk partition or optimizer sub-group to its uncommitted swap slot
        (the A/B slots; the committed slot stays the live state), a partition or sub-group held in memory to
        a staging copy. Only once every byte of this rank matched and every rank of ``group`` agreed do the
        slots flip and the copies replace the live values. Any error before that (a ChecksumError, an I/O
        error, the optimizer's ValueError, another rank's failure as `RanksFailed`) rolls the staged slots
        back and drops the copies: the state is exactly as before, and training may go on. Every rank must
        call it (one all-reduce of a flag before the commit)."""
        records = self._saved_records()
        region = self.store.region
        if region is not None and region.staged:
            raise RuntimeError("internal error: load_checkpoint found parameter slots staged by a step not "
                               "committed or given up")
        compared, began = self.reader.bytes_verified, time.perf_counter()
        copies: list[tuple[ParamRecord, torch.Tensor]] = []
        agreed = False

        def agree() -> None:  # every byte of this rank checked; a failure anywhere stops every rank's commit
            nonlocal agreed
            agreed = True
            failed = self._agreement().agreed(None, f"load_checkpoint of {self.path}")
            if failed is not None:
                raise failed
        state = dict(self.state)
        saved = state.pop("optimizer")
        state.pop("parameters", None)
        try:
            self._stage_partitions(records, copies)
            if self.optimizer is None:
                agree()
            else:
                names = self.reader.names("optimizer")
                layout = {name: self._trainable[int(name.split(".")[0])].partition_numel for name in names}
                ahead = self._read_ahead(saved, layout)  # the next ranges read while one is checked and staged
                with sized_partitions(self._trainable):
                    try:
                        self.optimizer.load_state(saved, layout, lambda name, start, stop: ahead.take((name, start, stop)),
                                                  before_commit=agree)
                    except ValueError as error:
                        saved_by = self.rank if self.rank < self.saved_world_size else 0
                        raise ValueError(f"{os.path.join(self.path, states_file(saved_by))}: {error}") from error
                    finally:
                        ahead.close()  # sync point: no read left in flight into a buffer the pool gives out again
        except BaseException as error:
            if region is not None:
                region.rollback()  # reads take the committed slots again; nothing else changed
            if not agreed:
                failed = self._agreement().agreed(error if isinstance(error, Exception) else None,
                                                  f"load_checkpoint of {self.path}")
                if failed is not None and failed is not error:
                    raise failed from error
            raise
        # Every rank's bytes are good, and the optimizer's state committed: the partitions follow it.
        self.committed = True
        if region is not None:
            region.commit()
        for rec, values in copies:
            host_copy(rec.partition.data, values)
        for rec in records:
            self.store.refresh(rec)
        self.verify_seconds = time.perf_counter() - began
        self.verified_bytes = self.reader.bytes_verified - compared  # only bytes whose checksums were compared
        return state

    def _stage_partitions(self, records: list[ParamRecord], copies: list[tuple[ParamRecord, torch.Tensor]]) -> None:
        """Read every saved partition (checked as it lands, the next ones read meanwhile: `ReadAhead`) into where
        the new state is staged: an on-disk partition to its uncommitted slot (a few writes in flight), one in
        memory to a copy appended to ``copies``. Raises ChecksumError / TensorIOError; the caller rolls back."""
        region = self.store.region
        writes: list = []
        sizes = [rec.partition_numel * rec.partition.element_size() for rec in records]
        # Read ahead: at most the largest partition's bytes (and 64 MiB) beyond the one being staged, 4 reads.
        ahead = ReadAhead(range(len(records)), lambda i: self._read_partition(records[i]), sizes.__getitem__,
                          depth=4, max_bytes=min(READ_AHEAD_BYTES, max(sizes, default=0)))
        try:
            for i, rec in enumerate(records):
                values = ahead.take(i)
                if rec.on_disk:
                    # Written from the read buffer itself, no copy: page-aligned where the partition starts a
                    # page of the file (O_DIRECT from it), else tensorio stages it. The request keeps ``values``
                    # alive, so the reader's pool gives that buffer out again only once the write is done.
                    if values.dtype != rec.partition.dtype:  # saved in another dtype: converted
                        values = values.to(rec.partition.dtype)
                    writes.append(region.stage(rec.slots, values))
                    if len(writes) > 2:
                        writes.pop(0).result()  # sync point: bounds the memory in flight
                else:  # ``values`` is a read buffer the pool gives out again: copied out of it
                    copies.append((rec, host_copy(torch.empty_like(values), values)))
            for future in writes:  # sync point
                future.result()
        except BaseException:
            for future in writes:  # never roll back a slot still being written
                future.exception()
            raise
        finally:
            ahead.close()  # sync point: no read left in flight into a buffer the pool gives out again

    def _agreement(self) -> StepAgreement:
        return StepAgreement(world_size=self.world_size, rank=self.rank, group=self.group)

    def _saved_records(self) -> list[ParamRecord]:
        """The store's records the checkpoint holds (frozen ones may be left out of it)."""
        saved = set(self.reader.names("params"))
        return [rec for rec in self.store.records if rec.name in saved]

    def _read_partition(self, rec: ParamRecord) -> PendingRead:
        """Start reading this rank's partition of ``rec``."""
        start = self.rank * rec.partition_numel
        return self.reader.read("params", rec.name, start, start + rec.partition_numel,
                                numel=None if self.saved_world_size == self.world_size else rec.numel)

    def _read_ahead(self, saved: Mapping[str, Any], layout: Mapping[str, int]) -> ReadAhead:
        """The optimizer's reads, in the order its `load_state` asks for them (`OffloadAdam.load_reads`), started
        ahead: at most one sub-group's state (and `READ_AHEAD_BYTES`) beyond the range being staged. An optimizer
        that cannot say its order is read one range at a time."""
        plan = getattr(self.optimizer, "load_reads", None)
        groups = plan(saved, layout) if plan is not None else []
        largest = max((sum(4 * (stop - start) for _, start, stop in group) for group in groups), default=0)
        return ReadAhead([key for group in groups for key in group], lambda key: self._read_state(*key),
                         lambda key: 4 * (key[2] - key[1]), max_bytes=min(READ_AHEAD_BYTES, largest))

    def _read_state(self, name: str, start: int, stop: int) -> PendingRead:
        """Start reading elements ``[start, stop)`` of this rank's partition of optimizer state ``name``."""
        rec = self._trainable[int(name.split(".")[0])]
        base = self.rank * rec.partition_numel
        return self.reader.read("optimizer", name, base + start, base + stop,
                                numel=None if self.saved_world_size == self.world_size else rec.numel)

    def _check_params(self) -> None:
        file = os.path.join(self.path, params_file(0))
        names = set(self.reader.names("params"))
        ours = {rec.name for rec in self.store.records}
        missing = {rec.name for rec in self._trainable} - names  # frozen ones may be left out (exclude_frozen)
        if missing or names - ours:
            raise ValueError(f"{file}: the checkpoint's parameters differ from the model's "
                             f"(missing: {sorted(missing)[:5]}, unexpected: {sorted(names - ours)[:5]})")
        records = [rec for rec in self.store.records if rec.name in names]
        for rec in records:
            saved = self.reader.tensor("params", rec.name).shape[0]
            if saved != partition_numel(rec.numel, self.saved_world_size):
                raise ValueError(f"{file}: parameter {rec.name!r} has {saved} elements per rank of "
                                 f"{self.saved_world_size}, the model's {rec.numel} elements would have "
                                 f"{partition_numel(rec.numel, self.saved_world_size)}; load it into the same model")

    def _check_optimizer(self) -> None:
        file = os.path.join(self.path, optimizer_file(0))
        saved = self.state["optimizer"]
        # The groups first: other groups number the parameters in another order, and the sizes below would
        # then disagree without saying why.
        groups, ours = saved["param_groups"], self.optimizer.param_groups
        states = os.path.join(self.path, states_file(0))
        if len(groups) != len(ours) or any(len(g["params"]) != len(o["params"]) for g, o in zip(groups, ours)):
            raise ValueError(f"{states}: the checkpoint's optimizer has {len(groups)} param group(s) of "
                             f"{[len(g['params']) for g in groups]} parameters, this engine's {len(ours)} of "
                             f"{[len(o['params']) for o in ours]} (transformers' Trainer and OffloadTrainer save "
                             f"two: with and without weight decay); initialize with the same groups "
                             f"(model_parameters=) to resume it, or load the weights alone with "
                             f"load_module_only=True (fp32 training) or engine.load_pretrained")
        for name in self.reader.names("optimizer"):
            index = int(name.split(".")[0])
            if not 0 <= index < len(self._trainable):
                raise ValueError(f"{file}: state {name!r} is for parameter {index}; the model has "
                                 f"{len(self._trainable)} trainable parameters")
            rec = self._trainable[index]
            size = self.reader.tensor("optimizer", name).shape[0]
            if size != partition_numel(rec.numel, self.saved_world_size):
                raise ValueError(f"{file}: state {name!r} has {size} elements per rank, the model's {rec.name!r} "
                                 f"({rec.numel} elements) would have {partition_numel(rec.numel, self.saved_world_size)}")
        names = set(self.reader.names("optimizer"))
        for index in saved["steps"]:
            for key in ("exp_avg", "exp_avg_sq"):
                if f"{index}.{key}" not in names:
                    raise ValueError(f"{file}: no {key} for parameter {index}, which has a step count")


def model_config(model: nn.Module | None) -> dict[str, Any] | None:
    """``model``'s transformers config as config.json holds it (with ``architectures``), or None
    for a model without one."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "to_json_string"):
        return None
    values = json.loads(config.to_json_string(use_diff=False))
    values["architectures"] = [type(model).__name__]
    return values


def save_16bit_model(save_dir: str | os.PathLike, save_filename: str, *, rank: int, world_size: int,
                     group: Any, store: ParamStore, model: nn.Module | None = None) -> None:
    """Write the whole model's weights (gathered across ranks, in the training dtype) to
    ``save_dir/save_filename`` as safetensors with ``format: pt`` metadata, and ``model``'s
    config.json beside it (when it has a transformers config), so that ``from_pretrained(save_dir)``
    loads it as written; rank 0 writes. Every rank must call it.

    One gathered parameter in memory at a time; each file appears whole or not at all. Raises
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
            target, {rec.name: (rec.param.dtype, rec.shape) for rec in records}, {"format": "pt"}))
    with writer as out:
        for rec in records:  # every rank gathers (a collective); rank 0 writes
            kept = rec.full is not None
            full = store.gather(rec)
            if out is not None:
                out.write(rec.name, full.view(rec.shape).cpu())  # from the device where compute runs there
            if not kept:
                store.release(rec)
    if rank == 0:
        _write_config(save_dir, model)
    if world_size > 1:
        dist.barrier(group=group)


@contextlib.contextmanager
def _write_handle(aio: AioConfig) -> Iterator[AioHandle | None]:
    """The save's own tensorio handle for its O_DIRECT writes (1 MiB pieces, 16 in flight), closed at the end
    (its writes all waited for by then); None where ``aio.direct`` is False."""
    if aio.direct is False:
        yield None
        return
    with AioHandle(block_size=1 << 20, queue_depth=16, backend=aio.backend) as handle:
        yield handle


def _partitions_read_ahead(store: ParamStore, records: list[ParamRecord]) -> Iterator[tuple[ParamRecord, torch.Tensor]]:
    """(record, its partition) in order, the next on-disk partition's read started before this one is given
    out, so that reading one overlaps writing the other; two partitions in memory at most. An in-memory
    partition is given as it is (the save reads it and changes nothing). Raises TensorIOError."""
    pending: collections.deque = collections.deque()
    for rec in records:
        pending.append((rec, store.start_read_partition(rec) if rec.on_disk else (rec.partition.detach(), None)))
        if len(pending) > 1:
            yield _arrived(pending.popleft())
    while pending:
        yield _arrived(pending.popleft())


def _arrived(entry: tuple[ParamRecord, tuple[torch.Tensor, Any]]) -> tuple[ParamRecord, torch.Tensor]:
    rec, (values, future) = entry
    if future is not None:
        future.result()  # sync point
    return rec, values


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


def _parameter_list(records: list[ParamRecord], optimizer: Any) -> list[dict[str, Any]]:
    """Each parameter's names, shape, dtype and optimizer index (None when frozen): what the offline
    consolidation needs to rebuild full tensors."""
    index = {id(rec): i for i, rec in enumerate(_optimizer_order(records, optimizer))}
    return [{"name": rec.name, "names": list(rec.names), "shape": list(rec.shape),
             "dtype": str(rec.partition.dtype).removeprefix("torch."), "optimizer_index": index.get(id(rec))}
            for rec in records]


def _optimizer_order(records: list[ParamRecord], optimizer: Any) -> list[ParamRecord]:
    """The trainable records in the order the optimizer numbers its parameters (its param groups, one
    after the other): the index its saved state is keyed by."""
    return in_optimizer_order([rec for rec in records if rec.param.requires_grad], optimizer.param_groups)


def _write_beside(staging: Any, model: nn.Module | None) -> list[str]:
    """config.json (when the model has one), generation_config.json (when it can generate) and zero_to_fp32.py,
    into the tag being saved; return their names."""
    written = [CONFIG_NAME] if _write_config(staging, model) else []
    generation = _generation_config(model)
    if generation is not None:
        target = os.path.join(os.fspath(staging), GENERATION_CONFIG_NAME)
        with _naming_the_file(target):
            write_json(target, generation)
        written.append(GENERATION_CONFIG_NAME)
    with _naming_the_file(os.path.join(staging, SCRIPT_NAME)) as path, open(path, "w") as file:
        file.write(_SCRIPT)
    return [*written, SCRIPT_NAME]


def _generation_config(model: nn.Module | None) -> dict[str, Any] | None:
    """``model``'s generation config as ``save_pretrained`` writes it (the values that differ from the
    defaults), or None for a model that cannot generate."""
    config = getattr(model, "generation_config", None)
    can_generate = getattr(model, "can_generate", None)
    if config is None or not hasattr(config, "to_json_string") or not callable(can_generate) or not can_generate():
        return None
    return json.loads(config.to_json_string(use_diff=True))


def _write_config(directory: str | os.PathLike, model: nn.Module | None) -> bool:
    """Write ``model``'s config.json into ``directory``; False (nothing written) for a model without one."""
    config = model_config(model)
    if config is None:
        return False
    target = os.path.join(os.fspath(directory), CONFIG_NAME)
    with _naming_the_file(target):
        write_json(target, config)
    return True


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
