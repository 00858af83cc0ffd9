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


def _table(page: str, heading: str) -> dict[str, str]:
    """The first table under ``heading`` of docs/``page``: {each backticked name of the first cell: the second cell}."""
    text = (DOCS / page).read_text(encoding="utf-8")
    after = text[text.index(f"\n{heading}\n") + len(heading) + 2:]
    lines = after[after.index("\n|"):].strip("\n").split("\n\n")[0].splitlines()
    rows = {}
    for line in lines[2:]:  # past the header and the |---| line
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        for name in re.findall(r"`([^`]+)`", cells[0]):
            rows[name] = cells[1]
    return rows


def _documented_default(cell: str):
    """A table's default cell as a value, or ``...`` for words that are not one ("derived", "see below")."""
    if cell in ("true", "false"):
        return cell == "true"
    if cell in ("not set", "—", "none"):
        return None
    if re.fullmatch(r'"[^"]*"', cell):
        return cell.strip('"')
    if re.fullmatch(r"\[[0-9., e-]+\]", cell):
        return tuple(float(x) for x in cell.strip("[]").split(","))
    try:
        return float(cell)
    except ValueError:
        return ...


def _config_sections():
    from offload.config import (AdamParams, EngineConfig, Fp16Config, OffloadOptimizerConfig, OffloadParamConfig,
                                WarmupParams, ZeroConfig)
    return [("### Top level", EngineConfig, {"bfloat16", "source", "world_size"}),
            ("### `fp16`", Fp16Config, set()), ("### `optimizer`", AdamParams, set()),
            ("### `scheduler`", WarmupParams, set()), ("### `zero_optimization`", ZeroConfig, set()),
            ("#### `offload_param`", OffloadParamConfig, set()),
            ("#### `offload_optimizer`", OffloadOptimizerConfig, set())]


@pytest.mark.parametrize("heading, cls, not_fields", _config_sections(), ids=lambda v: getattr(v, "__name__", None))
def test_engine_config_tables_name_every_key_with_its_default(heading, cls, not_fields):
    """docs/engine_config.md: each section's table lists exactly the keys its dataclass takes, and every
    default written as a value (a number, true/false, a quoted string, "not set") is the field's default."""
    import dataclasses

    rows = _table("engine_config.md", heading)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init and f.name not in not_fields}
    extra = {"aio"} if cls.__name__ == "ZeroConfig" else set()
    assert set(rows) - {"bfloat16"} == set(fields) | extra
    for name, field in fields.items():
        documented = _documented_default(rows[name])
        if documented is ... or field.default is dataclasses.MISSING:
            continue
        assert documented == field.default, f"{heading} {name}: the page says {rows[name]}, the code {field.default!r}"


def test_the_auto_table_names_the_keys_resolve_auto_fills():
    """docs/engine_config.md's '"auto" values' table: the keys are the ones `resolve_auto` fills, each from
    the argument the table names (a row's short names such as `betas` share its first key's section)."""
    from offload.config.parse import AUTO_ARGUMENTS

    page = (DOCS / "engine_config.md").read_text(encoding="utf-8")
    table = page[page.index("| Key | Filled from |"):].split("\n\n")[0].splitlines()[2:]
    documented = {}
    for line in table:
        keys, source = [cell.strip() for cell in line.strip("|").split("|")]
        names = re.findall(r"`([^`]+)`", keys)
        arguments = re.findall(r"`([^`]+)`", source)
        parent = names[0].rpartition(".")[0]
        for i, name in enumerate(names):
            key = name if "." in name or not parent else f"{parent}.{name}"
            # the i-th argument, the last one for a spelling more (`bfloat16.enabled`), h for `hidden_size`
            documented[key] = (arguments[min(i, len(arguments) - 1)] if arguments
                               else "hidden_size" if "h*h" in source or "*h" in source else "")
    assert set(documented) == set(AUTO_ARGUMENTS)
    for key, argument in AUTO_ARGUMENTS.items():
        if key != "train_batch_size":  # removed, computed from the micro batch: the table says so in words
            assert documented[key] == argument, key


def test_the_aio_options_table_is_aio_config():
    """docs/tensorio.md's "Options" table: AioConfig's keys, each with its default (block_size in MiB)."""
    import dataclasses

    from tensorio import AioConfig

    rows = _table("tensorio.md", "## Options (`AioConfig`, the `aio` section)")
    defaults = {f.name: f.default for f in dataclasses.fields(AioConfig)}
    assert set(rows) == set(defaults)
    assert rows.pop("block_size") == f"{defaults['block_size'] >> 20} MiB"
    for name, cell in rows.items():
        assert _documented_default(cell) == defaults[name], name


def test_the_inference_settings_table_names_every_override_with_its_default():
    """docs/inference.md's "Settings" table: its override column is `InferenceConfig`'s fields (and
    ``checkpoint``, which `init_inference` takes beside them), and the defaults written as values hold."""
    import dataclasses

    from offload.infer.config import InferenceConfig, KVOffload

    page = (DOCS / "inference.md").read_text(encoding="utf-8")
    table = page[page.index("| key | override | default | meaning |"):].split("\n\n")[0].splitlines()[2:]
    rows = {}
    for line in table:
        _, override, default = [cell.strip() for cell in line.strip("|").split("|")][:3]
        rows[override.strip("`")] = default
    fields = {f.name: f for f in dataclasses.fields(InferenceConfig)}
    assert set(rows) == set(fields) | {"checkpoint"}
    assert _documented_default(rows["buffer_count"]) == fields["buffer_count"].default
    assert _documented_default(rows["compute_device"]) == fields["compute_device"].default
    assert _documented_default(rows["experts"]) == fields["experts"].default
    assert _documented_default(rows["kv_offload"]) == KVOffload().device
    assert _documented_default(rows["device"]) == fields["device"].default
    assert rows["max_in_cpu"].startswith("1e9")  # None: DeepSpeed's 1e9 elements (the config's docstring)


def _inline_names(text: str) -> set[str]:
    """Dotted names of the project's packages written in backticks: `offload.zero.Init`, `tensorio.prefault`."""
    names = set()
    for quoted in re.findall(r"`([^`\n]+)`", text):
        names |= set(re.findall(r"\b((?:offload|tensorio|benchmarks|bench)(?:\.[A-Za-z_]\w*)+)", quoted))
    return names


def _resolves(name: str) -> bool:
    import importlib

    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attribute in parts[i:]:
            if not hasattr(obj, attribute):
                return False
            obj = getattr(obj, attribute)
        return True
    return False


_PAGES = [REPO / "README.md", *sorted(DOCS.glob("*.md"))]
_PLACEHOLDERS = {"benchmarks.NAME"}  # docs/benchmarks.md: "python -m benchmarks.NAME --help"
_OUTPUTS = {"configs/aio_tuned.json"}  # docs/tuning.md: the file `tensorio-bench tune` writes


@pytest.mark.parametrize("page", _PAGES, ids=lambda path: path.name)
def test_the_names_a_page_gives_exist(page):
    """Every `offload.x.y` / `tensorio.x` name, every path of the clone (offload/..., tests/..., configs/...)
    and every test a page names in backticks exists: a renamed function, module or test makes its page fail."""
    text = page.read_text(encoding="utf-8")
    missing = sorted(name for name in _inline_names(text) - _PLACEHOLDERS if not _resolves(name))
    quoted = re.findall(r"`([^`\n]+)`", text)
    paths = {path for q in quoted for path in re.findall(
        r"\b((?:tests|offload|tensorio|benchmarks|bench|scripts|configs|docs)/[\w./-]+\.(?:py|json|sh|md))", q)}
    missing += sorted(path for path in paths - _OUTPUTS if not (REPO / path).exists())
    tests = "\n".join(path.read_text(encoding="utf-8") for path in (REPO / "tests").rglob("*.py"))
    named = {m for q in quoted for m in re.findall(r"(?:::|^)(test_\w+)$", q)}
    missing += sorted(name for name in named if f"def {name}(" not in tests)
    assert missing == []


def test_the_readme_names_every_tensorio_bench_command():
    """README.md's layout line for bench/ lists the commands `tensorio-bench` has."""
    from bench.cli import _parser

    (line,) = [line for line in (REPO / "README.md").read_text(encoding="utf-8").splitlines()
               if line.startswith("bench/ ")]
    listed = set(line.split("(")[1].split(")")[0].split(", "))
    parser = _parser()
    commands = next(action for action in parser._actions if action.dest == "command").choices
    assert listed == set(commands)
