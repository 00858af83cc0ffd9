"""OffloadTrainer against plain transformers.Trainer: the same losses, learning rates and grad norms,
a saved model that reloads, and an exact resume (issue 26's target, on a tiny GPT-2)."""

import math

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from offload.integrations.transformers import OffloadTrainer  # noqa: E402

from tests.torchrun import torchrun  # noqa: E402

STEPS, ACCUMULATION, MICRO = 20, 2, 2
SEQ = 16


def tiny_gpt2():
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=256, n_positions=SEQ,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(config)


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n):
        g = torch.Generator().manual_seed(1)
        self.ids = torch.randint(0, 256, (n, SEQ), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def arguments(out, **overrides):
    values = dict(output_dir=str(out), max_steps=STEPS, per_device_train_batch_size=MICRO,
                  gradient_accumulation_steps=ACCUMULATION, learning_rate=1e-3, weight_decay=0.1,
                  max_grad_norm=1.0, lr_scheduler_type="linear", warmup_steps=4, logging_steps=1,
                  save_strategy="no", report_to=[], seed=0, data_seed=0, use_cpu=True, disable_tqdm=True,
                  dataloader_num_workers=0, per_device_eval_batch_size=4)
    values.update(overrides)
    return transformers.TrainingArguments(**values)


def nvme_config(disk_dir):
    return {
        "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
        "train_batch_size": "auto", "gradient_clipping": "auto",
        "zero_optimization": {
            "stage": 3, "stage3_gather_16bit_weights_on_model_save": True,
            "offload_param": {"device": "nvme", "nvme_path": str(disk_dir), "buffer_count": 4, "buffer_size": 1 << 16,
                              "max_in_cpu": 0},
            "offload_optimizer": {"device": "nvme", "nvme_path": str(disk_dir)},
        },
    }


def logged(trainer):
    """Per step: (loss, learning rate, grad norm)."""
    return [(e["loss"], e["learning_rate"], e["grad_norm"]) for e in trainer.state.log_history if "loss" in e]


def assert_same_logs(ours, reference):
    assert len(ours) == len(reference) > 0
    for step, (a, b) in enumerate(zip(ours, reference), 1):
        for name, x, y in zip(("loss", "learning rate", "grad norm"), a, b):
            assert x == pytest.approx(y, rel=1e-5, abs=1e-12), f"step {step}: {name} {x} != {y}"


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("plain")
    trainer = transformers.Trainer(model=tiny_gpt2(), args=arguments(out), train_dataset=Tokens(200),
                                   eval_dataset=Tokens(8))
    trainer.train()
    return trainer


def test_trainer_matches_plain_trainer_and_saves_a_model_that_reloads(reference, disk_dir, tmp_path):
    trainer = OffloadTrainer(model=tiny_gpt2(), args=arguments(tmp_path / "run"), train_dataset=Tokens(200),
                             eval_dataset=Tokens(8), offload_config=nvme_config(disk_dir))
    trainer.train()
    assert_same_logs(logged(trainer), logged(reference))
    assert trainer.engine.global_steps == STEPS
    # Evaluation through the engine gives plain Trainer's loss on the same weights.
    assert trainer.evaluate()["eval_loss"] == pytest.approx(reference.evaluate()["eval_loss"], rel=1e-5)
    # The saved model is the trained one: from_pretrained reloads it to equal logits.
    trainer.save_model(tmp_path / "saved")
    assert (tmp_path / "saved" / "config.json").is_file()
    reloaded = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "saved")
    ids = Tokens(4).ids
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, reference.model(ids).logits, rtol=1e-5, atol=1e-5)
    # predict runs through the engine too.
    prediction = trainer.predict(Tokens(4))
    assert prediction.predictions.shape == (4, SEQ, 256)
    trainer.engine.close()


@pytest.fixture(scope="module")
def first_run(tmp_path_factory):
    """The output_dir of a run of STEPS steps that saved at steps 10 and 20 (checkpoint-10, checkpoint-20)."""
    tmp = tmp_path_factory.mktemp("first")
    first = OffloadTrainer(model=tiny_gpt2(), args=arguments(tmp / "run", save_strategy="steps", save_steps=10),
                           train_dataset=Tokens(200), offload_config=nvme_config(tmp))
    first.train()
    first.engine.close()
    return tmp / "run"


class StepsRun(transformers.TrainerCallback):
    """The global step at the end of each optimizer step this trainer ran (a resume runs only the rest)."""

    def __init__(self):
        self.steps = []

    def on_step_end(self, args, state, control, **kwargs):
        self.steps.append(state.global_step)


def test_resume_from_step_10_continues_identically(first_run, reference, disk_dir, tmp_path):
    checkpoint = first_run / "checkpoint-10"
    assert (checkpoint / "latest").is_file() and (checkpoint / "model.safetensors").is_file()
    ran = StepsRun()
    resumed = OffloadTrainer(model=tiny_gpt2(), args=arguments(tmp_path / "run", save_strategy="steps", save_steps=10),
                             train_dataset=Tokens(200), offload_config=nvme_config(disk_dir), callbacks=[ran])
    resumed.train(resume_from_checkpoint=str(checkpoint))
    assert ran.steps == list(range(11, STEPS + 1))  # steps 11 to 20 only: resumed, not retrained from step 1
    ours = logged(resumed)  # the first 10 steps' logs come back with the trainer state
    assert len(ours) == STEPS and resumed.engine.global_steps == STEPS
    assert_same_logs(ours[10:], logged(reference)[10:])
    resumed.engine.close()


def test_a_save_interrupted_by_ctrl_c_is_skipped_on_resume(reference, disk_dir, tmp_path, monkeypatch, caplog):
    """Ctrl-C while the engine fsyncs checkpoint-20 leaves the model files there but no engine checkpoint
    and no trainer_state.json: resume_from_checkpoint=True skips it with a warning naming it and resumes
    from checkpoint-10 (steps 11-20, plain Trainer's logs), and the run's own save at step 20 makes it
    whole; that folder passed by its path is refused, naming it and what it lacks."""
    import logging

    from offload.storage import checkpoint_dir

    fsync_tree = checkpoint_dir._fsync_tree

    def interrupted_at_step_20(root):
        if ".staging-global_step20-" in root.name:
            raise KeyboardInterrupt
        fsync_tree(root)

    monkeypatch.setattr(checkpoint_dir, "_fsync_tree", interrupted_at_step_20)
    run = tmp_path / "run"
    first = OffloadTrainer(model=tiny_gpt2(), args=arguments(run, save_strategy="steps", save_steps=10),
                           train_dataset=Tokens(200), offload_config=nvme_config(disk_dir))
    with pytest.raises(KeyboardInterrupt):
        first.train()
    first.engine.close()
    monkeypatch.undo()
    left = run / "checkpoint-20"
    assert (left / "model.safetensors").is_file()
    assert not (left / "latest").exists() and not (left / "trainer_state.json").exists()

    with pytest.raises(ValueError, match=rf"^resume_from_checkpoint: {left} is incomplete \(it lacks the engine's "
                                         rf"checkpoint \('latest'\) and trainer_state.json"):
        OffloadTrainer(model=tiny_gpt2(), args=arguments(run), train_dataset=Tokens(200),
                       offload_config=nvme_config(disk_dir)).train(resume_from_checkpoint=str(left))

    ran = StepsRun()
    resumed = OffloadTrainer(model=tiny_gpt2(), args=arguments(run, save_strategy="steps", save_steps=10),
                             train_dataset=Tokens(200), offload_config=nvme_config(disk_dir), callbacks=[ran])
    with caplog.at_level(logging.WARNING, logger="offload"):
        resumed.train(resume_from_checkpoint=True)
    assert f"skipping {left}, an incomplete checkpoint" in caplog.text
    assert ran.steps == list(range(11, STEPS + 1))
    assert_same_logs(logged(resumed)[10:], logged(reference)[10:])
    assert (left / "latest").is_file() and (left / "trainer_state.json").is_file()  # saved whole this time
    resumed.engine.close()


@pytest.mark.parametrize("kind", ["tensor data", "state file"])
def test_a_resume_from_a_checkpoint_with_a_flipped_bit_is_refused(first_run, disk_dir, tmp_path, monkeypatch, kind):
    """Moved to another folder and named by a relative path from a third one, as docs/trainer_hf.md's
    relative paths are: the flipped bit is named before any step runs."""
    from checkpoint_flips import copy_elsewhere, flip, relative

    from tensorio import ChecksumError

    checkpoint = copy_elsewhere(first_run / "checkpoint-10", tmp_path / "moved")
    path, _ = flip(checkpoint / "global_step10", kind)
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")
    ran = StepsRun()
    resumed = OffloadTrainer(model=tiny_gpt2(), args=arguments(tmp_path / "run"), train_dataset=Tokens(200),
                             offload_config=nvme_config(disk_dir), callbacks=[ran])
    try:
        with pytest.raises(ChecksumError, match=f"checksum mismatch .*: {path}"):
            resumed.train(resume_from_checkpoint=relative(checkpoint))
        assert ran.steps == [] and resumed.engine.global_steps == 0
    finally:
        resumed.engine.close()


def test_config_optimizer_and_scheduler_are_the_engines(disk_dir, tmp_path):
    config = nvme_config(disk_dir)
    config["optimizer"] = {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto", "betas": "auto",
                                                       "eps": "auto"}}
    config["scheduler"] = {"type": "WarmupDecayLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                              "warmup_num_steps": "auto", "total_num_steps": "auto"}}
    trainer = OffloadTrainer(model=tiny_gpt2(), args=arguments(tmp_path / "run", max_steps=6),
                             train_dataset=Tokens(40), offload_config=config)
    trainer.train()
    groups = trainer.engine.optimizer.param_groups
    assert [g["weight_decay"] for g in groups] == [0.1, 0.0]  # Trainer's decay / no-decay groups
    logs = logged(trainer)
    assert len(logs) == 6 and all(math.isfinite(loss) and norm > 0 for loss, _, norm in logs)
    rates = [lr for _, lr, _ in logs]
    # DeepSpeed's log warmup to args.learning_rate over args.warmup_steps ("auto"), logged per step
    assert rates == sorted(rates) and rates[0] == 0.0 and 0 < rates[3] < 1e-3 and rates[-1] == pytest.approx(1e-3)
    trainer.engine.close()


class FloatFeatures(torch.nn.Module):
    """A Linear(32, 32) regression on float features, returning its loss as Trainer expects."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layer = torch.nn.Linear(32, 32)

    def forward(self, features, targets):
        return {"loss": torch.nn.functional.mse_loss(self.layer(features).float(), targets.float())}


class Features(torch.utils.data.Dataset):
    def __init__(self, n):
        g = torch.Generator().manual_seed(1)
        self.features, self.targets = torch.randn(n, 32, generator=g), torch.randn(n, 32, generator=g)

    def __len__(self):
        return len(self.features)

    def __getitem__(self, i):
        return {"features": self.features[i], "targets": self.targets[i]}


def test_bf16_with_float_inputs_matches_plain_trainer_bf16(disk_dir, tmp_path):
    """bf16 and a model whose inputs are floats: the batch's floats are cast to the engine's bf16, as
    Trainer casts them under DeepSpeed, and the losses are plain Trainer's bf16 ones within bf16's
    tolerance (before: "mat1 and mat2 must have the same dtype")."""
    config = {"bf16": {"enabled": "auto"}, "gradient_clipping": "auto", "zero_optimization": {"stage": 3}}
    options = dict(max_steps=3, gradient_accumulation_steps=1, bf16=True, lr_scheduler_type="constant",
                   warmup_steps=0)
    plain = transformers.Trainer(model=FloatFeatures(), args=arguments(tmp_path / "plain", **options),
                                 train_dataset=Features(6))
    plain.train()
    ours = OffloadTrainer(model=FloatFeatures(), args=arguments(tmp_path / "ours", **options),
                          train_dataset=Features(6), offload_config=config)
    ours.train()
    assert ours.engine.config.bf16.enabled
    losses = [[entry["loss"] for entry in trainer.state.log_history if "loss" in entry] for trainer in (ours, plain)]
    assert len(losses[0]) == len(losses[1]) == 3
    assert losses[0] == pytest.approx(losses[1], rel=1e-2)
    ours.engine.close()


def test_missing_config_is_refused(tmp_path):
    with pytest.raises(ValueError, match="offload_config"):
        OffloadTrainer(model=tiny_gpt2(), args=arguments(tmp_path))


@pytest.mark.multiprocess
def test_two_ranks_through_torchrun_match_plain_trainer(disk_dir):
    """Two gloo processes: OffloadTrainer (each rank one partition) against plain Trainer's DDP, rank by rank."""
    ranks = torchrun("tests.trainer_dist_worker", "offload,plain", str(disk_dir))
    for rank in (0, 1):
        assert_same_logs(ranks[rank]["offload"], ranks[rank]["plain"])
    assert (disk_dir / "saved" / "model.safetensors").is_file()


@pytest.mark.parametrize("given", ["engine", "engine.module"])
def test_plain_trainer_given_the_engine_is_refused_naming_offload_trainer(disk_dir, tmp_path, given):
    """The issue's first tries: Trainer(model=engine) failed with "'Engine' object has no attribute 'to'",
    Trainer(model=engine.module) with the engine's optimizer deep inside a step; both now say to use
    OffloadTrainer, before any step."""
    from offload import initialize

    config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_clipping": 1.0,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "zero_optimization": {"stage": 3,
                                    "offload_param": {"device": "nvme", "nvme_path": str(disk_dir), "max_in_cpu": 0},
                                    "offload_optimizer": {"device": "nvme", "nvme_path": str(disk_dir)}}}
    engine, optimizer, *_ = initialize(model=tiny_gpt2(), config=config)
    model = engine if given == "engine" else engine.module
    with pytest.raises(RuntimeError, match="OffloadTrainer"):
        trainer = transformers.Trainer(model=model, args=arguments(tmp_path, max_steps=2), train_dataset=Tokens(8),
                                       optimizers=(optimizer, None))
        trainer.train()
    assert engine.global_steps == 0
    engine.close()
