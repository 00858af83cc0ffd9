"""Engine checkpoints hold JSON and safetensors only: loading one never runs code, and what cannot be
stored without pickling is refused when saving, naming the entry."""

from __future__ import annotations

import os
import pickle

import pytest
import torch

from offload.train.checkpoint.rank_state import decode_state, encode_state
from offload.train.engine import initialize
from test_engine import engine_config, mlp, mlp_batches, mlp_loss, train


class _WritesAFile:
    """Unpickling this writes a file: what a hostile checkpoint would do."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_a_pickled_state_file_is_refused_and_never_unpickled(disk_dir, tmp_path):
    engine, *_ = initialize(model=mlp(), config=engine_config(disk_dir, "nvme", "nvme"))
    train(engine, mlp_batches(2), mlp_loss)
    path = engine.save_checkpoint(tmp_path, tag="crafted")
    marker = tmp_path / "pwned"
    os.remove(os.path.join(path, "rank00000_states.json"))
    with open(os.path.join(path, "rank00000_states.pt"), "wb") as file:
        pickle.dump({"payload": _WritesAFile(str(marker))}, file)
    with pytest.raises(ValueError, match=r"rank00000_states\.pt: .*pickled.*not loaded"):
        engine.load_checkpoint(tmp_path, tag="crafted")
    assert not marker.exists()
    engine.close()


def test_client_state_round_trips_json_values_and_tensors(disk_dir, tmp_path):
    engine, *_ = initialize(model=mlp(), config=engine_config(disk_dir, "nvme", "nvme"))
    train(engine, mlp_batches(2), mlp_loss)
    client = {"epoch": 3, "name": "run-1", "ratios": (0.5, float("inf")), "nested": {"ids": torch.arange(5)},
              "none": None}
    engine.save_checkpoint(tmp_path, client_state=client)
    fresh, *_ = initialize(model=mlp(), config=engine_config(disk_dir, "nvme", "nvme"))
    _, loaded = fresh.load_checkpoint(tmp_path)
    assert loaded["epoch"] == 3 and loaded["name"] == "run-1" and loaded["none"] is None
    assert loaded["ratios"] == [0.5, float("inf")]
    assert torch.equal(loaded["nested"]["ids"], torch.arange(5))
    engine.close()
    fresh.close()


def test_client_state_that_needs_pickle_is_refused_before_anything_is_written(disk_dir, tmp_path):
    engine, *_ = initialize(model=mlp(), config=engine_config(disk_dir, "nvme", "nvme"))
    train(engine, mlp_batches(2), mlp_loss)
    with pytest.raises(TypeError, match=r"state\['client_state'\]\['sampler'\] is a object.*never runs code"):
        engine.save_checkpoint(tmp_path, client_state={"sampler": object()})
    assert not (tmp_path / "latest").exists() and not (tmp_path / "global_step2").exists()
    engine.close()


def test_encode_decode_is_the_identity_on_json_and_tensors():
    state = {"a": [1, 2.5, "x", None, True], "b": {"t": torch.ones(2, 3, dtype=torch.bfloat16)}, "c": float("nan")}
    encoded, tensors = encode_state(state)
    back = decode_state(encoded, tensors)
    assert back["a"] == state["a"] and torch.equal(back["b"]["t"], state["b"]["t"])
    assert back["c"] != back["c"]  # nan survives


def test_save_16bit_model_refuses_a_file_name_that_leaves_the_directory(disk_dir, tmp_path):
    config = engine_config(disk_dir, "nvme", "nvme")
    config["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = True
    engine, *_ = initialize(model=mlp(), config=config)
    with pytest.raises(ValueError, match=r"save_filename '\.\./x\.safetensors': use a plain file name"):
        engine.save_16bit_model(tmp_path / "out", "../x.safetensors")
    assert not (tmp_path / "x.safetensors").exists()
    engine.close()
