"""Resume at another world size (issue 27): a checkpoint saved by W ranks loads into W' ranks, its
parameters, fp32 masters and moments repartitioned, and the next 3 losses equal those of a run that
never stopped at W' (within the tolerance of tests/test_engine_dist.py: the reduction order differs).
Processes over gloo, started here, as in tests/test_engine_dist.py."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from ranks import run_ranks
from test_engine_dist import _free_port, gpt2

from offload.train.engine import initialize

pytest.importorskip("transformers")

GLOBAL_BATCH = 6  # divides over 1, 2 and 3 ranks
BEFORE, AFTER = 2, 3


def batches(n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 128, (GLOBAL_BATCH, 16), generator=g) for _ in range(n)]


def config(tmp: str, world_size: int, clip: float, bf16: bool) -> dict:
    zero = {"stage": 3, "stage3_param_persistence_threshold": 100, "sub_group_size": 4096,
            "offload_param": {"device": "nvme", "nvme_path": tmp, "max_in_cpu": 0, "buffer_size": 16384,
                              "buffer_count": 2},
            "offload_optimizer": {"device": "nvme", "nvme_path": tmp}}
    return {"train_batch_size": GLOBAL_BATCH, "train_micro_batch_size_per_gpu": GLOBAL_BATCH // world_size,
            "zero_optimization": zero, "gradient_clipping": clip, "bf16": {"enabled": bf16},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01, "eps": 1e-6}}}


def train(rank: int, world_size: int, tmp: str, clip: float, bf16: bool, first: int, last: int, load: str | None,
          save: str | None, out: str | None) -> None:
    """Steps ``first`` to ``last`` (exclusive) at ``world_size``, after loading ``load``; save to ``save``;
    rank 0 writes the losses to ``out``."""
    engine, *_ = initialize(model=gpt2(), config=config(tmp, world_size, clip, bf16))
    if load is not None:
        _, client = engine.load_checkpoint(load)
        assert client["saved_by"] == f"rank{rank}" or rank >= 1 and client["saved_by"] == "rank0"
        assert engine.global_steps == first
    losses = []
    for batch in batches(last)[first:]:
        share = batch.chunk(world_size)[rank]
        loss = engine(share, labels=share).loss
        engine.backward(loss)
        engine.step()
        total = loss.detach().float().clone()
        if world_size > 1:
            torch.distributed.all_reduce(total)
        losses.append(total.item() / world_size)
    if save is not None:
        engine.save_checkpoint(save, client_state={"saved_by": f"rank{rank}"})
    if out is not None and rank == 0:
        torch.save(losses, out)
    engine.close()


def run(rank: int, world_size: int, runs: tuple[tuple, ...]) -> None:
    """`train` with each of ``runs``' arguments in turn, in one process group."""
    if world_size > 1:
        torch.distributed.init_process_group("gloo", rank=rank, world_size=world_size)
    for args in runs:
        train(rank, world_size, *args)
    if world_size > 1:
        torch.distributed.destroy_process_group()


def launch(world_size: int, *runs: tuple) -> None:
    """``runs`` (`train`'s arguments after the world size) one after the other at ``world_size``: in this
    process for one rank, else in that many processes started once."""
    if world_size == 1:
        run(0, 1, runs)
        return
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    run_ranks(run, [(rank, world_size, runs) for rank in range(world_size)])


# clip 0: the updates run during backward; clip > 0: in the next forward (their state read ahead).
@pytest.mark.multiprocess
@pytest.mark.parametrize("saved,resumed,clip,bf16", [(2, 1, 0.0, False), (1, 2, 0.5, False), (1, 3, 0.0, True),
                                                     (3, 2, 0.0, False)],
                         ids=["2-to-1", "1-to-2-clipped", "1-to-3-bf16", "3-to-2"])
def test_resume_at_another_world_size_continues_as_a_run_that_never_stopped(disk_dir, saved, resumed, clip, bf16,
                                                                            monkeypatch):
    tmp = str(disk_dir)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    ckpt, resumed_out, straight_out = (os.path.join(tmp, name) for name in ("ckpt", "resumed.pt", "straight.pt"))
    launch(saved, (tmp, clip, bf16, 0, BEFORE, None, ckpt, None))
    launch(resumed, (tmp, clip, bf16, BEFORE, BEFORE + AFTER, ckpt, None, resumed_out),  # one start for both runs
           (tmp, clip, bf16, 0, BEFORE + AFTER, None, None, straight_out))
    after_resume, straight = torch.load(resumed_out), torch.load(straight_out)
    assert len(after_resume) == AFTER
    rtol = 2e-2 if bf16 else 1e-5  # bf16: the world-size difference of the first steps is bf16-rounded
    torch.testing.assert_close(torch.tensor(after_resume), torch.tensor(straight[BEFORE:]), rtol=rtol, atol=0)
    # not trivially equal: the losses move from step to step
    assert len({round(loss, 4) for loss in straight[BEFORE:]}) == AFTER


SMALL_CHUNK = 4096
"""Bytes per checksum chunk in the test below: GPT-2's larger partitions span several."""


def _save_in_small_chunks(rank: int, world_size: int, tmp: str, ckpt: str) -> None:
    from offload.storage import file_checksums

    file_checksums.CHUNK = SMALL_CHUNK  # this rank process only
    run(rank, world_size, ((tmp, 0.0, False, 0, BEFORE, None, ckpt, None),))


@pytest.mark.multiprocess
def test_a_flip_in_a_middle_chunk_of_rank_1s_file_is_refused_at_every_world_size(disk_dir, monkeypatch):
    """Saved by 2 ranks in 4 KiB checksum chunks; one bit flipped in a middle chunk of a tensor of rank 1's
    params file. Every rank of world sizes 1 and 3 reads its share as a load does (a partial range of the
    saved partitions at 3): the reads that cover the chunk fail naming the file and the tensor, the others
    pass, and every byte read was compared with its checksum. A load at world size 1 refuses it."""
    from checkpoint_flips import tensor_at

    from offload.params.partition import partition_numel
    from offload.train.checkpoint.reader import CheckpointReader
    from tensorio import ChecksumError
    from tensorio.testing import flip_bit

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    tmp = str(disk_dir)
    os.environ.update(MASTER_PORT=str(_free_port()))
    run_ranks(_save_in_small_chunks, [(rank, 2, tmp, os.path.join(tmp, "ckpt")) for rank in range(2)])
    tag = disk_dir / "ckpt" / f"global_step{BEFORE}"
    victim = tag / "rank00001_params.safetensors"
    name, offset, nbytes = tensor_at(victim)
    assert nbytes >= 3 * SMALL_CHUNK
    flipped = offset + SMALL_CHUNK + SMALL_CHUNK // 2  # in its second chunk of several
    flip_bit(victim, flipped, 3)
    with CheckpointReader(tag) as reader:
        numel = {p["name"]: int(torch.Size(p["shape"]).numel()) for p in reader.state["parameters"]}
        saved_partition = reader.tensor("params", name).shape[0]
        itemsize = reader.tensor("params", name).dtype.itemsize
        element = saved_partition + (flipped - offset) // itemsize  # of the flat tensor
        for world_size in (1, 3):
            for rank in range(world_size):
                for param in reader.names("params"):
                    part = partition_numel(numel[param], world_size)
                    start = rank * part
                    read = reader.read("params", param, start, start + part, numel=numel[param])
                    if param == name and start <= element < start + part:
                        with pytest.raises(ChecksumError, match=f"checksum mismatch \\(tensor '{name}'\\): {victim}"):
                            read.result()
                    else:
                        read.result()
            assert reader.bytes_verified == reader.bytes_read > 0
    engine, *_ = initialize(model=gpt2(), config=config(tmp, 1, 0.0, False))
    try:
        with pytest.raises(ChecksumError, match=f"checksum mismatch \\(tensor '{name}'\\): {victim}"):
            engine.load_checkpoint(disk_dir / "ckpt")
        assert engine.global_steps == 0
    finally:
        engine.close()


def _refuse_a_flip_on_rank_1(rank: int, world_size: int, tmp: str, out: str) -> None:
    """A run of 4 steps (the reference); another that saves after step 2, takes step 3, then loads the
    checkpoint in which rank 1 flipped one bit of its own optimizer file (refused), and takes step 4."""
    from checkpoint_flips import tensor_at

    from tensorio.testing import flip_bit

    torch.distributed.init_process_group("gloo", rank=rank, world_size=world_size)
    shares = [batch.chunk(world_size)[rank] for batch in batches(BEFORE + 2)]
    result: dict = {}

    def step(engine, batch):
        loss = engine(batch, labels=batch).loss
        engine.backward(loss)
        engine.step()
        total = loss.detach().float().clone()
        torch.distributed.all_reduce(total)
        return total.item() / world_size
    try:
        engine, *_ = initialize(model=gpt2(), config=config(tmp, world_size, 0.0, False))
        result["reference"] = [step(engine, batch) for batch in shares]
        engine.close()
        engine, *_ = initialize(model=gpt2(), config=config(tmp, world_size, 0.0, False))
        losses = [step(engine, batch) for batch in shares[:BEFORE]]
        saved = engine.save_checkpoint(os.path.join(tmp, "ckpt"))
        losses.append(step(engine, shares[BEFORE]))  # the engine's state is no longer the checkpoint's
        if rank == 1:
            victim = os.path.join(saved, "rank00001_optimizer.safetensors")
            _, offset, nbytes = tensor_at(Path(victim))
            flip_bit(victim, offset + nbytes // 2, 5)
        torch.distributed.barrier()
        before = dict(engine.full_parameters())
        try:
            engine.load_checkpoint(os.path.join(tmp, "ckpt"))
        except Exception as error:  # noqa: BLE001 - the test asserts on it
            result["error"] = (type(error).__name__, str(error), type(error.__cause__).__name__, str(error.__cause__))
        result["unchanged"] = all(torch.equal(t, before[name]) for name, t in engine.full_parameters())
        result["steps"], result["failure"] = engine.global_steps, engine.stats().failure.value
        losses.append(step(engine, shares[BEFORE + 1]))
        result["losses"] = losses
        engine.close()
    finally:
        torch.save(result, f"{out}.{rank}")
        torch.distributed.destroy_process_group()


@pytest.mark.multiprocess
def test_a_load_refused_on_rank_1_is_refused_on_every_rank_and_both_train_on(disk_dir, monkeypatch):
    """World size 2, one bit flipped in rank 1's optimizer file only: rank 1's check fails, every rank refuses
    the load (rank 0's bytes were good, and it had staged them), both engines keep the state of step 3 and
    take step 4 as a run that was never asked to load (the same losses, bit for bit)."""
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(_free_port()))
    out = str(disk_dir / "result")
    run_ranks(_refuse_a_flip_on_rank_1, [(rank, 2, str(disk_dir), out) for rank in range(2)], timeout=300)
    zero, one = (torch.load(f"{out}.{rank}") for rank in range(2))
    for result in (zero, one):
        kind, message, _, _ = result["error"]
        assert kind == "RanksFailed" and "failed on rank 1" in message and "ChecksumError" in message, message
        assert result["unchanged"] and result["steps"] == BEFORE + 1 and result["failure"] == "none"
        assert result["losses"] == result["reference"]  # step 4 from step 3's state, as if no load was asked
    assert one["error"][2] == "ChecksumError" and "rank00001_optimizer.safetensors" in one["error"][3]
    assert zero["reference"] == one["reference"] and len(set(zero["reference"])) == BEFORE + 2
