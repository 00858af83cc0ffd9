"""OffloadAccelerator against a plain Accelerate loop: the same losses, learning rates and grad norms
with accumulation, clipping, AdamW groups and a schedule; save_state / load_state resume; the
consolidated state dict reloads."""

import pytest
import torch

accelerate = pytest.importorskip("accelerate")
transformers = pytest.importorskip("transformers")

from offload.integrations.accelerate import OffloadAccelerator  # noqa: E402

from tests.test_engine import gpt2  # noqa: E402

STEPS, ACCUMULATION = 6, 2


def batches():
    g = torch.Generator().manual_seed(1)
    return torch.utils.data.DataLoader(torch.randint(0, 64, (STEPS * ACCUMULATION * 2, 8), generator=g), batch_size=2)


def parts():
    model = gpt2(dropout=0.0)
    decay = [p for p in model.parameters() if p.dim() > 1]
    no_decay = [p for p in model.parameters() if p.dim() <= 1]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}], lr=1e-2)
    schedule = transformers.get_linear_schedule_with_warmup(opt, 2, STEPS)
    return model, opt, batches(), schedule


def run(accelerator, prepared, skip=0):
    """The loop of Accelerate's docs; per micro batch (loss, lr), per step the grad norm."""
    model, opt, loader, schedule = prepared
    seen, norms = [], []
    for i, batch in enumerate(loader):
        if i < skip:
            continue
        with accelerator.accumulate(model):
            loss = model(batch, labels=batch).loss
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                norms.append(float(accelerator.clip_grad_norm_(model.parameters(), 1.0)))
            opt.step()
            schedule.step()
            opt.zero_grad()
        seen.append((loss.item(), schedule.get_last_lr()[0]))
    return seen, norms


def config(disk_dir):
    return {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto", "gradient_clipping": 1.0,
            "zero_optimization": {"stage": 3,
                                  "offload_param": {"device": "nvme", "nvme_path": str(disk_dir), "buffer_size": 1 << 14,
                                                    "max_in_cpu": 0},
                                  "offload_optimizer": {"device": "nvme", "nvme_path": str(disk_dir)}}}


@pytest.fixture()
def fresh_state():
    accelerate.state.AcceleratorState._reset_state(True)
    yield
    accelerate.state.AcceleratorState._reset_state(True)


def test_accelerator_matches_plain_accelerate(disk_dir, tmp_path, fresh_state):
    plain = accelerate.Accelerator(gradient_accumulation_steps=ACCUMULATION, cpu=True)
    reference = run(plain, plain.prepare(*parts()))
    accelerate.state.AcceleratorState._reset_state(True)
    ours = OffloadAccelerator(offload_config=config(disk_dir), gradient_accumulation_steps=ACCUMULATION, cpu=True)
    prepared = ours.prepare(*parts())
    result = run(ours, prepared)
    assert len(result[0]) == STEPS * ACCUMULATION and len(result[1]) == STEPS
    for i, (a, b) in enumerate(zip(result[0], reference[0])):
        assert a == pytest.approx(b, rel=1e-5), f"micro batch {i}"
    assert result[1] == pytest.approx(reference[1], rel=1e-5)
    state = ours.get_state_dict(prepared[0])
    assert state["lm_head.weight"] is state["transformer.wte.weight"]
    assert ours.unwrap_model(prepared[0]) is ours.engine.module
    with pytest.raises(ValueError, match="gradient_clipping"):
        ours.clip_grad_norm_(prepared[0].parameters(), 0.5)
    ours.engine.close()


def test_save_state_and_load_state_resume(disk_dir, tmp_path, fresh_state):
    first = OffloadAccelerator(offload_config=config(disk_dir), gradient_accumulation_steps=ACCUMULATION, cpu=True)
    model, opt, loader, schedule = first.prepare(*parts())
    full = run(first, (model, opt, loader, schedule))
    first.engine.close()
    half = STEPS * ACCUMULATION // 2
    # train half, save, start anew, load, train the rest: the uninterrupted run's losses and rates
    accelerate.state.AcceleratorState._reset_state(True)
    saver = OffloadAccelerator(offload_config=config(disk_dir), gradient_accumulation_steps=ACCUMULATION, cpu=True)
    prepared = saver.prepare(*parts())
    model, opt, loader, schedule = prepared
    for i, batch in enumerate(loader):
        if i == half:
            break
        with saver.accumulate(model):
            saver.backward(model(batch, labels=batch).loss)
    saver.save_state(tmp_path / "state")
    saver.engine.close()
    accelerate.state.AcceleratorState._reset_state(True)
    loader_ = OffloadAccelerator(offload_config=config(disk_dir), gradient_accumulation_steps=ACCUMULATION, cpu=True)
    prepared = loader_.prepare(*parts())
    loader_.load_state(tmp_path / "state")
    resumed = run(loader_, prepared, skip=half)
    for i, (a, b) in enumerate(zip(resumed[0], full[0][half:])):
        assert a == pytest.approx(b, rel=1e-5), f"micro batch {half + i}"
    loader_.engine.close()


def float_features_run(accelerator):
    """Two steps of a Linear(32, 32) on float features (torch.randn), prepared by ``accelerator``: the losses."""
    torch.manual_seed(0)
    model = torch.nn.Linear(32, 32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(8, 32, generator=g), torch.randn(8, 32, generator=g))
    model, opt, loader = accelerator.prepare(model, opt, torch.utils.data.DataLoader(data, batch_size=4))
    losses = []
    for features, targets in loader:
        loss = torch.nn.functional.mse_loss(model(features).float(), targets.float())
        accelerator.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def test_bf16_with_float_inputs_matches_plain_accelerate_bf16(fresh_state):
    """mixed_precision="bf16" and a model whose inputs are floats: they are cast to the engine's bf16, and
    two steps give plain Accelerate's bf16 losses within bf16's tolerance (before: "mat1 and mat2 must have
    the same dtype"). Token ids stay integers (the GPT-2 tests above)."""
    reference = float_features_run(accelerate.Accelerator(cpu=True, mixed_precision="bf16"))
    accelerate.state.AcceleratorState._reset_state(True)
    ours = OffloadAccelerator(offload_config={"bf16": {"enabled": "auto"}, "zero_optimization": {"stage": 3}},
                              cpu=True, mixed_precision="bf16")
    losses = float_features_run(ours)
    assert ours.engine.config.bf16.enabled
    assert len(losses) == len(reference) == 2
    assert losses == pytest.approx(reference, rel=1e-2)
    ours.engine.close()


@pytest.mark.parametrize("kind", ["tensor data", "state file"])
def test_load_state_of_a_state_with_a_flipped_bit_is_refused(disk_dir, tmp_path, fresh_state, monkeypatch, kind):
    """save_state's folder moved elsewhere and named by a relative path from a third folder: load_state refuses
    it, naming the file, and the engine is unchanged."""
    from checkpoint_flips import copy_elsewhere, flip, relative

    from tensorio import ChecksumError

    saver = OffloadAccelerator(offload_config=config(disk_dir), gradient_accumulation_steps=ACCUMULATION, cpu=True)
    model, opt, loader, schedule = saver.prepare(*parts())
    for i, batch in enumerate(loader):
        if i == 2:
            break
        with saver.accumulate(model):
            saver.backward(model(batch, labels=batch).loss)
            opt.step()
            opt.zero_grad()
    saver.save_state(tmp_path / "state")
    saver.engine.close()
    moved = copy_elsewhere(tmp_path / "state", tmp_path / "moved")
    (tag,) = [p for p in moved.iterdir() if p.name.startswith("global_step")]
    path, _ = flip(tag, kind)
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")
    accelerate.state.AcceleratorState._reset_state(True)
    loader_ = OffloadAccelerator(offload_config=config(disk_dir), gradient_accumulation_steps=ACCUMULATION, cpu=True)
    model, *_ = loader_.prepare(*parts())
    before = dict(loader_.engine.full_parameters())
    with pytest.raises(ChecksumError, match=f"checksum mismatch .*: {path}"):
        loader_.load_state(relative(moved))
    assert loader_.engine.global_steps == 0
    assert all(torch.equal(value, before[name]) for name, value in loader_.engine.full_parameters())
    loader_.engine.close()


@pytest.mark.multiprocess
def test_two_processes_match_plain_accelerate(disk_dir):
    """Two processes started by ``accelerate launch --multi_gpu --num_processes 2`` (gloo on the CPU):
    OffloadAccelerator (each rank one partition of every parameter) against plain Accelerate's DDP,
    rank by rank: the same losses, learning rates (the schedule stepped once per process) and norms."""
    from tests.torchrun import accelerate_launch

    ours = accelerate_launch("tests.accelerate_dist_worker", "offload", str(disk_dir))
    theirs = accelerate_launch("tests.accelerate_dist_worker", "plain", str(disk_dir))
    for rank in (0, 1):
        assert len(ours[rank]["seen"]) == STEPS * ACCUMULATION // 2  # each rank half the batches
        for i, (a, b) in enumerate(zip(ours[rank]["seen"], theirs[rank]["seen"])):
            assert a == pytest.approx(b, rel=1e-5), f"rank {rank}, micro batch {i}"
        assert ours[rank]["norms"] == pytest.approx(theirs[rank]["norms"], rel=1e-5)
    assert ours[0]["seen"] != ours[1]["seen"]  # the ranks saw different batches
