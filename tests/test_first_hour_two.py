"""The first hour, round two (issue 40): errors that are one line and lead somewhere (naming what the
user calls at that point), settings that mean the same everywhere, plans and reports that say what
happens, and the set-up and demo commands as the README gives them."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_engine import gpt2
from test_infer_generate import required_and_kv, saved_model

from offload.checkpoint import main as checkpoint_command
from offload.config import EngineConfig, resolve_auto
from offload.infer import init_inference
from offload.infer.cli import _report
from offload.infer.cli import main as generate_command
from offload.infer.plan.host import BudgetError, UnitSize, make_plan
from offload.train.engine import initialize

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def llama():
    yield from saved_model("llama")


def one_line_usage_error(capsys, run) -> str:
    """Run ``run`` (an argparse command), expect exit status 2; return the error line (usage aside)."""
    with pytest.raises(SystemExit) as stopped:
        run()
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err.strip().splitlines()[-1]


# ---- 5. errors that are one line and lead somewhere ------------------------------------------------

def test_generate_refuses_prompt_ids_outside_the_vocabulary(llama, capsys):
    directory, model = llama
    vocab = model.config.vocab_size
    line = one_line_usage_error(capsys, lambda: generate_command([str(directory), "--prompt-ids", f"1,{vocab}"],
                                                                 out=io.StringIO()))
    assert re.search(rf"--prompt-ids: {vocab} is outside the model's vocabulary \(vocab_size {vocab} in .*config.json\); "
                     rf"use ids from 0 to {vocab - 1}$", line), line


def test_generate_refuses_a_missing_nvme_path(llama, capsys, tmp_path):
    directory, _ = llama
    line = one_line_usage_error(capsys, lambda: generate_command(
        [str(directory), "--prompt-ids", "1,2", "--nvme-path", str(tmp_path / "absent")], out=io.StringIO()))
    assert line.endswith(f"--nvme-path: {tmp_path / 'absent'} is not an existing directory; create it or pass one "
                         f"that exists")


def test_consolidate_on_a_trainer_output_folder_names_its_checkpoints(tmp_path, capsys):
    for step in (10, 20, 5):  # what OffloadTrainer leaves in output_dir: a save_dir per checkpoint-<step>
        (tmp_path / "out" / f"checkpoint-{step}" / f"global_step{step}").mkdir(parents=True)
        (tmp_path / "out" / f"checkpoint-{step}" / "latest").write_text(f"global_step{step}")
    assert checkpoint_command(["consolidate", str(tmp_path / "out"), str(tmp_path / "hf3")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert (f"{tmp_path / 'out'} is not a checkpoint but holds 3: checkpoint-5, checkpoint-10, checkpoint-20; pass one "
            f"of them as the checkpoint directory, such as {tmp_path / 'out' / 'checkpoint-20'}") in err
    save_dir = tmp_path / "out" / "checkpoint-10"
    assert checkpoint_command(["consolidate", str(save_dir), str(tmp_path / "hf3"), "--tag", "x"]) == 2
    err = capsys.readouterr().err
    assert f"checkpoint {save_dir / 'x'} (named by --tag) does not exist; tags in {save_dir}: global_step10" in err
    (tmp_path / "empty").mkdir()
    assert checkpoint_command(["consolidate", str(tmp_path / "empty"), str(tmp_path / "hf3")]) == 2
    assert "pass --tag TAG (tags in" in capsys.readouterr().err


def test_a_folder_with_only_pytorch_model_bin_says_how_to_convert_it(tmp_path):
    (tmp_path / "pytorch_model.bin").write_bytes(b"\0" * 64)
    with pytest.raises(FileNotFoundError) as raised:
        init_inference(str(tmp_path))
    message = str(raised.value)
    assert f"no model.safetensors and no model.safetensors.index.json; it holds pytorch_model.bin (pickle" in message
    assert f".save_pretrained({str(tmp_path)!r}), which writes model.safetensors beside it" in message


def test_an_unresolved_scheduler_auto_names_the_call_that_fills_everything(disk_dir):
    """Outside a trainer, the message names resolve_auto with every argument the config needs; doing
    exactly that then works (before: "call offload.resolve_auto(config) first", which then asked for more)."""
    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                           "warmup_num_steps": "auto"}}}
    with pytest.raises(ValueError) as raised:
        initialize(model=gpt2(), config=config)
    assert str(raised.value) == ('scheduler.params.warmup_min_lr: "auto" is not resolved; call offload.resolve_auto('
                                 'config, lr=..., warmup_steps=...) first, which fills its 3 "auto" values, or write '
                                 'the values')
    engine, *_ = initialize(model=gpt2(), config=resolve_auto(config, lr=1e-3, warmup_steps=10))
    assert engine.lr_scheduler is not None
    engine.close()


def test_a_batch_size_mismatch_does_not_suggest_auto_outside_a_trainer():
    with pytest.raises(ValueError) as raised:
        EngineConfig.from_dict({"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2,
                                "gradient_accumulation_steps": 2}, world_size=1)
    message = str(raised.value)
    assert message.startswith("train_batch_size (8) must equal train_micro_batch_size_per_gpu (2) x "
                              "gradient_accumulation_steps (2) x world size (1) = 4; change one of them or leave one "
                              "out to have it derived")
    assert 'set them to "auto"' not in message and "only under OffloadTrainer" in message


def test_kv_budget_error_calls_the_ring_a_ring_and_names_the_command_line_flag(llama, tmp_path):
    directory, _ = llama
    required, _, _ = required_and_kv(directory, 1)
    with init_inference(directory, disk_gbps=1.0, max_in_cpu=f"{required + 64}B",
                        kv_offload={"device": "nvme", "nvme_path": str(tmp_path)}) as engine:
        with pytest.raises(BudgetError) as raised:
            engine.reserve(4, 64)
    message = str(raised.value)
    assert "a KV cache of" not in message
    assert re.search(r"plus .* for batch 4 x 64 tokens: the KV cache's read-ahead ring, 2 x .* \(kv_offload.buffer_count, "
                     r"--kv-buffer-count: 1 halves it\), the cache itself \(.*\) being on NVMe; raise max_in_cpu", message), \
        message


def test_an_int4_run_that_cannot_fit_is_refused_before_quantizing(llama, tmp_path):
    directory, _ = llama
    required, _, _ = required_and_kv(directory, 1)
    cache = tmp_path / "cache"
    cache.mkdir()
    with pytest.raises(BudgetError, match=r"^zero_optimization.offload_param.max_in_cpu: the budget of .* cannot hold "
                                          r"the weights that must stay in memory"):
        init_inference(directory, max_in_cpu=f"{required // 2}B", weight_quantization="int4", nvme_path=str(cache),
                       disk_gbps=1.0)
    assert list(cache.iterdir()) == []  # nothing quantized, nothing written


# ---- 6. the same setting means the same everywhere ------------------------------------------------

def test_training_takes_max_in_cpu_as_a_size_as_generation_does():
    zero = {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": ".", "max_in_cpu": "8GiB"}}
    assert EngineConfig.from_dict({"zero_optimization": zero}, world_size=1).zero_optimization.offload_param \
        .max_in_cpu == (8 << 30) // 4  # fp32 elements
    bf16 = EngineConfig.from_dict({"bf16": {"enabled": True}, "zero_optimization": zero}, world_size=1)
    assert bf16.zero_optimization.offload_param.max_in_cpu == (8 << 30) // 2
    with pytest.raises(ValueError, match=r"^zero_optimization.offload_param.max_in_cpu: '8 GiBs' is not allowed; use "
                                         r"an integer >= 0 \(elements\) or \"auto\" .* or bytes as a size such as"):
        EngineConfig.from_dict({"zero_optimization": {**zero, "offload_param": {
            **zero["offload_param"], "max_in_cpu": "8 GiBs"}}}, world_size=1)


def test_generate_json_prints_only_the_json_on_stdout(llama, capsys):
    directory, _ = llama
    out = io.StringIO()
    figures = generate_command([str(directory), "--prompt-ids", "1,2,3", "--max-new-tokens", "2", "--max-in-cpu",
                                "1GiB", "--disk-gbps", "1.0", "--json"], out=out)
    assert json.loads(out.getvalue()) == json.loads(json.dumps(figures))  # one JSON document, nothing else
    assert "placement:" in capsys.readouterr().err  # the plan and the tokens went to stderr


def test_consolidate_dtype_sets_both_dtype_keys(disk_dir):
    import transformers

    from test_engine import engine_config, gpt2_batches, gpt2_loss

    model = gpt2()
    model.config.dtype = torch.float32  # as from_pretrained leaves it: config.json then says "dtype": "float32"
    engine, *_ = initialize(model=model, config=engine_config(disk_dir, "cpu", "cpu", micro=2))
    engine.backward(gpt2_loss(engine, gpt2_batches(1)[0]))
    engine.step()
    engine.save_checkpoint(disk_dir / "ckpt")
    engine.close()
    assert checkpoint_command(["consolidate", str(disk_dir / "ckpt"), str(disk_dir / "bf"), "--dtype", "bf16",
                               "--no-progress"]) == 0
    written = json.loads((disk_dir / "bf" / "config.json").read_text())
    assert written["dtype"] == written["torch_dtype"] == "bfloat16"
    assert transformers.AutoModelForCausalLM.from_pretrained(disk_dir / "bf").dtype == torch.bfloat16


# ---- 8. plans and reports that read right ---------------------------------------------------------

def test_budget_zero_reads_as_a_sentence():
    units = [UnitSize("embed", 100, 100, 100, False), UnitSize("layers.0", 200, 200, 200, True)]
    first = make_plan(units, budget=0, buffer_count=2).describe().splitlines()[0]
    assert first == ("placement: budget 0 for resident weights and the KV cache (everything streamable is streamed; "
                     "only what must stay is in memory)")


def test_read_faster_than_the_measured_disk_is_not_a_percentage_over_100():
    out = io.StringIO()
    _report({"time_to_first_token_s": 1.0, "init_s": 0.5, "first_token_s": 0.5, "load_s": 0.1, "s_per_token": 0.1,
             "tokens_per_s": 10.0, "batch": 1, "device_resident_bytes": None, "read_bytes_per_forward": 138_000_000,
             "read_gbps": 1.38, "disk_gbps": 1.08, "disk_source": "measured: 256 MiB read with O_DIRECT",
             "disk_s_per_forward": 0.128}, out)
    line = out.getvalue().splitlines()[-1]
    assert "%" not in line and "faster than the disk's 1.08 GB/s (measured" in line and "--disk-gbps" in line


def test_the_plan_says_the_kv_cache_is_quantized(llama):
    directory, _ = llama
    with init_inference(directory, disk_gbps=1.0, max_in_cpu="1GiB", kv_offload={"quantization": "int8"}) as engine:
        text = engine.reserve(1, 16).describe()
    assert re.search(r"KV cache quantized: keys and values stored as int8 \(group \d+, asymmetric\)", text), text


def test_demo_is_named_as_run_calls_it_and_takes_the_sweeps_flags(monkeypatch, capsys):
    from bench import demo

    monkeypatch.setenv("TENSORIO_DEMO_PROG", "./run demo")
    parser = demo.parser()
    assert parser.prog == "./run demo"
    args = parser.parse_args(["--no-progress", "--no-fio"])
    assert args.no_progress and args.no_fio


# ---- the README's commands -------------------------------------------------------------------------

@pytest.mark.subprocess
def test_run_demo_help_says_run_demo():
    done = subprocess.run([str(REPO / "run"), "demo", "--help"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: ./run demo")
    assert "--no-progress" in done.stdout


@pytest.mark.subprocess
def test_setup_shows_no_pip_location_warnings(tmp_path):
    """scripts/setup.sh on a fresh clone, pip stubbed: the torch install and the project install both
    warn about index locations (as pip does here); neither warning reaches the user, the rest does."""
    clone = tmp_path / "clone"
    (clone / "scripts").mkdir(parents=True)
    (clone / "scripts" / "setup.sh").write_bytes((REPO / "scripts" / "setup.sh").read_bytes())
    (clone / "scripts" / "setup.sh").chmod(0o755)
    (clone / "pyproject.toml").write_text("[project]\nname = 'x'\n")
    bin_dir = clone / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    # A python whose `import torch` fails until pip installs it, and whose pip warns as pip does here.
    (bin_dir / "python").write_text(f"""#!/bin/sh
if [ "$1" = "-m" ] && [ "$2" = "pip" ]; then
    echo "WARNING: Location 'file:///opt/pypi/simple/torch/' is ignored: it is neither a file nor a directory." >&2
    echo "installing $*"
    touch {clone}/.venv/torch-installed
    exit 0
fi
if [ "$1" = "-c" ]; then
    case "$2" in *torch*) [ -f {clone}/.venv/torch-installed ] || exit 1 ;; esac
    exit 0
fi
exit 0
""")
    (bin_dir / "python").chmod(0o755)
    fake_path = tmp_path / "bin"
    fake_path.mkdir()
    (fake_path / "fio").write_text("#!/bin/sh\nexit 0\n")
    (fake_path / "fio").chmod(0o755)
    env = {**os.environ, "PATH": f"{fake_path}:{os.environ['PATH']}"}
    done = subprocess.run(["bash", str(clone / "scripts" / "setup.sh")], capture_output=True, text=True, env=env,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    output = done.stdout + done.stderr
    assert "setup: installing torch" in output and "installing the project" in output
    assert "installing -m pip" in output  # pip's own output passes through
    assert "WARNING: Location" not in output, output


# ---- 7. the integration pages' examples do what the pages say ------------------------------------

@pytest.mark.subprocess
@pytest.mark.parametrize("page, engine", [("docs/trainer_hf.md", "trainer.engine"),
                                          ("docs/lightning.md", "trainer.strategy.engine"),
                                          ("docs/accelerate.md", "accelerator.engine")])
def test_integration_examples_put_parameters_and_optimizer_on_nvme(page, engine, disk_dir):
    """Each page's complete example, run as printed (in a scratch directory): its plan has every
    parameter partition and the whole optimizer state on NVMe, as the page says."""
    from test_docs_snippets import snippets

    example = next(code for _, code, skipped in snippets(REPO / page) if not skipped)
    runner = (f"exec(compile({example!r}, {page!r}, 'exec'))\n"
              f"import json; plan = {engine}.plan\n"
              f"print('PLAN', json.dumps([plan.on_disk[0], plan.in_memory[0], plan.persistent[0], "
              f"plan.optimizer_on_nvme]))\n")
    done = subprocess.run([sys.executable, "-c", runner], cwd=disk_dir, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    on_disk, in_memory, persistent, optimizer_on_nvme = json.loads(done.stdout.split("PLAN ")[-1])
    assert on_disk > 0 and in_memory == persistent == 0 and optimizer_on_nvme == 1.0
