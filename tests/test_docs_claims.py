"""Statements of docs/ that the code can check (issue 52): the keys a page calls accepted and without
effect are the keys the parser accepts and ignores, the keys it says warn are the ones that warn, the
process group torchrun gets is the compute device's, and the pages agree on the defaults they state."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
DOCS = REPO / "docs"


def _backticked(text: str) -> set[str]:
    return set(re.findall(r"`([^`]+)`", text))


def test_the_inference_keys_called_without_effect_are_the_ones_the_parser_ignores():
    from offload.infer.config import IGNORED_KEYS

    page = (DOCS / "inference.md").read_text(encoding="utf-8")
    paragraph = page[page.index("Accepted and without effect here:"):].split("\n\n")[0]
    documented = {name.removeprefix("zero_optimization.") for name in _backticked(paragraph.split(" (")[0])}
    ignored = {(f"{section.removeprefix('zero_optimization').lstrip('.')}." if section.count(".") else "") + name
               for section, names in IGNORED_KEYS.items() for name in names}
    assert documented == ignored


def test_the_training_keys_said_to_warn_are_the_ones_that_warn(caplog):
    """docs/engine.md's row of keys "accepted; no effect, and a warning names them" against the engine's
    warning, each key set to a non-default value."""
    from offload.config import ZeroConfig
    from offload.train.assemble import _warn_no_effect

    page = (DOCS / "engine.md").read_text(encoding="utf-8")
    (row,) = [line for line in page.splitlines() if "accepted; no effect, and a warning names them" in line]
    documented = _backticked(row.split("|")[1])
    changed = ZeroConfig.from_dict({"stage": 3, "contiguous_gradients": False, "allgather_partitions": False,
                                    "allgather_bucket_size": 1, "reduce_scatter": False,
                                    "offload_optimizer": {"device": "nvme", "nvme_path": "/tmp", "fast_init": True}})
    with caplog.at_level(logging.WARNING, logger="offload"):
        _warn_no_effect(changed)
    (message,) = [r.getMessage() for r in caplog.records]
    warned = set(message.split(": ", 1)[1].split(" set but")[0].split(", "))
    assert {name for name in warned if not name.startswith("allgather_")} | {"allgather_*"} == documented


def test_torchrun_gets_the_process_group_of_the_compute_device():
    """docs/engine.md: NCCL where the engine computes on CUDA, gloo where it computes on the CPU (not gloo
    "even on a machine with a GPU")."""
    from offload.device import CpuDevice, process_group_backend
    from offload.device._cuda import CudaDevice

    page = (DOCS / "engine.md").read_text(encoding="utf-8")
    assert "even on a machine with a GPU" not in page and "one reduce-scatter per parameter" not in page
    assert "NCCL where it computes on CUDA" in page
    assert process_group_backend(CpuDevice()) == "gloo"
    assert CudaDevice.collective_backend == "nccl"


def _rows(page: str, key: str, *, cells: int) -> list[str]:
    """The table rows of docs/``page`` for ``key`` that have ``cells`` cells."""
    return [line for line in (DOCS / page).read_text(encoding="utf-8").splitlines()
            if line.startswith(f"| `{key}` |") and line.count("|") == cells + 1]


@pytest.mark.parametrize("key, engine_row, config_row", [
    ("sub_group_size", "below an eighth of the size the engine would choose", "below an eighth of the size"),
    ("gradient_clipping", "absent: 1.0", "| 1.0 |"),
])
def test_the_engine_pages_agree_on_what_they_both_state(key, engine_row, config_row):
    """docs/engine.md and docs/engine_config.md state the same floor for sub_group_size and the same
    default for gradient_clipping, and the code has them."""
    from offload.config import EngineConfig
    from offload.train import sizing

    (engine,) = _rows("engine.md", key, cells=2)  # | key | what the engine does |
    (config,) = _rows("engine_config.md", key, cells=3)  # | key | default | meaning |
    assert engine_row in engine and config_row in config
    assert sizing._SUB_GROUP_FLOOR_SHARE == 8
    assert EngineConfig.from_dict({"train_batch_size": 1, "zero_optimization": {"stage": 3}},
                                  world_size=1).gradient_clipping == 1.0


def test_offload_param_pin_memory_is_said_to_be_unread_and_is():
    """The key is parsed, and nothing in the engine or the placement reads it; the pages say so."""
    sources = [path for folder in ("train", "params", "storage", "device") for path in (REPO / "offload" / folder).rglob("*.py")]
    readers = [str(path.relative_to(REPO)) for path in sources
               if re.search(r"offload_param\.pin_memory|param\.pin_memory", path.read_text(encoding="utf-8"))]
    assert readers == []
    for name in ("engine.md", "engine_config.md"):
        (row,) = [line for line in (DOCS / name).read_text(encoding="utf-8").splitlines()
                  if line.startswith(("| `offload_param.pin_memory` |", "| `pin_memory` | false | Accepted"))]
        assert "not read" in row
