"""The DeepSpeed surface trainers call on the engine (issue 26, item 4): initialize's arguments, param
groups, the accumulation boundary, overflow, the kept grad norm, the consolidated state dict, the
config as a mapping, and the checkpoint options. Public engine surface only."""

from __future__ import annotations

import argparse
import json

import pytest
import torch
from torch import nn

from offload.train.engine import initialize
from offload.train.step.update_mode import UpdateMode

from tests.test_engine import LR, WD, engine_config, gpt2, gpt2_batches, gpt2_loss, mlp, mlp_batches, mlp_loss


def groups_of(model):
    decay = [p for n, p in model.named_parameters() if n.endswith("weight") and p.dim() > 1]
    no_decay = [p for n, p in model.named_parameters() if not (n.endswith("weight") and p.dim() > 1)]
    return [{"params": decay, "weight_decay": WD, "lr": LR}, {"params": no_decay, "weight_decay": 0.0, "lr": LR / 2}]


def plain(groups_fn, batches, gas=1, clip=0.0):
    model = mlp()
    opt = torch.optim.AdamW(groups_fn(model), fused=True)
    norms = []
    for i, batch in enumerate(batches):
        (mlp_loss(model, batch) / gas).backward()
        if (i + 1) % gas == 0:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip if clip else float("inf"))))
            opt.step()
            opt.zero_grad()
    return {n: p.detach() for n, p in model.named_parameters()}, norms


@pytest.mark.parametrize("devices", [("none", "none"), ("nvme", "nvme")])
@pytest.mark.parametrize("path", ["client", "config"])
def test_param_groups_keep_their_own_lr_and_weight_decay(disk_dir, devices, path):
    batches = mlp_batches(4)
    expected, _ = plain(groups_of, batches, clip=1.0)
    model = mlp()
    config = engine_config(disk_dir, *devices, gradient_clipping=1.0)
    if path == "client":
        del config["optimizer"]
        engine, optimizer, *_ = initialize(model=model, optimizer=torch.optim.AdamW(groups_of(model)), config=config)
    else:  # the config's optimizer over model_parameters' groups, each overriding the config's lr / weight decay
        engine, optimizer, *_ = initialize(model=model, model_parameters=groups_of(model), config=config)
    assert [(g["lr"], g["weight_decay"]) for g in optimizer.param_groups] == [(LR, WD), (LR / 2, 0.0)]
    for batch in batches:
        engine.backward(mlp_loss(engine, batch))
        engine.step()
    for name, full in engine.full_parameters():
        torch.testing.assert_close(full, expected[name], rtol=1e-6, atol=1e-7, msg=lambda m: f"{name}: {m}")
    engine.close()


def test_a_trainable_parameter_in_no_group_is_refused(disk_dir):
    model = mlp()
    first = list(model.parameters())[:2]
    config = engine_config(disk_dir)
    del config["optimizer"]
    with pytest.raises(ValueError, match="in no param group"):
        initialize(model=model, optimizer=torch.optim.AdamW(first), config=config)


def test_initialize_takes_deepspeed_arguments(disk_dir, tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(engine_config(disk_dir)))
    args = argparse.Namespace(deepspeed_config=str(path), local_rank=0)
    engine, optimizer, loader, scheduler = initialize(args=args, model=mlp(), dist_init_required=False,
                                                      distributed_port=29501)
    assert loader is None and scheduler is None and optimizer is engine.optimizer
    assert engine.config["zero_optimization"]["stage"] == 3 and engine.config.get("fp16", {}) == {}
    assert dict(engine.config)["train_batch_size"] == 4  # derived values are in the mapping too
    engine.destroy()
    engine, *_ = initialize(model=mlp(), config_params=engine_config(disk_dir))
    engine.close()
    with pytest.raises(ValueError, match="both given"):
        initialize(model=mlp(), config=engine_config(disk_dir), config_params=engine_config(disk_dir))
    with pytest.raises(ValueError, match="args.deepspeed_config"):
        initialize(args=args, model=mlp(), config=engine_config(disk_dir))
    with pytest.raises(ValueError, match="mpu"):
        initialize(model=mlp(), config=engine_config(disk_dir), mpu=object())
    with pytest.raises(ValueError, match="first positional argument"):
        initialize(mlp(), config=engine_config(disk_dir))


@pytest.mark.parametrize("opt", ["none", "nvme"])
def test_boundary_override_and_the_kept_grad_norm(disk_dir, opt):
    """As Accelerate drives DeepSpeed: the boundary set before each backward, step() only at the boundary,
    the loss already divided (scale_wrt_gas=False); get_global_grad_norm() is the last step's after it."""
    batches = mlp_batches(4)
    expected, norms = plain(lambda m: [{"params": list(m.parameters()), "lr": LR, "weight_decay": WD}], batches,
                            gas=2, clip=1.0)
    engine, optimizer, *_ = initialize(model=mlp(), config=engine_config(disk_dir, "none", opt, gas=2,
                                                                         gradient_clipping=1.0))
    assert engine.get_global_grad_norm() is None  # before the first step, as DeepSpeed
    assert optimizer.overflow is False
    steps = []
    for i, batch in enumerate(batches):
        boundary = i % 2 == 1
        engine.set_gradient_accumulation_boundary(boundary)
        returned = engine.backward(mlp_loss(engine, batch) / 2, scale_wrt_gas=False)
        assert returned.shape == ()
        if boundary:
            engine.step()
            steps.append(engine.get_global_grad_norm())
            assert optimizer.overflow is False
    assert steps == pytest.approx(norms, rel=1e-5)
    assert engine.global_steps == 2
    engine.zero_grad()
    assert engine.get_global_grad_norm() == pytest.approx(norms[-1], rel=1e-5)  # kept until the next backward
    for name, full in engine.full_parameters():
        torch.testing.assert_close(full, expected[name], rtol=1e-6, atol=1e-7)
    engine.close()


def test_fp16_overflow_is_the_optimizers_flag(disk_dir):
    engine, optimizer, *_ = initialize(model=mlp(), config=engine_config(disk_dir, fp16={"enabled": True, "initial_scale_power": 4}))
    x, y = mlp_batches(1)[0]
    engine.backward(nn.functional.mse_loss(engine(x.half()).float(), y) * float("inf"))
    engine.step()
    assert optimizer.overflow is True and engine.skipped_steps == 1
    engine.backward(mlp_loss(engine, (x.half(), y.half())).float())
    engine.step()
    assert optimizer.overflow is False
    engine.close()


def test_consolidated_state_dict_is_the_whole_model(disk_dir):
    model = gpt2(dropout=0.0)
    model.transformer.wpe.weight.requires_grad_(False)
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    config = engine_config(disk_dir, "nvme", "nvme")
    config["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = True
    engine, *_ = initialize(model=model, config=config)
    assert engine.zero_gather_16bit_weights_on_model_save() is True
    # DeepSpeed's own name for this method, which Accelerate and HF Trainer call: public surface here.
    state = engine._zero3_consolidated_16bit_state_dict()
    assert state.keys() == expected.keys()
    for name, tensor in state.items():
        torch.testing.assert_close(tensor, expected[name], msg=lambda m: f"{name}: {m}")
    assert state["lm_head.weight"] is state["transformer.wte.weight"]  # tied: one tensor
    assert "transformer.wpe.weight" not in engine._zero3_consolidated_16bit_state_dict(exclude_frozen_parameters=True)
    engine.close()


def _trained(disk_dir, steps, **extra):
    engine, *_ = initialize(model=gpt2(dropout=0.0), config=engine_config(disk_dir, "nvme", "nvme", **extra))
    for batch in gpt2_batches(steps):
        engine.backward(gpt2_loss(engine, batch))
        engine.step()
    return engine


def test_checkpoint_options(disk_dir, tmp_path):
    engine = _trained(disk_dir, 2)
    engine.save_checkpoint(tmp_path, client_state={"epoch": 1})
    after_two = dict(engine.full_parameters())
    engine.backward(gpt2_loss(engine, gpt2_batches(3)[2]))
    engine.step()
    # save_latest=False: a tag nobody names
    engine.save_checkpoint(tmp_path, tag="side", save_latest=False)
    assert (tmp_path / "latest").read_text().strip() == "global_step2"
    # No latest in a folder: (None, None) and nothing changes, as DeepSpeed.
    assert engine.load_checkpoint(tmp_path / "empty") == (None, None)
    # The module only: parameters back, counters and optimizer state kept.
    path, client = engine.load_checkpoint(tmp_path, load_module_only=True)
    assert engine.global_steps == 3
    for name, full in engine.full_parameters():
        torch.testing.assert_close(full, after_two[name])
    path, client = engine.load_checkpoint(tmp_path, load_lr_scheduler_states=False, load_module_strict=False)
    assert client == {"epoch": 1} and engine.global_steps == 2
    with pytest.raises(ValueError, match="custom_load_fn"):
        engine.load_checkpoint(tmp_path, custom_load_fn=lambda *a: None)
    engine.close()


def test_exclude_frozen_parameters(disk_dir, tmp_path):
    model = gpt2(dropout=0.0)
    model.transformer.wpe.weight.requires_grad_(False)
    engine, *_ = initialize(model=model, config=engine_config(disk_dir, "nvme", "nvme"))
    engine.backward(gpt2_loss(engine, gpt2_batches(1)[0]))
    engine.step()
    before = dict(engine.full_parameters())
    engine.save_checkpoint(tmp_path, exclude_frozen_parameters=True)
    engine.load_checkpoint(tmp_path)
    for name, full in engine.full_parameters():
        torch.testing.assert_close(full, before[name])
    engine.close()


def test_load_without_optimizer_states_is_refused_under_bf16(disk_dir, tmp_path):
    engine, *_ = initialize(model=mlp(), config=engine_config(disk_dir, bf16={"enabled": True}))
    engine.save_checkpoint(tmp_path)
    with pytest.raises(ValueError, match="master weights"):
        engine.load_checkpoint(tmp_path, load_optimizer_states=False)
    engine.close()


def test_save_pretrained_on_the_partitioned_model_writes_the_real_weights(disk_dir, tmp_path):
    import transformers

    engine = _trained(disk_dir, 2)
    trained = dict(engine.full_parameters())
    engine.module.save_pretrained(tmp_path / "saved")
    reloaded = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "saved")
    for name, tensor in reloaded.named_parameters():
        torch.testing.assert_close(tensor.detach(), trained[name], msg=lambda m: f"{name}: {m}")
    engine.close()
    with pytest.raises(RuntimeError, match="save_16bit_model"):
        engine.module.save_pretrained(tmp_path / "late")


def test_a_forward_with_gradients_outside_the_engine_is_refused(disk_dir):
    engine = _trained(disk_dir, 1)
    batch = gpt2_batches(1)[0]
    with pytest.raises(RuntimeError, match=r"call engine\(\.\.\.\)"):
        gpt2_loss(engine.module, batch)
    with torch.no_grad():  # evaluation on the module itself is fine
        assert torch.isfinite(gpt2_loss(engine.module, batch))
    engine.backward(gpt2_loss(engine, batch))  # and training through the engine goes on
    engine.step()
    engine.close()


@pytest.mark.parametrize("clip", [0.0, 1.0])  # updates during backward / in the next forward
def test_a_backward_outside_the_engine_is_refused_and_training_goes_on(disk_dir, clip):
    """loss.backward() instead of engine.backward(loss): with clipping it left the step under way and the
    next backward failed deep inside ("a step is under way"); now the backward is refused at its first
    gradient, nothing taken, and training through the engine goes on as if it had not happened."""
    batches = gpt2_batches(3)
    expected = dict(_trained(disk_dir, 3, gradient_clipping=clip).full_parameters())
    engine = _trained(disk_dir, 1, gradient_clipping=clip)
    loss = gpt2_loss(engine, batches[1])
    with pytest.raises(RuntimeError, match=r"outside the engine .* call engine\.backward\(loss\)"):
        loss.backward()
    del loss
    for batch in batches[1:]:
        engine.backward(gpt2_loss(engine, batch))
        engine.step()
    for name, full in engine.full_parameters():
        torch.testing.assert_close(full, expected[name], rtol=0, atol=0, msg=lambda m: f"{name}: {m}")
    engine.close()


@pytest.mark.parametrize("clip", [0.0, 1.0])
def test_the_engines_optimizer_stepped_directly_is_refused(disk_dir, clip):
    """A trainer's own optimizer.step() after engine.step() (the engine's optimizer passed to it): with
    clipping the second step ended the one handed to the next forward, silently changing the parameters.
    It is refused, saying to call engine.step(); the refused call changes nothing."""
    batches = gpt2_batches(3)
    expected = dict(_trained(disk_dir, 3, gradient_clipping=clip).full_parameters())
    engine = _trained(disk_dir, 1, gradient_clipping=clip)
    with pytest.raises(RuntimeError, match=r"called directly.*call engine\.step\(\) instead"):
        engine.optimizer.step()
    for batch in batches[1:]:
        engine.backward(gpt2_loss(engine, batch))
        engine.step()
        with pytest.raises(RuntimeError, match="called directly"):
            engine.optimizer.step()
    for name, full in engine.full_parameters():
        torch.testing.assert_close(full, expected[name], rtol=0, atol=0, msg=lambda m: f"{name}: {m}")
    assert engine.global_steps == 3
    engine.close()


def test_a_second_backward_before_step_is_refused_when_updates_run_in_backward(disk_dir):
    """Two engine.backward() calls without engine.step() between them, updates during backward (no
    clipping): the second used to fail deep in the optimizer ("got a second gradient in one backward ...
    reentrant activation-checkpoint segments"). It is refused naming what happened and what to call, the
    refused call changes nothing, and training goes on as if it had not happened."""
    batches = gpt2_batches(3)
    expected = dict(_trained(disk_dir, 3).full_parameters())
    engine = _trained(disk_dir, 1)
    assert engine.stats().mode is UpdateMode.IN_BACKWARD
    engine.backward(gpt2_loss(engine, batches[1]))
    loss = gpt2_loss(engine, batches[1])
    with pytest.raises(RuntimeError, match=r"engine\.backward\(\) was called twice without engine\.step\(\).*"
                                           r"call engine\.step\(\) after each engine\.backward\(\).*"
                                           r"gradient_accumulation_steps"):
        engine.backward(loss)
    del loss
    engine.step()
    engine.backward(gpt2_loss(engine, batches[2]))
    engine.step()
    for name, full in engine.full_parameters():
        torch.testing.assert_close(full, expected[name], rtol=0, atol=0, msg=lambda m: f"{name}: {m}")
    assert engine.global_steps == 3
    engine.close()
