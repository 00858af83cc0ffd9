"""Checksums in checkpoints: each rank's JSON records its tensor files' checksums (header, and each
tensor in 8 MiB chunks); one bit flipped at rest in any file is named (file, tensor, offset, both
checksums) by ``python -m offload.checkpoint verify``, by a load (which reads every byte once and commits
nothing unless all matched: the engine trains on as if it had not been asked) and by ``consolidate``; the same
checkpoint with the bit put back loads and training resumes as if uninterrupted; a checkpoint from
before checksums loads with one warning; verify on something that is not a checkpoint ends in one line,
exit status 2."""

from __future__ import annotations

import json
import logging
import os
import shutil

import pytest
import torch

from offload.checkpoint import main as checkpoint_command
from offload.storage.file_checksums import CHUNK, FileChecksums
from offload.train.checkpoint.rank_state import CheckpointLoad, sized_partitions
from offload.train.engine import initialize
from tensorio import ChecksumError
from tensorio.testing import flip_bit
from test_engine import engine_config, gpt2, gpt2_batches, gpt2_loss

BATCHES = gpt2_batches(4)


def _engine(tmp, aio=None):
    """GPT-2 with parameters and optimizer state on NVMe; ``aio``: the config's aio section (its backend)."""
    engine, *_ = initialize(model=gpt2(0.0), config=engine_config(tmp, "nvme", "nvme", micro=2, aio=aio or {}))
    if aio:
        assert engine.param_store.swap._io().backend_name == aio["backend"]
    return engine


def _step(engine, batch):
    loss = gpt2_loss(engine, batch)
    engine.backward(loss)
    engine.step()
    return loss.item()


def _tensor_bytes(path):
    """The bytes of every tensor of the safetensors file at ``path``."""
    raw = path.read_bytes()
    length = int.from_bytes(raw[:8], "little")
    return sum(e["data_offsets"][1] - e["data_offsets"][0] for k, e in json.loads(raw[8:8 + length]).items()
               if k != "__metadata__")


def _tensor_at(path, name):
    """(absolute offset, bytes) of tensor ``name`` in the safetensors file at ``path``."""
    raw = path.read_bytes()
    length = int.from_bytes(raw[:8], "little")
    begin, end = json.loads(raw[8:8 + length])[name]["data_offsets"]
    return 8 + length + begin, end - begin


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A checkpoint after 2 steps (with a client tensor); the losses and parameters of steps 3 and 4, and the
    losses of steps 1 and 2."""
    tmp = tmp_path_factory.mktemp("ckpt")
    engine = _engine(tmp)
    first = [_step(engine, batch) for batch in BATCHES[:2]]
    engine.save_checkpoint(tmp / "ckpt", client_state={"ema": torch.arange(10.0)})
    reference = [_step(engine, BATCHES[2]), _step(engine, BATCHES[3])], dict(engine.full_parameters()), first
    engine.close()
    return tmp / "ckpt" / "global_step2", reference


def test_the_json_records_every_file_and_verify_passes(saved, capsys):
    tag, _ = saved
    raw = (tag / "rank00000_states.json").read_bytes()
    states = json.loads(raw)
    assert states["format"] == 2 and raw.startswith(b'{"format": 2, "states_checksum": "')  # its own checksum first
    records = states["checksums"]
    assert set(records) == {"rank00000_params.safetensors", "rank00000_optimizer.safetensors",
                            "rank00000_client.safetensors"}
    assert set(states["files"]) == {"config.json", "generation_config.json", "zero_to_fp32.py"}
    params = FileChecksums.from_json(records["rank00000_params.safetensors"], "test")
    assert params.chunk == CHUNK and "transformer.wte.weight" in params.tensors
    assert checkpoint_command(["verify", str(tag)]) == 0
    assert checkpoint_command(["verify", str(tag.parent)]) == 0  # the save_dir, through `latest`
    out = capsys.readouterr()
    every = {"rank00000_states.json", "rank00000_params.safetensors", "rank00000_optimizer.safetensors",
             "rank00000_client.safetensors", "config.json", "generation_config.json", "zero_to_fp32.py"}
    assert {line.split()[1].rsplit("/", 1)[1] for line in out.out.splitlines()} == every
    assert out.out.count("ok ") == 14 and "every checksum matches" in out.err


def test_the_checked_bytes_are_the_bytes_compared_with_their_checksums(saved, disk_dir, monkeypatch, caplog,
                                                                      aio_backend):
    """The load's figure counts the bytes whose checksums were compared: every byte it read, from a relative
    path too; and none for a checkpoint without checksums, whose load says nothing of a check."""
    tag, _ = saved
    monkeypatch.chdir(disk_dir)
    expected = sum(_tensor_bytes(tag / name) for name in ("rank00000_params.safetensors",
                                                          "rank00000_optimizer.safetensors"))
    engine = _engine(disk_dir, aio_backend)
    try:
        with CheckpointLoad(os.path.relpath(tag.parent), None, rank=0, world_size=1, store=engine.param_store,
                            optimizer=engine.optimizer, backend=aio_backend["backend"]) as source:
            assert source.reader.handle.backend_name == aio_backend["backend"]
            assert source.reader.bytes_read == 0  # opening reads headers and the state file, no tensor bytes
            source.apply()
            # One pass: every byte read once, checked as it landed, and loaded without a second read.
            assert source.verified_bytes == source.reader.bytes_verified == source.reader.bytes_read == expected
        with caplog.at_level(logging.INFO, logger="offload"):
            engine.load_checkpoint(os.path.relpath(tag.parent))
        assert f"{expected / 1e6:.1f} MB of {tag} checked against their checksums" in caplog.text
        old = _before_checksums(tag.parent, disk_dir / "old", keep_tensor_checksums=False)
        with CheckpointLoad(old, None, rank=0, world_size=1, store=engine.param_store,
                            optimizer=engine.optimizer) as source:
            assert source.verified_bytes == 0
            source.apply()
            assert source.reader.bytes_verified == 0 < source.reader.bytes_read
    finally:
        engine.close()


@pytest.mark.parametrize("where", ["params tensor", *(pytest.param(w, marks=pytest.mark.slow) for w in
                                                       ("params header", "optimizer tensor", "client tensor"))])
def test_a_bit_flipped_at_rest_is_named_by_verify_load_and_consolidate(saved, where, disk_dir, capsys, aio_backend):
    tag, reference = saved
    file, tensor = {"params tensor": ("rank00000_params.safetensors", "transformer.h.1.mlp.c_fc.weight"),
                    "params header": ("rank00000_params.safetensors", None),
                    "optimizer tensor": ("rank00000_optimizer.safetensors", "3.exp_avg_sq"),
                    "client tensor": ("rank00000_client.safetensors", "t0")}[where]
    path = tag / file
    offset = 20 if tensor is None else sum(_tensor_at(path, tensor)) - 3  # in the tensor's last chunk
    flip_bit(path, offset, 5)
    try:
        what = "the safetensors header" if tensor is None else f"tensor {tensor!r}"
        # 1. verify names it, in one line, exit status 2.
        assert checkpoint_command(["verify", str(tag)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"checksum mismatch ({what}): {path}" in err and "expected" in err
        # 2. A load refuses it, naming the file and the tensor, before it changes anything: the engine is as
        #    it was (its parameters, and its next step's loss that of a run never asked to load).
        engine = _engine(disk_dir, aio_backend)
        try:
            assert _step(engine, BATCHES[0]) == reference[2][0]
            before = dict(engine.full_parameters())
            with pytest.raises(ChecksumError, match=f"checksum mismatch \\({what}\\): {path}"):
                engine.load_checkpoint(tag.parent)
            assert all(torch.equal(value, before[name]) for name, value in engine.full_parameters())
            assert _step(engine, BATCHES[1]) == reference[2][1]
            # 3. consolidate verifies as it copies (the parameters, and the master weights it may take).
            if where.startswith("params"):
                assert checkpoint_command(["consolidate", str(tag.parent), str(disk_dir / "out"), "--no-progress"]) == 2
                assert f"checksum mismatch ({what}): {path}" in capsys.readouterr().err
                assert not (disk_dir / "out" / "model.safetensors").exists()
            # 4. With the bit put back the checkpoint loads, and training resumes as if never interrupted.
            flip_bit(path, offset, 5)
            offset = None
            engine.load_checkpoint(tag.parent)
            assert [_step(engine, BATCHES[2]), _step(engine, BATCHES[3])] == reference[0]
            params = dict(engine.full_parameters())
            assert all(torch.equal(params[name], value) for name, value in reference[1].items())
        finally:
            engine.close()
    finally:
        if offset is not None:
            flip_bit(path, offset, 5)


def test_a_flip_in_the_middle_of_the_optimizer_file_is_refused_by_the_one_pass_load_and_changes_nothing(
        saved, disk_dir):
    """The one-pass load reads the parameters (staged in their uncommitted slots) before it meets a flipped
    byte in the middle of the optimizer's file: it refuses the checkpoint, and the parameters and the
    optimizer's state are exactly as before (tensor by tensor); training goes on as if never asked."""
    tag, reference = saved
    path = tag / "rank00000_optimizer.safetensors"
    raw = path.read_bytes()
    header = 8 + int.from_bytes(raw[:8], "little")
    offset = header + (len(raw) - header) // 2  # the middle of the file's data
    entries = {k: v for k, v in json.loads(raw[8:header]).items() if k != "__metadata__"}
    tensor = next(k for k, v in entries.items() if header + v["data_offsets"][0] <= offset < header + v["data_offsets"][1])
    flip_bit(path, offset, 2)
    try:
        engine = _engine(disk_dir)
        try:
            assert _step(engine, BATCHES[0]) == reference[2][0]
            params = {name: value.clone() for name, value in engine.full_parameters()}
            state = _optimizer_state(engine)
            with pytest.raises(ChecksumError, match=f"checksum mismatch \\(tensor {tensor!r}\\): {path}"):
                engine.load_checkpoint(tag.parent)
            assert all(torch.equal(value, params[name]) for name, value in engine.full_parameters())
            after = _optimizer_state(engine)
            assert after["param_groups"] == state["param_groups"] and after["state"].keys() == state["state"].keys()
            for index, values in state["state"].items():
                assert values.keys() == after["state"][index].keys()
                assert all(torch.equal(after["state"][index][key], value) for key, value in values.items())
            assert _step(engine, BATCHES[1]) == reference[2][1]  # as a run never asked to load
        finally:
            engine.close()
    finally:
        flip_bit(path, offset, 2)


def _optimizer_state(engine):
    """The optimizer's whole state (its on-disk parameters given their sizes meanwhile, as a save does)."""
    with sized_partitions([rec for rec in engine.param_store.records if rec.param.requires_grad]):
        return engine.optimizer.state_dict()


def test_verify_prints_the_files_that_passed_before_one_that_fails(saved, capsys):
    """A flipped bit in the optimizer's file: verify still says "ok" for the state and parameter files it
    checked before, then the one-line error, exit status 2."""
    tag, _ = saved
    path = tag / "rank00000_optimizer.safetensors"
    offset = sum(_tensor_at(path, "3.exp_avg_sq")) - 3
    flip_bit(path, offset, 5)
    try:
        assert checkpoint_command(["verify", str(tag)]) == 2
    finally:
        flip_bit(path, offset, 5)
    out = capsys.readouterr()
    assert out.out.splitlines() == [line for line in out.out.splitlines() if line.startswith("ok ")]
    assert [line.split()[1] for line in out.out.splitlines()] == [str(tag / "rank00000_states.json"),
                                                                   str(tag / "rank00000_params.safetensors")]
    assert out.err.count("\n") == 1 and f"checksum mismatch (tensor '3.exp_avg_sq'): {path}" in out.err


def _before_checksums(save_dir, into, *, keep_tensor_checksums):
    """A copy of the checkpoint as a version before state files carried their own checksum (format 1) wrote it:
    with its tensor files' checksums, or from before those too."""
    shutil.copytree(save_dir, into)
    states = into / "global_step2" / "rank00000_states.json"
    value = json.loads(states.read_text())
    del value["states_checksum"], value["files"]
    value["format"] = 1
    if not keep_tensor_checksums:
        del value["checksums"]
    states.write_text(json.dumps(value))
    return into


@pytest.mark.parametrize("keep", [False, True], ids=["no checksums", "tensor checksums only"])
def test_a_checkpoint_from_before_checksums_loads_with_one_warning(saved, disk_dir, caplog, capsys, keep):
    tag, reference = saved
    old = _before_checksums(tag.parent, disk_dir / "old", keep_tensor_checksums=keep)
    engine = _engine(disk_dir)
    try:
        with caplog.at_level(logging.INFO, logger="offload"):
            engine.load_checkpoint(old)
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert warnings == [f"{old / 'global_step2'}: saved before its state files carried a checksum: their bytes "
                            f"are not verified (the tensor files' are)" if keep else
                            f"{old / 'global_step2'}: saved without checksums (before they were recorded): read "
                            f"without verifying its bytes"]
        assert ("checked against their checksums" in caplog.text) == keep
        assert [_step(engine, BATCHES[2]), _step(engine, BATCHES[3])] == reference[0]
    finally:
        engine.close()
    capsys.readouterr()
    assert checkpoint_command(["verify", str(old)]) == (0 if keep else 2)
    out = capsys.readouterr()
    if keep:  # the tensor files verified, the state file said to be unverifiable
        assert f"unverified {old / 'global_step2' / 'rank00000_states.json'}" in out.out
        assert out.out.count("ok ") == 3 and "before they carried a checksum of their own" in out.err


@pytest.mark.parametrize("bad", ["missing", "a file", "not a checkpoint", "missing rank file"])
def test_verify_on_what_is_not_a_checkpoint_is_one_line_and_exit_2(saved, bad, disk_dir, capsys):
    tag, _ = saved
    if bad == "missing":
        target, expected = disk_dir / "nothing", "does not exist"
    elif bad == "a file":
        target, expected = tag / "rank00000_params.safetensors", "is a file, not a checkpoint"
    elif bad == "not a checkpoint":
        target, expected = disk_dir, "is not a checkpoint"
    else:
        import shutil

        target = disk_dir / "partial"
        shutil.copytree(tag, target)
        (target / "rank00000_optimizer.safetensors").unlink()
        expected = "rank00000_optimizer.safetensors: missing from the checkpoint"
    assert checkpoint_command(["verify", str(target)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and expected in err and str(target) in err


@pytest.mark.bench
def test_checkpoint_load_benchmark_reports_the_check_of_every_byte_the_load_reads(disk_dir, capsys):
    """benchmarks/checkpoint_load at a tiny size: per load, its one pass read and checked the rank's whole share
    once (fp32 parameters and Adam's two moments: 12 bytes a parameter) within the load's time."""
    from benchmarks.checkpoint_load import main as checkpoint_load

    tiny = {"n_layer": 2, "n_embd": 64, "n_head": 2, "vocab_size": 128, "n_positions": 32}
    figures = checkpoint_load(["--dir", str(disk_dir), "--model-config", json.dumps(tiny), "--repeats", "2",
                               "--no-fio"])
    import transformers

    numel = sum(p.numel() for p in transformers.GPT2LMHeadModel(transformers.GPT2Config(**tiny)).parameters())
    assert len(figures["loads_s"]) == len(figures["checks_s"]) == 2
    assert abs(figures["checked_gb"] * 1e9 - 12 * numel) <= 0.05e6  # the log line's figure, to 0.1 MB
    assert 0 < figures["check_s"] < figures["load_s"]
    assert figures["state_file_bytes"] > 0 and figures["state_check_s"] > 0 and figures["state_plain_s"] > 0
    out = capsys.readouterr().out
    assert "of which the check" in out and "read with its checksum checked" in out
