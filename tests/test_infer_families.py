"""Every popular decoder family generates from its checkpoint as transformers saves it, token for token.

A tiny random model of each family, saved by ``save_pretrained`` in several shards (the names and layouts real
checkpoints on the Hub have: one tensor per expert for the mixtures of experts, GPT-NeoX's ``embed_out``), is
generated from greedily in bf16 with every decoder layer resident and with a budget that streams them: the
tokens equal those of transformers' own ``from_pretrained`` of the same directory in memory. In int4, streamed
and resident give the same tokens. Every other decoder-only family transformers ships that loads with the same
code (MORE_FAMILIES: state-space and hybrid ones included) is generated from streamed in bf16 only, with the same
comparison. (offload/infer/weights/names.py: transformers' conversion of names and layouts applied to the
checkpoint's tensors as they are read.)
"""

from __future__ import annotations

import shutil

import pytest
import torch
import transformers

from offload.infer import init_inference
from offload.infer.build import CheckpointMismatchError
from test_infer_generate import scratch_dir

COMMON = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=128, pad_token_id=0, bos_token_id=1, eos_token_id=2)
MOE = dict(num_experts_per_tok=2, moe_intermediate_size=32)

FAMILIES = {
    "llama": lambda: transformers.LlamaConfig(**COMMON),
    "mistral": lambda: transformers.MistralConfig(**COMMON),
    "mixtral": lambda: transformers.MixtralConfig(**COMMON, num_local_experts=4, num_experts_per_tok=2),
    "qwen2": lambda: transformers.Qwen2Config(**COMMON),
    "qwen2_moe": lambda: transformers.Qwen2MoeConfig(**COMMON, **MOE, num_experts=4, shared_expert_intermediate_size=48),
    "qwen3": lambda: transformers.Qwen3Config(**COMMON, head_dim=16),
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(**COMMON, **MOE, head_dim=16, num_experts=4),
    "gemma2": lambda: transformers.Gemma2Config(**COMMON, head_dim=16),
    "gemma3_text": lambda: transformers.Gemma3TextConfig(**COMMON, head_dim=16),
    "phi3": lambda: transformers.Phi3Config(**COMMON),
    "gpt2": lambda: transformers.GPT2Config(n_embd=64, n_layer=3, n_head=4, vocab_size=256, n_positions=128,
                                           bos_token_id=1, eos_token_id=2, pad_token_id=0),
    "gpt_neox": lambda: transformers.GPTNeoXConfig(vocab_size=256, hidden_size=64, num_hidden_layers=3,
                                                  num_attention_heads=4, intermediate_size=96,
                                                  max_position_embeddings=128, bos_token_id=1, eos_token_id=2,
                                                  pad_token_id=0),
    "opt": lambda: transformers.OPTConfig(vocab_size=256, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                                          ffn_dim=96, max_position_embeddings=128, word_embed_proj_dim=64,
                                          bos_token_id=1, eos_token_id=2, pad_token_id=0),
    "deepseek_v3": lambda: transformers.DeepseekV3Config(**{**COMMON, "num_key_value_heads": 4}, **MOE,
                                                         n_routed_experts=4, n_shared_experts=1,
                                                         first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=24,
                                                         qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
                                                         n_group=1, topk_group=1),
}
"""Each family's tiny config (the list of docs/inference.md, "Model families")."""


def _tiny(model_type: str, **settings):
    """A tiny config of ``model_type`` (transformers' ``AutoConfig.for_model``): COMMON with ``settings`` over it."""
    return lambda: transformers.AutoConfig.for_model(model_type, **{**COMMON, **settings})


MORE_FAMILIES = {
    "gemma": _tiny("gemma", head_dim=16),
    "phi": _tiny("phi"),
    "olmo": _tiny("olmo"),
    "olmo2": _tiny("olmo2"),
    "olmo3": _tiny("olmo3"),
    "olmoe": _tiny("olmoe", num_experts=4, num_local_experts=4, num_experts_per_tok=2),
    "flex_olmo": _tiny("flex_olmo", num_experts=4, num_local_experts=4, num_experts_per_tok=2),
    "granite": _tiny("granite"),
    "granitemoe": _tiny("granitemoe", num_local_experts=4, num_experts_per_tok=2),
    "granitemoeshared": _tiny("granitemoeshared", num_local_experts=4, num_experts_per_tok=2, shared_intermediate_size=48),
    "cohere": _tiny("cohere"),
    "cohere2": _tiny("cohere2"),
    "starcoder2": _tiny("starcoder2"),
    "stablelm": _tiny("stablelm"),
    "falcon": _tiny("falcon"),
    "gpt_bigcode": _tiny("gpt_bigcode"),
    "gptj": _tiny("gptj", rotary_dim=8),
    "codegen": _tiny("codegen", rotary_dim=8),
    "bloom": _tiny("bloom"),
    "persimmon": _tiny("persimmon"),
    "glm": _tiny("glm", head_dim=16),
    "glm4": _tiny("glm4", head_dim=16),
    "glm4_moe": _tiny("glm4_moe", num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1, head_dim=16),
    "helium": _tiny("helium", head_dim=16),
    "smollm3": _tiny("smollm3"),
    "exaone4": _tiny("exaone4"),
    "ernie4_5": _tiny("ernie4_5", head_dim=16),
    "ernie4_5_moe": _tiny("ernie4_5_moe", num_experts=4, moe_num_experts=4, num_experts_per_tok=2, moe_k=2, moe_intermediate_size=32, head_dim=16),
    "deepseek_v2": _tiny("deepseek_v2", num_key_value_heads=4, num_experts=4, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16),
    "minimax": _tiny("minimax", num_experts=4, num_local_experts=4, num_experts_per_tok=2, head_dim=16),
    "hunyuan_v1_dense": _tiny("hunyuan_v1_dense", head_dim=16),
    "hunyuan_v1_moe": _tiny("hunyuan_v1_moe", num_experts=4, num_local_experts=4, num_experts_per_tok=2, moe_topk=2, head_dim=16),
    "arcee": _tiny("arcee"),
    "seed_oss": _tiny("seed_oss", head_dim=16),
    "jetmoe": _tiny("jetmoe", num_local_experts=4, num_experts_per_tok=2),
    "dots1": _tiny("dots1", num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1, head_dim=16),
    "ministral": _tiny("ministral", head_dim=16),
    "apertus": _tiny("apertus", head_dim=16),
    "phimoe": _tiny("phimoe", num_local_experts=4, num_experts_per_tok=2),
    "gpt_oss": _tiny("gpt_oss", num_experts=4, num_local_experts=4, num_experts_per_tok=2, head_dim=16),
    "nemotron": _tiny("nemotron", head_dim=16),
    "internlm3": _tiny("internlm3", head_dim=16),
    "bitnet": _tiny("bitnet"),
    "doge": _tiny("doge"),
    "mpt": _tiny("mpt"),
    "xglm": _tiny("xglm"),
    "ctrl": _tiny("ctrl"),
    "biogpt": _tiny("biogpt"),
    "openai-gpt": _tiny("openai-gpt"),
    "gpt_neox_japanese": _tiny("gpt_neox_japanese"),
    "cwm": _tiny("cwm", head_dim=16),
    "vaultgemma": _tiny("vaultgemma", head_dim=16),
    "gemma4_text": _tiny("gemma4_text", head_dim=16, vocab_size_per_layer_input=256),  # head_dim kept per layer
    "gemma4_unified_text": _tiny("gemma4_unified_text", head_dim=16, vocab_size_per_layer_input=256),
    "diffllama": _tiny("diffllama"),
    "llama4_text": _tiny("llama4_text", num_local_experts=4, num_experts_per_tok=2, head_dim=16),
    "exaone_moe": _tiny("exaone_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, first_k_dense_replace=1, n_group=1, topk_group=1, head_dim=16),
    "afmoe": _tiny("afmoe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, head_dim=16),
    "nanochat": _tiny("nanochat"),
    "solar_open": _tiny("solar_open", num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1, n_group=1, topk_group=1, head_dim=16),
    "mellum": _tiny("mellum"),
    "hyperclovax": _tiny("hyperclovax"),
    "iquestcoder": _tiny("iquestcoder"),
    "jais2": _tiny("jais2"),
    "lfm2": _tiny("lfm2"),
    "mamba": _tiny("mamba"),
    "falcon_h1": _tiny("falcon_h1"),  # its mixers' mup_vector buffers are computed by the model's initialisation
    "gpt_neo": _tiny("gpt_neo", num_layers=3, attention_types=[[['global', 'local'], 1], [['global'], 1]]),
    "minicpm3": _tiny("minicpm3", num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16),
    "youtu": _tiny("youtu", num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16),
    "qwen3_next": _tiny("qwen3_next", num_hidden_layers=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16),
    "jamba": _tiny("jamba", num_experts=4, num_local_experts=4, num_experts_per_tok=2, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1),
    "bamba": _tiny("bamba", attn_layer_indices=[1], mamba_n_heads=8),
    "cohere2_moe": _tiny("cohere2_moe", num_experts=4, num_experts_per_tok=2),
    "deepseek_v32": _tiny("deepseek_v32", num_key_value_heads=4, num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16),
    "granite_swa": _tiny("granite_swa"),
    "granitemoe_swa": _tiny("granitemoe_swa", num_local_experts=4, num_experts_per_tok=2, shared_intermediate_size=48),
    "apertus1p5_text": _tiny("apertus1p5_text", head_dim=16),
    "ministral3": _tiny("ministral3", head_dim=16),
    "minimax_m2": _tiny("minimax_m2", num_experts=4, num_local_experts=4, num_experts_per_tok=2, head_dim=16),
    "sarvam_mla": _tiny("sarvam_mla", num_key_value_heads=4, num_experts=4, num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16),
    "laguna": _tiny("laguna", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48, head_dim=16),
    "hy_v3": _tiny("hy_v3", num_experts=4, num_local_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, head_dim=16),
    "hy_v4": _tiny("hy_v4", num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1, n_group=1, topk_group=1, head_dim=16),
    "exaone": _tiny("exaone"),
    "glm_moe_dsa": _tiny("glm_moe_dsa", num_key_value_heads=4, num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16),
    "gpt-sw3": _tiny("gpt-sw3"),
    "falcon_mamba": _tiny("falcon_mamba"),
    "rwkv": _tiny("rwkv"),
    "recurrent_gemma": _tiny("recurrent_gemma"),
    "nemotron_h": _tiny("nemotron_h", num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1, n_group=1, topk_group=1),
    "olmo_hybrid": _tiny("olmo_hybrid"),
    "lfm3": _tiny("lfm3"),
    "zaya": _tiny("zaya"),
    "deepseek_v4": _tiny("deepseek_v4", num_key_value_heads=4, num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16),
    "sarvam_moe": _tiny("sarvam_moe", num_experts=4, num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1, head_dim=16),
}
"""Every other decoder-only family transformers ships that generates from our engine as transformers does
(docs/inference.md, "Model families"): streamed in bf16 only, to keep the test's time (a tiny model each)."""

NEW_TOKENS = 8

pytestmark = pytest.mark.slow  # 14 families x 2 engines, 93 more streamed: about 4 minutes on 2 busy cores

NO_INT4 = {"gpt2": "GPT2LMHeadModel has no nn.Linear in its decoder layers"}
"""Families whose decoder layers hold no ``nn.Linear`` for the packed kernels (GPT-2's are ``Conv1D``):
int4 is refused in one line."""


def _prompt() -> torch.Tensor:
    return torch.randint(3, 256, (2, 8), generator=torch.Generator().manual_seed(1))


def save_family(directory, family: str, **config) -> int:
    """Save a tiny random bf16 model of ``family`` (seed 0; ``config`` overrides its settings) to ``directory``
    with ``save_pretrained``, in shards of 100 KB (the names and layouts real checkpoints have); its bytes."""
    torch.manual_seed(0)
    settings = {**FAMILIES, **MORE_FAMILIES}[family]()
    for key, value in config.items():
        setattr(settings, key, value)
    model = transformers.AutoModelForCausalLM.from_config(settings).to(torch.bfloat16).eval()
    model.save_pretrained(directory, max_shard_size="100KB")
    return sum(p.numel() * p.element_size() for p in model.parameters())


@pytest.fixture(scope="module")
def saved():
    """family -> (checkpoint directory, its bf16 bytes, transformers' greedy tokens from it, the scratch root)."""
    root = scratch_dir("infer-families-")
    built = {}
    try:
        for family in FAMILIES:
            directory = root / family
            size = save_family(directory, family)
            loaded = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.bfloat16).eval()
            with torch.no_grad():
                tokens = loaded.generate(_prompt(), max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
            built[family] = (directory, size, tokens.tolist(), root)
        yield built
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _generate(directory, budget, **settings):
    with init_inference(directory, dtype=torch.bfloat16, max_in_cpu=budget, disk_gbps=1.0, **settings) as engine:
        tokens = engine.generate(_prompt(), max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0).tolist()
        experts = [layer.name for layer in engine.experts.layers] if engine.experts is not None else []
        return tokens, [name for name in engine.plan.streamed] + experts  # a MoE's experts are streamed on their own


@pytest.mark.parametrize("family", list(FAMILIES))
def test_streamed_and_resident_give_transformers_tokens(saved, family):
    directory, size, reference, _ = saved[family]
    resident, streamed_none = _generate(directory, 4 * size)
    assert streamed_none == [] and resident == reference
    streamed, names = _generate(directory, size // 3)
    assert names, "a third of the model's bytes streams its decoder layers"
    assert streamed == reference


@pytest.mark.parametrize("family", list(FAMILIES))
def test_int4_streamed_gives_int4_residents_tokens(saved, family):
    directory, size, _, root = saved[family]
    if family in NO_INT4:
        with pytest.raises(ValueError, match=f"weight_quantization: {NO_INT4[family]}"):
            _generate(directory, 4 * size, weight_quantization="int4", nvme_path=str(root))
        return
    resident, streamed_none = _generate(directory, 4 * size, weight_quantization="int4", nvme_path=str(root))
    streamed, names = _generate(directory, size // 6, weight_quantization="int4", nvme_path=str(root))
    assert streamed_none == [] and names
    assert streamed == resident


@pytest.mark.parametrize("family", list(MORE_FAMILIES))
def test_more_families_streamed_give_transformers_tokens(family):
    """Each of MORE_FAMILIES, its decoder layers streamed in bf16: transformers' tokens."""
    root = scratch_dir(f"infer-family-{family}-")
    try:
        size = save_family(root / family, family)
        loaded = transformers.AutoModelForCausalLM.from_pretrained(root / family, dtype=torch.bfloat16).eval()
        with torch.no_grad():
            reference = loaded.generate(_prompt(), max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0).tolist()
        streamed, names = _generate(root / family, size // 3)
        assert names, "a third of the model's bytes streams its decoder layers"
        assert streamed == reference
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_a_buffer_no_initialisation_computes_is_refused_naming_it(monkeypatch):
    """A buffer neither in the checkpoint nor written by transformers' initialisation (of its module or any
    above it) is refused by name, not used as the garbage of uninitialised memory."""
    directory = scratch_dir("unset-buffer")
    try:
        save_family(directory, "llama")
        monkeypatch.setattr(transformers.LlamaPreTrainedModel, "_init_weights", lambda self, module: None)
        with pytest.raises(ValueError, match=r"buffer 'model\.rotary_emb\.inv_freq' of LlamaForCausalLM is neither in "
                                             r"the checkpoint nor computed by transformers' initialisation"):
            init_inference(directory, disk_gbps=1.0)
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def test_a_tensor_no_parameter_takes_is_named_with_the_family(saved, tmp_path):
    """A checkpoint of one family under another's config: the first tensor the loader cannot place, named
    with the model type, before anything is read."""
    directory, _, _, _ = saved["mixtral"]
    shutil.copytree(directory, tmp_path / "mixed")
    config = FAMILIES["llama"]()
    config.save_pretrained(tmp_path / "mixed")
    with pytest.raises(CheckpointMismatchError, match=r"parameter 'model\.layers\.0\.mlp\.gate_proj\.weight' of "
                                                      r"LlamaForCausalLM \(model_type 'llama'\) is not in the checkpoint"):
        init_inference(tmp_path / "mixed", dtype=torch.bfloat16, disk_gbps=1.0)


@pytest.mark.parametrize("method", ["gptq", "awq", "fp8"])
def test_a_prequantized_checkpoint_is_refused_in_one_line(saved, tmp_path, method):
    """config.json's quantization_config: its tensors are packed by that method, never read as weights."""
    import json

    directory, _, _, _ = saved["llama"]
    shutil.copytree(directory, tmp_path / "quantized")
    config = json.loads((tmp_path / "quantized" / "config.json").read_text())
    config["quantization_config"] = {"quant_method": method, "bits": 4, "group_size": 128}
    (tmp_path / "quantized" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=f"a {method.upper()}-quantized checkpoint .*not supported yet: use the "
                                         f"model's bf16 or fp16 checkpoint with weight_quantization") as refused:
        init_inference(tmp_path / "quantized", dtype=torch.bfloat16, disk_gbps=1.0)
    assert "\n" not in str(refused.value)
