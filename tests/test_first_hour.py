"""A first hour without surprises (issue 27): the shipped configs run as they are, a config that keeps
in memory what it asked to offload says so, the plan prints, inference's max_in_cpu 0 streams what
it can, command errors are one line, permission errors say so, docs cite files that exist."""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_engine import engine_config, gpt2, gpt2_batches, gpt2_loss
from test_infer_generate import saved_model

from offload.infer import init_inference
from offload.infer.plan.host import BudgetError, UnitSize, format_bytes, make_plan
from offload.train.engine import initialize

REPO = Path(__file__).resolve().parent.parent
CONFIGS = REPO / "configs"


# ---- the shipped configs -------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["zero3_nvme_offload.json", "zero3_bf16_nvme_offload.json", "zero3_cpu_optimizer.json"])
def test_shipped_configs_train_as_they_are(name, disk_dir, monkeypatch, caplog):
    monkeypatch.chdir(disk_dir)  # nvme_path "." is the working directory
    with caplog.at_level(logging.WARNING, logger="offload"):
        engine, *_ = initialize(model=_gpt2_with_a_large_embedding(), config=str(CONFIGS / name))
    for batch in gpt2_batches(2, batch=1):
        engine.backward(gpt2_loss(engine, batch))
        engine.step()
    assert engine.global_steps == 2
    plan = engine.plan
    if "nvme" in name:  # every partition the config puts on NVMe is there, and nothing is said about it
        assert plan.on_disk[0] + plan.persistent[0] == len(engine.records) and plan.on_disk[0] > 0
        assert plan.in_memory == (0, 0) and plan.optimizer_on_nvme == 1.0
        assert "max_in_cpu" not in caplog.text
    else:
        assert plan.optimizer_device == "cpu" and plan.optimizer_on_nvme == 0.0
    engine.close()


def _gpt2_with_a_large_embedding():
    """A tiny GPT-2 whose embedding (131 072 elements) is above the shipped configs' persistence threshold."""
    import transformers

    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=2, n_embd=128, n_head=2, vocab_size=1024,
                                                                n_positions=16))


def test_inference_config_is_read_as_shipped():
    from offload.infer import InferenceConfig

    config = InferenceConfig.from_dict(str(CONFIGS / "inference_nvme.json"))
    assert config.device == "nvme" and config.budget_bytes(2) == 8 << 30


# ---- a config that keeps in memory what it asked to offload ------------------------------------------

def test_max_in_cpu_that_keeps_everything_in_memory_warns_once_with_the_figures(disk_dir, caplog):
    config = engine_config(disk_dir, "nvme", "nvme", micro=1)
    config["zero_optimization"]["offload_param"]["max_in_cpu"] = 1e9  # DeepSpeed's default
    with caplog.at_level(logging.WARNING, logger="offload"):
        engine, *_ = initialize(model=gpt2(0.0), config=config)
        for batch in gpt2_batches(2, batch=1):
            engine.backward(gpt2_loss(engine, batch))
            engine.step()
    warnings = [r.getMessage() for r in caplog.records if "max_in_cpu" in r.getMessage()]
    assert len(warnings) == 1
    count = len(engine.records)
    assert re.search(rf'offload_param.device is "nvme", but max_in_cpu \(1,000,000,000 elements\) keeps {count} of '
                     rf'{count} partitions \([0-9.]+ MB\) in memory and puts 0 \(0.00 MB\) on NVMe; set max_in_cpu to 0',
                     warnings[0])
    text = str(engine.plan)
    assert f"on NVMe:   0 parameters" in text and f"in memory: {count} parameters" in text
    assert "max_in_cpu 1,000,000,000 elements" in text and "the update runs during backward" in text
    engine.close()


# ---- inference: max_in_cpu 0 and budget messages -----------------------------------------------------

@pytest.fixture(scope="module")
def llama():
    yield from saved_model("llama")


def test_inference_max_in_cpu_zero_streams_everything_streamable(llama):
    directory, model = llama
    ids = torch.tensor([[5, 9, 42]])
    with init_inference(directory, max_in_cpu=0, disk_gbps=1.0) as engine:
        plan = engine.plan
        must = {u.name for u in plan.units if not u.streamable}
        assert plan.resident == must and must  # embeddings and norms stay; every layer is streamed
        assert len(plan.streamed) == len([u for u in plan.units if u.streamable])
        assert ("budget 0 for resident weights and the KV cache (everything streamable is streamed; only what must "
                "stay is in memory)") in plan.describe()
        out = engine.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False)
    expected = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False)
    assert torch.equal(out, expected)


def test_budget_messages_round_the_need_up():
    units = [UnitSize("model.embed_tokens", 1_153_434, 1_153_434, 1_153_434, False)]  # 1.1000... MiB
    with pytest.raises(BudgetError, match=r"raise max_in_cpu to at least 1\.2 MiB$"):
        make_plan(units, budget=1 << 20, buffer_count=2)
    assert format_bytes(1_153_434) == "1.1 MiB" and format_bytes(1_153_434, up=True) == "1.2 MiB"
    assert format_bytes(1 << 20, up=True) == "1.0 MiB"


# ---- command errors in one line -------------------------------------------------------------------

def _generate(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "offload.generate", *args], capture_output=True, text=True)


@pytest.mark.subprocess
def test_generate_user_errors_are_one_line(disk_dir, llama, capsys, monkeypatch):
    (disk_dir / "notes").mkdir()
    (disk_dir / "notes" / "a.txt").write_text("not a model")
    no_config = disk_dir / "weights"
    no_config.mkdir()
    shutil.copy(next(Path(llama[0]).glob("*.safetensors")), no_config / "model.safetensors")
    done = _generate(str(disk_dir / "notes"), "--prompt-ids", "1,2")  # the command itself, once
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr and done.stderr.count("\n") == 1, done.stderr
    assert done.stderr.startswith("python -m offload.generate: error: ") and str(disk_dir / "notes") in done.stderr
    # The same entry (`run_command` around the CLI's main) in this process, for each kind of directory.
    from offload.cli_errors import run_command
    from offload.infer.cli import main

    capsys.readouterr()
    for directory in (disk_dir / "notes", no_config, disk_dir / "missing"):
        assert run_command(main, "python -m offload.generate", [str(directory), "--prompt-ids", "1,2"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("python -m offload.generate: error: ") and str(directory) in err
    with pytest.raises((OSError, ValueError)):  # --debug: the error goes on with its traceback
        run_command(main, "python -m offload.generate", [str(disk_dir / "notes"), "--prompt-ids", "1,2", "--debug"])
    monkeypatch.setenv("OFFLOAD_DEBUG", "1")
    with pytest.raises((OSError, ValueError)):
        run_command(main, "python -m offload.generate", [str(disk_dir / "notes"), "--prompt-ids", "1,2"])


@pytest.mark.subprocess
def test_generate_with_max_in_cpu_zero_runs(llama):
    done = _generate(str(llama[0]), "--prompt-ids", "5,9,42", "--max-new-tokens", "2", "--max-in-cpu", "0",
                     "--disk-gbps", "1")
    assert done.returncode == 0, done.stderr
    assert "budget 0 for resident weights and the KV cache (everything streamable is streamed" in done.stdout


# ---- permission denied -----------------------------------------------------------------------------

def _as_unprivileged(code: str) -> subprocess.CompletedProcess:
    """Run ``code`` in a process that file permissions apply to (root without its capabilities)."""
    prefix = []
    if os.geteuid() == 0:
        if shutil.which("setpriv") is None:
            pytest.skip("root ignores file permissions, and setpriv (to drop its capabilities) is missing")
        prefix = ["setpriv", "--bounding-set=-all", "--inh-caps=-all"]
    return subprocess.run([*prefix, sys.executable, "-c", code], capture_output=True, text=True, cwd="/",
                          env={**os.environ, "PYTHONPATH": str(REPO)})


@pytest.fixture
def locked_dir(disk_dir):
    """A directory inside one that nobody may enter (mode 000)."""
    parent = disk_dir / "private"
    (parent / "swap").mkdir(parents=True)
    os.chmod(parent, 0)
    yield parent / "swap"
    os.chmod(parent, 0o700)


@pytest.mark.subprocess
def test_validate_says_permission_denied(locked_dir):
    done = _as_unprivileged(f"import sys; from bench.cli import main; sys.exit(main(['validate', {str(locked_dir)!r}]))")
    assert "Traceback" not in done.stderr, done.stderr
    assert f"permission denied: {locked_dir}" in done.stdout


@pytest.mark.subprocess
def test_engine_nvme_path_says_permission_denied(locked_dir):
    config = {"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": str(locked_dir)}},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    done = _as_unprivileged(
        "from offload.config import EngineConfig, check_nvme_paths\n"
        f"check_nvme_paths(EngineConfig.from_dict({config!r}, world_size=1))")
    assert "PermissionError" in done.stderr and "does not exist" not in done.stderr
    assert f"zero_optimization.offload_param.nvme_path: {str(locked_dir)!r}: permission denied" in done.stderr


# ---- what the docs and code cite --------------------------------------------------------------------

def test_cited_source_paths_exist():
    cited = re.compile(r"`((?:offload|tensorio|bench|benchmarks|tests)/[\w/.-]+\.py)")
    missing = []
    for path in [REPO / "README.md", *(REPO / "docs").glob("*.md"), *(REPO / "offload").rglob("*.py")]:
        for match in cited.finditer(path.read_text(encoding="utf-8")):
            if not (REPO / match.group(1)).exists():
                missing.append(f"{path.relative_to(REPO)}: {match.group(1)}")
    docstring = re.compile(r"\b(offload/[\w/]+\.py)\b")
    for path in (REPO / "offload").rglob("*.py"):
        missing += [f"{path.relative_to(REPO)}: {m}" for m in docstring.findall(path.read_text()) if not (REPO / m).exists()]
    assert not missing


def test_offload_uses_only_public_tensorio_names():
    private = [f"{path.relative_to(REPO)}: {line.strip()}" for path in (REPO / "offload").rglob("*.py")
               for line in path.read_text().splitlines() if re.match(r"\s*(from|import) tensorio\._", line)]
    assert not private
