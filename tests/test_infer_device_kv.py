"""The KV cache on the host (pinned memory or NVMe) while compute runs on a device with memory of its own,
on the simulated device (random copy delays): each layer's keys and values go to the device per token
through the seam, the new token's come back. Tokens equal the in-memory transformers model's (which the
device-resident cache also equals: tests/test_infer_device_ring.py), for batch 1 and a padded batch."""

from __future__ import annotations

import contextlib

import pytest
import torch
from test_infer_device_ring import TOKENS, generate, models, sizes, tier_settings  # noqa: F401 (fixture)
from test_infer_generate import PAD, assert_same_generation, one_thread, prompts, reference  # noqa: F401 (autouse)

from offload.device import DeviceSyncError, SimulatedDevice
from offload.infer import BudgetError, init_inference
from offload.infer.device_kv import KVStager


@contextlib.contextmanager
def engine_on(directory, budget: int, settings: dict, seed: int = 0):
    """(device, engine) on a simulated device of ``budget`` bytes; every device buffer given back on exit."""
    with SimulatedDevice(budget_bytes=budget, budget_setting="max_memory[0]", seed=seed) as device:
        with init_inference(directory, compute_device=device, **settings) as engine:
            yield device, engine
        assert device.allocated_bytes == 0


def check_staged(engine, batch: int) -> None:
    """The plan keeps the cache on the host and counts its copies to the device per token."""
    plan = engine.plan
    assert plan.kv.staged_nbytes * plan.kv.layers * plan.kv.micro_batches >= engine.kv_bytes(batch, TOKENS)
    assert plan.device.kv_link_bytes == engine.kv_bytes(batch, TOKENS)
    assert plan.device.kv_bytes == 2 * plan.kv.staged_nbytes  # the device holds its two buffers, not the cache
    weights = sum(u.buffer_nbytes for u in plan.units if u.name not in plan.device.resident)
    assert plan.host_to_device_bytes_per_forward == weights + engine.kv_bytes(batch, TOKENS)


@pytest.mark.simulated
@pytest.mark.parametrize("seed", [1, 2])
@pytest.mark.parametrize("where", ["cpu", "nvme"])
@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_a_kv_cache_on_the_host_generates_the_same_tokens(models, tmp_path, kind, batch, where, seed):
    directory, model = models[kind, torch.float32]
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
