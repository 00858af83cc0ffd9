"""A mixture-of-experts model reads only the experts its tokens pick (offload/infer/experts/).

Tiny Mixtral, Qwen3-MoE and DeepSeek-V3 models saved by transformers' ``save_pretrained`` (one tensor per
expert on disk, as on the Hub) are generated from with their decoder layers streamed: the tokens equal
transformers' own in memory, and the bytes the engine reads for experts are exactly those of the experts the
routers picked (recorded by a hook on each experts module, independently of the engine's counts).
"""

from __future__ import annotations

import errno
import shutil

import pytest
import torch
import transformers

from offload.infer import init_inference
from tensorio import IOFuture, TensorIOError
from test_infer_families import save_family
from test_infer_generate import scratch_dir

MOE_FAMILIES = ["mixtral", "qwen3_moe", "deepseek_v3"]
NEW_TOKENS = 6


def _prompt(batch: int = 1) -> torch.Tensor:
    return torch.randint(3, 256, (batch, 8), generator=torch.Generator().manual_seed(batch))


@pytest.fixture(scope="module")
def saved():
    """family -> (checkpoint directory, model bytes, transformers' greedy tokens at batch 1 and 3)."""
    root = scratch_dir("infer-experts-")
    built = {}
    try:
        for family in MOE_FAMILIES:
            directory = root / family
            size = save_family(directory, family)
            loaded = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.bfloat16).eval()
            with torch.no_grad():
                tokens = {b: loaded.generate(_prompt(b), max_new_tokens=NEW_TOKENS, do_sample=False,
                                             pad_token_id=0).tolist() for b in (1, 3)}
            built[family] = (directory, size, tokens)
        yield built
    finally:
        shutil.rmtree(root, ignore_errors=True)


def picked_recorder(engine):
    """A forward pre-hook on every experts module recording (layer position, expert) of each forward's picks."""
    picked = []
    for layer in engine.experts.layers:
        def hook(module, args, position=layer.position, count=layer.count):
            picked.append({(position, e) for e in args[1].reshape(-1).tolist() if 0 <= e < count})
        layer.module.register_forward_pre_hook(hook)
    return picked


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_only_the_picked_experts_are_read(saved, family):
    directory, _, reference = saved[family]
    with init_inference(directory, dtype=torch.bfloat16, max_in_cpu=0, disk_gbps=1.0) as engine:
        store = engine.experts
        assert store is not None and "experts:" in str(engine.plan)
        store.guess = False  # every read is then one the router asked for
        picked = picked_recorder(engine)
        tokens = engine.generate(_prompt(), max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0).tolist()
        assert tokens == reference[1]
        experts = {(layer.position, e.index): e for layer in store.layers for e in layer.experts}
        expected = sum(experts[key].read_nbytes for step in picked for key in step)
        whole = sum(e.read_nbytes for e in experts.values()) * len(picked) // len(store.layers)
        assert store.counts.bytes_read == expected  # no cache (budget 0): each pick read once per forward
        assert store.counts.reads == sum(len(step) for step in picked)
        assert expected < whole  # top 2 of 4 at batch 1: fewer bytes than every expert every forward


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_guesses_cache_and_batches_keep_transformers_tokens(saved, family):
    """The next layer's experts guessed and read ahead, a cache by use, and a batch of 3 whose union of picks
    is read once per layer: the same tokens as transformers."""
    directory, size, reference = saved[family]
    with init_inference(directory, dtype=torch.bfloat16, max_in_cpu=size // 4, disk_gbps=1.0) as engine:
        store = engine.experts
        for batch in (1, 3):
            out = engine.generate(_prompt(batch), max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
            assert out.tolist() == reference[batch]
        counts = store.counts
        assert counts.guessed and counts.guessed_used  # guesses were read, and some were right
        assert 0 < store.cache_bytes <= store.capacity
        kept = [store.uses[key] for key in store.cache]
        others = [n for key, n in store.uses.items() if key not in store.cache]
        assert sum(kept) / len(kept) >= sum(others) / max(1, len(others))  # the most used stay


def test_every_expert_kept_once_read_reads_none_again(saved):
    """A cache that holds every expert beside the streamed layers: once each is read, a generate reads no expert."""
    directory, size, reference = saved["mixtral"]
    with init_inference(directory, dtype=torch.bfloat16, max_in_cpu=size // 3, disk_gbps=1.0) as engine:
        store = engine.experts
        assert store is not None  # the decoder layers' other weights fit, the experts do not
        store.set_capacity(store.total_nbytes)
        assert all(store.keep(layer.position, expert.index) for layer in store.layers for expert in layer.experts)
        before = store.counts.bytes_read
        out = engine.generate(_prompt(), max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
        assert out.tolist() == reference[1]
        assert store.counts.bytes_read == before and store.counts.hits == store.counts.picked


def test_whole_streams_every_expert_with_its_layer(saved):
    directory, _, reference = saved["mixtral"]
    with init_inference(directory, dtype=torch.bfloat16, max_in_cpu=0, disk_gbps=1.0, experts="whole") as whole:
        tokens = whole.generate(_prompt(), max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0).tolist()
        assert whole.experts is None and "experts:" not in str(whole.plan)
        whole_bytes = whole.io_bytes()
    with init_inference(directory, dtype=torch.bfloat16, max_in_cpu=0, disk_gbps=1.0) as routed:
        routed.experts.guess = False
        routed.generate(_prompt(), max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
        routed_bytes = routed.io_bytes()
    assert tokens == reference[1]
    assert routed_bytes < whole_bytes


def test_a_resident_model_keeps_its_experts_in_its_layers(saved):
    directory, size, reference = saved["qwen3_moe"]
    with init_inference(directory, dtype=torch.bfloat16, max_in_cpu=4 * size, disk_gbps=1.0) as engine:
        assert engine.experts is None and not engine.plan.streamed
        out = engine.generate(_prompt(), max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
        assert out.tolist() == reference[1]


def test_a_failed_expert_read_raises_and_the_next_generate_works(saved, monkeypatch):
    directory, _, reference = saved["mixtral"]
    with init_inference(directory, dtype=torch.bfloat16, max_in_cpu=0, disk_gbps=1.0) as engine:
        store = engine.experts
        real = store.handle.read
        failing = {"left": 1}

        def read(buffer, path, offset):  # the first read into an expert slot fails as the disk reports it
            if failing["left"] and any(s.data_ptr() <= buffer.data_ptr() < s.data_ptr() + s.numel() for s in store.slots):
                failing["left"] -= 1
                future = IOFuture()
                future._resolve(0, TensorIOError(errno.EIO, "read (injected)", path=path, offset=offset,
                                                  length=buffer.numel()))
                return future
            return real(buffer, path, offset)

        monkeypatch.setattr(store.handle, "read", read)
        with pytest.raises(TensorIOError, match="injected"):
            engine.generate(_prompt(), max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
        assert not store._reads and len(store._free) == store.slot_count  # every slot given back
        out = engine.generate(_prompt(), max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
        assert out.tolist() == reference[1]


def test_an_unknown_experts_setting_is_refused():
    with pytest.raises(ValueError, match=r"experts: 'all' is not allowed; use \"routed\""):
        init_inference("/nonexistent", experts="all")
