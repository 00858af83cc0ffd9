"""Every error of `init_inference` by name: checkpoint files, tensors, shapes, budgets, settings."""

from __future__ import annotations

import json
import os
import shutil
import threading
from pathlib import Path

import pytest
import torch
from test_infer_generate import (
    NEW_TOKENS,
    PAD,
    build_model,
    one_thread,  # noqa: F401 - the module's autouse fixture
    prompts,
    saved_model,
    tight_budget,
)

from offload.infer import BudgetError, CheckpointMismatchError, InferenceConfig, init_inference
from offload.storage.safetensors_reader import SafetensorsError
from tensorio import TensorIOError


@pytest.fixture(scope="module")
def pristine():
    """A small sharded Llama checkpoint; tests copy it before breaking it."""
    yield from saved_model("llama")


@pytest.fixture
def checkpoint(pristine, disk_dir):
    copy = disk_dir / "ckpt"
    shutil.copytree(pristine[0], copy)
    return copy


def _shards(directory: Path) -> list[Path]:
    return sorted(directory.glob("model-*.safetensors"))


def _edit_config(directory: Path, **changes) -> None:
    path = directory / "config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


# ---- the checkpoint's files ------------------------------------------------------------------------


def test_missing_shard(checkpoint):
    victim = _shards(checkpoint)[2]
    victim.unlink()
    with pytest.raises(FileNotFoundError, match=rf"{victim.name} is missing; .*model\.safetensors\.index\.json lists it"):
        init_inference(checkpoint)


def test_truncated_shard(checkpoint):
    victim = _shards(checkpoint)[1]
    os.truncate(victim, victim.stat().st_size - 100)
    with pytest.raises(SafetensorsError, match=rf"{victim.name} is truncated: it is \d+ bytes long, but its header places"):
        init_inference(checkpoint)


def test_no_config_json(checkpoint):
    (checkpoint / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="no config.json"):
        init_inference(checkpoint)


@pytest.mark.parametrize("while_loading", [False, True], ids=["loaded", "while-loading"])
def test_shard_truncated_while_generating_raises_and_the_engine_recovers(checkpoint, pristine, monkeypatch,
                                                                        while_loading):
    """The last shard holds streamed layers and the resident final norm. Truncated after the resident
    weights are in, or before the background load has read them (held until then): generating raises
    naming the file, and once the file is back the next generation is exact."""
    from offload.infer.stream import streamer as stream

    victim, truncated, read_windows = _shards(checkpoint)[-1], threading.Event(), stream.read_windows

    def load_reads_victim_once_truncated(handle, windows, buffer):
        if threading.current_thread().name == "load-resident" and any(w.path == str(victim) for w in windows):
            assert truncated.wait(timeout=120)  # an event, with a guard against a hang
        return read_windows(handle, windows, buffer)

    budget = tight_budget(checkpoint)
    if while_loading:
        monkeypatch.setattr(stream, "read_windows", load_reads_victim_once_truncated)
    with init_inference(checkpoint, max_in_cpu=budget, disk_gbps=1.0) as engine:
        files = {unit.name: {engine.checkpoint[ref.tensor].path for ref in unit.params} for unit in engine.units}
        assert any(str(victim) in files[unit.name] for unit in engine.plan.streamed)
        assert any(str(victim) in files[name] for name in engine.plan.resident)
        if not while_loading:
            engine.wait_loaded()
        saved = victim.read_bytes()
        os.truncate(victim, 4096)
        truncated.set()
        ids, mask = prompts(1)
        with pytest.raises(TensorIOError, match=rf"short read.*{victim.name}"):
            engine.generate(ids, attention_mask=mask, max_new_tokens=4, pad_token_id=PAD, do_sample=False)
        victim.write_bytes(saved)  # the file is back: the next call works, from a clean ring
        ours = engine.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, pad_token_id=PAD, do_sample=False)
        engine.wait_loaded()
        assert {u.name for u in engine.units if u.state == "resident"} == set(engine.plan.resident)
    with torch.no_grad():
        expected = pristine[1].generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, pad_token_id=PAD,
                                        do_sample=False)
    assert ours.tolist() == expected.tolist()


# ---- the checkpoint against the model ------------------------------------------------------------------


def test_tensor_the_model_lacks(checkpoint):
    _edit_config(checkpoint, num_hidden_layers=3)
    with pytest.raises(CheckpointMismatchError, match=r"tensor 'model\.layers\.3\.[a-z_.]+' in .*model-\d+-of-\d+\.safetensors "
                                                      r"has no parameter or buffer in LlamaForCausalLM"):
        init_inference(checkpoint)


def test_parameter_missing_from_the_checkpoint(checkpoint):
    _edit_config(checkpoint, num_hidden_layers=5)
    with pytest.raises(CheckpointMismatchError, match=r"parameter 'model\.layers\.4\.[a-z_.]+' of LlamaForCausalLM "
                                                      r"\(model_type 'llama'\) is not in the checkpoint"):
        init_inference(checkpoint)


def test_shape_mismatch(checkpoint):
    _edit_config(checkpoint, intermediate_size=96)
    with pytest.raises(CheckpointMismatchError, match=r"tensor 'model\.layers\.0\.mlp\.[a-z_]+\.weight' in .* has shape "
                                                      r"\[\d+, \d+\], but parameter .* has shape \[\d+, \d+\]"):
        init_inference(checkpoint)


def test_model_not_on_meta_is_refused(checkpoint, pristine):
    with pytest.raises(ValueError, match="not on the meta device"):
        init_inference(build_model("llama"), checkpoint=checkpoint)


# ---- budgets and buffers ------------------------------------------------------------------------


def test_budget_smaller_than_what_must_stay(checkpoint):
    with pytest.raises(BudgetError, match=r"max_in_cpu: the budget of 10\.0 KiB cannot hold the weights that must stay "
                                          r"in memory \(64\.2 KiB: model\.embed_tokens, model\.norm\); raise max_in_cpu "
                                          r"to at least 64\.3 KiB"):
        init_inference(checkpoint, max_in_cpu="10KiB")


def test_buffer_smaller_than_the_largest_layer(checkpoint):
    with pytest.raises(BudgetError, match=r"buffer_size: a buffer of 4\.0 KiB cannot hold 'model\.layers\.\d+', which is "
                                          r"streamed and needs [\d.]+ KiB"):
        init_inference(checkpoint, max_in_cpu="70KiB", buffer_size=1024)


def test_batch_and_length_that_do_not_fit_are_refused_up_front(checkpoint):
    with init_inference(checkpoint, max_in_cpu=tight_budget(checkpoint, 1), disk_gbps=1.0) as engine:
        read = engine.io_bytes()
        ids, mask = prompts(4)
        with pytest.raises(BudgetError, match=r"plus a KV cache of [\d.]+ KiB for batch 4 x 24 tokens; raise max_in_cpu to "
                                              r"at least [\d.]+ KiB or lower the batch size"):
            engine.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, pad_token_id=PAD)
        assert engine.io_bytes() == read  # refused before any forward


def test_a_length_that_does_not_fit_names_the_most_that_does(checkpoint):
    """The refusal gives the longest length that fits at that batch, and that length does fit (one more
    does not); the plan is left as it was."""
    import re

    with init_inference(checkpoint, max_in_cpu=tight_budget(checkpoint, 1), disk_gbps=1.0) as engine:
        plan = engine.plan
        with pytest.raises(BudgetError, match=r"for batch 4 x 4096 tokens.*\. At batch 4 at most [\d,]+ tokens fit "
                                              r"\(prompt and new tokens together\)$") as refused:
            engine.reserve(4, 4096)
        assert engine.plan is plan
        most = int(re.search(r"at most ([\d,]+) tokens fit", str(refused.value)).group(1).replace(",", ""))
        assert 0 < most < 4096
        with pytest.raises(BudgetError, match=f"for batch 4 x {most + 1} tokens"):
            engine.reserve(4, most + 1)
        assert engine.reserve(4, most).kv_shape == (4, most)


def test_no_length_fits_where_not_even_one_token_does(checkpoint):
    with init_inference(checkpoint, device="cpu", disk_gbps=1.0) as engine:
        with pytest.raises(BudgetError, match=r"more than this machine's .*\. No length fits at batch 100000000$"):
            engine.reserve(100_000_000, 16)


def test_more_than_the_machine_has_is_refused(checkpoint):
    with init_inference(checkpoint, device="cpu", disk_gbps=1.0) as engine:
        with pytest.raises(BudgetError, match=r"batch 100000 x 100000 tokens needs [\d.]+ TiB of memory .* more than this "
                                              r"machine's"):
            engine.reserve(100_000, 100_000)


def test_other_dtype_streamed_without_nvme_path(checkpoint):
    with pytest.raises(ValueError, match=r"offload_param\.nvme_path: dtype torch\.bfloat16 differs from the checkpoint's "
                                         r"\(torch\.float32\)"):
        init_inference(checkpoint, dtype="bf16", max_in_cpu="50KiB")


# ---- settings -----------------------------------------------------------------------------------


@pytest.mark.parametrize("config, overrides, message", [
    ({"zero_optimization": {"offload_param": {"device": "nvme", "max_in_cpu": 1, "bogus": 1}}}, {},
     r"zero_optimization\.offload_param\.bogus: unknown key"),
    ({"zero_optimization": {"offload_param": {"device": "gpu"}}}, {}, r"offload_param\.device: 'gpu' is not allowed"),
    ({"zero_optimization": {"offload_param": {"max_in_cpu": "lots"}}}, {}, r"offload_param\.max_in_cpu: 'lots' is not a size"),
    ({"zero_optimization": {"offload_param": {"buffer_count": 0}}}, {}, r"offload_param\.buffer_count: 0 is not allowed"),
    ({"zero_optimization": {"stage3_prefetch_bucket_size": -1}}, {}, r"stage3_prefetch_bucket_size: -1 is not allowed"),
    ({"zero_optimization": {"unknown_zero_key": 1}}, {}, r"zero_optimization\.unknown_zero_key: unknown key"),
    ({"optimizer": {}}, {}, r"^optimizer: unknown key"),
    ({"aio": {"block_size": 1000}}, {}, r"aio\.block_size: 1000 is not allowed"),
    ({"bf16": {"enabled": True}, "fp16": {"enabled": True}}, {}, r"bf16\.enabled, fp16\.enabled: more than one dtype"),
    ({}, {"dtype": "int8"}, r"dtype: 'int8' is not allowed"),
    ({}, {"max_in_cpu_bytes": 5}, r"max_in_cpu_bytes: unknown setting"),
])
def test_bad_settings_are_refused_naming_the_key(config, overrides, message):
    with pytest.raises(ValueError, match=message):
        InferenceConfig.from_dict(config, **overrides)


def test_deepspeed_inference_config_is_read(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({
        "bf16": {"enabled": True}, "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": 1e8, "offload_param": {
            "device": "nvme", "nvme_path": "/nvme", "pin_memory": True, "buffer_count": 4, "buffer_size": 1e8,
            "max_in_cpu": 1e9}},
        "aio": {"block_size": 1048576, "queue_depth": 16, "intra_op_parallelism": 2}}))
    config = InferenceConfig.from_dict(str(path), max_in_cpu="8GiB")
    assert config.dtype == torch.bfloat16 and config.buffer_count == 4 and config.buffer_size == 10**8
    assert config.prefetch_bucket_size == 10**8 and config.nvme_path == "/nvme"
    assert config.aio.queue_depth == 16 and config.aio.thread_count == 2
    assert config.budget_bytes(2) == 8 << 30
    assert InferenceConfig.from_dict({}).budget_bytes(2) == 2 * 10**9  # DeepSpeed's 1e9 elements
