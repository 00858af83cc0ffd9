"""``max_in_cpu: "auto"`` / ``max_memory={"cpu": "auto", 0: "auto"}``: the budget taken from the host's
available memory (a fake MemAvailable, a fake cgroup limit), printed with its figures, placing as the
same number of bytes would, and refused with the figures where the host is too small."""

from __future__ import annotations

import io

import pytest
import torch
from test_infer_generate import NEW_TOKENS, PAD, models, one_thread, prompts, reference, required_and_kv  # noqa: F401

import offload.infer.engine as engine_module
from offload.device import AUTO_MARGIN_SHARE, HostMemory, SimulatedDevice, host_memory
from offload.infer import init_inference
from offload.infer.activations import AUTO_PROCESS_MARGIN_BYTES
from offload.infer.cli import main
from offload.infer.config import InferenceConfig
from offload.infer.plan.host import BudgetError

GiB = 1 << 30


def available_for(budget: int, ring: int) -> int:
    """The available memory (whole kB, as /proc/meminfo gives it) whose "auto" budget beside ``ring`` bytes
    of ring buffers and activations (`reserved_bytes`) is at least ``budget`` and at most 1 kB more."""
    available = int((budget + ring + AUTO_PROCESS_MARGIN_BYTES) / (1 - AUTO_MARGIN_SHARE)) // 1024 * 1024
    while auto_of(available, ring) < budget:
        available += 1024
    return available


def auto_of(available: int, ring: int) -> int:
    return available - ring - AUTO_PROCESS_MARGIN_BYTES - int(AUTO_MARGIN_SHARE * available)


def fake_host(monkeypatch, tmp_path, *, available: int, cgroup_limit: int | None = None, usage: int = 0) -> None:
    """The engine reads a fake /proc/meminfo (``available``) and, with ``cgroup_limit``, a cgroup v1 of that limit."""
    proc = tmp_path / "proc"
    (proc / "self").mkdir(parents=True)
    (proc / "meminfo").write_text(f"MemTotal: {24 * GiB // 1024} kB\nMemAvailable: {available // 1024} kB\n")
    (proc / "self" / "cgroup").write_text("4:memory:/bench\n" if cgroup_limit else "0::/\n")
    mount = tmp_path / "cgroup"
    if cgroup_limit:
        group = mount / "memory" / "bench"
        group.mkdir(parents=True)
        (group / "memory.limit_in_bytes").write_text(str(cgroup_limit))
        (group / "memory.usage_in_bytes").write_text(str(usage))
        (group / "memory.stat").write_text("total_inactive_file 0\n")
    monkeypatch.setattr(engine_module, "host_memory", lambda: host_memory(proc=proc, cgroup_root=mount))


def ring_bytes(directory, buffer_count: int = 2) -> int:
    """What "auto" reserves beside its budget: the ring buffers, and the activations of one sequence of the
    tiny model's whole context (128 tokens: shorter than AUTO_ACTIVATION_TOKENS)."""
    _, _, largest = required_and_kv(directory, 1)
    with init_inference(directory, device="cpu", disk_gbps=1.0) as probe:
        activations = probe.activation_bytes(1, 128, logits=1)
    return buffer_count * largest + activations


@pytest.mark.parametrize("setting", [{"max_in_cpu": "auto"}, {"max_memory": {"cpu": "auto"}},
                                     {"config": {"zero_optimization": {"offload_param": {"max_in_cpu": "auto"}}}}])
def test_auto_places_as_the_bytes_it_took_and_says_from_what(models, monkeypatch, tmp_path, setting):
    directory, model = models["llama", torch.float32]
    required, kv, largest = required_and_kv(directory, 1)
    budget = required + kv + 2 * largest + 100  # two decoder layers beside what must stay
    available = available_for(budget, ring_bytes(directory))
    fake_host(monkeypatch, tmp_path, available=available)
    config = setting.pop("config", None)
    with init_inference(directory, config, disk_gbps=1.0, **setting) as engine:
        ids, mask = prompts(1)
        ours = engine.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, pad_token_id=PAD, do_sample=False)
        plan = engine.plan
        assert plan.budget == auto_of(available, ring_bytes(directory)) and budget <= plan.budget <= budget + 1024
        text = plan.describe()
        assert "= \"auto\":" in text and "available (MemAvailable" in text and "ring buffers (2 x" in text
        assert "margin" in text
    with init_inference(directory, max_in_cpu=f"{plan.budget}B", disk_gbps=1.0) as same:
        same.reserve(1, 8 + NEW_TOKENS)
        assert same.plan.resident == plan.resident and 0 < len(plan.streamed) < len(plan.units)
        assert same.plan.budget_source == ""
    assert ours.tolist() == reference(model, 1, do_sample=False).sequences.tolist()


def test_auto_follows_a_cgroup_limit_below_mem_available(models, monkeypatch, tmp_path):
    directory, _ = models["llama", torch.float32]
    required, kv, largest = required_and_kv(directory, 1)
    room = available_for(required + kv + largest + 7, ring_bytes(directory))
    fake_host(monkeypatch, tmp_path, available=20 * GiB, cgroup_limit=room + GiB, usage=GiB)
    with init_inference(directory, max_in_cpu="auto", disk_gbps=1.0) as engine:
        plan = engine.reserve(1, 8 + NEW_TOKENS)
        assert plan.budget == auto_of(room, ring_bytes(directory))
        assert "cgroup v1 " in plan.describe() and "bench: limit" in plan.describe()


def test_a_number_keeps_deepspeeds_meaning_elements_of_the_dtype(models):
    directory, _ = models["llama", torch.float32]
    with init_inference(directory, max_in_cpu=100_000, disk_gbps=1.0) as engine:
        assert engine.plan.budget == 400_000 and engine.plan.budget_source == ""


def test_auto_on_a_host_smaller_than_the_weights_that_must_stay_names_the_figures(models, monkeypatch, tmp_path):
    directory, _ = models["llama", torch.float32]
    required, _, _ = required_and_kv(directory, 1)
    fake_host(monkeypatch, tmp_path, available=available_for(required // 2, ring_bytes(directory)))
    with pytest.raises(BudgetError) as caught:
        init_inference(directory, max_in_cpu="auto", disk_gbps=1.0)
    message = str(caught.value)
    assert message.startswith("zero_optimization.offload_param.max_in_cpu: the budget of ")
    assert "\"auto\":" in message and "available (MemAvailable" in message and "margin" in message
    assert "cannot hold the weights that must stay in memory" in message and "model.embed_tokens" in message
    assert "more available memory" in message and "raise max_in_cpu" not in message


@pytest.mark.simulated
def test_auto_for_both_tiers_on_a_device(models, monkeypatch, tmp_path):
    directory, _ = models["llama", torch.float32]
    fake_host(monkeypatch, tmp_path, available=4 * GiB)
    with SimulatedDevice(memory_bytes=64 << 20) as device:
        with init_inference(directory, compute_device=device, max_memory={0: "auto", "cpu": "auto"},
                            disk_gbps=1.0) as engine:
            plan = engine.plan
            free, _ = device.memory_info()
            assert plan.device is not None and plan.device.budget <= 0.9 * (64 << 20)
            text = plan.describe()
            assert "max_memory[0] \"auto\": 90% of the simulated device's free" in text
            assert "pinned ring buffers" in text and "available (MemAvailable 4.00 GiB" in text


@pytest.mark.parametrize("config, message", [
    ({"max_in_cpu": "auto", "max_memory": {"cpu": "1GiB"}}, "both set the host's budget"),
    ({"max_in_cpu": "autos"}, "or \"auto\""),
    ({"max_memory": {"cpu": "lots"}}, "max_memory\\['cpu'\\]: .*or \"auto\""),
])
def test_bad_auto_settings_are_refused_naming_the_key(config, message):
    with pytest.raises(ValueError, match=message):
        InferenceConfig.from_dict(None, **config)


def test_the_commands_default_budget_is_auto(models):
    directory, _ = models["llama", torch.float32]
    out = io.StringIO()
    main([str(directory), "--prompt-ids", "5,17,99", "--max-new-tokens", "2", "--disk-gbps", "1.0"], out=out)
    assert "= \"auto\":" in out.getvalue()
    out = io.StringIO()
    main([str(directory), "--prompt-ids", "5,17,99", "--max-new-tokens", "2", "--disk-gbps", "1.0",
          "--max-in-cpu", "100000"], out=out)
    assert "\"auto\"" not in out.getvalue()


@pytest.mark.slow
def test_auto_streams_a_600_mb_model_in_a_container_of_800_mib(monkeypatch, tmp_path):
    """The issue's case: a 592 MiB Llama, "auto", in a cgroup of 800 MiB of which the process holds 0.26 GiB.
    The margin is what generation will take (one 2048-token sequence's activations, by estimate) and 64 MiB,
    not a fixed 512 MiB: the plan streams the decoder layers within the room instead of refusing."""
    import shutil

    import transformers

    from test_infer_generate import scratch_dir

    root = scratch_dir("infer-small-container-")
    try:
        config = transformers.LlamaConfig(hidden_size=1024, intermediate_size=2816, num_hidden_layers=22,
                                          num_attention_heads=16, num_key_value_heads=4, vocab_size=32000,
                                          max_position_embeddings=4096, tie_word_embeddings=False)
        with torch.device("meta"):
            shapes = {n: p.shape for n, p in transformers.AutoModelForCausalLM.from_config(config).named_parameters()}
        from safetensors.torch import save_file

        save_file({n: torch.zeros(s, dtype=torch.bfloat16) for n, s in shapes.items()}, str(root / "model.safetensors"))
        config.save_pretrained(root)
        size = sum(s.numel() * 2 for s in shapes.values())
        assert 560 << 20 < size < 640 << 20
        fake_host(monkeypatch, tmp_path, available=24 * GiB, cgroup_limit=800 << 20, usage=int(0.26 * GiB))
        with init_inference(root, max_in_cpu="auto", disk_gbps=1.0, dtype=torch.bfloat16) as engine:
            plan = engine.plan
            assert plan.streamed and plan.resident_bytes < size
            must = sum(u.nbytes for u in plan.units if not u.streamable)
            assert must < plan.budget < (800 << 20) - int(0.26 * GiB)
            assert plan.memory_bytes + engine.activation_bytes(1, 2048, logits=1) <= (800 << 20) - int(0.26 * GiB)
            assert "activations (1 x 2048 tokens)" in plan.describe()
    finally:
        shutil.rmtree(root, ignore_errors=True)
