"""KV cache offload: tokens with the cache on NVMe equal tokens with it in memory; the plan places it;
bad settings are clear errors."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from offload.infer import init_inference
from offload.infer.config import InferenceConfig
from offload.infer.kv.cache import CACHE_KEYWORD, OffloadedKVCache
from offload.infer.plan.host import BudgetError, UnitSize, place_kv
from tensorio import AioHandle

from test_infer_generate import PAD, build_model, one_thread, prompts, save_checkpoint, scratch_dir  # noqa: F401

NEW_TOKENS = 80  # past a page of tokens for every layer (32 at batch 1 in fp32, 64 in bf16): reads and writes happen


@pytest.fixture(scope="module")
def llama():
    """dtype -> (checkpoint directory, the in-memory model)."""
    root = scratch_dir("infer-kv-")
    built = {}
    for dtype in (torch.float32, torch.bfloat16):
        model = build_model("llama", dtype, num_hidden_layers=5)
        built[dtype] = (save_checkpoint(model, root / str(dtype)[6:]), model)
    yield built
    shutil.rmtree(root, ignore_errors=True)


def generate(engine, batch: int):
    ids, mask = prompts(batch)
    return engine.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, pad_token_id=PAD, do_sample=False)


def leftovers(directory) -> list[str]:
    return [name for name in os.listdir(directory) if name.startswith("offload-kv-")]


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kv", [{"device": "nvme"}, {"device": "nvme", "cpu_percent": 40, "buffer_count": 1}],
                         ids=["all-nvme", "40pct-cpu-one-buffer"])
def test_tokens_with_cache_on_nvme_equal_tokens_with_cache_in_memory(llama, dtype, batch, kv):
    directory, model = llama[dtype]
    with init_inference(directory, disk_gbps=1.0, kv_offload="cpu") as engine:
        in_memory = generate(engine, batch)
        assert engine.plan.kv.nvme_layers == ()
    with init_inference(directory, disk_gbps=1.0, kv_offload=kv) as engine:
        on_nvme = generate(engine, batch)
        placement = engine.plan.kv
        assert len(placement.nvme_layers) == (5 if "cpu_percent" not in kv else 3)
        assert engine.kv_bytes_read > 0 and engine.kv_bytes_written > 0
    assert on_nvme.tolist() == in_memory.tolist()
    if dtype == torch.float32:  # and transformers' own DynamicCache (in bf16, near ties part over 88 tokens)
        ids, mask = prompts(batch)
        with torch.no_grad():
            ref = model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, pad_token_id=PAD, do_sample=False)
        assert on_nvme.tolist() == ref.tolist()
    assert leftovers(directory) == []  # the cache's files are gone after generate


def test_auto_puts_on_nvme_only_what_the_budget_cannot_hold(llama):
    directory, _ = llama[torch.float32]
    with init_inference(directory, device="cpu", disk_gbps=1.0) as probe:
        required = sum(u.nbytes for u in probe.units if not u.streamable)
        layer = probe.kv_bytes(4, 8 + NEW_TOKENS) // 5
    # Room for the weights that must stay, a ring of 2 layers' caches and 1 layer in memory: 4 layers go to NVMe.
    budget = required + 3 * layer + layer // 2
    with init_inference(directory, disk_gbps=1.0, max_in_cpu=f"{budget}B") as engine:
        plan = engine.reserve(4, 8 + NEW_TOKENS)
        assert len(plan.kv.nvme_layers) == 4 and plan.kv.memory_layers == 1
        assert plan.kv_bytes == 3 * layer  # one layer plus the ring of two
        assert "KV on NVMe" in plan.describe() and "4 of 5 layers" in plan.describe()
        plan = engine.reserve(1, 8 + NEW_TOKENS)  # a quarter of the cache: it fits in memory again
        assert plan.kv.nvme_layers == ()
        ids, mask = prompts(4)
        ours = engine.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, pad_token_id=PAD, do_sample=False)
        assert engine.plan.kv.nvme_layers and engine.kv_bytes_read > 0
    with init_inference(directory, disk_gbps=1.0, max_in_cpu="1GiB") as engine:
        assert ours.tolist() == generate(engine, 4).tolist()


def test_place_kv_spreads_the_layers_and_says_when_nothing_fits():
    units = [UnitSize("embed", 1000, 1000, 1000, False)]
    auto = dict(layers=8, layer_nbytes=100, device="auto", cpu_percent=None, buffer_count=2)
    assert place_kv(units, budget=1000 + 800, **auto).nvme_layers == ()
    assert place_kv(units, budget=None, **auto).nvme_layers == ()
    placement = place_kv(units, budget=1000 + 450, **auto)  # ring 200, 2 layers in memory
    assert placement.memory_layers == 2 and set(range(8)) - set(placement.nvme_layers) == {0, 4}
    assert placement.memory_bytes == 400 and placement.nvme_bytes == 600
    nvme = dict(auto, device="nvme")
    assert len(place_kv(units, budget=0, **dict(nvme, cpu_percent=50)).nvme_layers) == 4
    assert len(place_kv(units, budget=0, **nvme).nvme_layers) == 8
    with pytest.raises(BudgetError, match=r"max_in_cpu: .* plus a KV cache of 800 B for batch 2 x 9 tokens; .* its "
                                          r"read-ahead ring of 2 x 100 B, .* needs a budget of 1.2 KiB; "
                                          r"kv_offload.buffer_count 1 halves it"):
        place_kv(units, budget=1000 + 150, kv_shape=(2, 9), **auto)


@pytest.mark.parametrize("value, message", [
    ({"device": "disk"}, r"kv_offload.device: 'disk' is not allowed"),
    ({"cpu_percent": 10}, r"kv_offload.cpu_percent: only with device \"nvme\""),
    ({"device": "nvme", "cpu_percent": 101}, r"kv_offload.cpu_percent: 101 is not allowed"),
    ({"device": "nvme", "buffer_count": 0}, r"kv_offload.buffer_count: 0 is not allowed"),
    ({"device": "nvme", "where": "disk"}, r"kv_offload.where: unknown key"),
    ("tape", r"kv_offload.device: 'tape' is not allowed"),
])
def test_bad_kv_offload_settings_are_named(value, message):
    with pytest.raises(ValueError, match=message):
        InferenceConfig.from_dict({"kv_offload": value})


def test_missing_cache_directory_is_named(llama):
    directory, _ = llama[torch.float32]
    missing = os.path.join(directory, "no-such-dir")
    with init_inference(directory, disk_gbps=1.0, kv_offload={"device": "nvme", "nvme_path": missing}) as engine:
        with pytest.raises(FileNotFoundError, match=r"kv_offload.nvme_path: .*no-such-dir is not a directory"):
            generate(engine, 1)


def test_cache_refuses_tokens_past_its_length_and_beam_search(llama):
    _, model = llama[torch.float32]
    root = scratch_dir("infer-kv-cache-")
    ids, mask = prompts(1)
    try:
        with AioHandle() as handle:
            with OffloadedKVCache(5, [1, 3], handle, root, max_tokens=8 + 4) as cache:
                with pytest.raises(ValueError, match=r"kv_offload: layer 1's cache holds 12 tokens .* 13 are asked"):
                    model.generate(ids, attention_mask=mask, max_new_tokens=6, pad_token_id=PAD, do_sample=False,
                                   **{CACHE_KEYWORD: cache})
            with OffloadedKVCache(5, [1, 3], handle, root, max_tokens=8 + 6) as cache:
                with pytest.raises(NotImplementedError, match=r"kv_offload: .*beam search"):
                    model.generate(ids, attention_mask=mask, max_new_tokens=6, pad_token_id=PAD, num_beams=2,
                                   **{CACHE_KEYWORD: cache})
        assert os.listdir(root) == []
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_command_line_puts_the_cache_on_nvme(llama):
    import io

    from offload.infer.cli import main

    directory, model = llama[torch.float32]
    out = io.StringIO()
    ids = [5, 17, 99, 3]
    figures = main([str(directory), "--prompt-ids", ",".join(map(str, ids)), "--max-new-tokens", "40",
                    "--kv-offload", "nvme", "--kv-cpu-percent", "40", "--disk-gbps", "1.0"], out=out)
    assert "KV on NVMe" in out.getvalue() and figures["kv_nvme_layers"] == 3
    assert figures["kv_bytes_read"] > 0 and figures["kv_bytes_written"] > 0
    prompt = torch.tensor([ids])
    with torch.no_grad():
        ref = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=40, do_sample=False,
                             pad_token_id=PAD)
    assert figures["tokens"] == ref[0, len(ids):].tolist()


@pytest.mark.parametrize("kv", ["cpu", "nvme"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_block_schedule_micro_batches_give_the_same_tokens(llama, dtype, kv):
    """A left-padded batch of 4 through each layer as 2 micro-batches of 2 (and as 4 of 1), the cache
    in memory or on NVMe: the tokens of the whole batch at once; each layer read once per step."""
    directory, _ = llama[dtype]
    with init_inference(directory, disk_gbps=1.0, max_in_cpu=0, kv_offload="cpu") as engine:
        whole = generate(engine, 4)
        reads_whole = engine.io_bytes()
    for size in (2, 1):
        with init_inference(directory, disk_gbps=1.0, max_in_cpu=0, kv_offload=kv,
                            block_schedule={"micro_batch_size": size}) as engine:
            micro = generate(engine, 4)
            assert engine.plan.kv.micro_batches == 4 // size
            assert f"block schedule: batch 4 as {4 // size} micro-batches of {size}" in engine.plan.describe()
            assert engine.io_bytes() == reads_whole  # the weights are read once per step for all micro-batches
            assert all("forward" not in layer.__dict__ for layer in engine.schedule.layers)  # unwrapped after
        assert micro.tolist() == whole.tolist()


def test_block_schedule_auto_sizes_micro_batches_to_the_activation_limit(llama):
    directory, _ = llama[torch.float32]
    with init_inference(directory, disk_gbps=1.0) as probe:
        two = probe.activation_bytes(2, 8 + NEW_TOKENS)  # a batch's mask is counted from 2 sequences on
    with init_inference(directory, disk_gbps=1.0, block_schedule={"max_activation_bytes": two + 1}) as engine:
        assert engine.reserve(6, 8 + NEW_TOKENS).kv.micro_batches == 3  # 2 sequences fit the limit
        assert engine.reserve(5, 8 + NEW_TOKENS).kv.micro_batches == 5  # 5 is prime: micro-batches of 1
        assert engine.reserve(1, 8 + NEW_TOKENS).kv.micro_batches == 1
    with init_inference(directory, disk_gbps=1.0, block_schedule={"micro_batch_size": 4}) as engine:
        assert engine.reserve(6, 8 + NEW_TOKENS).kv.micro_batches == 2  # 4 lowered to a divisor of 6: 3


@pytest.mark.parametrize("value, message", [
    ({"micro_batch_size": 0}, r"block_schedule.micro_batch_size: 0 is not allowed"),
    ({"max_activation_bytes": "lots"}, r"block_schedule.max_activation_bytes: 'lots' is not a size"),
    ({"micro_batches": 2}, r"block_schedule.micro_batches: unknown key"),
])
def test_bad_block_schedule_settings_are_named(value, message):
    with pytest.raises(ValueError, match=message):
        InferenceConfig.from_dict({"block_schedule": value})


def test_command_line_runs_the_block_schedule(llama):
    import io

    from offload.infer.cli import main

    directory, model = llama[torch.float32]
    out = io.StringIO()
    figures = main([str(directory), "--prompt-ids", "5,17,99,3", "--max-new-tokens", "6", "--batch-size", "4",
                    "--micro-batch-size", "2", "--kv-offload", "nvme", "--disk-gbps", "1.0"], out=out)
    assert "block schedule: batch 4 as 2 micro-batches of 2" in out.getvalue()
    prompt = torch.tensor([[5, 17, 99, 3]])
    with torch.no_grad():
        ref = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=6, do_sample=False,
                             pad_token_id=PAD)
    assert figures["tokens"] == ref[0, 4:].tolist()


def test_memory_holds_the_ring_while_the_files_hold_the_cache(llama):
    """Bounded memory: whatever the number of layers on NVMe, memory holds ``buffer_count`` buffers of
    one layer's cache (plus partial pages); the files hold every layer's written pages."""
    _, model = llama[torch.float32]
    root = scratch_dir("infer-kv-bound-")
    ids, mask = prompts(4)
    try:
        with AioHandle() as handle, OffloadedKVCache(5, range(5), handle, root, max_tokens=8 + NEW_TOKENS) as cache:
            with torch.no_grad():
                model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, pad_token_id=PAD, do_sample=False,
                               **{CACHE_KEYWORD: cache})
            ring = cache.ring
            layer_bytes = 2 * (8 + NEW_TOKENS) * ring.row_nbytes  # keys and values of one layer at the full length
            assert len(ring.buffers) == 2 and layer_bytes <= ring.buffer_nbytes < layer_bytes + 2 * 4096
            files = sorted(os.listdir(ring.directory))
            assert len(files) == 5
            flushed = cache.layers[0].flushed
            assert flushed == (8 + NEW_TOKENS - 1) // ring.page_tokens * ring.page_tokens > 0
            for name in files:  # each file: the keys' region, then the values' written pages
                assert os.path.getsize(os.path.join(ring.directory, name)) == ring.region_nbytes + flushed * ring.row_nbytes
            assert all(layer.length - layer.flushed < ring.page_tokens for layer in cache.layers)
        assert os.listdir(root) == []
    finally:
        shutil.rmtree(root, ignore_errors=True)
