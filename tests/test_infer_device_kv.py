"""The KV cache on the host (pinned memory or NVMe) while compute runs on a device with memory of its own,
on the simulated device (random copy delays): each layer's keys and values go to the device per token
through the seam, the new token's come back. Tokens equal the in-memory transformers model's (which the
device-resident cache also equals: tests/test_infer_device_ring.py), for batch 1 and a padded batch."""

from __future__ import annotations

import contextlib

import pytest
import torch
from test_infer_device_ring import TOKENS, generate, gpu, models, sizes, tier_settings  # noqa: F401 (fixture)
from test_infer_generate import NEW_TOKENS, PAD, assert_same_generation, one_thread, prompts, reference  # noqa: F401 (autouse)

from offload.device import DeviceSyncError, SimulatedDevice
from offload.infer import BudgetError, init_inference


@contextlib.contextmanager
def engine_on(directory, budget: int, settings: dict, seed: int = 0):
    """(device, engine) on a simulated device of ``budget`` bytes; every device buffer given back on exit."""
    with SimulatedDevice(budget_bytes=budget, budget_setting="max_memory[0]", seed=seed, register_host=True) as device:
        with init_inference(directory, compute_device=device, **settings) as engine:
            yield device, engine
        assert device.allocated_bytes == 0


def check_staged(engine, batch: int) -> None:
    """The plan keeps the cache on the host and counts its copies to the device per token."""
    plan = engine.plan
    decoded = engine.kv_bytes(batch, TOKENS, quantized=False)  # what the device buffers hold (dequantized)
    assert plan.kv.staged_nbytes * plan.kv.layers * plan.kv.micro_batches >= decoded
    assert plan.device.kv_link_bytes == decoded
    assert plan.device.kv_bytes == 2 * plan.kv.staged_nbytes  # the device holds its two buffers, not the cache
    weights = sum(u.device_copy_nbytes for u in plan.units if u.name not in plan.device.resident)
    assert plan.host_to_device_bytes_per_forward == weights + decoded


@pytest.mark.simulated
@pytest.mark.parametrize("where", ["cpu", "nvme"])
@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_a_kv_cache_on_the_host_generates_the_same_tokens(models, tmp_path, kind, batch, where):
    directory, model = models[kind, torch.float32]
    seed = {"llama": 1, "gpt2": 2}[kind] + batch + (10 if where == "nvme" else 0)  # a different copy schedule each
    budget, settings = tier_settings(directory, batch, "host")  # the device could hold the cache: honoured anyway
    settings["kv_offload"] = {"device": where, "nvme_path": str(tmp_path)}
    with engine_on(directory, budget, settings, seed) as (device, engine):
        ours = generate(engine, batch)
        check_staged(engine, batch)
        assert (engine.plan.kv.nvme_layers == tuple(range(engine.plan.kv.layers))) == (where == "nvme")
        if where == "nvme" and batch > 1:  # batch 1's 24 tokens are less than a page: they stay in the tail
            assert engine.kv_bytes_written > 0 and engine.kv_bytes_read > 0
        assert device.allocated_bytes <= device.budget_bytes
    assert_same_generation(ours, reference(model, batch, do_sample=False), torch.float32)
    assert not list(tmp_path.iterdir())  # the cache's files are removed


def attention_modules(engine) -> list:
    """The decoder layers' attention modules, in forward order (Llama's ``self_attn``, GPT-2's ``attn``)."""
    return [m for name, m in engine.module.named_modules() if name.endswith((".self_attn", ".attn"))]


@pytest.mark.simulated
@pytest.mark.parametrize("where,batch,micro", [("cpu", 1, None), ("nvme", 4, None), ("nvme", 4, 2)])
def test_each_layers_cache_is_copied_to_the_device_while_the_layer_before_computes(models, tmp_path, where, batch,
                                                                                    micro):
    directory, model = models["llama", torch.float32]
    budget, settings = tier_settings(directory, batch, "host")
    settings["kv_offload"] = {"device": where, "nvme_path": str(tmp_path)}
    if micro:
        settings["block_schedule"] = {"micro_batch_size": micro}  # the parts of a layer in turn, each staged ahead
    with engine_on(directory, budget, settings, seed=7) as (device, engine):
        windows: list[list[int]] = []  # per attention call (a layer, or one micro-batch's part): the copy log's
        hooks = []                     # length when it starts and when it has finished
        for attention in attention_modules(engine):
            hooks.append(attention.register_forward_pre_hook(lambda *_: windows.append([len(device.copy_log)])))
            hooks.append(attention.register_forward_hook(lambda *_: windows[-1].append(len(device.copy_log))))
        try:
            ours = generate(engine, batch)
        finally:
            for hook in hooks:
                hook.remove()
        assert engine.plan.kv.micro_batches == (batch // micro if micro else 1)
        log = device.copy_log
    assert_same_generation(ours, reference(model, batch, do_sample=False), torch.float32)
    parts = 6 * (batch // micro if micro else 1)
    assert len(windows) == parts * NEW_TOKENS  # a prefill and NEW_TOKENS - 1 steps
    kv = [[record for record in log[start:end] if record.buffer.startswith("kv[")] for start, end in windows]
    for i, copies in enumerate(kv):
        # During its attention a part copies its new keys back, then starts the next part's cache on its way;
        # its own cache was copied before (the prefill's parts hold no tokens before: nothing to copy there,
        # until the last part starts the first one's for the next forward).
        expected = ["to_host", "to_device"] if i >= parts - 1 else ["to_host"]
        assert [record.direction for record in copies] == expected, (i, copies)
        assert copies[0].stream == "kv-copies"
        if i >= parts - 1 and i + 1 < len(kv):
            # The next part's attention reads (and copies its new keys back from) the buffer filled then.
            assert kv[i + 1][0].buffer == copies[1].buffer != copies[0].buffer
            assert copies[1].nbytes > 0


def budget_without_the_cache(directory, batch: int) -> tuple[int, dict, dict]:
    """(device budget, settings, sizes): the device holds what must stay, the activations, the weights'
    ring and half the KV cache (two layers' worth of the six is what its buffers need), not the cache."""
    budget, settings = tier_settings(directory, batch, "host")
    s = sizes(directory, batch)
    return budget - s["kv"] // 2, settings, s


@pytest.mark.simulated
@pytest.mark.parametrize("batch", [1, 4])
def test_a_kv_cache_too_large_for_the_device_goes_to_the_host_by_itself(models, tmp_path, batch):
    directory, model = models["gpt2", torch.float32]
    budget, settings, s = budget_without_the_cache(directory, batch)
    settings["kv_offload"] = {"nvme_path": str(tmp_path)}  # device "auto"
    layer = s["kv"] // 6
    # Host room for the NVMe ring and the two staging buffers only: the cache goes on to NVMe, bounded by the disk.
    settings["max_in_cpu"] = f"{4 * layer + layer // 2}B"
    with engine_on(directory, budget, settings, seed=5) as (device, engine):
        ours = generate(engine, batch)
        check_staged(engine, batch)
        assert engine.plan.kv.nvme_layers == tuple(range(engine.plan.kv.layers))
        assert device.allocated_bytes <= budget < s["required"] + s["activations"] + s["kv"] + 2 * s["slot"]
    assert_same_generation(ours, reference(model, batch, do_sample=False), torch.float32)


class _Unwaited:
    """A copy's event whose ``synchronize`` forgets to wait."""

    def __init__(self, event) -> None:
        self.event = event

    def synchronize(self) -> None:
        pass


@pytest.mark.simulated
def test_new_keys_read_before_their_copy_to_the_host_is_waited_for_raise(models, monkeypatch):
    directory, _ = models["llama", torch.float32]
    budget, settings = tier_settings(directory, 1, "host")
    settings["kv_offload"] = {"device": "cpu"}
    with engine_on(directory, budget, settings, seed=1) as (device, engine):
        to_host = device.to_host
        monkeypatch.setattr(device, "to_host", lambda dst, src, *, stream: _Unwaited(to_host(dst, src, stream=stream)))
        with pytest.raises(DeviceSyncError, match=r"read by the host while copy #\d+ from device buffer "
                                                  r"'kv\[\d\]' may still fill it"):
            generate(engine, 1)


@pytest.mark.simulated
def test_a_device_that_cannot_hold_even_the_kv_buffers_names_the_figures(models):
    directory, _ = models["llama", torch.float32]
    budget, settings, s = budget_without_the_cache(directory, 4)
    with engine_on(directory, budget - s["kv"] // 2, settings) as (_, engine):
        ids, mask = prompts(4)
        with pytest.raises(BudgetError, match=r"max_memory\[0\]: the device budget of .* \+ activations .* \+ KV cache "
                                              r"buffers 2 x .* \(one layer's cache for batch 4 x 24 tokens; the cache "
                                              r"itself is on the host\) \+ a copy ring of 2 x .* raise max_memory\[0\] "
                                              r"to at least"):
            engine.generate(ids, attention_mask=mask, max_new_tokens=TOKENS - 8, pad_token_id=PAD)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("where", ["cpu", "nvme"])
def test_a_kv_cache_on_the_host_generates_the_gpu_resident_caches_tokens_on_a_gpu(models, tmp_path, where):
    directory, _ = models["llama", torch.float32]
    budget, settings = tier_settings(directory, 4, "host")
    with init_inference(directory, compute_device="cuda", max_memory={0: budget}, **settings) as engine:
        resident = generate(engine, 4)
    settings["kv_offload"] = {"device": where, "nvme_path": str(tmp_path)}
    with init_inference(directory, compute_device="cuda", max_memory={0: budget}, **settings) as engine:
        staged = generate(engine, 4)
        check_staged(engine, 4)
    assert staged.sequences.tolist() == resident.sequences.tolist()
    for a, b in zip(staged.logits, resident.logits):
        assert (a - b).abs().max() <= 1e-4 * b.abs().max()


@pytest.mark.simulated
def test_a_quantized_kv_cache_on_the_host_equals_the_cpu_paths(models, tmp_path):
    directory, _ = models["llama", torch.float32]
    kv = {"device": "nvme", "nvme_path": str(tmp_path), "quantization": "int8"}
    with init_inference(directory, device="cpu", disk_gbps=1.0, compute_device="cpu", kv_offload=kv) as engine:
        on_cpu = generate(engine, 4)
    budget, settings = tier_settings(directory, 4, "host")
    settings["kv_offload"] = kv
    with engine_on(directory, budget, settings, seed=4) as (_, engine):
        staged = generate(engine, 4)
        check_staged(engine, 4)  # the device buffers hold the dequantized keys and values
        assert engine.plan.kv.layer_nbytes < engine.plan.kv.staged_nbytes
    assert staged.sequences.tolist() == on_cpu.sequences.tolist()
