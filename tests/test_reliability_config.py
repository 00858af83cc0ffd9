"""Config loading errors (issue 14): anything that is neither a mapping nor a path is a ValueError
naming the type received; a file that cannot be read is an OSError naming the path."""

from __future__ import annotations

import errno
import json
import os
import re
from pathlib import Path

import pytest
import torch

import offload
from offload.config import EngineConfig
from offload.config.parse import read_config

GOOD = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}


@pytest.mark.parametrize("source, named", [([], "list []"), (3, "int 3"), (b"ds.json", "bytes b'ds.json'"),
                                           (("a",), "tuple ('a',)"), (1.5, "float 1.5")])
def test_a_config_that_is_neither_a_mapping_nor_a_path_names_the_type(source, named):
    named = re.escape(named)
    with pytest.raises(ValueError, match=rf"config: expected a dict or the path .* got {named}$"):
        read_config(source)
    with pytest.raises(ValueError, match=rf"got {named}$"):
        EngineConfig.from_file(source, world_size=1)
    with pytest.raises(ValueError, match=rf"got {named}$"):
        offload.initialize(model=torch.nn.Linear(2, 2), config=source)


def test_an_integer_config_is_not_taken_for_a_file_descriptor(tmp_path):
    # open(3) would read (and then close) descriptor 3
    r, w = os.pipe()
    try:
        with pytest.raises(ValueError, match=f"got int {r}"):
            read_config(r)
        os.write(w, b"x")  # both ends are still open
        assert os.read(r, 1) == b"x"
    finally:
        os.close(r)
        os.close(w)


def test_a_missing_config_file_names_the_path(tmp_path, monkeypatch):
    missing = tmp_path / "nope.json"
    with pytest.raises(FileNotFoundError, match=f"config file {missing} does not exist") as info:
        read_config(missing)
    assert info.value.errno == errno.ENOENT
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError, match=rf"config file ds\.json \(in {tmp_path}\) does not exist"):
        offload.initialize(model=torch.nn.Linear(2, 2), config="ds.json")
    with pytest.raises(FileNotFoundError, match="ds.json"):
        offload.resolve_auto("ds.json")


def test_a_directory_or_unreadable_config_names_the_path(tmp_path):
    with pytest.raises(IsADirectoryError, match=f"config file {tmp_path} is a directory"):
        read_config(tmp_path)
    binary = tmp_path / "model.bin"
    binary.write_bytes(b"\xff\xfe\x00")
    with pytest.raises(ValueError, match=f"{binary}: not UTF-8 text"):
        read_config(binary)
    if os.geteuid() != 0:  # root reads any file
        locked = tmp_path / "locked.json"
        locked.write_text("{}")
        locked.chmod(0)
        with pytest.raises(PermissionError, match=f"config file {locked} is not readable"):
            read_config(locked)


def test_bad_json_and_a_non_object_name_the_path(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    with pytest.raises(ValueError, match=f"{bad}: not valid JSON"):
        read_config(bad)
    bad.write_text("[1]")
    with pytest.raises(ValueError, match=f"{bad}: expected a JSON object at the top, got list"):
        read_config(bad)


def test_from_dict_given_a_path_says_to_use_from_file(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(GOOD))
    with pytest.raises(ValueError, match="from_dict takes a dict.*use EngineConfig.from_file"):
        EngineConfig.from_dict(str(path), world_size=1)
    with pytest.raises(ValueError, match=r"config: expected a JSON object, got \[\] \(list\)"):
        EngineConfig.from_dict([], world_size=1)
    assert EngineConfig.from_file(Path(path), world_size=1).train_micro_batch_size_per_gpu == 1
    assert read_config(str(path)) == GOOD
