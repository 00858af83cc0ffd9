"""Checksums on the swap files: one bit flipped in a slot between its write and its read (parameter
partitions, gradients on disk, optimizer state) is named (file, offset, length, what the range holds,
both checksums), nothing is trained on it, the engine refuses to step or save until a checkpoint is
loaded, and training resumed from that checkpoint is the uninterrupted run's. A bit flipped on its way
(the second read is good) is no error at all. ``aio.verify: false`` turns the checksums off."""

from __future__ import annotations

import errno
import os
import re

import pytest
import torch

from offload.train.engine import initialize
from tensorio import ChecksumError, TensorIOError
from tensorio.testing import Fail, FlipBit, flip_bit, inject_faults
from test_engine import assert_same_tensors, engine_config, mlp, mlp_batches, mlp_loss, parameters_now, train

BATCHES = mlp_batches(4)

# The update paths of test_engine_faults, plus a host so small that gradients go to a swap file of their
# own (bf16 partitions have no fp32 slot to hold them).
CONFIGS = {"in backward": {}, "in the next forward": {"gradient_clipping": 1.0},
           "gradients in the parameter slots": {"gradient_clipping": 1.0, "host": 1 << 10},
           "gradients in their own swap file": {"gradient_clipping": 1.0, "host": 1 << 10, "bf16": {"enabled": True}},
           "after backward": {"gradient_clipping": 1.0, "ratio": 0.5}}

KIND = re.compile(r"offload-(params|grads|adam)-")

READ_IN_STEP_THREE = {"in backward": {"params", "adam"}, "in the next forward": {"params", "adam"},
                      "gradients in the parameter slots": {"params", "adam"},
                      "gradients in their own swap file": {"params", "grads", "adam"},
                      "after backward": {"params", "grads", "adam"}}
"""The kinds of swap file each configuration reads in step 3, so flips in every kind of slot are covered:
each test checks its own (whichever xdist worker runs it)."""


def _loss(engine, batch):
    dtype = engine.records[0].partition.dtype  # bf16 under "bf16"
    return mlp_loss(engine, (batch[0].to(dtype), batch[1].to(dtype)))


def _moments(engine):
    """The optimizer state as the engine's checkpoints stream it: (name, first element) -> values."""
    runs = {}
    engine.optimizer.save_state(lambda name, first, values: runs.__setitem__((name, first), values.clone()))
    return runs


def _make(disk_dir, monkeypatch, name, **aio):
    import offload.train.sizing as sizing

    extra = dict(CONFIGS[name])
    ratio, host = extra.pop("ratio", 1.0), extra.pop("host", None)
    if host is not None:
        monkeypatch.setattr(sizing, "host_memory_bytes", lambda: host)
    config = engine_config(disk_dir, "nvme", "nvme", **extra)
    config["zero_optimization"]["offload_optimizer"]["ratio"] = ratio
    if aio:
        config["aio"] = aio
    engine, *_ = initialize(model=mlp(), config=config)
    return engine


def _step_three(engine):
    """Step 3 whole, with the next forward when the update runs there."""
    loss = _loss(engine, BATCHES[2])
    engine.backward(loss)
    engine.step()
    if engine.stats().mode.value == "in the next forward":
        _loss(engine, BATCHES[3])


def test_the_configurations_read_every_kind_of_swap_file():
    assert set().union(*READ_IN_STEP_THREE.values()) == {"params", "grads", "adam"}
    assert set(READ_IN_STEP_THREE) == set(CONFIGS)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_a_bit_flipped_in_any_slot_is_named_and_never_trained_on(name, disk_dir, tmp_path, monkeypatch, aio_backend):
    engine = _make(disk_dir, monkeypatch, name, **aio_backend)
    assert engine.param_store.swap._io().backend_name == aio_backend["backend"]
    try:
        train(engine, BATCHES[:2], _loss)
        engine.save_checkpoint(tmp_path)
        params, moments = parameters_now(engine), _moments(engine)
        reference = train(engine, BATCHES[2:], _loss), parameters_now(engine)
        engine.load_checkpoint(tmp_path)
        with inject_faults() as counted:
            _step_three(engine)
        reads = [r for r in counted.requests if r.op == "read" and KIND.search(r.path)]
        by_kind: dict[str, list[int]] = {}
        for r in reads:
            by_kind.setdefault(KIND.search(r.path)[1], []).append(1)
        # The first and the last read of each kind of swap file, counted among the reads of that kind.
        targets = {(kind, n) for kind, hits in by_kind.items() for n in (1, len(hits))}
        assert set(by_kind) == READ_IN_STEP_THREE[name]  # a flip in each: every kind of slot is covered
        for kind, n in sorted(targets):
            engine.load_checkpoint(tmp_path)
            flip = FlipBit(n=n, path=lambda p, kind=kind: f"offload-{kind}-" in p)
            try:
                with inject_faults(flip):
                    _step_three(engine)
            except ChecksumError as raised:
                error = raised
            else:
                # Only a read ahead that nothing used may pass (the last one, of the next step's first
                # partitions): the step ran on good values, those of the run without a flip.
                assert n > 1 and flip.hits == 1, f"a flipped bit in the first read of the {kind} file was not named"
                engine.load_checkpoint(tmp_path)
                assert train(engine, BATCHES[2:], _loss) == reference[0]
                continue
            assert flip.hits == 1, (kind, n)
            path, offset = flip.flipped[0]
            assert error.path == path and error.offset <= offset < error.offset + error.length
            assert error.expected != error.actual
            assert f"offload-{kind}-" in str(error) and f"{error.expected:016x}" in str(error)
            assert {"params": "parameter '", "grads": "gradient of parameter '",
                    "adam": "optimizer state of sub-group"}[kind] in error.what
            # The engine refuses to go on from what is on disk, naming the error and how to resume.
            with pytest.raises(RuntimeError, match=r"cannot step: a swap file returned corrupt bytes .*ChecksumError.*"
                                                   r"Resume with load_checkpoint"):
                engine.step()
            with pytest.raises(RuntimeError, match="cannot save a checkpoint: a swap file returned corrupt bytes"):
                engine.save_checkpoint(tmp_path, tag="corrupt")
            assert engine.global_steps == 2
            if engine.stats().mode.value != "after backward":
                # Rolled back entirely: with the flipped bit put back, parameters and moments are step 2's,
                # so nothing of the corrupt read reached them.
                flip_bit(path, offset, flip.bit)
                assert_same_tensors(parameters_now(engine), params)
                assert_same_tensors(_moments(engine), moments)
            engine.load_checkpoint(tmp_path)
            losses = train(engine, BATCHES[2:], _loss)
            assert losses == reference[0], (kind, n)
            assert_same_tensors(parameters_now(engine), reference[1])
        assert not (tmp_path / "corrupt").exists()
        assert engine.param_store.swap.bytes_verified == engine.param_store.swap.bytes_read > 0
    finally:
        engine.close()


def test_a_bit_flipped_on_its_way_is_read_again_and_training_goes_on(disk_dir, tmp_path, monkeypatch, caplog,
                                                                     aio_backend):
    engine = _make(disk_dir, monkeypatch, "in the next forward", **aio_backend)
    try:
        train(engine, BATCHES[:2], _loss)
        engine.save_checkpoint(tmp_path)
        reference = train(engine, BATCHES[2:], _loss), parameters_now(engine)
        engine.load_checkpoint(tmp_path)
        flip = FlipBit(n=2, path=lambda p: "offload-" in p, transient=True)
        with inject_faults(flip):
            losses = train(engine, BATCHES[2:], _loss)
        assert flip.flipped and "the second read is good" in caplog.text
        assert losses == reference[0]
        assert_same_tensors(parameters_now(engine), reference[1])
    finally:
        engine.close()


def test_verify_false_checks_nothing(disk_dir, monkeypatch):
    engine = _make(disk_dir, monkeypatch, "in the next forward", verify=False)
    try:
        train(engine, BATCHES[:1], _loss)
        with inject_faults(FlipBit(n=1, path=lambda p: "offload-params-" in p)):
            train(engine, BATCHES[1:2], _loss)  # trained on: what the switch is for is measuring the checksums' cost
        assert engine.param_store.swap.bytes_verified == 0 < engine.param_store.swap.bytes_read
    finally:
        engine.close()


def test_a_read_of_a_range_whose_write_failed_is_refused(disk_dir):
    from offload.storage.swapfile import SwapFile
    from tensorio import AioConfig

    swap = SwapFile(disk_dir, AioConfig(), kind="test")
    try:
        values = torch.arange(1024, dtype=torch.float32)
        offset = swap.allocate(values.nbytes)
        swap.write(values, offset).result()
        with inject_faults(Fail(errno.ENOSPC, op="write", path=lambda path: path == swap.path)):
            with pytest.raises(TensorIOError):
                swap.write(values, offset).result()
        with pytest.raises(TensorIOError, match="the last write of these bytes failed"):
            swap.read(torch.empty_like(values), offset)
        with pytest.raises(RuntimeError, match="no checksummed write of that range"):
            swap.read(torch.empty(10), offset + 4096)
        swap.write(values, offset).result()
        back = torch.empty_like(values)
        swap.read(back, offset, what="test values").result()
        assert torch.equal(back, values) and swap.bytes_verified == values.nbytes
        flip_bit(swap.path, offset + 7)
        with pytest.raises(ChecksumError, match=r"checksum mismatch \(test values\)"):
            swap.read(back, offset, what="test values").result()
    finally:
        swap.close()
    assert not os.path.exists(swap.path)
