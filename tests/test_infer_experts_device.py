"""Experts read by the router's choice with compute on a device of its own: the tiers per expert there too
(offload/infer/experts/device.py), on the simulated device.

Tiny random Mixtral and Qwen2-MoE models saved by transformers' ``save_pretrained`` (one tensor per expert
on disk; tests/test_infer_families.py's, Qwen2-MoE with 8 experts) generate on a simulated device whose
budget holds every unit but the experts (attention, norms, routers, the head), the KV cache and
activations of the generate, the experts' copy slots, and only a few experts: the most used are kept
there, the others copied there when picked, from pinned host memory (the host tier, kept by use too) or
read from NVMe. In bf16 and int4: the tokens equal our run with every weight resident on the CPU (and
transformers' on the CPU in bf16), the logits those of the same routed run on the CPU bit for bit, with
the copies run late (only when waited for) or after random delays; the device buffers the seam counts
never exceed the budget less the KV cache's and the activations' room; experts move between the tiers as
their use counts grow (the device tier's counters); the plan says how many experts stay on the device, in
host memory and stream. A device too small for a whole layer of experts copies them one by one. An
expert needed on the device but not copied there fails loudly instead of computing on the host.
"""

from __future__ import annotations

import shutil

import pytest
import torch
import transformers
from torch.nn.attention import SDPBackend, sdpa_kernel
from test_infer_families import save_family
from test_infer_generate import one_thread  # noqa: F401 - autouse: one compute thread for tiny matrices
from test_infer_generate import scratch_dir

from offload.device import DeviceSyncError, SimulatedDevice, cuda_available
from offload.infer import BudgetError, init_inference
from offload.infer.experts import DeviceExperts, ExpertPlan
from offload.infer.experts.device import ExpertLayout

pytestmark = pytest.mark.simulated

MOE = ["mixtral", "qwen2_moe"]
WIDER = {"qwen2_moe": dict(num_experts=8, moe_intermediate_size=64)}
"""Qwen2-MoE with 8 experts of twice the width: its 4 tiny int4 experts a layer would fit the device beside
the rest, the whole model kept there (no expert to route)."""
DTYPES = {"bf16": None, "int4": {"num_bits": 4, "group_size": 32}}
"""int4 in groups of 32: every expert projection of the tiny configs is packed."""
PROMPT, NEW_TOKENS = 8, 6
BUFFERS = 1
"""offload_param.buffer_count: copy slots on the device are buffer_count x top-k experts."""


def _prompt() -> torch.Tensor:
    return torch.randint(3, 256, (1, PROMPT), generator=torch.Generator().manual_seed(1))


def _generate(engine, prompt: torch.Tensor | None = None) -> tuple[list, torch.Tensor]:
    """Greedy tokens and every step's logits, on the host."""
    prompt = _prompt() if prompt is None else prompt
    out = engine.generate(prompt.to(engine.device), max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0,
                          output_logits=True, return_dict_in_generate=True)
    return out.sequences.cpu().tolist(), torch.stack(out.logits).cpu()


@pytest.fixture(scope="module")
def saved():
    """family -> (checkpoint directory, model bytes, scratch root for the quantized caches, transformers' tokens)."""
    root = scratch_dir("infer-experts-device-")
    built = {}
    try:
        for family in MOE:
            size = save_family(root / family, family, **WIDER.get(family, {}))
            loaded = transformers.AutoModelForCausalLM.from_pretrained(root / family, dtype=torch.bfloat16).eval()
            with torch.no_grad():
                tokens = loaded.generate(_prompt(), max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0).tolist()
            built[family] = (root / family, size, root, tokens)
        yield built
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _settings(saved, family: str, dtype: str) -> dict:
    directory, _, root, _ = saved[family]
    settings = dict(dtype=torch.bfloat16, disk_gbps=1.0, buffer_count=BUFFERS)
    if DTYPES[dtype] is not None:
        settings.update(weight_quantization=DTYPES[dtype], nvme_path=str(root))
    return settings


@pytest.fixture(scope="module")
def on_the_cpu(saved):
    """(family, dtype) -> ((tokens, logits) with every weight resident on the CPU, (tokens, logits) routed on
    the CPU with every decoder layer streamed), attention on torch's math kernel (the simulated device's)."""
    found = {}

    def runs(family: str, dtype: str):
        if (family, dtype) not in found:
            directory, size, _, _ = saved[family]
            settings = _settings(saved, family, dtype)
            with sdpa_kernel([SDPBackend.MATH]):
                with init_inference(directory, max_in_cpu=4 * size, **settings) as engine:
                    assert engine.experts is None and not engine.plan.streamed
                    resident = _generate(engine)
                with init_inference(directory, max_in_cpu=0, **settings) as engine:
                    assert engine.experts is not None and engine.experts.device is None
                    routed = _generate(engine)
            found[family, dtype] = resident, routed
        return found[family, dtype]

    return runs


def budgets(directory, settings: dict, keep: int) -> dict:
    """The device budget that holds every unit but the experts (each as the buffer the device gives it), the KV
    cache and activations of a generate's prefill, the experts' copy slots and ``keep`` experts; and its parts.
    Measured on a CPU engine that routes the experts (its units are the device's without their experts)."""
    with init_inference(directory, max_in_cpu=0, **settings) as probe:
        layers = probe.experts.layers
        packed = max(ExpertLayout.of(layer).nbytes for layer in layers)
        tokens = PROMPT + NEW_TOKENS
        parts = {"units": sum(u.buffer_nbytes for u in probe.units), "kv": probe.kv_bytes(1, tokens),
                 "prefill": probe.activation_bytes(1, tokens, logits=1, context=tokens),
                 "decode": probe.activation_bytes(1, 1, logits=1, context=tokens),
                 "slots": BUFFERS * max(layer.top_k for layer in layers) * packed, "packed": packed,
                 "experts": sum(layer.count for layer in layers)}
    parts["budget"] = parts["units"] + parts["kv"] + parts["prefill"] + parts["slots"] + keep * packed
    return parts


class PeakDevice(SimulatedDevice):
    """The simulated device, with the largest `allocated_bytes` (the seam's accounting) after any allocation."""

    peak = 0

    def empty(self, *args, **kwargs):
        buffer = super().empty(*args, **kwargs)
        self.peak = max(self.peak, self.allocated_bytes)
        return buffer


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("family", MOE)
def test_the_device_keeps_the_most_used_experts_and_gives_the_cpu_tokens(saved, on_the_cpu, family, dtype):
    directory, size, _, transformers_tokens = saved[family]
    settings = _settings(saved, family, dtype)
    keep = 3
    parts = budgets(directory, settings, keep)
    host = 2 * parts["packed"] + (BUFFERS * 2 + 1) * parts["packed"]  # pinned: two experts and those in transit
    schedule = "late" if dtype == "int4" else "random"  # a copy runs only when waited for, or after a random delay
    with PeakDevice(budget_bytes=parts["budget"], budget_setting="max_memory[0]", schedule=schedule) as device:
        with init_inference(directory, compute_device=device, max_memory={"cpu": host}, **settings) as engine:
            store = engine.experts
            assert store is not None and isinstance(store.device, DeviceExperts)
            assert not engine.plan.streamed  # every unit but the experts fits on the device: no copy ring
            plan = engine.reserve(1, PROMPT + NEW_TOKENS, logits=1)  # the generate's prefill, as it reserves it
            experts = plan.experts
            assert experts.on_device == keep and experts.in_host_memory == 2
            assert experts.streamed == parts["experts"] - keep - 2
            assert (f"kept by use (of {parts['experts']} experts): {keep} on the device "
                    f"({keep * parts['packed'] / 1024:.1f} KiB), 2 in pinned host memory "
                    f"({2 * parts['packed'] / 1024:.1f} KiB), {experts.streamed} streamed from NVMe when picked") in str(plan)
            assert plan.host_to_device_bytes_per_forward >= experts.host_to_device_bytes_per_forward > 0
            tokens, logits = _generate(engine)
            tier = store.device
            # 1. The CPU's tokens, and the routed CPU run's logits bit for bit.
            resident, routed = on_the_cpu(family, dtype)
            assert tokens == resident[0] and torch.equal(logits, routed[1])
            if dtype == "bf16":
                assert tokens == transformers_tokens
            # 2. Within the budget at every allocation, the KV cache's and the activations' room left alone.
            assert 0 < device.peak <= parts["budget"] - parts["kv"] - parts["decode"]
            assert tier.kept_bytes <= engine.plan.experts.device_cache_bytes
            # 3. The tiers moved by use: experts kept on the device, hit there, and taken off for more used ones.
            counts = tier.counts
            assert 0 < len(tier.kept) < parts["experts"] and counts.hits > 0 and counts.copies > 0
            assert counts.kept > len(tier.kept) and counts.demoted > 0  # back to pinned host memory
            assert counts.staged_ahead_used > 0  # a next layer's guess, held on the host, staged ahead and used
            on_device = [store.uses[k] for k in tier.kept]
            others = [n for k, n in store.uses.items() if k not in tier.kept]
            assert min(on_device) >= sum(others) / len(others)  # the most used stay
            # 4. The host tier holds pinned experts, none of those on the device, within its share.
            assert store.cache and not set(store.cache) & set(tier.kept)
            assert all(device.is_pinned(buffer) for buffer in store.cache.values())
            assert store.cache_bytes <= engine.plan.experts.cache_bytes
            # A second prompt: the kept experts compute there again (and the tokens stay the CPU's).
            hits = counts.hits
            again = torch.randint(3, 256, (1, PROMPT), generator=torch.Generator().manual_seed(7))
            tokens, _ = _generate(engine, again)
            assert counts.hits > hits
        assert device.allocated_bytes == 0  # every expert's device buffer given back
    with sdpa_kernel([SDPBackend.MATH]), init_inference(directory, max_in_cpu=4 * size, **settings) as engine:
        assert tokens == _generate(engine, again)[0]


def test_an_expert_not_copied_to_the_device_fails_loudly(saved, monkeypatch):
    """Values left on the host: the device refuses to mix them in (as a GPU would), nothing computes on the host.
    A copy not waited for (the late schedule runs a copy only then): the device's check names the buffer.
    Either way the next generate works."""
    directory, _, _, reference = saved["mixtral"]
    settings = _settings(saved, "mixtral", "bf16")
    parts = budgets(directory, settings, 0)
    with SimulatedDevice(budget_bytes=parts["budget"], budget_setting="max_memory[0]", schedule="late") as device:
        with init_inference(directory, compute_device=device, max_in_cpu=0, **settings) as engine:
            engine.wait_loaded()
            with monkeypatch.context() as patch:  # the copy slot skipped: host values bound
                patch.setattr(DeviceExperts, "stage", lambda tier, key, host: tier.layouts[key[0]].views(host))
                with pytest.raises(RuntimeError, match=r"Expected all tensors to be on the same device.* and cpu"):
                    _generate(engine)
            with monkeypatch.context() as patch:  # the compute stream does not wait for the copy
                patch.setattr(device.compute_stream, "wait_event", lambda event: None)
                with pytest.raises(DeviceSyncError, match=r"device buffer 'expert-slots\[\d\]' read on stream "
                                                          r"'compute' before the event of its copy"):
                    _generate(engine)
            assert _generate(engine)[0] == reference
        assert device.allocated_bytes == 0


def test_a_device_too_small_for_a_whole_layer_of_experts_copies_them_one_by_one(saved, on_the_cpu):
    """A device whose budget cannot hold a copy ring of one whole decoder layer (its experts included) refuses
    ``experts`` "whole"; routed, the layers go through a ring of their other weights and the experts one by one."""
    directory, _, _, transformers_tokens = saved["mixtral"]
    settings = _settings(saved, "mixtral", "bf16")
    with init_inference(directory, max_in_cpu=0, experts="whole", **settings) as probe:  # whole layers, on the CPU
        ring = BUFFERS * max(u.buffer_nbytes for u in probe.units if u.streamable)
        must = sum(u.buffer_nbytes for u in probe.units if not u.streamable)
        budget = must + probe.activation_bytes(1, 1) + ring - 1
    with SimulatedDevice(budget_bytes=budget, budget_setting="max_memory[0]") as device:
        with pytest.raises(BudgetError, match=r"max_memory\[0\]: the device budget .* a copy ring of 1 x"):
            init_inference(directory, compute_device=device, max_in_cpu=0, experts="whole", **settings)
        with init_inference(directory, compute_device=device, max_in_cpu=0, **settings) as engine:
            assert engine.experts is not None and engine.plan.streamed and engine.plan.device.ring_slots
            tokens, logits = _generate(engine)
        assert device.allocated_bytes == 0
    resident, routed = on_the_cpu("mixtral", "bf16")
    assert tokens == resident[0] == transformers_tokens and torch.equal(logits, routed[1])


def test_the_experts_plan_counts_each_tier():
    """Pure arithmetic: 3 layers x 4 experts of 36 KiB (packed 36.5 KiB), the device holding 3, host memory 2."""
    packed = 36 * 1024 + 512
    plan = ExpertPlan(layers=3, count=4, top_k=2, expert_nbytes=36 * 1024, expert_read_nbytes=40 * 1024, slots=2,
                      slot_nbytes=44 * 1024, cache_bytes=2 * packed + 100, batch=1, device_cache_bytes=3 * packed + 5,
                      device_slots=2, packed_nbytes=packed)
    assert (plan.on_device, plan.in_host_memory, plan.streamed) == (3, 2, 7)
    assert plan.memory_bytes == 2 * 44 * 1024 + 2 * packed + 3 * packed  # read slots, two kept, three in transit
    assert plan.host_to_device_bytes_per_forward == int(3 * 2.0 * packed * (1 - 3 / 12))  # 2 picked a layer
    assert plan.read_bytes_per_forward == int(3 * 2.0 * 40 * 1024 * (1 - 5 / 12))
    assert ("kept by use (of 12 experts): 3 on the device (109.5 KiB), 2 in pinned host memory (73.0 KiB), 7 streamed "
            "from NVMe when picked") in plan.describe()
    host_only = ExpertPlan(layers=3, count=4, top_k=2, expert_nbytes=36 * 1024, expert_read_nbytes=40 * 1024, slots=2,
                           slot_nbytes=44 * 1024, cache_bytes=5 * 36 * 1024, batch=1)
    assert (host_only.on_device, host_only.in_host_memory, host_only.streamed) == (0, 5, 7)
    assert host_only.host_to_device_bytes_per_forward == 0 and "5 of 12 experts, 7 streamed" in host_only.describe()


# ---- on a GPU, where there is one ---------------------------------------------------------------------

gpu = pytest.mark.skipif(not cuda_available(), reason="needs CUDA (pytest -m gpu on a GPU machine)")


@pytest.mark.gpu
@gpu
def test_on_a_gpu_the_most_used_experts_stay_there_and_give_transformers_tokens(saved):
    """The first test's device tier on CUDA: the tokens of transformers' model on the same GPU."""
    directory, _, _, _ = saved["mixtral"]
    settings = _settings(saved, "mixtral", "bf16")
    parts = budgets(directory, settings, 3)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.bfloat16).to("cuda").eval()
    with torch.no_grad():
        expected = loaded.generate(_prompt().cuda(), max_new_tokens=NEW_TOKENS, do_sample=False,
                                   pad_token_id=0).cpu().tolist()
    del loaded
    host = 2 * parts["packed"] + (BUFFERS * 2 + 1) * parts["packed"]
    with init_inference(directory, compute_device="cuda", max_memory={0: parts["budget"], "cpu": host},
                        **settings) as engine:
        assert engine.experts is not None and engine.experts.device is not None
        tokens, _ = _generate(engine)
        counts = engine.experts.device.counts
        assert 0 < len(engine.experts.device.kept) < parts["experts"]
    assert tokens == expected and counts.hits > 0 and counts.kept > 0
