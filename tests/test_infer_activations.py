"""The activation estimate follows how transformers allocates: SDPA (the default) never holds every head's
attention scores and generate keeps the last position's logits, so a long prompt is not refused for memory
it never takes; eager attention does hold them, and is counted. Measured in a fresh process (its peak RSS)
against the estimate plus the KV cache."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest


_CHILD = r'''
import json, resource, shutil, sys, tempfile
import psutil, torch, transformers
from offload.infer import init_inference
from benchmarks._common import high_water_mark, reset_high_water_mark
tokens, impl, root = int(sys.argv[1]), sys.argv[2], sys.argv[3]
torch.manual_seed(0)
config = transformers.LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=32,
                                  num_key_value_heads=8, vocab_size=32000, max_position_embeddings=65536)
transformers.AutoModelForCausalLM.from_config(config).to(torch.bfloat16).save_pretrained(root + "/llama")
ids = torch.randint(3, 32000, (1, tokens), generator=torch.Generator().manual_seed(1))
with init_inference(root + "/llama", disk_gbps=1.0, block_schedule={"max_activation_bytes": 1 << 36}) as engine:  # unchunked
    engine.module.config._attn_implementation = impl
    engine.generate(ids[:, :16], max_new_tokens=2, do_sample=False, pad_token_id=0)  # every lazy allocation made
    engine.wait_loaded()  # resident weights still loading in the background (a loaded machine) are not the growth
    # the kernel's high-water mark reset to the RSS now: a peak before (with the libraries' pages all in, which
    # memory pressure may have evicted since) does not hide the generate's; where it cannot be reset, ru_maxrss
    if reset_high_water_mark():
        base, high_water = psutil.Process().memory_info().rss, high_water_mark
    else:
        base = max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, psutil.Process().memory_info().rss)
        high_water = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    engine.generate(ids, max_new_tokens=2, do_sample=False, pad_token_id=0)
    peak = high_water()
    print(json.dumps({"growth": peak - base, "estimate": engine.activation_bytes(1, tokens + 2, logits=1),
                      "kv": engine.kv_bytes(1, tokens + 2),
                      "issue_16k": engine.activation_bytes(1, 16384, logits=1)}))
'''


@pytest.mark.subprocess
@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_the_estimate_bounds_a_long_prompts_peak(impl, disk_dir):
    run = subprocess.run([sys.executable, "-c", _CHILD, "2048", impl, str(disk_dir)], capture_output=True, text=True,
                         cwd=Path(__file__).resolve().parents[1])
    assert run.returncode == 0, run.stderr
    figures = json.loads(run.stdout.strip().splitlines()[-1])
    # an upper bound, as the plan needs, with the margin "auto" keeps beside it for the allocator's own (RSS grows
    # a few MiB past the tensors: docs/inference.md, "Memory bound")
    from offload.infer.activations import AUTO_PROCESS_MARGIN_BYTES

    assert figures["growth"] <= figures["estimate"] + figures["kv"] + AUTO_PROCESS_MARGIN_BYTES, figures
    if impl == "eager":  # every head's scores, held: the estimate is that, within 1.5x
        assert figures["estimate"] + figures["kv"] <= 1.5 * figures["growth"]
    else:  # tiled attention: a 16K-token prompt of this 32-head model takes well under a GiB
        assert figures["issue_16k"] < 1 << 30


def test_a_prompt_whose_activations_exceed_the_limit_is_prefilled_in_chunks(caplog):
    """One sequence's prefill over max_activation_bytes runs in chunks (transformers' prefill_chunk_size), each a
    forward that reads the streamed layers once: the tokens are the unchunked run's, and the forwards are the
    chunks' plus one per new token."""
    import logging
    import shutil

    import torch

    from offload.infer import init_inference
    from test_infer_generate import build_model, save_checkpoint, scratch_dir

    root = scratch_dir("infer-chunks-")
    try:
        model = build_model("llama", torch.float32)
        directory = save_checkpoint(model, root / "llama")
        ids = torch.randint(3, 256, (1, 64), generator=torch.Generator().manual_seed(3))
        with torch.no_grad():
            expected = model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0)
        with init_inference(directory, disk_gbps=1.0, max_in_cpu="200KiB") as probe:
            limit = probe.activation_bytes(1, 20, logits=1, context=72)  # room for a chunk of 16 to 20 tokens
        with init_inference(directory, disk_gbps=1.0, max_in_cpu="200KiB",
                            block_schedule={"max_activation_bytes": limit}) as engine:
            forwards = []
            engine.module.register_forward_pre_hook(lambda module, args, kwargs: forwards.append(
                (kwargs.get("input_ids") if kwargs.get("input_ids") is not None else args[0]).shape[-1]),
                with_kwargs=True)
            with caplog.at_level(logging.INFO, logger="offload.infer"):
                ours = engine.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0)
            assert engine.plan.streamed  # every chunk reads the streamed layers
    finally:
        shutil.rmtree(root, ignore_errors=True)
    assert ours.tolist() == expected.tolist()
    assert forwards == [16, 16, 16, 16] + [1] * 7
    assert "prefilling the 64-token prompt in chunks of 16 tokens" in caplog.text


@pytest.mark.simulated
def test_the_prefills_reserve_is_freed_for_the_decode():
    """On a device of its own, the prompt's activations are reserved beside the weights for the prefill only:
    from the first decode step the plan holds one token's, and the room goes to weights kept on the device
    (more units there), with the tokens of the model in memory."""
    import shutil

    import torch

    from offload.infer import init_inference
    from test_infer_generate import build_model, save_checkpoint, scratch_dir

    root = scratch_dir("infer-decode-reserve-")
    try:
        model = build_model("llama", torch.float32)
        directory = save_checkpoint(model, root / "llama")
        ids = torch.randint(3, 256, (1, 96), generator=torch.Generator().manual_seed(3))
        with torch.no_grad():
            expected = model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
        with init_inference(directory, disk_gbps=1.0, compute_device="simulated",
                            max_memory={0: "900KiB", "cpu": 0}) as engine:
            seen = []  # (tokens of the forward, units kept on the device, activations reserved there)
            engine.module.register_forward_hook(lambda module, args, kwargs, out: seen.append(
                (kwargs["input_ids"].shape[-1], len(engine.plan.device.resident), engine.plan.device.activation_bytes)),
                with_kwargs=True)
            ours = engine.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
            decode_step = engine.activation_bytes(1, 1, logits=1, context=102)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    assert ours.tolist() == expected.tolist()
    (prompt, kept_prefill, reserved_prefill), *steps = seen
    assert prompt == 96 and reserved_prefill > 50 * decode_step
    assert all(tokens == 1 and reserved == decode_step and kept > kept_prefill for tokens, kept, reserved in steps)


@pytest.mark.parametrize("prompt, chunk", [(2048, 512), (64, None)])
def test_the_estimate_bounds_the_peak_of_live_tensors(prompt, chunk):
    """Against the tensors torch holds (the profiler's peak, not RSS: the allocator's reuse and fragmentation
    aside), for a grouped-query model with a large vocabulary: a chunk of a long prompt, whose mask and keys and
    values repeated to every head over the whole context SDPA takes, and a short prompt, whose output head
    would be copied whole by matmul for the last position's strided slice without the engine's row-major
    input. The estimate plus the KV cache bounds the peak; for the chunk, whose activations are MiBs, within
    1.5x (the short prompt's are 0.5 MiB, where the kernels' per-thread workspace, which differs with the
    threads a process has, is as large)."""
    import shutil

    import torch
    import transformers

    from benchmarks._common import live_tensor_peak
    from offload.infer import init_inference
    from test_infer_generate import scratch_dir

    root = scratch_dir("infer-live-peak-")
    try:
        torch.manual_seed(0)
        config = transformers.LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=8,
                                          num_key_value_heads=2, vocab_size=32000, max_position_embeddings=4096)
        transformers.AutoModelForCausalLM.from_config(config).to(torch.bfloat16).save_pretrained(root / "llama")
        ids = torch.randint(3, 32000, (1, prompt), generator=torch.Generator().manual_seed(1))
        extra = {"prefill_chunk_size": chunk} if chunk else {}
        with init_inference(root / "llama", disk_gbps=1.0) as engine:
            engine.generate(ids[:, :16], max_new_tokens=2, do_sample=False, pad_token_id=0)
            _, peak = live_tensor_peak(lambda: engine.generate(ids, max_new_tokens=2, do_sample=False, pad_token_id=0,
                                                               **extra))
            total = prompt + 2
            estimate = engine.activation_bytes(1, chunk or total, logits=1, context=total) + engine.kv_bytes(1, total)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    assert peak <= estimate, (peak, estimate)
    if chunk:
        assert estimate <= 1.5 * peak, (peak, estimate)
