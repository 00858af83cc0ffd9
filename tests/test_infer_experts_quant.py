"""Experts quantized expert by expert and read by the router's choice (offload/infer/weights/quant_experts.py,
offload/infer/experts/).

Tiny Mixtral and Qwen2-MoE models saved by transformers' ``save_pretrained`` (one tensor per expert on
disk), generated from with ``weight_quantization`` int4 and int8: the routed run (only the picked experts
read) gives the tokens of our resident run of the same quantization; each expert is read as its quantized
bytes (sizes computed here from the config, not from the engine's layout) in one aligned read; the bytes
the store reads are exactly those of the experts the routers picked (recorded by a hook); the cache by use
holds the quantized tensors, equal to those ``safetensors`` reads from the quantized cache file. A
checkpoint that stores the experts fused is read expert by expert once quantized; on a device with
``experts`` "whole" the packed experts stream with their layer, bit for bit as on the CPU. And `QuantExperts` computes what its
dequantized weights compute.
"""

from __future__ import annotations

import shutil

import pytest
import torch
import transformers
from safetensors import safe_open
from test_infer_experts import picked_recorder
from test_infer_families import FAMILIES, save_family
from test_infer_generate import one_thread  # noqa: F401 - autouse: one compute thread for tiny matrices
from test_infer_generate import scratch_dir

from offload.infer import init_inference
from offload.infer.config import WeightQuantization
from offload.infer.weights.quant_experts import QuantExperts, expert_tensors, projections

MOE = ["mixtral", "qwen2_moe"]
SPECS = {"int4": {"num_bits": 4, "group_size": 32}, "int8": "int8"}
"""int4 in groups of 32: every expert projection of the tiny configs is quantized (64 would leave Qwen2-MoE's
down projection, 32 inputs, in bf16)."""
NEW_TOKENS = 6
PAGE = 4096


def _prompt(batch: int = 2) -> torch.Tensor:
    return torch.randint(3, 256, (batch, 8), generator=torch.Generator().manual_seed(batch))


def _generate(engine) -> tuple[list, torch.Tensor]:
    """Greedy tokens and every step's logits (the tiny random experts rarely change a token: the logits show
    any difference)."""
    out = engine.generate(_prompt(), max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0,
                          output_logits=True, return_dict_in_generate=True)
    return out.sequences.tolist(), torch.stack(out.logits)


@pytest.fixture(scope="module")
def saved():
    """family -> (checkpoint directory, model bytes, config, scratch root for the quantized caches)."""
    root = scratch_dir("infer-experts-quant-")
    built = {}
    try:
        for family in MOE:
            built[family] = (root / family, save_family(root / family, family), FAMILIES[family](), root)
        yield built
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def resident_tokens(saved):
    """(family, bits) -> greedy tokens and logits of our run with every layer resident, quantized (computed once)."""
    found = {}

    def tokens(family: str, bits: str) -> tuple[list, torch.Tensor]:
        if (family, bits) not in found:
            directory, size, _, root = saved[family]
            with init_inference(directory, dtype=torch.bfloat16, max_in_cpu=4 * size, disk_gbps=1.0,
                                weight_quantization=SPECS[bits], nvme_path=str(root)) as engine:
                assert engine.experts is None and not engine.plan.streamed
                assert any(isinstance(m, QuantExperts) for m in engine.module.modules())
                found[family, bits] = _generate(engine)
        return found[family, bits]

    return tokens


def _quantized_nbytes(out_features: int, in_features: int, bits: str) -> int:
    """One projection's bytes: int4 two values a byte and a bf16 scale and zero per 32 inputs of each output;
    int8 a byte a value and a bf16 scale per output (symmetric)."""
    if bits == "int4":
        return out_features * in_features // 2 + in_features // 32 * out_features * 2 * 2
    return out_features * in_features + out_features * 2


def _expert_nbytes(config, bits: str) -> int:
    hidden = config.hidden_size
    inner = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
    return _quantized_nbytes(2 * inner, hidden, bits) + _quantized_nbytes(hidden, inner, bits)


@pytest.mark.parametrize("bits", list(SPECS))
@pytest.mark.parametrize("family", MOE)
def test_routed_quantized_experts_give_resident_tokens_and_read_quantized_bytes(saved, resident_tokens, family, bits):
    directory, _, config, root = saved[family]
    expected = _expert_nbytes(config, bits)
    bf16 = 3 * config.hidden_size * (getattr(config, "moe_intermediate_size", None) or config.intermediate_size) * 2
    with init_inference(directory, dtype=torch.bfloat16, max_in_cpu=0, disk_gbps=1.0,
                        weight_quantization=SPECS[bits], nvme_path=str(root)) as engine:
        store = engine.experts
        assert store is not None, "the quantized experts are read by the router's choice"
        store.guess = False  # every read is then one the router asked for
        experts = {(layer.position, e.index): e for layer in store.layers for e in layer.experts}
        for expert in experts.values():
            assert expert.nbytes == expected  # about 1/4 (int4) or 1/2 (int8) of bf16's
            assert len(expert.windows) == 1 and expert.read_nbytes == -(-expected // PAGE) * PAGE  # one aligned read
        assert expected < (0.35 if bits == "int4" else 0.55) * bf16
        assert engine.plan.experts.expert_nbytes == expected
        assert engine.plan.experts.expert_read_nbytes == -(-expected // PAGE) * PAGE
        picked = picked_recorder(engine)
        tokens, logits = _generate(engine)
        assert store.counts.reads == sum(len(step) for step in picked)
        assert store.counts.bytes_read == sum(experts[key].read_nbytes for step in picked for key in step)
    reference = resident_tokens(family, bits)
    assert tokens == reference[0] and torch.equal(logits, reference[1])


def test_the_cache_by_use_holds_the_quantized_experts_as_stored(saved, resident_tokens):
    """Every expert kept once read: a generate reads none, and what is kept is the cache file's bytes."""
    directory, size, config, root = saved["mixtral"]
    with init_inference(directory, dtype=torch.bfloat16, max_in_cpu=0, disk_gbps=1.0,
                        weight_quantization=SPECS["int4"], nvme_path=str(root)) as engine:
        store = engine.experts
        store.set_capacity(store.total_nbytes)
        assert all(store.keep(layer.position, expert.index) for layer in store.layers for expert in layer.experts)
        assert store.cache_bytes == store.total_nbytes == len(store.cache) * _expert_nbytes(config, "int4")
        before = store.counts.bytes_read
        tokens, logits = _generate(engine)
        assert store.counts.bytes_read == before and store.counts.hits == store.counts.picked
        (path,) = {w.path for layer in store.layers for e in layer.experts for w in e.windows}
        with safe_open(path, framework="pt") as stored:
            for (position, e), slices in store.cache.items():
                layer = store.layers[position]
                for ref, value in zip(layer.params, slices):
                    name = ref.tensor.replace(f"{layer.name}.0.", f"{layer.name}.{e}.")
                    assert torch.equal(value, stored.get_tensor(name)), name
        assert {v.dtype for slices in store.cache.values() for v in slices} == {torch.uint8, torch.bfloat16}
    reference = resident_tokens("mixtral", "int4")
    assert tokens == reference[0] and torch.equal(logits, reference[1])


def test_whole_layers_stream_the_quantized_experts_with_their_layer(saved, resident_tokens):
    directory, size, _, root = saved["qwen2_moe"]
    with init_inference(directory, dtype=torch.bfloat16, max_in_cpu=0, disk_gbps=1.0, experts="whole",
                        weight_quantization=SPECS["int8"], nvme_path=str(root)) as engine:
        assert engine.experts is None and engine.plan.streamed
        tokens, logits = _generate(engine)
    reference = resident_tokens("qwen2_moe", "int8")
    assert tokens == reference[0] and torch.equal(logits, reference[1])


def test_a_checkpoint_with_fused_experts_is_read_expert_by_expert_once_quantized(saved):
    """Experts stored fused (one tensor for all of a layer's, the model's own names) are left whole in bf16;
    the quantized cache stores them per expert, so that quantized they are read by the router's choice."""
    from safetensors.torch import save_file

    _, size, config, _ = saved["mixtral"]
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).to(torch.bfloat16).eval()
    directory = scratch_dir("infer-fused-experts-")
    try:
        config.save_pretrained(directory)
        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, directory / "model.safetensors",
                  metadata={"format": "pt"})
        with init_inference(directory, dtype=torch.bfloat16, max_in_cpu=0, disk_gbps=1.0) as engine:
            assert engine.experts is None  # bf16: streamed with their layers
        runs = []
        for budget in (4 * size, 0):
            with init_inference(directory, dtype=torch.bfloat16, max_in_cpu=budget, disk_gbps=1.0,
                                weight_quantization=SPECS["int4"], nvme_path=str(directory)) as engine:
                assert (engine.experts is not None) == (budget == 0)
                runs.append(_generate(engine))
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    assert runs[0][0] == runs[1][0] and torch.equal(runs[0][1], runs[1][1])


@pytest.mark.simulated
def test_on_a_device_the_quantized_experts_stream_with_their_layer(saved):
    """Compute on a device with ``experts`` "whole": the experts are streamed packed with their layer (through
    the device's ring), and compute bit for bit what the CPU computes (attention on torch's math kernel on
    both, as the simulated device takes it). Routed on a device: tests/test_infer_experts_device.py."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from offload.device import SimulatedDevice

    directory, size, _, root = saved["mixtral"]
    settings = dict(dtype=torch.bfloat16, disk_gbps=1.0, weight_quantization=SPECS["int4"], nvme_path=str(root))
    with init_inference(directory, max_in_cpu=4 * size, device="cpu", compute_device="cpu", **settings) as engine, \
            sdpa_kernel([SDPBackend.MATH]):
        expected = _generate(engine)
    with SimulatedDevice(budget_bytes=int(size * 0.36), budget_setting="max_memory[0]") as device:
        with init_inference(directory, compute_device=device, max_in_cpu=0, experts="whole", **settings) as engine:
            streamed = [u for u in engine.units if u.name not in engine.plan.resident]
            assert engine.experts is None and any(isinstance(m, QuantExperts) for u in streamed for m in u.module.modules())
            tokens, logits = _generate(engine)
    assert tokens == expected[0] and torch.equal(logits.cpu(), expected[1])


@pytest.mark.parametrize("bits", list(SPECS))
def test_quant_experts_compute_their_dequantized_weights(bits):
    """`QuantExperts` against an fp32 computation with each projection's weight as its kernel reads it back,
    and against transformers' own module on the unquantized weights (a wrong layout would be far off)."""
    torch.manual_seed(0)
    config = FAMILIES["mixtral"]()
    source = transformers.models.mixtral.modeling_mixtral.MixtralExperts(config).to(torch.bfloat16)
    torch.nn.init.normal_(source.gate_up_proj, std=0.1)
    torch.nn.init.normal_(source.down_proj, std=0.1)
    spec = WeightQuantization.parse(SPECS[bits])
    quantized = QuantExperts(source, spec, torch.bfloat16)
    values = {"gate_up_proj": source.gate_up_proj.detach(), "down_proj": source.down_proj.detach()}
    state = {name.removeprefix("x."): tensor for name, tensor in expert_tensors("x", source, values, spec, torch.bfloat16)}
    quantized.load_state_dict(state, assign=True, strict=True)
    hidden = torch.randn(7, config.hidden_size, dtype=torch.bfloat16)
    index = torch.tensor([[0, 1], [1, 2], [3, 0], [2, 3], [1, 0], [3, 2], [0, 3]])
    weights = torch.rand(7, 2, dtype=torch.bfloat16)
    with torch.no_grad():
        out = quantized(hidden, index, weights).float()
        reference = torch.zeros(7, config.hidden_size)
        for e in range(4):
            expert = quantized.get_submodule(str(e))
            read_back = {n: getattr(expert, n)(torch.eye(getattr(expert, n).in_features, dtype=torch.bfloat16)).T.float()
                         for n in ("gate_up", "down")}
            for token, k in zip(*torch.where(index == e)):
                gate, up = (hidden[token].float() @ read_back["gate_up"].T).chunk(2)
                reference[token] += weights[token, k].float() * ((torch.nn.functional.silu(gate) * up) @ read_back["down"].T)
        original = source(hidden, index, weights).float()
    assert [name for name, *_ in projections(source)] == ["gate_up_proj", "down_proj"]
    assert (out - reference).norm() <= 0.02 * reference.norm()
    assert (out - original).norm() <= (0.15 if bits == "int4" else 0.02) * original.norm()
