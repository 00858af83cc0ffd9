"""``max_in_cpu: "auto"`` / ``max_memory={"cpu": "auto", 0: "auto"}``: the budget taken from the host's
available memory (a fake MemAvailable, a fake cgroup limit), printed with its figures, placing as the
same number of bytes would, and refused with the figures where the host is too small."""

from __future__ import annotations

import io

import pytest
import torch
from test_infer_generate import NEW_TOKENS, PAD, models, one_thread, prompts, reference, required_and_kv  # noqa: F401

import offload.infer.engine as engine_module
from offload.device import AUTO_MARGIN_BYTES, AUTO_MARGIN_SHARE, HostMemory, SimulatedDevice, host_memory
from offload.infer import init_inference
from offload.infer.cli import main
from offload.infer.config import InferenceConfig
from offload.infer.plan.host import BudgetError

GiB = 1 << 30


def available_for(budget: int, ring: int) -> int:
    """The available memory (whole kB, as /proc/meminfo gives it) whose "auto" budget beside ``ring`` bytes
    of ring buffers is at least ``budget`` and at most 1 kB more."""
    available = int((budget + ring + AUTO_MARGIN_BYTES) / (1 - AUTO_MARGIN_SHARE)) // 1024 * 1024
    while auto_of(available, ring) < budget:
        available += 1024
    return available


def auto_of(available: int, ring: int) -> int:
    return available - ring - AUTO_MARGIN_BYTES - int(AUTO_MARGIN_SHARE * available)


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
    _, _, largest = required_and_kv(directory, 1)
    return buffer_count * largest


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
