"""OffloadStrategy against Lightning without offload: the same losses and learning rates with
configure_optimizers' AdamW groups and scheduler, clipping and accumulation, 20 steps; validation; the
transformers model saved with save_pretrained reloads to equal logits; a checkpoint at step 10 that
resumes identically; two processes against Lightning's ddp."""

import os

import pytest
import torch
import torch.distributed as dist

pl = pytest.importorskip("lightning.pytorch")

from offload.integrations.lightning import OffloadStrategy  # noqa: E402

from tests.test_engine import gpt2  # noqa: E402

STEPS, ACCUMULATION = 20, 2
_LAUNCH_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "NODE_RANK")


@pytest.fixture(autouse=True)
def nothing_distributed_left():
    """Lightning's DDP-type strategies start a process group in this process and export its launch
    variables: both go when each test ends, so that later tests (and their subprocesses) see one process."""
    saved = {key: os.environ.get(key) for key in _LAUNCH_VARIABLES}
    yield
    if dist.is_initialized():
        dist.destroy_process_group()
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


class Module(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.model = gpt2(dropout=0.0)
        self.seen = []  # per micro batch: (loss, lr)
        self.val_losses = []

    def training_step(self, batch, batch_idx):
        loss = self.model(batch, labels=batch).loss
        self.seen.append((loss.item(), self.trainer.optimizers[0].param_groups[0]["lr"]))
        return loss

    def validation_step(self, batch, batch_idx):
        self.val_losses.append(self.model(batch, labels=batch).loss.item())

    def configure_optimizers(self):
        decay = [p for n, p in self.named_parameters() if p.dim() > 1]
        no_decay = [p for n, p in self.named_parameters() if p.dim() <= 1]
        opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                                lr=1e-2)
        schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, (step + 1) / 4))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


def loader(n=STEPS * ACCUMULATION):
    g = torch.Generator().manual_seed(1)
    return torch.utils.data.DataLoader(torch.randint(0, 64, (n * 2, 8), generator=g), batch_size=2)


def trainer(tmp_path, strategy, **kwargs):
    # use_distributed_sampler=False: Lightning gives a DDP-type strategy (ours, DeepSpeed's) a DistributedSampler,
    # whose order differs from the plain single-device run's
    options = dict(devices=1, use_distributed_sampler=False)
    options.update(kwargs)
    return pl.Trainer(strategy=strategy, accelerator="cpu", max_steps=STEPS, accumulate_grad_batches=ACCUMULATION,
                      gradient_clip_val=1.0, logger=False, enable_progress_bar=False, enable_model_summary=False,
                      default_root_dir=tmp_path, num_sanity_val_steps=0, **options)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    module = Module()
    trainer(tmp_path_factory.mktemp("plain"), "auto", enable_checkpointing=False).fit(module, loader(), loader(4))
    return module


def nvme(disk_dir):
    return OffloadStrategy(offload_params="nvme", offload_optimizer="nvme", nvme_path=str(disk_dir))


def test_strategy_matches_lightning_validates_and_saves_a_model_that_reloads(reference, disk_dir, tmp_path):
    import transformers

    module = Module()
    run = trainer(tmp_path, nvme(disk_dir), enable_checkpointing=False)
    run.fit(module, loader(), loader(4))
    assert len(module.seen) == STEPS * ACCUMULATION
    for i, (ours, theirs) in enumerate(zip(module.seen, reference.seen)):
        assert ours == pytest.approx(theirs, rel=1e-5), f"micro batch {i}"
    assert module.val_losses == pytest.approx(reference.val_losses, rel=1e-5)
    assert run.strategy.engine.global_steps == STEPS
    # validate after fit runs through the engine too
    module.val_losses = []
    run.validate(module, loader(4))
    assert module.val_losses == pytest.approx(reference.val_losses, rel=1e-5)  # the same trained weights
    # The transformers model inside the LightningModule saves the real (gathered) weights: from_pretrained
    # reloads them to plain Lightning's logits.
    module.model.save_pretrained(tmp_path / "saved")
    reloaded = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "saved")
    ids = next(iter(loader(4)))
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, reference.model(ids).logits, rtol=1e-5, atol=1e-5)
    run.strategy.engine.close()


def test_registered_names(disk_dir, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run = pl.Trainer(strategy="offload_stage_3_nvme", accelerator="cpu", devices=1, max_steps=1, logger=False,
                     enable_progress_bar=False, enable_checkpointing=False)
    assert isinstance(run.strategy, OffloadStrategy)
    assert run.strategy.config["zero_optimization"]["offload_param"]["device"] == "nvme"
    assert isinstance(pl.Trainer(strategy="offload_stage_3", accelerator="cpu", devices=1, logger=False).strategy,
                      OffloadStrategy)


def resumed_run(tmp_path, strategy_fn):
    """Fit with a checkpoint every 10 steps, then fit a new module from the step-10 checkpoint: the
    resumed run's (loss, lr) per micro batch. Lightning restarts a plain DataLoader's epoch on resume,
    for both runs alike."""
    checkpoints = pl.callbacks.ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=10, save_top_k=-1)
    trainer(tmp_path, strategy_fn(), callbacks=[checkpoints]).fit(Module(), loader())
    path = tmp_path / "ckpt" / "epoch=0-step=10.ckpt"
    resumed = Module()
    run = trainer(tmp_path, strategy_fn())
    run.fit(resumed, loader(), ckpt_path=str(path))
    assert run.global_step == STEPS
    return resumed.seen, path


def test_checkpoint_resumes_identically(disk_dir, tmp_path):
    theirs, _ = resumed_run(tmp_path / "plain", lambda: "auto")
    ours, path = resumed_run(tmp_path / "ours", lambda: nvme(disk_dir))
    assert (path / "latest").is_file()  # the engine's checkpoint directory
    assert len(ours) == len(theirs) == STEPS * ACCUMULATION // 2
    for i, (a, b) in enumerate(zip(ours, theirs)):
        assert a == pytest.approx(b, rel=1e-5), f"micro batch {i} after the resume"


@pytest.mark.parametrize("kind", ["tensor data", "state file"])
def test_a_resume_from_a_checkpoint_with_a_flipped_bit_is_refused(disk_dir, tmp_path, monkeypatch, kind):
    """The step-10 checkpoint moved to another folder, named by a relative path from a third one: fit refuses
    it, naming the file, before any step runs."""
    from checkpoint_flips import copy_elsewhere, flip, relative

    from tensorio import ChecksumError

    checkpoints = pl.callbacks.ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=10, save_top_k=-1)
    trainer(tmp_path, nvme(disk_dir), callbacks=[checkpoints]).fit(Module(), loader())
    moved = copy_elsewhere(tmp_path / "ckpt" / "epoch=0-step=10.ckpt", tmp_path / "moved")
    path, _ = flip(moved / "checkpoint", kind)
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")
    resumed = Module()
    run = trainer(tmp_path, nvme(disk_dir))
    with pytest.raises(ChecksumError, match=f"checksum mismatch .*: {path}"):
        run.fit(resumed, loader(), ckpt_path=relative(moved))
    assert resumed.seen == [] and run.global_step == 0


class FloatFeatures(pl.LightningModule):
    """A Linear(32, 32) on float features (a TensorDataset of torch.randn), not token ids."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layer = torch.nn.Linear(32, 32)
        self.seen = []

    def training_step(self, batch, batch_idx):
        features, targets = batch
        loss = torch.nn.functional.mse_loss(self.layer(features).float(), targets.float())
        self.seen.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def test_bf16_with_float_inputs_matches_lightning_bf16_mixed(tmp_path):
    """The ZeRO-3 JSON's bf16 with Trainer(precision="bf16-mixed") and float inputs: the batch is cast to
    the engine's bf16 (as Lightning's DeepSpeed precision casts it), and two steps give plain Lightning's
    bf16-mixed losses within bf16's tolerance (before: "mat1 and mat2 must have the same dtype")."""
    import json

    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(8, 32, generator=g), torch.randn(8, 32, generator=g))
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({"bf16": {"enabled": True}, "zero_optimization": {"stage": 3}}))
    seen = {}
    for name, strategy in (("plain", "auto"), ("ours", OffloadStrategy(config=str(config)))):
        module = FloatFeatures()
        pl.Trainer(strategy=strategy, accelerator="cpu", devices=1, precision="bf16-mixed", max_steps=2,
                   logger=False, enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False,
                   use_distributed_sampler=False, default_root_dir=tmp_path / name
                   ).fit(module, torch.utils.data.DataLoader(data, batch_size=4))
        seen[name] = module.seen
    assert len(seen["ours"]) == len(seen["plain"]) == 2
    assert seen["ours"] == pytest.approx(seen["plain"], rel=1e-2)


@pytest.mark.multiprocess
def test_two_processes_match_lightning_ddp(disk_dir):
    """devices=2, one process per rank started by torchrun (gloo): OffloadStrategy (each rank one
    partition of every parameter) against Lightning's "ddp", rank by rank: the same losses and learning
    rates of every micro batch, and the same validation losses."""
    from tests.torchrun import torchrun

    ranks = torchrun("tests.lightning_dist_worker", "offload,plain", str(disk_dir))
    ours, theirs = ({rank: ranks[rank][kind] for rank in ranks} for kind in ("offload", "plain"))
    for rank in (0, 1):
        assert ours[rank]["steps"] == theirs[rank]["steps"] > 0
        assert len(ours[rank]["seen"]) == len(theirs[rank]["seen"]) == 2 * ours[rank]["steps"]
        for i, (a, b) in enumerate(zip(ours[rank]["seen"], theirs[rank]["seen"])):
            assert a == pytest.approx(b, rel=1e-5), f"rank {rank}, micro batch {i}"
        assert ours[rank]["val"] == pytest.approx(theirs[rank]["val"], rel=1e-5)
    assert ours[0]["seen"] != ours[1]["seen"]  # the ranks saw different batches
