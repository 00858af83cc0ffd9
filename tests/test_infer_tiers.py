"""The three tiers (device, pinned host, NVMe): ``max_memory`` as Accelerate names it, the device
tier's placement and the plan's bytes per link (pure arithmetic), and the errors of bad tier
settings, each naming the setting and the figures and leaving nothing behind."""

from __future__ import annotations

import io
import os
import threading

import pytest
import torch
from test_infer_generate import NEW_TOKENS, PAD, one_thread, prompts, reference, saved_model  # noqa: F401 (autouse)

from offload.device import SimulatedDevice, cuda_available
from offload.infer import BudgetError, InferenceConfig, UnitSize, init_inference, make_plan
from offload.infer.cli import main, parse_max_memory
from offload.infer.config import MaxMemory
from offload.infer.plan.device import place_device

KiB = 1 << 10


def units(layers: int = 6, layer: int = 100 * KiB, head: int = 150 * KiB) -> list[UnitSize]:
    """Embeddings (must stay), ``layers`` decoder layers, a norm (must stay) and an output head."""
    return ([UnitSize("embed", 50 * KiB, 50 * KiB, 50 * KiB, False)]
            + [UnitSize(f"layers.{i}", layer, layer + 4 * KiB, layer + 4 * KiB, True) for i in range(layers)]
            + [UnitSize("norm", KiB, 4 * KiB, 4 * KiB, False), UnitSize("head", head, head, head, True)])


# ---- max_memory ------------------------------------------------------------------------------------

@pytest.mark.parametrize("value", [{0: "6GiB", "cpu": "16GiB"}, {"0": "6GiB", "cpu": "16GiB"},
                                   {0: 6 << 30, "cpu": 16 << 30}])
def test_max_memory_reads_as_accelerate_writes_it(value):
    tiers = InferenceConfig.from_dict({"max_memory": value}).max_memory
    assert tiers == MaxMemory(device_index=0, device_bytes=6 << 30, host_bytes=16 << 30)
    assert InferenceConfig(max_memory=value).budget_bytes(2) == 16 << 30  # "cpu" is the host tier's budget


def test_max_memory_in_a_deepspeed_config_beside_offload_param():
    config = {"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "buffer_count": 3}},
              "max_memory": {"0": "6GB"}, "compute_device": "cpu"}
    settings = InferenceConfig.from_dict(config)
    assert settings.max_memory.device_bytes == 6 * 10**9 and settings.max_memory.host_bytes is None
    assert settings.budget_bytes(2) == 2 * 10**9  # max_in_cpu's default, 1e9 elements


@pytest.mark.parametrize("config,message", [
    ({"max_memory": {0: "6GiB", 1: "6GiB"}}, r"max_memory\[1\]: a second device \(max_memory\[0\] is given\)"),
    ({"max_memory": {"disk": "1TB"}}, r"max_memory\['disk'\]: unknown key; use a device index"),
    ({"max_memory": {0: "six"}}, r"max_memory\[0\]: 'six' is not a size"),
    ({"max_memory": {0: 0}}, r"max_memory\[0\]: 0 bytes leaves no room"),
    ({"max_memory": "6GiB"}, r"max_memory: expected a mapping"),
    ({"max_memory": {"cpu": "1GiB"}, "zero_optimization": {"offload_param": {"max_in_cpu": 10}}},
     r"max_in_cpu, max_memory\['cpu'\]: both set the host's budget"),
    ({"compute_device": "tpu"}, r"compute_device: 'tpu' is not allowed; use one of 'auto', 'cpu'"),
])
def test_bad_tier_settings_name_the_key(config, message):
    with pytest.raises(ValueError, match=message):
        InferenceConfig.from_dict(config)
    with pytest.raises(ValueError, match=r"host_to_device_gbps: 0 is not allowed; use GB/s > 0"):
        InferenceConfig.from_dict({}, host_to_device_gbps=0)


def test_the_command_line_flag_is_accelerate_s_mapping():
    assert parse_max_memory("0=6GiB, cpu=16GiB") == {"0": "6GiB", "cpu": "16GiB"}
    with pytest.raises(ValueError, match=r"--max-memory: '6GiB' is not KEY=SIZE"):
        parse_max_memory("6GiB")


# ---- the device tier's placement -------------------------------------------------------------------

def test_the_device_keeps_what_must_stay_then_the_ring_then_whole_layers():
    sizes = units()
    # a unit on the device counts as its buffer (the norm: 1 KiB of weights in a 4 KiB buffer; a layer 104 KiB)
    budget = 54 * KiB + 10 * KiB + 20 * KiB + 2 * 104 * KiB + 2 * 104 * KiB + 150 * KiB
    tier = place_device(sizes, budget=budget, setting="max_memory[0]", ring_slots=2, kv_bytes=20 * KiB,
                        activation_bytes=10 * KiB)
    kept = {u for u in tier.resident if u.startswith("layers.")}
    assert {"embed", "norm", "head"} <= tier.resident and len(kept) == 2  # the head first (largest), then two layers
    assert tier.ring_slots == 2 and tier.slot_nbytes == 104 * KiB  # the largest unit left out
    assert tier.used_bytes <= budget
    # What is left goes to the host tier: one layer in pinned memory, the rest streamed from NVMe.
    host = make_plan([u for u in sizes if u.name not in tier.resident], budget=110 * KiB, buffer_count=2)
    assert len(host.resident) == 1 and len(host.streamed) == 3
    assert host.read_bytes_per_forward == 3 * 104 * KiB


def test_a_device_that_holds_everything_needs_no_ring():
    sizes = units()
    tier = place_device(sizes, budget=1 << 20, setting="max_memory[0]", ring_slots=2)
    assert tier.resident == {u.name for u in sizes} and tier.ring_slots == 0 and tier.ring_bytes == 0


def test_plan_bytes_per_link_and_bound():
    sizes = units()
    tier = place_device(sizes, budget=54 * KiB + 2 * 104 * KiB + 150 * KiB, setting="max_memory[0]", ring_slots=2,
                        host_to_device_bps=1e9)
    assert tier.resident == {"embed", "norm", "head"}
    host = make_plan([u for u in sizes if u.name not in tier.resident], budget=220 * KiB, buffer_count=2,
                     disk_bps=0.5e9, disk_source="given")
    from dataclasses import replace
    plan = replace(host, units=tuple(sizes), resident=host.resident | tier.resident, device=tier)
    assert plan.host_to_device_bytes_per_forward == 6 * 104 * KiB  # every layer crosses once per token
    assert plan.read_bytes_per_forward == 4 * 104 * KiB  # two layers kept in pinned host memory
    assert plan.resident_bytes == 2 * 100 * KiB  # host memory: the device's units aside
    links = plan.link_seconds()
    assert links == pytest.approx({"nvme->host": 4 * 104 * KiB / 0.5e9, "host->device": 6 * 104 * KiB / 1e9})
    assert plan.bound_seconds() == pytest.approx(4 * 104 * KiB / 0.5e9)
    assert "per token: nvme->host 416.0 KiB" in plan.describe()
    unknown = replace(plan, device=replace(tier, host_to_device_bps=None))
    assert unknown.bound_seconds() is None and "speed unknown" in unknown.describe()


@pytest.mark.parametrize("kv,message", [
    (0, r"max_memory\[0\]: the device budget of 200.0 KiB cannot hold the units that must stay on the device "
        r"\(54.0 KiB: embed, norm\) \+ activations 10.0 KiB \+ a copy ring of 2 x 150.0 KiB \(the largest layer\) = "
        r"364.0 KiB; raise max_memory\[0\] to at least that, or set offload_param.buffer_count 1"),
    (64 * KiB, r"\+ KV cache 64.0 KiB \(batch 2 x 100 tokens\) \+ a copy ring .* lower the batch size"),
])
def test_a_device_too_small_for_the_ring_names_the_figures(kv, message):
    with pytest.raises(BudgetError, match=message):
        place_device(units(), budget=200 * KiB, setting="max_memory[0]", ring_slots=2, kv_bytes=kv, kv_shape=(2, 100),
                     activation_bytes=10 * KiB)


# ---- errors through init_inference: nothing written, nothing left behind ----------------------------

@pytest.fixture(scope="module")
def llama():
    yield from saved_model("llama")


def _threads() -> set[threading.Thread]:
    # Left aside: tqdm's monitor (started by a progress bar), and a closed simulated device's stream
    # threads, which SimulatedDevice.close stops without joining (they end on their own).
    return {t for t in threading.enumerate() if t.name != "tqdm_monitor" and not t.name.startswith("simulated-stream-")}


def _nothing_left(directory, files_before, threads_before):
    assert sorted(os.listdir(directory)) == files_before
    assert _threads() <= threads_before


@pytest.mark.simulated
@pytest.mark.parametrize("settings,message", [
    ({"compute_device": "simulated", "max_memory": {0: "2GiB"}},
     r"max_memory\[0\]: 2.0 GiB \(2147483648 bytes\) is more than the simulated device's free memory, 1.0 GiB"),
    ({"compute_device": "cpu", "max_memory": {0: "1GiB"}},
     r"max_memory\[0\]: a device budget, but compute is on the cpu device, whose memory is the host's"),
    pytest.param({"compute_device": "cuda"}, r"compute_device: \"cuda\" is asked for but CUDA is not available here",
                 marks=pytest.mark.skipif(cuda_available(), reason="CUDA is available")),
    ({"compute_device": "simulated", "max_memory": {0: "100KiB"}},
     r"max_memory\[0\]: the device budget of 100.0 KiB cannot hold the units that must stay on the device"),
])
def test_bad_tiers_raise_naming_the_setting_and_leave_nothing(llama, settings, message):
    directory, _ = llama
    files, threads = sorted(os.listdir(directory)), _threads()
    with pytest.raises(ValueError, match=message):
        init_inference(directory, nvme_path=str(directory / "converted"), **settings)
    _nothing_left(directory, files, threads)


@pytest.mark.simulated
def test_a_device_passed_with_another_budget_is_refused(llama):
    directory, _ = llama
    with SimulatedDevice(budget_bytes=1 << 20) as device:
        with pytest.raises(ValueError, match=r"max_memory\[0\]: 2097152 bytes, but the device passed as "
                                             r"compute_device has a budget of 1048576 bytes"):
            init_inference(directory, compute_device=device, max_memory={0: 2 << 20})
        assert device.allocated_bytes == 0


@pytest.mark.simulated
def test_the_command_generates_on_the_simulated_device_within_its_budget(llama):
    directory, model = llama
    out = io.StringIO()
    figures = main([str(directory), "--prompt-ids", "5,17,99,3", "--max-new-tokens", "6", "--compute-device",
                    "simulated", "--max-memory", "0=600KiB,cpu=0", "--disk-gbps", "1", "--host-to-device-gbps", "8"],
                   out=out)
    text = out.getvalue()
    prompt = torch.tensor([[5, 17, 99, 3]])
    with torch.no_grad():
        expected = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=6, do_sample=False,
                                  pad_token_id=PAD)[0, 4:].tolist()
    assert figures["tokens"] == expected
    assert "device: budget 600.0 KiB (max_memory[0])" in text and "streamed:" in text and "per token: nvme->host" in text
    assert "x the tiers' bound of" in text
    assert figures["host_to_device_bytes_per_forward"] > 0 and figures["bound_s_per_token"] > 0


def test_inference_never_names_cuda_outside_the_device_seam():
    """Everything that differs on a GPU goes through offload.device (docs/device.md): offload/infer
    takes a `Device` and branches on ``separate_memory``, never on CUDA."""
    root = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "offload", "infer")
    named = [name for name in sorted(os.listdir(root)) if name.endswith(".py")
             and "cuda" in open(os.path.join(root, name), encoding="utf-8").read().lower()]
    assert named == []


# ---- on a GPU, where there is one -------------------------------------------------------------------

gpu = pytest.mark.skipif(not cuda_available(), reason="needs CUDA (pytest -m gpu on a GPU machine)")


@pytest.mark.gpu
@gpu
def test_a_gpu_budget_over_its_free_memory_names_the_figures(llama):
    directory, _ = llama
    with pytest.raises(ValueError, match=r"max_memory\[0\]: .* is more than the cuda device's free memory, .* of .*; "
                                         r"lower it to at most that"):
        init_inference(directory, compute_device="cuda", max_memory={0: "100000GiB"})


@pytest.mark.gpu
@gpu
def test_the_command_generates_on_the_gpu_within_its_budget(llama):
    directory, model = llama
    out = io.StringIO()
    figures = main([str(directory), "--prompt-ids", "5,17,99,3", "--max-new-tokens", "6", "--compute-device", "cuda",
                    "--max-memory", "0=600KiB,cpu=0", "--disk-gbps", "1", "--host-to-device-gbps", "8"], out=out)
    prompt = torch.tensor([[5, 17, 99, 3]])
    with torch.no_grad():
        expected = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=6, do_sample=False,
                                  pad_token_id=PAD)[0, 4:].tolist()
    assert figures["tokens"] == expected  # fp32 on a GPU against the CPU: the same greedy tokens at this size
    assert "device: budget 600.0 KiB (max_memory[0])" in out.getvalue()
