"""The stage-3 engine against plain PyTorch: every offload combination, accumulation, tied weights,
activation checkpointing, prefetch, fp16/bf16, checkpoints and the configs in configs/."""

from __future__ import annotations

import copy
import json
import logging
import os
import weakref

import pytest
import torch
from torch import nn

from offload import resolve_auto
from offload.train.engine import initialize

transformers = pytest.importorskip("transformers")

DEVICES = ("none", "cpu", "nvme")
LR, WD = 1e-2, 0.01


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 33), nn.GELU(), nn.LayerNorm(33), nn.Linear(33, 8))


def gpt2(dropout: float = 0.1) -> nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16,
                                     bos_token_id=0, eos_token_id=0, resid_pdrop=dropout, embd_pdrop=dropout,
                                     attn_pdrop=dropout)
    return transformers.GPT2LMHeadModel(config)


def mlp_batches(n: int = 10, batch: int = 4) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(batch, 16, generator=g), torch.randn(batch, 8, generator=g)) for _ in range(n)]


def gpt2_batches(n: int = 10, batch: int = 2) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 64, (batch, 8), generator=g) for _ in range(n)]


def mlp_loss(model, batch):
    """The label goes where the output is (an engine's device), as a DeepSpeed user's loop moves it."""
    x, y = batch
    out = model(x)
    return nn.functional.mse_loss(out, y.to(out.device))


def gpt2_loss(model, batch):
    return model(batch, labels=batch).loss


def llama() -> nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=64, max_position_embeddings=16,
                                      tie_word_embeddings=False)
    return transformers.LlamaForCausalLM(config)


MODELS = {"mlp": (mlp, mlp_batches, mlp_loss), "gpt2": (gpt2, gpt2_batches, gpt2_loss),
          "llama": (llama, gpt2_batches, gpt2_loss)}
#: GPT-2 in the placement grids: the fast tier runs each grid on the MLP; GPT-2's own paths (the tied
#: embedding, 16-bit partitions, checkpoints) have fast tests of their own below.
GPT2_GRID = pytest.param("gpt2", marks=pytest.mark.slow)


def engine_config(tmp, param="none", opt="none", gas=1, micro=4, **extra) -> dict:
    zero = {"stage": 3, "stage3_param_persistence_threshold": 0, "sub_group_size": 4096,
            "offload_param": {"device": param}, "offload_optimizer": {"device": opt}}
    if param == "nvme":  # everything on disk, a budget of two small buffers
        zero["offload_param"].update(nvme_path=str(tmp), max_in_cpu=0, buffer_size=16384, buffer_count=2)
    if opt == "nvme":
        zero["offload_optimizer"].update(nvme_path=str(tmp), pipeline_read=True, pipeline_write=True)
    # No clipping unless a test asks (DeepSpeed's default is 1.0): the references clip only when told.
    config = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": gas, "zero_optimization": zero,
              "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WD}}, "gradient_clipping": 0.0}
    config.update(extra)
    return config


def reference(model, batches, loss_fn, gas, clip=0.0):
    """Plain PyTorch: losses and final parameters with torch.optim.AdamW (the fused kernel), clipped
    with torch.nn.utils.clip_grad_norm_ when ``clip``."""
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD, fused=True)
    losses = []
    for i, batch in enumerate(batches):
        loss = loss_fn(model, batch)
        (loss / gas).backward()
        losses.append(loss.item())
        if (i + 1) % gas == 0:
            if clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            opt.step()
            opt.zero_grad()
    return losses, {n: p.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)}


def reference_16bit(model, batches, loss_fn, gas, dtype, clip=0.0, loss_scale=1.0):
    """Plain PyTorch with 16-bit weights and fp32 master weights (DeepSpeed's bf16/fp16 semantics): the
    16-bit gradients accumulated in fp32, unscaled and clipped by one multiply (the norm taken as the
    engine takes it, one partition at a time), torch.optim.AdamW (fused) on the fp32 masters, copied back."""
    from offload.train.grads.clip import clip_coefficient, total_norm

    model = model.to(dtype)
    params = list(model.parameters())
    masters = [p.detach().float().clone().requires_grad_(True) for p in params]
    opt = torch.optim.AdamW(masters, lr=LR, weight_decay=WD, fused=True)
    acc: list = [None] * len(params)
    losses = []
    for i, batch in enumerate(batches):
        loss = loss_fn(model, batch)
        losses.append(loss.item())
        scaled = loss / gas if gas > 1 else loss
        (scaled * loss_scale if loss_scale != 1.0 else scaled).backward()
        for j, p in enumerate(params):
            grad, p.grad = p.grad.float(), None
            acc[j] = grad if acc[j] is None else acc[j].add_(grad)
        if (i + 1) % gas == 0:
            factor = 1.0 / loss_scale
            if clip:
                norm = total_norm([torch.linalg.vector_norm(a) for a in acc])
                factor *= clip_coefficient(norm * factor if factor != 1.0 else norm, clip)
            for master, a in zip(masters, acc):
                master.grad = a if factor == 1.0 else a * factor
            opt.step()
            opt.zero_grad()
            with torch.no_grad():
                for p, master in zip(params, masters):
                    p.copy_(master)
            acc = [None] * len(params)
    return losses, {n: p.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)}


def train(engine, batches, loss_fn):
    losses = []
    for batch in batches:
        loss = loss_fn(engine, batch)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def parameters_now(engine):
    """A copy of the engine's whole parameters, by name."""
    return {name: tensor.clone() for name, tensor in engine.full_parameters()}


def assert_same_tensors(a, b):
    """Two name -> tensor dicts hold the same names and bit-identical tensors."""
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def assert_close(losses, params, ref_losses, ref_params, rtol=1e-5, atol=1e-7):
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=rtol, atol=0)
    assert params.keys() == ref_params.keys()
    for name, ref in ref_params.items():
        torch.testing.assert_close(params[name], ref, rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("gas", [1, 2])
@pytest.mark.parametrize("opt", DEVICES)
@pytest.mark.parametrize("param", DEVICES)
@pytest.mark.parametrize("kind", ["mlp", GPT2_GRID])
def test_matches_plain_pytorch(disk_dir, kind, param, opt, gas):
    build, data, loss_fn = MODELS[kind]
    batches = data(10 * gas)  # 10 optimizer steps
    ref_losses, ref_params = reference(build(), batches, loss_fn, gas)
    engine, optimizer, loader, scheduler = initialize(model=build(),
                                                      config=engine_config(disk_dir, param, opt, gas, micro=len(batches[0])))
    assert loader is None and scheduler is None and optimizer is engine.optimizer
    losses = train(engine, batches, loss_fn)
    assert engine.global_steps == 10
    params = dict(engine.full_parameters())
    assert_close(losses, params, ref_losses, ref_params)
    if param == "nvme":
        # Every partition lives on disk between uses: the module's parameters are empty placeholders.
        assert all(p.numel() == 0 for p in engine.module.parameters())
        assert engine.io_bytes()["written"] > 0
    engine.close()


BACKWARD, FORWARD, AFTER = "during backward", "in the next forward", "after backward"


def update_mode(engine) -> str:
    """Where the engine runs each step's update (docs/engine.md): its fast paths, or the chunked step."""
    return engine.stats().mode.value


@pytest.mark.parametrize("case,mode", [
    ({}, BACKWARD), ({"gas": 2}, BACKWARD), ({"gradient_clipping": 1.0}, FORWARD), ({"param": "nvme"}, BACKWARD),
    ({"param": "nvme", "gradient_clipping": 1.0, "gas": 2}, FORWARD), ({"param": "nvme", "ratio": 0.5}, AFTER),
    ({"gradient_clipping": 1.0, "ratio": 0.5}, AFTER), ({"ratio": 0.0}, AFTER), ({"fp16": {"enabled": True}}, FORWARD),
    ({"bf16": {"enabled": True}}, BACKWARD), ({"bf16": {"enabled": True}, "gradient_clipping": 1.0}, FORWARD)],
    ids=["plain", "accumulation", "clipping", "params-on-disk", "params-on-disk-clipping-accumulation",
         "params-on-disk-state-half-in-ram", "clipping-state-half-in-ram", "no-state-on-disk", "fp16", "bf16",
         "bf16-clipping"])
def test_where_the_update_runs(disk_dir, case, mode):
    """During backward when nothing needs every gradient first (accumulation keeps the earlier
    micro-batches' partitions); in the next forward with clipping or fp16; after backward otherwise."""
    case = dict(case)
    ratio = case.pop("ratio", None)
    config = engine_config(disk_dir, case.pop("param", "cpu"), "nvme", case.pop("gas", 1), **case)
    if ratio is not None:
        config["zero_optimization"]["offload_optimizer"]["ratio"] = ratio
    engine, *_ = initialize(model=mlp(), config=config)
    assert update_mode(engine) == mode
    assert engine.optimizer.background_updates == (mode != AFTER)
    engine.close()


FAST_CASES = {  # name: (extra config, gas, 16-bit dtype or None, loss scale)
    "clipping": ({"gradient_clipping": 0.05}, 1, None, 1.0),
    "clipping-accumulation": ({"gradient_clipping": 0.05}, 2, None, 1.0),
    "accumulation": ({}, 2, None, 1.0),
    "clipping-not-reached": ({"gradient_clipping": 100.0}, 1, None, 1.0),
    "bf16-clipping": ({"bf16": {"enabled": True}, "gradient_clipping": 0.05}, 1, torch.bfloat16, 1.0),
    "bf16-accumulation": ({"bf16": {"enabled": True}}, 2, torch.bfloat16, 1.0),
    "fp16-clipping-accumulation": ({"fp16": {"enabled": True, "loss_scale": 128.0}, "gradient_clipping": 0.05}, 2,
                                   torch.float16, 128.0),
}


@pytest.mark.parametrize("param", ["cpu", "nvme"])
@pytest.mark.parametrize("case", list(FAST_CASES))
@pytest.mark.parametrize("kind", ["mlp", GPT2_GRID])
def test_fast_paths_match_plain_pytorch(disk_dir, kind, case, param):
    """Clipping, accumulation, bf16 and fp16 with the optimizer state (and the parameters) on NVMe take a
    fast path, and give plain PyTorch's results bit for bit: clip_grad_norm_ and (loss / gas).backward()
    for fp32; fp32 master weights (and fp32 gradient accumulation) for 16-bit."""
    extra, gas, dtype, scale = FAST_CASES[case]
    build, data, loss_fn = MODELS[kind]
    batches = data(6 * gas)
    if dtype is not None and kind == "mlp":
        batches = [(x.to(dtype), y.to(dtype)) for x, y in batches]
    clip = extra.get("gradient_clipping", 0.0)
    if dtype is None:
        ref_losses, ref_params = reference(build(), batches, loss_fn, gas, clip=clip)
    else:
        ref_losses, ref_params = reference_16bit(build(), batches, loss_fn, gas, dtype, clip=clip, loss_scale=scale)
    config = engine_config(disk_dir, param, "nvme", gas, micro=len(batches[0]), **extra)
    engine, *_ = initialize(model=build(), config=config)
    expected = FORWARD if clip or "fp16" in extra else BACKWARD
    assert update_mode(engine) == expected
    losses = train(engine, batches, loss_fn)
    assert engine.global_steps == 6 and engine.skipped_steps == 0
    if expected == FORWARD:
        assert engine.stats().steps_in_forward == 6  # every update ran in the forward after its step
    # The same kernels on the same numbers in the same order: bit for bit, 16-bit included.
    params = dict(engine.full_parameters())
    assert losses == ref_losses
    assert params.keys() == ref_params.keys()
    for name, ref in ref_params.items():
        assert torch.equal(params[name], ref), name
    engine.close()


def test_a_failed_parameter_write_back_raises_and_leaks_no_buffer(disk_dir, tmp_path):
    """Parameters on NVMe updated during backward: a write-back that fails (ENOSPC from the system call) is raised by
    step(), every buffer handed over is let go, and the step is rolled back entirely (the partitions
    written read their committed slot again, the optimizer commits nothing, the step count goes back):
    step() refuses only the lost gradients, and once the disk is back training goes on without a load,
    exactly as from the last checkpoint."""
    import errno
    from offload.train.checkpoint.rank_state import sized_partitions as _sized
    from tensorio import TensorIOError
    from tensorio.testing import Fail, inject_faults

    def optimizer_state():
        with _sized(engine.records):  # on-disk partitions get their size while the state is read
            return engine.optimizer.state_dict()

    engine, *_ = initialize(model=gpt2(dropout=0.0), config=engine_config(disk_dir, "nvme", "nvme", micro=2))
    assert engine.stats().mode.value == BACKWARD and engine.stats().records["nvme"] > 0
    batches = gpt2_batches(4)
    train(engine, batches[:2], gpt2_loss)
    engine.save_checkpoint(tmp_path)
    state_before = optimizer_state()
    params_before = dict(engine.full_parameters())
    params_file = engine.param_store.swap.path
    with inject_faults(Fail(errno.ENOSPC, op="write", path=lambda path: path == params_file)):
        with pytest.raises(TensorIOError) as info:
            train(engine, batches[2:3], gpt2_loss)
    assert info.value.errno == errno.ENOSPC
    # Nothing handed over is still held: only reads ahead for the next forward count in the budget.
    stats = engine.stats()
    assert stats.handed_over == stats.writes_in_flight == 0
    assert stats.buffers_held <= stats.buffer_budget
    assert all(rec.partition.numel() == 0 for rec in engine.records if rec.on_disk)
    state_after = optimizer_state()
    for i, entry in state_before["state"].items():
        assert torch.equal(state_after["state"][i]["exp_avg"], entry["exp_avg"]), i
    with pytest.raises(RuntimeError, match="cannot step: step 3 failed .* rolled back entirely"):
        engine.step()
    assert engine.global_steps == 2
    for name, value in engine.full_parameters():
        assert torch.equal(value, params_before[name]), name
    engine.zero_grad()
    losses = train(engine, batches[3:], gpt2_loss)  # no load: the model is whole
    after = dict(engine.full_parameters())
    engine.load_checkpoint(tmp_path)
    assert train(engine, batches[3:], gpt2_loss) == losses
    for name, value in engine.full_parameters():
        assert torch.equal(value, after[name]), name
    engine.close()


def test_parameters_on_disk_updated_during_backward_survive_a_failed_backward_and_an_eval_between(disk_dir, tmp_path):
    """A backward that raises half-way forgets its updates and lets every buffer go: the partitions it
    updated read their committed slot again, so the step is rolled back entirely and step() refuses only
    the lost gradients (until zero_grad); a forward between backward and step waits for the write-backs
    and leaves training as it would have been."""
    build, data, loss_fn = MODELS["mlp"]
    batches = data(4)
    ref_losses, ref_params = reference(build(), batches, loss_fn, 1)
    engine, *_ = initialize(model=build(), config=engine_config(disk_dir, "nvme", "nvme"))
    assert engine.stats().mode.value == BACKWARD and engine.stats().records["nvme"] > 0
    losses = []
    for i, batch in enumerate(batches):
        loss = loss_fn(engine, batch)
        engine.backward(loss)
        with torch.no_grad():  # an evaluation between backward and step
            engine(batch[0])
        engine.step()
        losses.append(loss.item())
    assert_close(losses, dict(engine.full_parameters()), ref_losses, ref_params)
    engine.save_checkpoint(tmp_path)

    def fail(grad):
        raise RuntimeError("injected failure in backward")
    # On the first layer's output: its gradient comes after the last layers' were handed over.
    hook = engine.module[0].register_forward_hook(lambda module, args, out: out.register_hook(fail) and None)
    loss = loss_fn(engine, batches[0])
    hook.remove()
    with pytest.raises(RuntimeError, match="injected failure"):
        engine.backward(loss)
    stats = engine.stats()
    assert stats.handed_over == stats.writes_in_flight == 0 and not engine.optimizer.updates_pending
    assert all(rec.partition.numel() == 0 for rec in engine.records if rec.on_disk)
    assert stats.buffers_held <= stats.buffer_budget
    with pytest.raises(RuntimeError, match="cannot step: step 5 failed .* rolled back entirely"):
        engine.step()
    assert engine.global_steps == 4
    for name, value in engine.full_parameters():
        torch.testing.assert_close(value, ref_params[name], rtol=1e-5, atol=1e-7)  # as after step 4
    engine.zero_grad()
    assert all(torch.isfinite(torch.tensor(train(engine, batches, loss_fn))))
    engine.close()


def wide_mlp() -> nn.Module:
    """Four 512 x 512 layers (about 1 M parameters): the engine would choose sub-groups of 262 144 elements."""
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(512, 512) for _ in range(4)])


@pytest.mark.parametrize("build,size,used", [(wide_mlp, 1000, 32768), (wide_mlp, 10, 32768), (mlp, 10, 1024),
                                             (mlp, 4096, 4096), (wide_mlp, 32768, 32768), (wide_mlp, 1 << 17, 1 << 17)])
def test_a_tiny_sub_group_size_is_raised_to_the_floor_with_a_warning(disk_dir, caplog, build, size, used):
    """sub_group_size 10 or 1000 cut the optimizer state into thousands of sub-groups and made each step ~30x
    slower, silently: it is raised to an eighth of the size the engine would choose (262 144 for the wide
    MLP: 32 768; at least 1024, the small MLP's), with a warning naming the size, the sub-groups it would
    make and the cost. A size at or above the floor is kept, without a word."""
    config = engine_config(disk_dir, "none", "nvme", micro=4)
    config["zero_optimization"]["sub_group_size"] = size
    with caplog.at_level("WARNING", logger="offload"):
        engine, *_ = initialize(model=build(), config=config)
    assert engine.optimizer.swap_config.sub_group_size == used
    said = [r.getMessage() for r in caplog.records if "sub_group_size" in r.getMessage()]
    if used == size:
        assert said == []
    else:
        numel = sum(p.numel() for p in build().parameters())
        (message,) = said
        assert message.startswith(f"zero_optimization.sub_group_size {size} would cut this rank's {numel} optimizer "
                                   f"elements into about {-(-numel // size)} sub-groups")
        assert "a step many times slower" in message and f"using {used}" in message
    x = torch.randn(4, 512 if build is wide_mlp else 16)
    engine.backward(engine(x).pow(2).mean())
    engine.step()
    engine.close()


@pytest.mark.parametrize("size,expected", [(1e9, "using 4096, chosen from the parameter sizes"),
                                           (10**6, "using 14336 (buffers at most 1/16")])
def test_a_huge_sub_group_size_is_cut_to_what_the_host_can_hold(disk_dir, monkeypatch, caplog, size, expected):
    """DeepSpeed's default sub_group_size (1e9) sizes its swap buffers from the config and runs hosts out
    of memory. Here 1e9 counts as not chosen: the size is chosen from the parameter sizes (the typical
    partition's, 4096 elements in this model) within 1/16 of host memory, with a warning; a size that is
    chosen but too large is cut to what fits. Training is the same."""
    import offload.train.sizing as sizing

    build, data, loss_fn = MODELS["gpt2"]
    batches = data(3)
    ref_losses, ref_params = reference(build(), batches, loss_fn, 1)
    monkeypatch.setattr(sizing, "host_memory_bytes", lambda: 8 << 20)  # an 8 MiB host
    config = engine_config(disk_dir, "none", "nvme", micro=2)
    config["zero_optimization"]["sub_group_size"] = size
    with caplog.at_level("WARNING", logger="offload"):
        engine, *_ = initialize(model=build(), config=config)
    assert any(f"sub_group_size {int(size)}" in r.getMessage() and expected in r.getMessage() for r in caplog.records)
    assert engine.optimizer.host_state_bytes()["buffers"] <= (8 << 20) // 16
    assert engine.optimizer.swap_config.buffer_count == 3  # not set: the updates overlap the passes
    losses = train(engine, batches, loss_fn)
    assert_close(losses, dict(engine.full_parameters()), ref_losses, ref_params)
    engine.close()


def test_updates_during_backward_report_the_gradient_norm(disk_dir):
    batches = mlp_batches(3)
    model = mlp()
    ref_norms = []
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD, fused=True)
    for batch in batches:
        mlp_loss(model, batch).backward()
        ref_norms.append(float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()]))))
        opt.step()
        opt.zero_grad()
    engine, *_ = initialize(model=mlp(), config=engine_config(disk_dir, "cpu", "nvme"))
    for batch, ref in zip(batches, ref_norms):
        engine.backward(mlp_loss(engine, batch))
        assert engine.get_global_grad_norm() == pytest.approx(ref, rel=1e-5)
        engine.step()
    assert dict(engine.full_parameters()).keys() == dict(model.named_parameters()).keys()
    for (name, ours), theirs in zip(engine.full_parameters(), model.parameters()):
        torch.testing.assert_close(ours, theirs.detach(), rtol=1e-5, atol=1e-7, msg=lambda m: f"{name}: {m}")
    engine.close()


@pytest.mark.parametrize("param,opt", [("nvme", "nvme"), ("cpu", "none")])
def test_llama_matches_plain_pytorch(disk_dir, param, opt):
    build, data, loss_fn = MODELS["llama"]
    batches = data(6)
    ref_losses, ref_params = reference(build(), batches, loss_fn, 2)
    engine, *_ = initialize(model=build(), config=engine_config(disk_dir, param, opt, 2, micro=2))
    losses = train(engine, batches, loss_fn)
    assert_close(losses, dict(engine.full_parameters()), ref_losses, ref_params)
    engine.close()


def test_prefetch_follows_the_first_step(disk_dir):
    config = engine_config(disk_dir, "nvme", "nvme", micro=2)
    config["zero_optimization"]["stage3_prefetch_bucket_size"] = 40000
    config["zero_optimization"]["offload_param"]["buffer_count"] = 4
    engine, *_ = initialize(model=gpt2(), config=config)
    batches = gpt2_batches(4)
    train(engine, batches[:1], gpt2_loss)
    # The first step reads on demand and records the order; its end reads the next forward's first
    # partitions ahead, within the prefetch bucket.
    stats = engine.stats()
    first = stats.reads["demand"]
    assert first == stats.recorded_order > 0
    assert stats.reads["prefetch"] > 0 and 0 < stats.buffers_held <= 40000
    train(engine, batches[1:], gpt2_loss)
    # From the second step on nearly every read is a prefetch; the budget is never exceeded by them.
    stats = engine.stats()
    assert stats.reads["prefetch"] > 2 * first * 0.8
    assert stats.reads["demand"] - first <= 3 * 3
    assert 0 < stats.buffers_held <= 40000
    engine.close()


def test_a_prefetch_bucket_smaller_than_a_partition_still_reads_the_next_one_ahead(disk_dir):
    """As DeepSpeed's coordinator: reads ahead start while less than the bucket is in flight, so the read
    that crosses it starts too. Hugging Face's "auto" bucket (0.9 h^2) is smaller than a GPT-2 layer's
    matrices; read ahead only while the whole partition fitted, nothing was ever prefetched."""
    config = engine_config(disk_dir, "nvme", "nvme", micro=2)
    config["zero_optimization"]["stage3_prefetch_bucket_size"] = 1
    engine, *_ = initialize(model=gpt2(), config=config)
    train(engine, gpt2_batches(3), gpt2_loss)
    stats = engine.stats()
    assert stats.reads["prefetch"] >= stats.recorded_order  # about one per gather from the second step on
    assert stats.buffers_held <= stats.buffer_budget
    engine.close()


@pytest.mark.parametrize("clip", [0.0, 1.0])  # updates during backward / in the next forward
def test_a_steps_io_buffers_are_reused_not_mapped_anew(disk_dir, clip):
    config = engine_config(disk_dir, "nvme", "nvme", micro=2, gradient_clipping=clip)
    engine, *_ = initialize(model=gpt2(), config=config)
    batches = gpt2_batches(6)
    train(engine, batches[:3], gpt2_loss)
    before = engine.stats()
    train(engine, batches[3:], gpt2_loss)
    after = engine.stats()
    # Once the steps repeat, the partition reads land in buffers earlier steps used. The pool's size
    # settles at the most buffers in use at once, which follows how the optimizer thread's updates
    # overlap the next forward: over runs it settles at 45 to 55 pages, and a later step may still
    # add a few small buffers (up to 7 pages seen). A step mapping its buffers anew would add a step's
    # worth (45 pages) every step, so three steps may add at most a third of one step's worth, and
    # at least three reads in four land in a buffer an earlier step used (mapping anew: none does).
    held, pool = before.io_buffers["held_bytes"], after.io_buffers
    assert held <= pool["held_bytes"] <= min(held + held // 3, pool["max_bytes"])
    reads = sum(after.reads[kind] - before.reads[kind] for kind in ("demand", "prefetch"))
    assert pool["reused"] - before.io_buffers["reused"] >= reads * 3 // 4 > 0
    released = weakref.ref(engine.param_store.swap.pool)
    engine.close()
    assert released() is None  # closing lets go of the pool: its idle buffers are freed


@pytest.mark.parametrize("grads_on_disk", [False, True])
def test_the_state_read_ahead_for_the_next_forward_is_kept_across_steps_only_with_gradients_in_memory(
        disk_dir, monkeypatch, grads_on_disk):
    """With the step in the next forward, the optimizer state read ahead late in backward lands in memory
    kept across steps (faulted in once) while the gradients stay in memory; with them on disk (a model
    large for the host) it is new memory each step, so that the backward's peak does not carry it."""
    import offload.train.sizing as sizing
    if grads_on_disk:
        monkeypatch.setattr(sizing, "_GRADS_SHARE", 1 << 60)  # as on a host too small to keep the gradients
    config = engine_config(disk_dir, "nvme", "nvme", micro=2, gradient_clipping=1.0)
    engine, *_ = initialize(model=gpt2(), config=config)
    train(engine, gpt2_batches(3), gpt2_loss)
    assert ("grads" in engine.stats().io) == grads_on_disk
    kept = engine.optimizer.host_state_bytes()["read_ahead"]
    assert (kept == 0) == grads_on_disk
    train(engine, gpt2_batches(2), gpt2_loss)
    assert engine.optimizer.host_state_bytes()["read_ahead"] == kept  # the same memory, not more
    engine.close()


def test_prefetch_with_a_changed_order_is_still_correct(disk_dir):
    """An eval forward between training steps and a different sequence length change the gather order."""
    build, data, loss_fn = MODELS["gpt2"]
    batches = data(6)
    batches[3] = batches[3][:, :5]
    ref_losses, ref_params = reference(build(), batches, loss_fn, 1)
    config = engine_config(disk_dir, "nvme", "nvme", micro=2)
    config["zero_optimization"]["offload_param"]["buffer_count"] = 3
    engine, *_ = initialize(model=build(), config=config)
    losses = []
    for i, batch in enumerate(batches):
        if i == 2:
            with torch.no_grad():
                engine.eval()
                engine(batch[:, :3])
                engine.train()
        loss = loss_fn(engine, batch)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    assert_close(losses, dict(engine.full_parameters()), ref_losses, ref_params)
    engine.close()


def test_budget_of_one_buffer_never_fails(disk_dir):
    """DeepSpeed's "Not enough buffers 0 for swapping 1": here a budget smaller than a layer only
    stops prefetching, reads on demand still happen."""
    config = engine_config(disk_dir, "nvme", "cpu", micro=2)
    config["zero_optimization"]["offload_param"].update(buffer_count=1, buffer_size=4096)  # one partition
    config["zero_optimization"]["stage3_max_reuse_distance"] = 0
    engine, *_ = initialize(model=gpt2(), config=config)
    train(engine, gpt2_batches(3), gpt2_loss)
    assert engine.global_steps == 3
    engine.close()


@pytest.mark.parametrize("reuse", [0, 10**9])
def test_a_tied_embedding_stays_gathered_from_forward_into_backward(disk_dir, reuse):
    """stage3_max_reuse_distance: GPT-2's lm_head (the tied embedding) is the last parameter of forward
    and the first of backward; within the distance it is not released and read again in between."""
    build, data, loss_fn = MODELS["gpt2"]
    batches = data(4)
    ref_losses, ref_params = reference(build(), batches, loss_fn, 1)
    config = engine_config(disk_dir, "nvme", "nvme", micro=2)
    config["zero_optimization"]["stage3_max_reuse_distance"] = reuse
    engine, *_ = initialize(model=build(), config=config)
    train(engine, batches[:2], gpt2_loss)
    before = engine.stats()
    losses = train(engine, batches[2:], gpt2_loss)
    after = engine.stats()
    reads_per_step = sum(after.reads[kind] - before.reads[kind] for kind in ("demand", "prefetch")) / 2
    # Without reuse every gather reads; with it, what the budget holds from forward into backward
    # (here at least the tied embedding) is not read again.
    if reuse:
        assert reads_per_step <= after.recorded_order - 1
    else:
        assert reads_per_step == after.recorded_order
    assert_close(ref_losses[:2] + losses, dict(engine.full_parameters()), ref_losses, ref_params)
    engine.close()


def test_max_in_cpu_keeps_the_first_partitions_in_memory(disk_dir):
    config = engine_config(disk_dir, "nvme", "none", micro=2)
    config["zero_optimization"]["offload_param"]["max_in_cpu"] = 20000
    engine, *_ = initialize(model=gpt2(), config=config)
    in_memory = sum(rec.partition_numel for rec in engine.records if not rec.on_disk)
    on_disk = [rec for rec in engine.records if rec.on_disk]
    assert 0 < in_memory <= 20000 and on_disk
    assert all(rec.partition.numel() == 0 for rec in on_disk)
    engine.close()


def test_persistent_small_parameters_stay_gathered(disk_dir):
    config = engine_config(disk_dir, "nvme", "none", micro=2)
    config["zero_optimization"]["stage3_param_persistence_threshold"] = 64
    engine, *_ = initialize(model=gpt2(), config=config)
    for rec in engine.records:
        assert (rec.param.numel() == rec.numel) == (rec.numel <= 64), rec.name
    engine.close()


def test_tied_weights_are_one_record(disk_dir):
    engine, *_ = initialize(model=gpt2(), config=engine_config(disk_dir, "nvme", "none", micro=2))
    tied = [rec for rec in engine.records if len(rec.names) > 1]
    assert [sorted(rec.names) for rec in tied] == [["lm_head.weight", "transformer.wte.weight"]]
    engine.close()


def _checkpoint_activations(model, reentrant: bool) -> None:
    """transformers' activation checkpointing: ``activation_checkpointing_enable``, or in older transformers
    ``gradient_checkpointing_enable`` (deprecated where the new name exists)."""
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": reentrant})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})


@pytest.mark.parametrize("reentrant", [True, False])
def test_activation_checkpointing(disk_dir, reentrant):
    build, data, loss_fn = MODELS["gpt2"]
    batches = data(4)
    model = build()
    _checkpoint_activations(model, reentrant)
    ref_losses, ref_params = reference(model, batches, loss_fn, 1)
    model = build()
    _checkpoint_activations(model, reentrant)
    engine, *_ = initialize(model=model, config=engine_config(disk_dir, "nvme", "nvme", micro=2))
    engine.train()
    losses = train(engine, batches, loss_fn)
    assert_close(losses, dict(engine.full_parameters()), ref_losses, ref_params)
    engine.close()


def test_accumulation_boundary_and_lr(disk_dir):
    engine, *_ = initialize(model=mlp(), config=engine_config(disk_dir, gas=3))
    boundaries = []
    for batch in mlp_batches(6):
        boundaries.append(engine.is_gradient_accumulation_boundary())
        engine.backward(mlp_loss(engine, batch))
        engine.step()
    assert boundaries == [False, False, True] * 2
    assert engine.global_steps == 2 and engine.get_lr() == [LR]
    engine.close()


def test_client_optimizer_and_scheduler(disk_dir):
    model = mlp()
    client = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    config = engine_config(disk_dir)
    del config["optimizer"]
    engine, optimizer, _, scheduler = initialize(
        model=model, config=config, optimizer=client,
        lr_scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5))
    assert engine.get_lr() == [3e-3]
    train(engine, mlp_batches(2), mlp_loss)
    assert engine.get_lr() == pytest.approx([3e-3 / 4])
    engine.close()


def test_config_scheduler_from_the_json(disk_dir):
    config = engine_config(disk_dir, scheduler={"type": "WarmupLR", "params": {
        "warmup_min_lr": 0.0, "warmup_max_lr": LR, "warmup_num_steps": 4, "warmup_type": "linear"}})
    engine, _, _, scheduler = initialize(model=mlp(), config=config)
    assert scheduler is not None
    lrs = []
    for batch in mlp_batches(5):
        engine.backward(mlp_loss(engine, batch))
        engine.step()
        lrs.append(engine.get_lr()[0])
    assert lrs[0] < lrs[2] < lrs[4] == pytest.approx(LR)
    engine.close()


@pytest.mark.parametrize("name", sorted(os.listdir(os.path.join(os.path.dirname(__file__), "..", "configs"))))
def test_repository_configs_load(disk_dir, name):
    path = os.path.join(os.path.dirname(__file__), "..", "configs", name)
    if not name.startswith("zero") or not name.endswith(".json"):
        pytest.skip("not an engine config")
    with open(path) as f:
        text = json.load(f)
    auto = {arg: False if any(text.get(key, {}).get("enabled") == "auto" for key in keys) else None
            for arg, keys in (("fp16", ["fp16"]), ("bf16", ["bf16", "bfloat16"]))}
    raw = copy.deepcopy(text) if '"auto"' not in open(path).read() else resolve_auto(path, micro_batch_size=2, gradient_accumulation_steps=1, hidden_size=64, lr=1e-3,
                       betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, warmup_steps=2, total_steps=10,
                       max_grad_norm=1.0, **auto)
    for section in ("offload_param", "offload_optimizer"):
        if raw.get("zero_optimization", {}).get(section, {}).get("nvme_path"):
            raw["zero_optimization"][section]["nvme_path"] = str(disk_dir)
    if "optimizer" not in raw:
        raw["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-3}}
    engine, *_ = initialize(model=gpt2(), config=raw)
    train(engine, gpt2_batches(2), gpt2_loss)
    assert engine.global_steps == 2
    engine.close()


def test_config_errors_name_the_key(disk_dir, tmp_path):
    with pytest.raises(ValueError, match="optimizer"):
        config = engine_config(disk_dir)
        del config["optimizer"]
        initialize(model=mlp(), config=config)
    with pytest.raises(FileNotFoundError, match="nvme_path"):
        initialize(model=mlp(), config=engine_config(tmp_path / "missing", "nvme"))
    with pytest.raises(ValueError, match="buffer_size"):
        config = engine_config(disk_dir, "nvme")
        config["zero_optimization"]["offload_param"]["buffer_size"] = 100
        initialize(model=gpt2(), config=config)
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(engine_config(disk_dir)))
    engine, *_ = initialize(model=mlp(), config=str(path))
    engine.close()


@pytest.mark.parametrize("hysteresis", [1, 2])
def test_fp16_overflow_skips_the_step_and_lowers_the_scale(disk_dir, hysteresis):
    config = engine_config(disk_dir, "nvme", "nvme", micro=4, fp16={
        "enabled": True, "initial_scale_power": 8, "hysteresis": hysteresis, "loss_scale_window": 1000})
    engine, *_ = initialize(model=mlp(), config=config)
    assert all(rec.partition.dtype == torch.float16 for rec in engine.records)
    batches = mlp_batches(4)
    train(engine, batches[:1], lambda m, b: mlp_loss(m, (b[0].half(), b[1].half())))
    before = {n: t.clone() for n, t in engine.full_parameters()}
    scale = engine.loss_scaler.loss_scale
    for _ in range(hysteresis):  # DeepSpeed: the first hysteresis - 1 overflows keep the scale
        loss = mlp_loss(engine, (batches[1][0].half(), batches[1][1].half())) * float("inf")  # injected overflow
        engine.backward(loss)
        engine.step()
        after = dict(engine.full_parameters())
        assert all(torch.equal(before[n], after[n]) for n in before)  # the step was skipped
    assert engine.skipped_steps == hysteresis
    assert engine.loss_scaler.loss_scale == scale / 2
    losses = train(engine, batches[2:], lambda m, b: mlp_loss(m, (b[0].half(), b[1].half())))
    assert all(torch.isfinite(torch.tensor(losses)))
    assert not all(torch.equal(before[n], t) for n, t in engine.full_parameters())
    engine.close()


@pytest.mark.parametrize("param", ["none", "nvme"])
def test_bf16_trains_to_a_lower_loss(disk_dir, param):
    config = engine_config(disk_dir, param, "nvme", micro=4, bf16={"enabled": True}, gradient_clipping=1.0)
    engine, *_ = initialize(model=mlp(), config=config)
    x, y = mlp_batches(1)[0]
    x, y = x.bfloat16(), y.bfloat16()
    losses = train(engine, [(x, y)] * 15, mlp_loss)
    assert all(rec.partition.dtype == torch.bfloat16 for rec in engine.records)
    assert losses[-1] < 0.7 * losses[0]
    engine.close()


@pytest.mark.parametrize("opt", ["cpu", "nvme"])  # gradients in memory / offloaded beside the state
def test_gradient_clipping_matches_torch(disk_dir, opt):
    build, data, loss_fn = MODELS["mlp"]
    batches = data(5)
    model = build()
    adamw = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD, fused=True)
    ref_losses = []
    for batch in batches:
        loss = loss_fn(model, batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        adamw.step()
        adamw.zero_grad()
        ref_losses.append(loss.item())
    ref_params = {n: p.detach() for n, p in model.named_parameters()}
    engine, *_ = initialize(model=build(), config=engine_config(disk_dir, "nvme", opt, gradient_clipping=0.05))
    losses = train(engine, batches, loss_fn)
    assert_close(losses, dict(engine.full_parameters()), ref_losses, ref_params)
    engine.close()


def _large_gradient_run(disk_dir, clipping):
    """Five steps of the MLP on targets large enough that every step's gradient norm is above 1;
    ``clipping`` None leaves ``gradient_clipping`` out of the config. Adam's eps of 1 makes the update
    follow the gradient's scale, so clipping changes it. (losses, norms, parameters, the plan's text)."""
    build, data, loss_fn = MODELS["mlp"]
    batches = [(x, 20 * y) for x, y in data(5)]
    config = engine_config(disk_dir, "nvme", "nvme", gradient_clipping=clipping,
                           optimizer={"type": "AdamW", "params": {"lr": LR, "weight_decay": WD, "eps": 1.0}})
    if clipping is None:
        del config["gradient_clipping"]
    engine, *_ = initialize(model=build(), config=config)
    losses, norms = [], []
    for batch in batches:
        loss = loss_fn(engine, batch)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        norms.append(engine.get_global_grad_norm())
    plan, params = str(engine.plan), parameters_now(engine)
    engine.close()
    return losses, norms, params, plan


def test_an_absent_gradient_clipping_clips_at_deepspeeds_default(disk_dir, caplog):
    """DeepSpeed clips the global norm at 1.0 when the config has no gradient_clipping (its
    GRADIENT_CLIPPING_DEFAULT): so does the engine, and its plan and log say so; 0 turns it off."""
    with caplog.at_level(logging.INFO, logger="offload"):
        absent, norms, absent_params, plan = _large_gradient_run(disk_dir, None)
    explicit, _, explicit_params, explicit_plan = _large_gradient_run(disk_dir, 1.0)
    off, _, off_params, off_plan = _large_gradient_run(disk_dir, 0.0)
    assert min(norms) > 1.0  # the clipping bites on every step
    assert absent == explicit
    assert_same_tensors(absent_params, explicit_params)
    assert off[0] == absent[0] and off[1:] != absent[1:]
    for name, tensor in off_params.items():  # unclipped, each step moved the weights several times as far
        assert (tensor - absent_params[name]).abs().max() > 0.01, name
    default = ("gradient clipping: global norm clipped at 1 (DeepSpeed's default: the config has no "
               "gradient_clipping; set it to 0 to turn clipping off)")
    assert default in plan and "the update runs in the next forward" in plan
    assert default in caplog.text
    assert "gradient clipping: global norm clipped at 1 (gradient_clipping)" in explicit_plan
    assert "gradient clipping: off (gradient_clipping 0)" in off_plan and "the update runs during backward" in off_plan


@pytest.mark.parametrize("param,opt", [("none", "none"), ("nvme", "nvme")])
def test_checkpoint_resume_is_identical_to_an_uninterrupted_run(disk_dir, tmp_path, param, opt):
    _, data, loss_fn = MODELS["gpt2"]
    build = lambda: gpt2(dropout=0.0)  # noqa: E731 (the RNG state is not part of a checkpoint)
    batches = data(10)
    extra = dict(scheduler={"type": "WarmupLR", "params": {"warmup_num_steps": 3, "warmup_max_lr": LR}})
    config = engine_config(disk_dir, param, opt, micro=2, **extra)
    engine, *_ = initialize(model=build(), config=config)
    straight = train(engine, batches, loss_fn)
    expected = dict(engine.full_parameters())
    engine.close()

    first, *_ = initialize(model=build(), config=config)
    train(first, batches[:5], loss_fn)
    path = first.save_checkpoint(tmp_path, client_state={"epoch": 3})
    first.close()
    second, *_ = initialize(model=build(), config=config)
    loaded, client = second.load_checkpoint(tmp_path)
    assert loaded == path == str(tmp_path / "global_step5") and client == {"epoch": 3}
    assert second.global_steps == 5
    resumed = train(second, batches[5:], loss_fn)
    assert resumed == straight[5:]
    for name, ref in expected.items():
        assert torch.equal(dict(second.full_parameters())[name], ref), name
    second.close()


def test_checkpoint_fp16_keeps_the_loss_scale(disk_dir, tmp_path):
    config = engine_config(disk_dir, "nvme", "nvme", micro=4, fp16={"enabled": True, "initial_scale_power": 5})
    engine, *_ = initialize(model=mlp(), config=config)
    half = [(x.half(), y.half()) for x, y in mlp_batches(2)]
    train(engine, half, mlp_loss)
    engine.loss_scaler.update(True)
    engine.loss_scaler.update(True)
    engine.save_checkpoint(tmp_path, tag="t")
    params = dict(engine.full_parameters())
    fresh, *_ = initialize(model=mlp(), config=config)
    fresh.load_checkpoint(tmp_path, tag="t")
    assert fresh.loss_scaler.loss_scale == engine.loss_scaler.loss_scale < 2 ** 5
    assert all(torch.equal(t, params[n]) for n, t in fresh.full_parameters())
    assert all(rec.partition.dtype == torch.float16 for rec in fresh.records)
    engine.close()
    fresh.close()


def test_a_failed_save_leaves_the_previous_checkpoint_loadable(disk_dir, tmp_path, monkeypatch):
    engine, *_ = initialize(model=mlp(), config=engine_config(disk_dir, "nvme", "nvme"))
    batches = mlp_batches(4)
    train(engine, batches[:2], mlp_loss)
    engine.save_checkpoint(tmp_path)
    saved = dict(engine.full_parameters())
    train(engine, batches[2:], mlp_loss)

    def crash(*args, **kwargs):
        raise OSError(28, "No space left on device (injected)")

    import offload.train.checkpoint.rank_state as rank_state
    monkeypatch.setattr(rank_state, "states_bytes", crash)  # the last file of the new tag fails to write
    with pytest.raises(OSError, match="injected"):
        engine.save_checkpoint(tmp_path)
    monkeypatch.undo()
    assert (tmp_path / "latest").read_text() == "global_step2"
    assert not (tmp_path / "global_step4").exists()
    fresh, *_ = initialize(model=mlp(), config=engine_config(disk_dir, "nvme", "nvme"))
    fresh.load_checkpoint(tmp_path)
    assert all(torch.equal(t, saved[n]) for n, t in fresh.full_parameters())
    engine.close()
    fresh.close()


def test_save_16bit_model_writes_every_weight(disk_dir, tmp_path):
    from safetensors.torch import load_file

    config = engine_config(disk_dir, "nvme", "nvme", micro=2, bf16={"enabled": True})
    config["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = True
    engine, *_ = initialize(model=gpt2(), config=config)
    train(engine, gpt2_batches(2), gpt2_loss)
    assert engine.save_16bit_model(tmp_path, "model.safetensors")
    weights = load_file(tmp_path / "model.safetensors")
    expected = dict(engine.full_parameters())
    assert set(weights) == {rec.name for rec in engine.records}
    for name, tensor in weights.items():
        assert tensor.dtype == torch.bfloat16 and torch.equal(tensor, expected[name])
    # A fresh transformers model loads the file (the tied lm_head comes with the embedding).
    model = gpt2().to(torch.bfloat16)
    missing, unexpected = model.load_state_dict(weights, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    engine.close()
    config["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = False
    engine, *_ = initialize(model=gpt2(), config=config)
    assert engine.save_16bit_model(tmp_path / "off") is False and not (tmp_path / "off").exists()
    engine.close()


def test_steps_per_print_and_wall_clock_breakdown_are_logged(disk_dir, caplog):
    config = engine_config(disk_dir, steps_per_print=2, wall_clock_breakdown=True)
    engine, *_ = initialize(model=mlp(), config=config)
    with caplog.at_level("INFO", logger="offload"):
        train(engine, mlp_batches(4), mlp_loss)
    lines = [r.getMessage() for r in caplog.records if r.name == "offload"]
    assert [line.split()[:2] for line in lines] == [["step", "2:"], ["step", "2"], ["step", "4:"], ["step", "4"]]
    assert lines[0].startswith("step 2: lr [0.01]") and "backward" in lines[1] and "forward" in lines[1]
    engine.close()


def test_keys_without_effect_are_named_in_a_warning(disk_dir, caplog):
    config = engine_config(disk_dir)
    config["zero_optimization"].update(contiguous_gradients=False, allgather_bucket_size=1000)
    with caplog.at_level("WARNING", logger="offload"):
        engine, *_ = initialize(model=mlp(), config=config)
    assert any("contiguous_gradients, allgather_bucket_size" in r.getMessage() for r in caplog.records)
    engine.close()


@pytest.mark.parametrize("case", ["bf16-clipping", "fp16-clipping-accumulation"])
def test_the_next_forward_does_not_read_16_bit_partitions_its_updates_overwrite(disk_dir, monkeypatch, case):
    """A 16-bit partition's update writes it whole from the fp32 master: from the second update on (the
    first one copies the partition into the new master), the forward that runs the step gets a buffer
    for it without reading it. Filled with NaN here, those buffers change nothing: plain PyTorch's
    results, bit for bit."""
    from offload.params.store import ParamStore

    start_read, unread = ParamStore.start_read, []

    def poisoned_start_read(store, rec):
        start_read(store, rec)
        if rec.read is None:  # given unread: its update must overwrite every element
            rec.buffer.fill_(float("nan"))
            unread.append(rec.index)

    monkeypatch.setattr(ParamStore, "start_read", poisoned_start_read)
    extra, gas, dtype, scale = FAST_CASES[case]
    build, data, loss_fn = MODELS["gpt2"]
    batches = data(4 * gas)
    ref_losses, ref_params = reference_16bit(build(), batches, loss_fn, gas, dtype, clip=0.05, loss_scale=scale)
    engine, *_ = initialize(model=build(), config=engine_config(disk_dir, "nvme", "nvme", gas,
                                                               micro=len(batches[0]), **extra))
    assert update_mode(engine) == FORWARD
    losses = train(engine, batches, loss_fn)
    assert unread and engine.stats().reads["skipped"] == len(unread)
    on_disk = {rec.index for rec in engine.records if rec.on_disk and rec.param.requires_grad}
    assert set(unread) <= on_disk
    params = dict(engine.full_parameters())
    assert losses == ref_losses
    for name, ref in ref_params.items():
        assert torch.equal(params[name], ref), name
    engine.close()


@pytest.mark.parametrize("case", ["clipping-accumulation", "accumulation", "bf16-clipping"])
def test_gradients_kept_in_the_swap_file_when_memory_is_short(disk_dir, monkeypatch, case):
    """On a host where the gradient partitions would take more than a quarter of the memory, the fast
    paths keep them in the gradient swap file between micro-batches and into the next forward, and the
    results are still plain PyTorch's, bit for bit."""
    import offload.train.sizing as sizing

    extra, gas, dtype, scale = FAST_CASES[case]
    build, data, loss_fn = MODELS["gpt2"]
    batches = data(4 * gas)
    clip = extra.get("gradient_clipping", 0.0)
    if dtype is None:
        ref_losses, ref_params = reference(build(), batches, loss_fn, gas, clip=clip)
    else:
        ref_losses, ref_params = reference_16bit(build(), batches, loss_fn, gas, dtype, clip=clip, loss_scale=scale)
    monkeypatch.setattr(sizing, "host_memory_bytes", lambda: 64 << 10)  # a 64 KiB host
    config = engine_config(disk_dir, "nvme", "nvme", gas, micro=len(batches[0]), **extra)
    config["zero_optimization"]["sub_group_size"] = 1024
    engine, *_ = initialize(model=build(), config=config)
    assert "grads" in engine.stats().io and update_mode(engine) == (FORWARD if clip else BACKWARD)
    losses = train(engine, batches, loss_fn)
    params = dict(engine.full_parameters())
    assert losses == ref_losses
    for name, ref in ref_params.items():
        assert torch.equal(params[name], ref), name
    # An on-disk fp32 partition's gradient waits in the partition's free slot; a 16-bit one's (half the
    # slot) and in-memory ones' in the gradient swap file.
    on_disk = [rec for rec in engine.records if rec.param.requires_grad and rec.on_disk]
    places = engine.stats().offloaded_grads
    assert on_disk and places["param_slot"] == (len(on_disk) if dtype is None else 0)
    assert (engine.stats().io["grads"]["read"] > 0) == (dtype is not None)  # fp32: every gradient in a free slot
    engine.close()


def test_the_step_in_the_next_forward_prepares_its_first_updates_during_backward(disk_dir):
    """With clipping, late in backward the optimizer reads ahead the state of the updates the next forward
    needs first, and the buffers backward read of those partitions are kept: the step hands them over at
    once, with no read, and the forward's first gather finds its update done or under way."""
    from offload.optim.swapper import Where

    build, data, loss_fn = MODELS["gpt2"]
    batches = data(4)
    ref_losses, ref_params = reference(build(), batches, loss_fn, 1, clip=0.05)
    engine, *_ = initialize(model=build(), config=engine_config(disk_dir, "nvme", "nvme", micro=2,
                                                               gradient_clipping=0.05))
    losses = train(engine, batches[:2], loss_fn)  # the gather order and the update order are learnt
    store, opt, records = engine.param_store, engine.optimizer, engine.records
    loss = loss_fn(engine, batches[2])
    engine.backward(loss)
    losses.append(loss.item())
    # The next forward's order of the update units (records updated together), as it gathers them.
    groups = opt.update_groups()
    group_of = {i: g for g, group in enumerate(groups) for i in group}
    gathered = dict.fromkeys(group_of[i] for i in [*store.prefetcher.trace, *range(len(records))] if i in group_of)
    units = [[records[i] for i in groups[g]] for g in gathered]
    first = units[0]
    on_disk = [rec.index for unit in units for rec in unit if rec.on_disk]
    kept = engine.stats().kept_for_next_forward
    assert kept and kept == set(on_disk[:len(kept)])  # the first ones in order
    assert records[on_disk[0]].buffer is not None  # the tied embedding: read by backward (lm_head), kept
    opt.wait_for_updates(lambda: False)  # the read-ahead has been started
    order = opt.update_order
    ahead = [i for i in order if opt.swapper.records[i].where is not Where.ON_DISK]
    assert ahead and ahead == order[:len(ahead)]  # the first sub-groups of the learnt order
    kept_recs = [records[i] for i in kept if records[i].buffer is not None]
    before = engine.stats().reads
    engine.step()
    # Handed over at once, or (when a partition of the same update, which backward does not read, is
    # still being read) still held for the hand-over: either way never read again.
    stats = engine.stats()
    assert sum(rec.buffer is None for rec in kept_recs) <= stats.handed_over
    assert stats.handed_over or any(rec.read is not None for rec in first)
    reads = stats.reads["demand"] + stats.reads["prefetch"] - before["demand"] - before["prefetch"]
    assert reads <= stats.recorded_order  # only read-ahead
    assert not stats.kept_for_next_forward
    losses += train(engine, batches[3:], loss_fn)
    assert losses == ref_losses
    for name, value in engine.full_parameters():
        assert torch.equal(value, ref_params[name]), name
    engine.close()
