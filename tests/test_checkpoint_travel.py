"""Checkpoints that travel (issue 27): consolidated offline into weights from_pretrained loads,
save_16bit_model loaded as written, a failed load that leaves the engine as it was, errors naming
the file. Resuming at another world size: tests/test_checkpoint_world_size.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from test_engine import engine_config, gpt2, gpt2_batches, gpt2_loss

from offload.checkpoint import main as checkpoint_command
from offload.storage.safetensors_reader import SafetensorsError
from offload.train.checkpoint.consolidate import (DTYPES, convert_zero_checkpoint_to_fp32_state_dict,
                                       get_fp32_state_dict_from_zero_checkpoint, load_state_dict_from_zero_checkpoint)
from offload.train.engine import initialize
from tensorio import ChecksumError

transformers = pytest.importorskip("transformers")


def trained(tmp, *, bf16: bool = False, steps: int = 3, save: bool = True):
    """An engine (parameters and optimizer on NVMe) after ``steps`` steps, saved to tmp/ckpt."""
    config = engine_config(tmp, "nvme", "nvme", micro=2, **({"bf16": {"enabled": True}} if bf16 else {}))
    config["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = True
    engine, *_ = initialize(model=gpt2(0.0), config=config)
    for batch in gpt2_batches(steps):
        engine.backward(gpt2_loss(engine, batch))
        engine.step()
    if save:
        engine.save_checkpoint(tmp / "ckpt")
    return engine


def logits(model, batch) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(batch).logits.float()


def full(engine) -> dict[str, torch.Tensor]:
    return dict(engine.full_parameters())


# ---- offline consolidation ---------------------------------------------------------------------------

def test_consolidated_checkpoint_loads_with_from_pretrained_and_gives_the_engines_logits(disk_dir):
    engine = trained(disk_dir)
    batch = gpt2_batches(1)[0]
    expected = logits(engine, batch)
    # sharded: every tensor of the small model is over 5 KB, so the shards hold one or a few each
    assert checkpoint_command(["consolidate", str(disk_dir / "ckpt"), str(disk_dir / "out"),
                               "--max-shard-size", "20KB", "--no-progress"]) == 0
    index = json.loads((disk_dir / "out" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    model = transformers.AutoModelForCausalLM.from_pretrained(disk_dir / "out")
    assert torch.equal(logits(model, batch), expected)
    raw = next((disk_dir / "out").glob("model-00001-*.safetensors")).read_bytes()
    header = json.loads(raw[8:8 + int.from_bytes(raw[:8], "little")])
    assert header["__metadata__"] == {"format": "pt"}
    engine.close()


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_page_sized_tensors_are_written_from_their_read_buffers(disk_dir, monkeypatch, dtype):
    """Tensors of whole pages (as every fp32 tensor of GPT-2 and Llama shapes): fp32 runs go from the
    buffer they were read into straight to the disk, only the header is copied; bf16 is converted
    while copied. Either way the weights are the engine's."""
    from safetensors import safe_open

    from offload.storage.safetensors_writer import DirectSafetensorsWriter

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 128, bias=False), torch.nn.ReLU(),
                                torch.nn.Linear(128, 32, bias=False))  # 4096 elements each: 4 pages of fp32
    engine, *_ = initialize(model=model, config=engine_config(disk_dir, "nvme", "nvme", micro=2))
    for _ in range(2):
        engine.backward(engine(torch.randn(2, 32)).square().mean())
        engine.step()
    engine.save_checkpoint(disk_dir / "ckpt")
    copied = []
    put = DirectSafetensorsWriter._put
    monkeypatch.setattr(DirectSafetensorsWriter, "_put", lambda self, raw: (copied.append(raw.numel()), put(self, raw)))
    convert_zero_checkpoint_to_fp32_state_dict(disk_dir / "ckpt", disk_dir / "out", dtype=DTYPES[dtype])
    with safe_open(disk_dir / "out" / "model.safetensors", framework="pt") as f:
        weights = {name: f.get_tensor(name) for name in f.keys()}
    expected = {name: value.to(DTYPES[dtype]) for name, value in engine.full_parameters()}
    assert weights.keys() == expected.keys() and all(torch.equal(weights[n], expected[n]) for n in expected)
    if dtype == "fp32":
        assert sum(copied) == 4096  # the header, padded to a page
    engine.close()


def test_deepspeed_functions_return_the_engines_fp32_weights(disk_dir):
    engine = trained(disk_dir)
    weights = full(engine)
    state = get_fp32_state_dict_from_zero_checkpoint(disk_dir / "ckpt")
    assert set(state) == {n for n, _ in gpt2(0.0).named_parameters()} | {"lm_head.weight"}
    assert all(torch.equal(state[name], value) for name, value in weights.items())
    assert state["lm_head.weight"] is state["transformer.wte.weight"]  # tied: every name, one tensor
    model = load_state_dict_from_zero_checkpoint(gpt2(0.0), disk_dir / "ckpt", tag="global_step3")
    assert torch.equal(logits(model, gpt2_batches(1)[0]), logits(engine, gpt2_batches(1)[0]))
    assert convert_zero_checkpoint_to_fp32_state_dict(disk_dir / "ckpt", disk_dir / "single") is None
    assert sorted(os.listdir(disk_dir / "single")) == ["config.json", "generation_config.json", "model.safetensors"]
    engine.close()


def test_bf16_checkpoint_consolidates_its_fp32_masters(disk_dir):
    engine = trained(disk_dir, bf16=True)
    weights = full(engine)  # bf16
    state = get_fp32_state_dict_from_zero_checkpoint(disk_dir / "ckpt")
    assert all(state[n].dtype == torch.float32 for n in weights)
    assert all(torch.equal(state[n].to(torch.bfloat16), w) for n, w in weights.items())  # the masters, rounded
    assert any(not torch.equal(state[n], w.float()) for n, w in weights.items())  # ... and not the bf16 weights
    assert checkpoint_command(["consolidate", str(disk_dir / "ckpt"), str(disk_dir / "bf"), "--dtype", "bf16",
                               "--no-progress"]) == 0
    model = transformers.AutoModelForCausalLM.from_pretrained(disk_dir / "bf")
    assert model.dtype == torch.bfloat16
    assert all(torch.equal(model.state_dict()[n], w) for n, w in weights.items())
    engine.close()


@pytest.mark.subprocess
def test_each_checkpoint_carries_a_zero_to_fp32_script(disk_dir):
    engine = trained(disk_dir)
    script = disk_dir / "ckpt" / "global_step3" / "zero_to_fp32.py"
    done = subprocess.run([sys.executable, str(script), str(disk_dir / "weights"), "--no-progress"],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    model = transformers.AutoModelForCausalLM.from_pretrained(disk_dir / "weights")
    assert torch.equal(logits(model, gpt2_batches(1)[0]), logits(engine, gpt2_batches(1)[0]))
    engine.close()


def test_consolidate_takes_a_tag_folder_and_writes_the_generation_config(disk_dir, monkeypatch):
    """`consolidate SAVE_DIR/global_step3 OUT` (a tag folder, which verify takes) consolidates that tag; the
    output holds generation_config.json beside config.json, as save_pretrained writes it."""
    engine = trained(disk_dir)
    engine.module.generation_config.max_new_tokens = 7  # a setting of the model's own, not a default
    engine.save_checkpoint(disk_dir / "ckpt", tag="custom")
    monkeypatch.chdir(disk_dir)  # the tag folder named by a relative path too
    assert checkpoint_command(["consolidate", "ckpt/custom/", str(disk_dir / "out"), "--no-progress"]) == 0
    model = transformers.AutoModelForCausalLM.from_pretrained(disk_dir / "out")
    assert torch.equal(logits(model, gpt2_batches(1)[0]), logits(engine, gpt2_batches(1)[0]))
    assert json.loads((disk_dir / "out" / "generation_config.json").read_text())["max_new_tokens"] == 7
    assert model.generation_config.max_new_tokens == 7
    engine.close()


def test_consolidate_takes_the_generation_config_a_trainer_wrote_beside_an_older_tag(disk_dir, monkeypatch):
    """A checkpoint saved before the tag carried generation_config.json: the one transformers' Trainer
    wrote in the checkpoint-<step> folder (the save_dir) goes into the output."""
    import offload.train.checkpoint.rank_state as rank_state

    monkeypatch.setattr(rank_state, "_generation_config", lambda model: None)
    engine = trained(disk_dir)
    assert not (disk_dir / "ckpt" / "global_step3" / "generation_config.json").exists()
    (disk_dir / "ckpt" / "generation_config.json").write_text(json.dumps({"max_new_tokens": 9}))
    assert checkpoint_command(["consolidate", str(disk_dir / "ckpt"), str(disk_dir / "out"), "--no-progress"]) == 0
    assert json.loads((disk_dir / "out" / "generation_config.json").read_text()) == {"max_new_tokens": 9}
    engine.close()


def test_a_checkpoint_with_other_param_groups_names_them_and_load_module_only(disk_dir):
    """OffloadTrainer's checkpoint (two param groups: decay, no decay) into a bare engine (one group): the
    error says so and names load_module_only=True, which then loads the weights."""
    config = engine_config(disk_dir, "nvme", "nvme", micro=2)
    model = gpt2(0.0)
    groups = [{"params": [p for p in model.parameters() if p.dim() > 1]},
              {"params": [p for p in model.parameters() if p.dim() <= 1], "weight_decay": 0.0}]
    engine, *_ = initialize(model=model, model_parameters=groups, config=config)
    for batch in gpt2_batches(2):
        engine.backward(gpt2_loss(engine, batch))
        engine.step()
    engine.save_checkpoint(disk_dir / "ckpt")
    weights = full(engine)
    engine.close()
    bare, *_ = initialize(model=gpt2(0.0), config=engine_config(disk_dir, "nvme", "nvme", micro=2))
    with pytest.raises(ValueError) as raised:
        bare.load_checkpoint(disk_dir / "ckpt")
    message = str(raised.value)
    assert message.startswith(f"{disk_dir / 'ckpt' / 'global_step2' / 'rank00000_states.json'}: the checkpoint's "
                              f"optimizer has 2 param group(s) of [{len(groups[0]['params'])}, "
                              f"{len(groups[1]['params'])}] parameters, this engine's 1 of ")
    assert "transformers' Trainer and OffloadTrainer save two" in message and "load_module_only=True" in message
    assert "\n" not in message
    bare.load_checkpoint(disk_dir / "ckpt", load_module_only=True)
    assert all(torch.equal(value, weights[name]) for name, value in bare.full_parameters())
    bare.close()


@pytest.mark.subprocess
def test_consolidate_command_errors_are_one_line(disk_dir):
    missing = disk_dir / "nothing"
    done = subprocess.run([sys.executable, "-m", "offload.checkpoint", "consolidate", str(missing), str(disk_dir / "o")],
                          capture_output=True, text=True)
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr
    assert f"checkpoint directory {missing} does not exist" in done.stderr
    debug = subprocess.run([sys.executable, "-m", "offload.checkpoint", "consolidate", str(missing), str(disk_dir / "o"),
                            "--debug"], capture_output=True, text=True)
    assert "Traceback" in debug.stderr and "FileNotFoundError" in debug.stderr


# ---- save_16bit_model -----------------------------------------------------------------------------

@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_save_16bit_model_is_loaded_by_from_pretrained_as_written(disk_dir, bf16):
    engine = trained(disk_dir, bf16=bf16, save=False)
    assert engine.save_16bit_model(disk_dir / "hf")
    model = transformers.AutoModelForCausalLM.from_pretrained(disk_dir / "hf")  # no hand work: config.json, format pt
    assert model.dtype == (torch.bfloat16 if bf16 else torch.float32)
    assert torch.equal(logits(model, gpt2_batches(1)[0]), logits(engine, gpt2_batches(1)[0]))
    engine.close()


# ---- a failed load ---------------------------------------------------------------------------------

def _truncate(path, keep: int) -> None:
    with open(path, "r+b") as file:
        file.truncate(keep)


@pytest.mark.parametrize("damage", ["truncated optimizer", "missing optimizer", "empty params", "truncated states"])
def test_a_failed_load_names_the_file_and_leaves_the_engine_as_it_was(disk_dir, damage):
    engine = trained(disk_dir, steps=2)  # saved after 2 steps
    tag = disk_dir / "ckpt" / "global_step2"
    batch = gpt2_batches(3)[2]
    engine.backward(gpt2_loss(engine, batch))
    engine.step()
    before, steps = full(engine), engine.global_steps
    victim = {"truncated optimizer": tag / "rank00000_optimizer.safetensors",
              "missing optimizer": tag / "rank00000_optimizer.safetensors",
              "empty params": tag / "rank00000_params.safetensors",
              "truncated states": tag / "rank00000_states.json"}[damage]
    if damage == "missing optimizer":
        victim.unlink()
        error = FileNotFoundError
    elif damage == "empty params":
        _truncate(victim, 0)
        error = SafetensorsError
    elif damage == "truncated states":
        _truncate(victim, victim.stat().st_size // 2)
        error = ChecksumError  # its own checksum no longer matches
    else:
        _truncate(victim, victim.stat().st_size - 100)
        error = SafetensorsError
    with pytest.raises(error, match=str(victim)):
        engine.load_checkpoint(disk_dir / "ckpt")
    after = full(engine)
    assert engine.global_steps == steps == 3
    assert all(torch.equal(after[n], t) for n, t in before.items())
    # ... and it trains on as if the call had not happened: the same step as an engine never asked to load
    (disk_dir / "twin").mkdir()
    twin = trained(disk_dir / "twin", steps=4, save=False)
    engine.backward(gpt2_loss(engine, gpt2_batches(4)[3]))
    engine.step()
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(engine.full_parameters(), twin.full_parameters()))
    engine.save_checkpoint(disk_dir / "again")  # not refused
    twin.close()
    engine.close()


def test_a_load_that_fails_part_way_leaves_the_engine_as_it_was(disk_dir, monkeypatch):
    """The load stages what it reads (inactive swap slots, copies of what is in memory) and commits only once
    every part is in: an optimizer state that fails to load after the parameters were read leaves the
    parameters of the step the engine was at, and the engine steps and saves; a good load then gives step 2."""
    engine = trained(disk_dir, steps=2)
    good = full(engine)
    engine.backward(gpt2_loss(engine, gpt2_batches(3)[2]))
    engine.step()
    before = full(engine)

    def broken(*args, **kwargs):
        raise OSError(5, "Input/output error (injected)")
    with monkeypatch.context() as patch:
        patch.setattr(engine.optimizer, "load_state", broken)  # after the parameters were read
        with pytest.raises(OSError, match="injected"):
            engine.load_checkpoint(disk_dir / "ckpt")
    assert engine.global_steps == 3 and all(torch.equal(t, before[n]) for n, t in engine.full_parameters())
    engine.backward(gpt2_loss(engine, gpt2_batches(4)[3]))
    engine.step()
    engine.save_checkpoint(disk_dir / "other")
    engine.load_checkpoint(disk_dir / "ckpt")
    assert engine.global_steps == 2 and all(torch.equal(t, good[n]) for n, t in engine.full_parameters())
    engine.backward(gpt2_loss(engine, gpt2_batches(3)[2]))
    engine.step()
    engine.close()


# ---- the O_DIRECT safetensors writer the consolidation writes with ------------------------------------

def test_direct_safetensors_writer_writes_what_the_buffered_one_writes(disk_dir):
    from tensorio import AioHandle

    from offload.storage import SafetensorsWriter
    from offload.storage.safetensors_writer import DirectSafetensorsWriter

    tensors = {"a": torch.randn(3, 5000), "b": torch.arange(7, dtype=torch.int64), "c": torch.randn(70001).bfloat16()}
    layout = {name: (t.dtype, t.shape) for name, t in tensors.items()}
    with SafetensorsWriter(disk_dir / "buffered.safetensors", layout, {"format": "pt"}) as out:
        for name, t in tensors.items():
            out.write(name, t)
    with AioHandle() as handle:
        with DirectSafetensorsWriter(disk_dir / "direct.safetensors", layout, {"format": "pt"}, handle,
                                     chunk_bytes=8192) as out:
            out.write("a", tensors["a"][:1])  # a tensor in runs, in order
            out.write("a", tensors["a"][1:])
            out.write("b", tensors["b"])
            out.write("c", tensors["c"])
        assert (disk_dir / "direct.safetensors").read_bytes() == (disk_dir / "buffered.safetensors").read_bytes()
        with pytest.raises(ValueError, match=r"tensor 'b' written out of order; next is a"):
            with DirectSafetensorsWriter(disk_dir / "bad.safetensors", layout, None, handle) as out:
                out.write("b", tensors["b"])
        with pytest.raises(ValueError, match=r"closed before tensor 'c' was written whole"):
            with DirectSafetensorsWriter(disk_dir / "short.safetensors", layout, None, handle) as out:
                out.write("a", tensors["a"])
                out.write("b", tensors["b"])


def test_direct_safetensors_writer_converts_and_writes_aligned_runs_from_where_they_are(disk_dir):
    """Values of another float dtype are converted on the way (an element may straddle the chunks);
    a page-aligned run is written from the caller's buffer, which stays held until the writer is
    closed (a pooled buffer is not handed out again meanwhile); the file is the buffered writer's."""
    from safetensors import safe_open
    from tensorio import AioHandle, BufferPool

    from offload.storage import SafetensorsWriter
    from offload.storage.safetensors_writer import DirectSafetensorsWriter

    pool = BufferPool(64 << 20)
    aligned = pool.take(3 * 4096, torch.float32)
    aligned.copy_(torch.randn(aligned.numel()))
    tensors = {"u": torch.arange(3, dtype=torch.uint8), "w": torch.randn(5001, dtype=torch.float64),
               "h": torch.randn(4099), "p": aligned}
    layout = {"u": (torch.uint8, (3,)), "w": (torch.float32, (5001,)), "h": (torch.bfloat16, (4099,)),
              "p": (torch.float32, (3 * 4096,))}
    with SafetensorsWriter(disk_dir / "buffered.safetensors", layout, {"format": "pt"}, data_align=4096) as out:
        for name, (dtype, _) in layout.items():
            out.write(name, tensors[name].to(dtype))
    expected = aligned.clone()
    with AioHandle() as handle:
        with DirectSafetensorsWriter(disk_dir / "direct.safetensors", layout, {"format": "pt"}, handle,
                                     chunk_bytes=8192, data_align=4096) as out:
            for name in ("u", "w", "h", "p"):  # "h" ends unaligned in the file: "p" goes through the chunks
                out.write(name, tensors[name])
        assert (disk_dir / "direct.safetensors").read_bytes() == (disk_dir / "buffered.safetensors").read_bytes()
        layout = {"p": (torch.float32, (3 * 4096,)), "q": (torch.float32, (4096,))}
        with DirectSafetensorsWriter(disk_dir / "held.safetensors", layout, None, handle, data_align=4096) as out:
            out.write("p", aligned)
            pointer = aligned.data_ptr()
            del aligned, tensors
            other = pool.take(3 * 4096, torch.float32)  # the writer still holds the first buffer
            assert other.data_ptr() != pointer
            out.write("q", torch.ones(4096))
        with safe_open(disk_dir / "held.safetensors", framework="pt") as f:
            assert torch.equal(f.get_tensor("p"), expected)
            assert torch.equal(f.get_tensor("q"), torch.ones(4096))
        with pytest.raises(ValueError, match=r"tensor 'q' is torch.float32, got torch.int64 values"):
            with DirectSafetensorsWriter(disk_dir / "bad.safetensors", layout, None, handle) as out:
                out.write("p", torch.zeros(3 * 4096))
                out.write("q", torch.zeros(4096, dtype=torch.int64))
