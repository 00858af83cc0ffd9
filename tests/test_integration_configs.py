"""Every DeepSpeed JSON a user brings (the Hugging Face / DeepSpeed examples, configs/) trains unedited
through each integration: OffloadTrainer, OffloadStrategy and OffloadAccelerator fill every "auto" from
their own framework's settings (batch size, accumulation, clipping, precision, the optimizer's
hyperparameters). The one edit: an "nvme_path" is pointed at a scratch directory, as the examples'
placeholder "/local_nvme" asks the user to do.

The integrations' constructors refuse an unknown keyword argument naming the closest known one, and a
bad value naming the argument."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
pl = pytest.importorskip("lightning.pytorch")
accelerate = pytest.importorskip("accelerate")

from bench.cli import DEFAULT_CONFIG_OUT  # noqa: E402
from offload.integrations.accelerate import OffloadAccelerator  # noqa: E402
from offload.integrations.lightning import OffloadStrategy  # noqa: E402
from offload.integrations.transformers import OffloadTrainer  # noqa: E402

REPO = Path(__file__).resolve().parent.parent

CONFIGS = sorted(p for p in (REPO / "configs").glob("*.json")
                 if p.name not in ("inference_nvme.json", DEFAULT_CONFIG_OUT.name))
"""The shipped training configs: not the sweep's own output, which a run of tensorio-bench leaves (git-ignored)."""
FAST = ("zero3_auto.json",)
"""The examples the fast tier runs through each integration; the slow tier runs them all."""
EACH_CONFIG = [pytest.param(p, marks=() if p.name in FAST else pytest.mark.slow, id=p.name) for p in CONFIGS]
SHARED = REPO.parent / "shared" / "configs"
"""Where the examples users bring are kept beside the clone; configs/ ships a copy of each."""

SEQ = 8
DEFAULTS = {"micro": 2, "accumulation": 2, "clip": 0.5, "lr": 3e-3, "betas": [0.8, 0.9], "eps": 1e-7,
            "weight_decay": 0.05, "fp16": False, "bf16": False}
"""The framework settings where a JSON says "auto"; where it writes a value, the user sets the same."""


def test_configs_carries_every_example_users_bring():
    """configs/ holds each JSON of ../shared/configs/ byte for byte (where that folder is beside the clone)."""
    if not SHARED.is_dir():
        pytest.skip(f"{SHARED} is not beside the clone")
    shipped = {p.read_bytes() for p in CONFIGS}
    missing = [p.name for p in sorted(SHARED.glob("*.json")) if p.read_bytes() not in shipped]
    assert not missing, f"copy these into configs/: {missing}"


def load(path: Path, nvme: Path) -> dict:
    """The JSON as written, with any nvme_path pointed at ``nvme``."""
    config = json.loads(path.read_text())
    for section in ("offload_param", "offload_optimizer"):
        node = config.get("zero_optimization", {}).get(section)
        if isinstance(node, dict) and "nvme_path" in node:
            node["nvme_path"] = str(nvme)
    return config


def settings(path: Path) -> dict:
    """The framework settings a user of this JSON gives: its written values, DEFAULTS for the rest."""
    config = json.loads(path.read_text())
    optimizer = config.get("optimizer", {}).get("params", {})
    bf16 = config.get("bf16", config.get("bfloat16", {})).get("enabled", False)
    written = {"micro": config.get("train_micro_batch_size_per_gpu"),
               "accumulation": config.get("gradient_accumulation_steps"), "clip": config.get("gradient_clipping"),
               **{name: optimizer.get(name) for name in ("lr", "betas", "eps", "weight_decay")},
               "fp16": config.get("fp16", {}).get("enabled"), "bf16": bf16}
    return {name: DEFAULTS[name] if value in (None, "auto") else value for name, value in written.items()}


def tiny_gpt2():
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64,
                                                                n_positions=SEQ))


def token_batches(n):
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, 64, (n, SEQ), generator=g)


def check_filled(engine, want, *, clip=True):
    """The engine's config holds the framework's settings ``want`` where the JSON said "auto", and it
    trained two steps."""
    config = engine.config
    assert config.train_micro_batch_size_per_gpu == want["micro"]
    assert config.gradient_accumulation_steps == want["accumulation"]
    assert config.bf16.enabled is want["bf16"] and config.fp16.enabled is want["fp16"]
    if clip:
        assert config.gradient_clipping == want["clip"]
    if config.optimizer is not None:
        params = config.source["optimizer"]["params"]
        for name in ("lr", "betas", "eps", "weight_decay"):
            assert params[name] == pytest.approx(want[name]), name
    assert engine.global_steps == 2


# ---- Hugging Face Trainer ---------------------------------------------------------------------------

class Tokens(torch.utils.data.Dataset):
    def __init__(self, n):
        self.ids = token_batches(n)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


@pytest.mark.parametrize("path", EACH_CONFIG)
def test_trainer_runs_each_config_unedited(path, disk_dir, tmp_path, monkeypatch):
    monkeypatch.chdir(disk_dir)  # the shipped configs' nvme_path "."
    want = settings(path)
    warmup = json.loads(path.read_text()).get("scheduler", {}).get("params", {}).get("warmup_num_steps", 0)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=want["micro"],
        gradient_accumulation_steps=want["accumulation"], learning_rate=want["lr"], max_grad_norm=want["clip"],
        adam_beta1=want["betas"][0], adam_beta2=want["betas"][1], adam_epsilon=want["eps"],
        weight_decay=want["weight_decay"], warmup_steps=0 if warmup == "auto" else warmup, fp16=want["fp16"],
        bf16=want["bf16"], save_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True,
        logging_strategy="no", dataloader_num_workers=0)
    trainer = OffloadTrainer(model=tiny_gpt2(), args=args, train_dataset=Tokens(16),
                             offload_config=load(path, disk_dir))
    trainer.train()
    check_filled(trainer.engine, want)
    trainer.engine.close()


# ---- Lightning --------------------------------------------------------------------------------------

class Module(pl.LightningModule):
    def __init__(self, want):
        super().__init__()
        self.model = tiny_gpt2()
        self.want = want

    def training_step(self, batch, batch_idx):
        return self.model(batch, labels=batch).loss

    def configure_optimizers(self):
        want = self.want
        return torch.optim.AdamW(self.parameters(), lr=want["lr"], betas=want["betas"], eps=want["eps"],
                                 weight_decay=want["weight_decay"])


def fit(strategy, tmp_path, want):
    # Lightning runs "16-mixed" as bf16 on the CPU: a JSON that writes fp16 out gets it with "32-true"
    precision = "bf16-mixed" if want["bf16"] else "32-true"
    run = pl.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_steps=2, precision=precision,
                     accumulate_grad_batches=want["accumulation"], gradient_clip_val=want["clip"], logger=False,
                     enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                     use_distributed_sampler=False, default_root_dir=tmp_path)
    loader = torch.utils.data.DataLoader(token_batches(2 * want["micro"] * want["accumulation"]),
                                         batch_size=want["micro"])
    run.fit(Module(want), loader)
    return run.strategy.engine


@pytest.fixture()
def no_process_group_left():
    """Lightning's DDP-type strategies start a process group and export launch variables: both go."""
    saved = dict(os.environ)
    yield
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    os.environ.clear()
    os.environ.update(saved)


@pytest.mark.parametrize("path", EACH_CONFIG)
def test_lightning_runs_each_config_unedited(path, disk_dir, tmp_path, monkeypatch, no_process_group_left):
    monkeypatch.chdir(disk_dir)
    want = settings(path)
    engine = fit(OffloadStrategy(config=load(path, disk_dir)), tmp_path, want)
    check_filled(engine, want)
    engine.close()


@pytest.mark.parametrize("name", ["zero3_auto.json", "zero2_bfloat16_auto.json"])
def test_lightning_precision_fills_fp16_and_bf16_auto(name, disk_dir, tmp_path, no_process_group_left):
    """precision="bf16-mixed" turns bf16 on and fp16 off where the JSON says "auto" (both, as the
    ZeRO-3 example does)."""
    want = {**settings(REPO / "configs" / name), "bf16": True}
    engine = fit(OffloadStrategy(config=load(REPO / "configs" / name, disk_dir)), tmp_path, want)
    check_filled(engine, want)
    engine.close()


# ---- Accelerate -------------------------------------------------------------------------------------

@pytest.fixture()
def fresh_accelerate():
    accelerate.state.AcceleratorState._reset_state(True)
    yield
    accelerate.state.AcceleratorState._reset_state(True)


def accelerate_run(accelerator, want, optimizer_of=None):
    model = tiny_gpt2()
    opt = (optimizer_of or (lambda m: torch.optim.AdamW(m.parameters(), lr=want["lr"], betas=want["betas"],
                                                         eps=want["eps"], weight_decay=want["weight_decay"])))(model)
    loader = torch.utils.data.DataLoader(token_batches(2 * want["micro"] * want["accumulation"]),
                                         batch_size=want["micro"])
    model, opt, loader = accelerator.prepare(model, opt, loader)
    for batch in loader:
        with accelerator.accumulate(model):
            accelerator.backward(model(batch, labels=batch).loss)
            opt.step()
            opt.zero_grad()
    return accelerator.engine


@pytest.mark.parametrize("path", EACH_CONFIG)
def test_accelerate_runs_each_config_unedited(path, disk_dir, monkeypatch, fresh_accelerate):
    monkeypatch.chdir(disk_dir)
    want = settings(path)
    precision = "fp16" if want["fp16"] else "bf16" if want["bf16"] else "no"
    accelerator = OffloadAccelerator(offload_config=load(path, disk_dir), cpu=True, mixed_precision=precision,
                                     gradient_accumulation_steps=want["accumulation"])
    engine = accelerate_run(accelerator, want)
    check_filled(engine, want, clip=False)
    clipping = json.loads(path.read_text()).get("gradient_clipping")
    # Accelerate's "auto", and DeepSpeed's default where the JSON has no gradient_clipping, are both 1.0
    assert engine.config.gradient_clipping == (1.0 if clipping in ("auto", None) else clipping)
    engine.close()


def test_accelerate_mixed_precision_and_dummy_optim_fill_auto(disk_dir, fresh_accelerate):
    """mixed_precision="bf16" fills bf16/fp16 "enabled"; DummyOptim's lr and weight decay fill the
    optimizer's (AdamW's betas and eps where it gives none)."""
    from accelerate.utils.deepspeed import DummyOptim

    want = {**DEFAULTS, "bf16": True, "betas": [0.9, 0.999], "eps": 1e-8}
    accelerator = OffloadAccelerator(offload_config=str(REPO / "configs" / "zero3_auto.json"), cpu=True,
                                     gradient_accumulation_steps=want["accumulation"], mixed_precision="bf16")
    engine = accelerate_run(accelerator, want, lambda m: DummyOptim(m.parameters(), lr=want["lr"], weight_decay=0.05))
    check_filled(engine, want, clip=False)
    engine.close()


# ---- constructors -----------------------------------------------------------------------------------

def test_strategy_refuses_the_deepspeed_spelling_naming_its_own(disk_dir):
    with pytest.raises(TypeError, match=r"OffloadStrategy: unexpected keyword argument offload_param='nvme'; "
                                        r"did you mean offload_params=\?"):
        OffloadStrategy(offload_param="nvme", nvme_path=str(disk_dir))


@pytest.mark.parametrize("kwargs, message", [
    ({"offload_params": "disk"}, r"OffloadStrategy\(offload_params='disk'\): not a device; use one of 'none', "),
    ({"offload_optimizer": "NVMe"}, r"OffloadStrategy\(offload_optimizer='NVMe'\): not a device"),
    ({"nvme_path": "swap"}, r"OffloadStrategy\(nvme_path='swap'\): nothing goes to NVMe"),
    ({"config": {"zero_optimization": {"stage": 3}}, "offload_params": "nvme"},
     r"OffloadStrategy\(config=..., offload_params=...\): .* pass either config or offload_params"),
    ({"config": "no_such.json"}, r"OffloadStrategy\(config=...\): config file no_such.json .*does not exist"),
    ({"config": {"zero_optimization": {"stage": 5}}},
     r"^OffloadStrategy\(config=...\): zero_optimization.stage: 5 is not allowed; use 0, 1, 2 or 3$"),
    ({"config": {"gradient_clipping": "auto", "zero_optimisation": {"stage": 3}}},
     r"^OffloadStrategy\(config=...\): zero_optimisation: unknown key"),
])
def test_strategy_refuses_bad_values_at_construction(kwargs, message):
    with pytest.raises((ValueError, OSError), match=message):
        OffloadStrategy(**kwargs)


def test_trainer_and_accelerator_refuse_unknown_keywords_and_bad_configs(tmp_path, fresh_accelerate):
    args = transformers.TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True)
    with pytest.raises(TypeError, match=r"OffloadTrainer: unexpected keyword argument offload_confg=.*did you mean "
                                        r"offload_config=\?"):
        OffloadTrainer(model=tiny_gpt2(), args=args, offload_confg={})
    with pytest.raises(FileNotFoundError, match=r"OffloadTrainer\(offload_config=...\): config file .*missing.json"):
        OffloadTrainer(model=tiny_gpt2(), args=args, offload_config=str(tmp_path / "missing.json"))
    with pytest.raises(TypeError, match=r"OffloadAccelerator: unexpected keyword argument gradient_acumulation_steps"
                                        r"=2; did you mean gradient_accumulation_steps=\?"):
        OffloadAccelerator(offload_config={}, gradient_acumulation_steps=2, cpu=True)
    with pytest.raises(ValueError, match=r"OffloadAccelerator\(offload_config=...\): .*not valid JSON"):
        (tmp_path / "bad.json").write_text("{")
        OffloadAccelerator(offload_config=str(tmp_path / "bad.json"), cpu=True)


def test_lightning_auto_without_a_source_names_the_lightning_setting(disk_dir, tmp_path, no_process_group_left):
    """An "auto" Lightning has nothing for says which Lightning setting fills it, not resolve_auto."""

    class NoOptimizer(Module):
        def __init__(self):
            super().__init__(DEFAULTS)

        def configure_optimizers(self):
            return None

    strategy = OffloadStrategy(config={"optimizer": {"type": "AdamW", "params": {"lr": "auto"}},
                                       "zero_optimization": {"stage": 3}})
    run = pl.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_steps=1, logger=False,
                     enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                     default_root_dir=tmp_path)
    with pytest.raises(ValueError, match=r'^optimizer\.params\.lr: "auto" needs a value; return an optimizer with '
                                         r'lr from configure_optimizers or write a value$'):
        run.fit(NoOptimizer(), torch.utils.data.DataLoader(token_batches(2), batch_size=1))


def test_trainer_errors_name_training_arguments_not_resolve_auto(tmp_path):
    """A value the JSON writes that TrainingArguments contradicts is named in TrainingArguments' terms."""
    args = transformers.TrainingArguments(output_dir=str(tmp_path), max_steps=1, learning_rate=5e-5, report_to=[],
                                          use_cpu=True, disable_tqdm=True, save_strategy="no")
    config = {"optimizer": {"type": "AdamW", "params": {"lr": 3e-5}}, "zero_optimization": {"stage": 3}}
    trainer = OffloadTrainer(model=tiny_gpt2(), args=args, train_dataset=Tokens(4), offload_config=config)
    with pytest.raises(ValueError, match=r"^optimizer\.params\.lr: the config says 3e-05 but "
                                         r"TrainingArguments\(learning_rate=5e-05\); make them agree"):
        trainer.train()
