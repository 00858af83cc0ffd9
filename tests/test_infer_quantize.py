"""Quantized weights on the stream: the kernels, the cache on the disk, generation, and the accuracy.

int8 (per channel) and int4 (groups) decoder weights through `init_inference`: each weight is within
half a quantization step of the original (read back through the kernel itself), streamed and
resident generation give the same logits, the cache is written once and reused, a changed
checkpoint is noticed, the plan shows the bytes before and after, and a tiny byte-level Llama trained
here on the standard library's source keeps its held-out perplexity within pinned bounds.
"""

from __future__ import annotations

import io
import json
import logging
import os
import shutil

import pytest
import torch
from test_infer_generate import one_thread  # noqa: F401 - autouse: one compute thread for tiny matrices
from test_infer_generate import PAD, build_model, prompts, save_checkpoint, scratch_dir, tight_budget

from offload.infer import InferenceConfig, init_inference
from offload.infer.cli import main
from offload.infer.config import WeightQuantization
from offload.infer.weights.quantize import QuantLinear, quantize_weight
from tensorio.testing import flip_bit

SPECS = [WeightQuantization(num_bits=8), WeightQuantization(num_bits=8, symmetric=False),
         WeightQuantization(num_bits=4, group_size=32), WeightQuantization(num_bits=4, group_size=64, symmetric=True)]


@pytest.fixture()
def llama(tmp_path):
    """A small bf16 Llama checkpoint (hidden 64, intermediate 192: every linear layer quantizable with
    groups of 32 and 64), the in-memory model, and a scratch directory for the caches."""
    root = scratch_dir("infer-quant-")
    model = build_model("llama", torch.bfloat16, intermediate_size=192)
    try:
        yield save_checkpoint(model, root / "llama"), model, root
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _quant_linear(weight: torch.Tensor, spec: WeightQuantization, dtype: torch.dtype) -> QuantLinear:
    layer = QuantLinear(weight.shape[1], weight.shape[0], spec, dtype, bias=False, device="cpu")
    for name, value in quantize_weight(weight, spec, dtype).items():
        getattr(layer, name).data = value
    return layer


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_every_weight_is_within_half_a_step(spec):
    torch.manual_seed(0)
    weight = torch.randn(96, 256) * torch.linspace(0.01, 2.0, 96)[:, None] + 0.1  # rows of different ranges, off zero
    layer = _quant_linear(weight, spec, torch.float32)
    with torch.no_grad():
        dequantized = layer(torch.eye(256)).T  # the kernel's own weight, read back column by column
    if spec.group_size is None:
        ranges = weight.abs().amax(1, keepdim=True) * 2 if spec.symmetric else weight.amax(1, keepdim=True) - weight.amin(1, keepdim=True)
        step = ranges / 255 if not spec.symmetric else ranges / 2 / 127
        step = step.expand_as(weight)
    else:
        groups = weight.reshape(96, -1, spec.group_size)
        ranges = groups.abs().amax(-1) / 7 if spec.symmetric else (groups.amax(-1) - groups.amin(-1)) / 15
        step = ranges.repeat_interleave(spec.group_size, dim=1)
    assert ((dequantized - weight).abs() <= step * 0.5 * 1.01 + 1e-6).all()
    x = torch.randn(5, 256)
    with torch.no_grad():
        assert torch.allclose(layer(x), x @ dequantized.T, rtol=1e-4, atol=1e-4)


def test_bf16_kernels_match_their_dequantized_weight():
    torch.manual_seed(1)
    weight = (torch.randn(64, 128) * 0.05).to(torch.bfloat16)
    for spec in SPECS:
        layer = _quant_linear(weight, spec, torch.bfloat16)
        with torch.no_grad():
            dequantized = layer(torch.eye(128, dtype=torch.bfloat16)).T.float()
            x = torch.randn(3, 128, dtype=torch.bfloat16)
            y = layer(x).float()
        expected = x.float() @ dequantized.T
        assert (y - expected).norm() <= 0.01 * expected.norm(), spec.name
        assert (dequantized - weight.float()).norm() <= (0.2 if spec.num_bits == 4 else 0.01) * weight.float().norm()


@pytest.mark.parametrize("bits", ["int8", "int4"])
def test_streamed_equals_resident_and_the_cache_is_written_once(llama, bits, caplog):
    directory, _, root = llama
    ids, mask = prompts(4)
    outputs = []
    settings = [dict(device="cpu"), dict(max_in_cpu=tight_budget(directory, 4)), dict(max_in_cpu=tight_budget(directory, 4))]
    for run, extra in enumerate(settings):
        with caplog.at_level(logging.WARNING, logger="offload.infer"):
            caplog.clear()
            with init_inference(directory, weight_quantization=bits, nvme_path=str(root), disk_gbps=1.0, **extra) as engine:
                assert bool(engine.plan.streamed) == (run > 0)
                assert engine.checkpoint.directory.startswith(str(root / "quantized-"))
                outputs.append(engine.generate(ids, attention_mask=mask, max_new_tokens=6, pad_token_id=PAD, do_sample=False,
                                               output_logits=True, return_dict_in_generate=True))
        assert ("writing the" in caplog.text) == (run == 0)  # the first run writes the cache, the others reuse it
    for other in outputs[1:]:
        assert other.sequences.tolist() == outputs[0].sequences.tolist()
        for a, b in zip(other.logits, outputs[0].logits):
            assert torch.equal(a, b)
    (cache,) = root.glob("quantized-*")
    record = json.loads((cache / "quantized.json").read_text())
    assert record["quantization"]["num_bits"] == int(bits[3:]) and len(record["quantized"]) == 4 * 7


def generate_int8(directory, root, ids, mask, aio=None):
    """One int8 forward under a tight budget: (logits, the directory the engine read its weights from);
    ``aio``: the aio section (its backend)."""
    with init_inference(directory, weight_quantization="int8", nvme_path=str(root), max_in_cpu=tight_budget(directory),
                        disk_gbps=1.0, **({"aio": aio} if aio else {})) as engine:
        if aio:
            assert engine.handle.backend_name == aio["backend"]
        return engine(ids, attention_mask=mask).logits, engine.checkpoint.directory


def test_a_changed_checkpoint_is_noticed(llama):
    directory, model, root = llama
    ids, mask = prompts(1)

    before, first = generate_int8(directory, root, ids, mask)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(-1)
    save_checkpoint(model, directory)
    after, second = generate_int8(directory, root, ids, mask)
    assert first != second and not (root / first).exists()  # a new cache; the stale one removed
    assert not torch.allclose(before, after)


def test_the_plan_shows_the_bytes_before_and_after(llama):
    directory, _, root = llama
    with init_inference(directory, weight_quantization="int4", nvme_path=str(root), max_in_cpu=tight_budget(directory),
                        disk_gbps=1.0) as engine:
        plan = engine.plan
    assert plan.quantization == "int4 (group 64, asymmetric)"
    # bf16 weights: int4 with a bf16 scale and zero per 64 weights is 4.5 bits, against 16
    assert 3.0 < plan.unquantized_read_bytes / plan.read_bytes_per_forward < 3.6
    assert f"quantized: {plan.quantization}" in plan.describe() and "unquantized" in plan.describe()


def test_the_command_takes_quantize(llama):
    directory, _, root = llama
    out = io.StringIO()
    figures = main([str(directory), "--prompt-ids", "5,17,99", "--max-new-tokens", "3", "--quantize", "int8",
                    "--nvme-path", str(root), "--max-in-cpu", tight_budget(directory), "--disk-gbps", "1.0"], out=out)
    assert "quantized: int8 (per channel, symmetric)" in out.getvalue()
    assert figures["quantization"] and figures["unquantized_read_bytes_per_forward"] > 1.8 * figures["read_bytes_per_forward"]


def test_the_command_takes_an_int4_group_size(llama, capsys):
    directory, _, root = llama
    out = io.StringIO()
    main([str(directory), "--prompt-ids", "5,17,99", "--max-new-tokens", "2", "--quantize", "int4",
          "--quantize-group-size", "32", "--nvme-path", str(root), "--max-in-cpu", tight_budget(directory),
          "--disk-gbps", "1.0"], out=out)
    assert "quantized: int4 (group 32, asymmetric)" in out.getvalue()
    with pytest.raises(SystemExit):
        main([str(directory), "--prompt-ids", "5", "--quantize", "int8", "--quantize-group-size", "128"], out=out)
    assert "--quantize-group-size 128 needs --quantize int4" in capsys.readouterr().err


def test_deepspeed_config_and_errors():
    nested = {"weight_quantization": {"quantized_initialization": {"num_bits": 4, "group_size": 128, "group_dim": 1,
                                                                   "symmetric": False}}}
    assert InferenceConfig.from_dict(nested).weight_quantization == WeightQuantization(num_bits=4, group_size=128,
                                                                                       symmetric=False)
    assert InferenceConfig.from_dict({"weight_quantization": {"num_bits": 8}}).weight_quantization.symmetric is True
    assert InferenceConfig.from_dict(weight_quantization="none").weight_quantization is None
    bad = [({"num_bits": 3}, "weight_quantization.num_bits"), ({"num_bits": 8, "group_size": 64}, "with num_bits 8"),
           ({"num_bits": 4, "group_size": 100}, "weight_quantization.group_size"),
           ({"num_bits": 4, "group_dim": 0}, "group_dim"), ({"bits": 4}, "weight_quantization.bits: unknown key"),
           ({"group_size": 64}, "num_bits: missing"), ({"num_bits": 4, "symmetric": "yes"}, "symmetric")]
    for section, message in bad:
        with pytest.raises(ValueError, match=message):
            InferenceConfig.from_dict({"weight_quantization": section})
    with pytest.raises(ValueError, match="int8.*int4"):
        InferenceConfig.from_dict(weight_quantization="int3")


def test_a_missing_cache_directory_is_named(llama):
    directory, _, root = llama
    with pytest.raises(FileNotFoundError, match="nvme_path.*does not exist"):
        init_inference(directory, weight_quantization="int8", nvme_path=str(root / "missing"), disk_gbps=1.0)


def test_held_out_perplexity_deltas_on_a_tiny_trained_model(tmp_path):
    """A byte-level Llama (hidden 64, 2 layers) trained here for 150 steps on the standard library's
    source; held-out perplexity through the engine, decoder layers streamed."""
    from benchmarks.infer_accuracy import corpus, evaluate, save, train, windows

    data, held = corpus(limit=2_000_000)
    model = train(data, hidden=64, layers=2, steps=150, seq=128, batch=16, lr=3e-3)
    root = scratch_dir("infer-acc-")
    try:
        checkpoint = save(model, root / "tiny")
        ids = windows(held, 16, 128)
        base = evaluate(checkpoint, ids, None, root)
        assert base["perplexity"] < 20  # it learned: a uniform guess is 256, the bytes' own frequencies about 30
        int8 = evaluate(checkpoint, ids, {"num_bits": 8}, root, reference=base["log_probs"])
        int4 = evaluate(checkpoint, ids, {"num_bits": 4, "group_size": 64}, root, reference=base["log_probs"])
    finally:
        shutil.rmtree(root, ignore_errors=True)
    assert int8["perplexity"] / base["perplexity"] - 1 <= 0.005
    assert int4["perplexity"] / base["perplexity"] - 1 <= 0.04
    assert 0 < int8["kl"] < int4["kl"]


def test_a_corrupt_cache_is_named_and_written_again(llama, caplog, aio_backend):
    directory, _, root = llama
    ids, mask = prompts(1)

    before, cache = generate_int8(directory, root, ids, mask, aio_backend)
    path = os.path.join(cache, "model.safetensors")
    raw = open(path, "rb").read()
    length = int.from_bytes(raw[:8], "little")
    name = next(n for n in json.loads(raw[8:8 + length]) if "q_proj" in n)
    first, _ = json.loads(raw[8:8 + length])[name]["data_offsets"]
    flip_bit(path, 8 + length + first + 3)
    with caplog.at_level(logging.WARNING, logger="offload.infer"):
        after, again = generate_int8(directory, root, ids, mask, aio_backend)
    assert again == cache and f"the cache {cache} is corrupt (checksum mismatch (tensor {name!r}): {path}" in caplog.text
    assert "writing the" in caplog.text and torch.equal(before, after)
