"""Generation with streamed weights equals the in-memory transformers model, token for token.

Small random Llama and GPT-2 models built from configs, saved as sharded safetensors, run at three
budgets (everything resident; nothing but the embeddings and norms; that with a ring of one buffer
of exactly one layer), batch 1 and a left-padded batch of 4, fp32 (logits within 1e-5 relative) and
bf16 (the same tokens).
"""

from __future__ import annotations

import copy
import io
import json
import logging
import shutil
import tempfile
import threading
from contextlib import redirect_stdout
from pathlib import Path

import pytest
import torch
import transformers

from offload.infer import init_inference

REPO = Path(__file__).resolve().parent.parent
NEW_TOKENS = 16
PAD = 0


def llama_config(**overrides) -> transformers.LlamaConfig:
    values = dict(hidden_size=64, intermediate_size=160, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=256, max_position_embeddings=128, pad_token_id=PAD,
                  bos_token_id=1, eos_token_id=2)
    values.update(overrides)
    return transformers.LlamaConfig(**values)


def gpt2_config(**overrides) -> transformers.GPT2Config:
    values = dict(n_embd=64, n_layer=4, n_head=4, vocab_size=256, n_positions=128, bos_token_id=1, eos_token_id=2,
                  pad_token_id=PAD)
    values.update(overrides)
    return transformers.GPT2Config(**values)


def build_model(kind: str, dtype: torch.dtype = torch.float32, seed: int = 0, **overrides):
    """A random model of ``kind`` ("llama" or "gpt2"), in eval mode."""
    torch.manual_seed(seed)
    config = llama_config(**overrides) if kind == "llama" else gpt2_config(**overrides)
    return transformers.AutoModelForCausalLM.from_config(config).to(dtype).eval()


def save_checkpoint(model, directory: Path, shard: str = "60KB") -> Path:
    """``model.save_pretrained`` as several shards; returns the directory."""
    model.save_pretrained(directory, max_shard_size=shard)
    return directory


def scratch_dir(prefix: str) -> Path:
    """A directory on the local disk (O_DIRECT works there), removed by the caller."""
    root = REPO / ".tio_scratch"
    root.mkdir(exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=prefix, dir=root))


def saved_model(kind: str, shard: str = "60KB", **overrides):
    """A generator for module fixtures: yields (checkpoint directory on the disk, the model), then removes it."""
    root = scratch_dir(f"infer-{kind}-")
    model = build_model(kind, **overrides)
    try:
        yield save_checkpoint(model, root / kind, shard), model
    finally:
        shutil.rmtree(root, ignore_errors=True)


def prompts(batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and attention mask: one prompt of 8, or 4 prompts of 8, 5, 3 and 8 tokens, left-padded."""
    gen = torch.Generator().manual_seed(batch)
    lengths = [8] if batch == 1 else [8, 5, 3, 8]
    ids = torch.full((batch, 8), PAD)
    mask = torch.zeros((batch, 8), dtype=torch.long)
    for row, length in enumerate(lengths):
        ids[row, 8 - length:] = torch.randint(3, 256, (length,), generator=gen)
        mask[row, 8 - length:] = 1
    return ids, mask


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny matrices: one compute thread is faster, and far steadier on a busy 2-core machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def models():
    """(kind, dtype) -> (checkpoint directory, the in-memory reference model)."""
    root = scratch_dir("infer-models-")
    built = {}
    for kind in ("llama", "gpt2"):
        for dtype in (torch.float32, torch.bfloat16):
            model = build_model(kind, dtype)
            built[kind, dtype] = (save_checkpoint(model, root / f"{kind}-{str(dtype)[6:]}"), model)
    yield built
    shutil.rmtree(root, ignore_errors=True)


def reference(model, batch: int, **kwargs):
    ids, mask = prompts(batch)
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, pad_token_id=PAD,
                              output_logits=True, return_dict_in_generate=True, **kwargs)


def required_and_kv(directory: Path, batch: int) -> tuple[int, int, int]:
    """(bytes that must stay resident, KV bytes for the test's generation, largest layer's buffer bytes)."""
    with init_inference(directory, device="cpu", disk_gbps=1.0) as probe:
        required = sum(u.nbytes for u in probe.units if not u.streamable)
        largest = max(u.buffer_nbytes for u in probe.units if u.streamable)
        return required, probe.kv_bytes(batch, 8 + NEW_TOKENS), largest


def tight_budget(directory: Path, batch: int = 1) -> str:
    """A budget that holds only what must stay resident and the KV cache of the test's generation."""
    required, kv, _ = required_and_kv(directory, batch)
    return f"{required + kv}B"


def budget_settings(budget: str, directory: Path, batch: int, itemsize: int) -> dict:
    if budget == "all":
        return {"max_in_cpu": "1GiB"}
    required, kv, largest = required_and_kv(directory, batch)
    settings = {"max_in_cpu": f"{required + kv}B"}
    if budget == "one-buffer":
        settings.update(buffer_count=1, buffer_size=-(-largest // itemsize))
    return settings


def assert_same_generation(ours, ref, dtype: torch.dtype) -> None:
    assert ours.sequences.tolist() == ref.sequences.tolist()
    if dtype == torch.float32:
        for step, (a, b) in enumerate(zip(ours.logits, ref.logits)):
            scale = b.abs().max()
            a = a.to(b.device)  # from the device generation computed on (simgpu, cuda) to the reference's
            assert (a - b).abs().max() <= 1e-5 * scale, f"logits of step {step} differ"


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("budget", ["all", "embeddings", "one-buffer"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_greedy_generation_equals_transformers(models, kind, dtype, budget, batch):
    directory, model = models[kind, dtype]
    itemsize = torch.empty((), dtype=dtype).element_size()
    settings = budget_settings(budget, directory, batch, itemsize)
    with init_inference(directory, disk_gbps=1.0, **settings) as engine:
        ids, mask = prompts(batch)
        ours = engine.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, pad_token_id=PAD,
                               output_logits=True, return_dict_in_generate=True, do_sample=False)
        plan = engine.plan
        if budget == "all":
            assert not plan.streamed
        else:  # nothing but what must stay is resident: every layer (and an untied head) streams
            assert {u.name for u in plan.streamed} == {u.name for u in engine.units if u.streamable}
            assert plan.streamed and all(not u.streamable for u in engine.units if u.name in plan.resident)
            assert engine.streamer.bytes_read >= NEW_TOKENS * plan.read_bytes_per_forward
        if budget == "one-buffer":
            assert len(engine.streamer.buffers) == 1
        # the model's own forward agrees too
        logits = engine(ids, attention_mask=mask).logits
    assert_same_generation(ours, reference(model, batch, do_sample=False), dtype)
    with torch.no_grad():
        expected = model(ids, attention_mask=mask).logits
    if dtype == torch.float32:
        assert (logits - expected).abs().max() <= 1e-5 * expected.abs().max()
    else:
        assert torch.equal(logits.argmax(-1), expected.argmax(-1))


def test_sampling_equals_transformers_with_the_same_seed(models):
    directory, model = models["llama", torch.float32]
    required, kv, _ = required_and_kv(directory, 4)
    with init_inference(directory, max_in_cpu=f"{required + kv}B", disk_gbps=1.0) as engine:
        ids, mask = prompts(4)
        torch.manual_seed(123)
        ours = engine.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, pad_token_id=PAD, do_sample=True,
                               top_k=20, temperature=0.9)
    torch.manual_seed(123)
    with torch.no_grad():
        ref = model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, pad_token_id=PAD, do_sample=True,
                             top_k=20, temperature=0.9)
    assert ours.tolist() == ref.tolist()


def write_tokenizer(directory: Path, vocab_size: int = 256) -> transformers.PreTrainedTokenizerFast:
    """A word-level tokenizer over "<pad>", "<s>", "</s>", "w3" ... "w255" (no download), saved into ``directory``."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, vocab_size)}}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<pad>", pad_token="<pad>",
                                                     bos_token="<s>", eos_token="</s>")
    tokenizer.save_pretrained(directory)
    return tokenizer


def test_text_streamer_prints_what_transformers_prints(models, tmp_path):
    directory, model = models["gpt2", torch.float32]
    tokenizer = write_tokenizer(tmp_path)
    ids = tokenizer("w5 w17 w99 w3", return_tensors="pt").input_ids
    outputs = []
    for runner in ("ref", "ours"):
        text = io.StringIO()
        with redirect_stdout(text):
            streamer = transformers.TextStreamer(tokenizer, skip_prompt=True)
            if runner == "ref":
                with torch.no_grad():
                    model.generate(ids, max_new_tokens=8, do_sample=False, streamer=streamer, pad_token_id=PAD)
            else:
                with init_inference(directory, max_in_cpu=tight_budget(directory), disk_gbps=1.0) as engine:
                    assert engine.plan.streamed
                    engine.generate(ids, max_new_tokens=8, do_sample=False, streamer=streamer, pad_token_id=PAD)
        outputs.append(text.getvalue())
    assert outputs[0] == outputs[1] and outputs[0].strip()


def test_meta_model_with_checkpoint_argument(models):
    directory, model = models["llama", torch.float32]
    with torch.device("meta"):
        meta = transformers.AutoModelForCausalLM.from_config(model.config)
    with init_inference(meta, checkpoint=directory, max_in_cpu=tight_budget(directory), disk_gbps=1.0) as engine:
        assert engine.module is meta and engine.plan.streamed
        ours = engine.generate(prompts(1)[0], attention_mask=prompts(1)[1], max_new_tokens=NEW_TOKENS,
                               pad_token_id=PAD, do_sample=False)
    assert ours.tolist() == reference(model, 1, do_sample=False).sequences.tolist()


def test_kv_cache_counts_against_the_budget_and_layers_move(models):
    directory, model = models["llama", torch.float32]
    required, kv4, _ = required_and_kv(directory, 4)
    _, kv1, _ = required_and_kv(directory, 1)
    with init_inference(directory, device="cpu", disk_gbps=1.0) as probe:
        everything = sum(u.nbytes for u in probe.units)
    budget = everything + kv1  # every layer fits at batch 1, but batch 4's KV cache needs some of their room
    with init_inference(directory, max_in_cpu=f"{budget}B", disk_gbps=1.0) as engine:
        ids, mask = prompts(1)
        engine.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, pad_token_id=PAD, do_sample=False)
        resident_at_1 = set(engine.plan.resident)
        engine.wait_loaded()
        engine(ids, attention_mask=mask)
        assert _hooked(engine) == set()  # every layer kept in memory computes as transformers' own: no hook
        ids4, mask4 = prompts(4)
        ours = engine.generate(ids4, attention_mask=mask4, max_new_tokens=NEW_TOKENS, pad_token_id=PAD,
                               output_logits=True, return_dict_in_generate=True, do_sample=False)
        assert engine.plan.kv_bytes == kv4 and engine.plan.kv_shape == (4, 8 + NEW_TOKENS)
        assert set(engine.plan.resident) < resident_at_1 and engine.plan.resident_bytes + kv4 <= budget
        assert _hooked(engine) == {u.name for u in engine.plan.streamed}  # the demoted ones stream: hooked again
        assert_same_generation(ours, reference(model, 4, do_sample=False), torch.float32)
        engine.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, pad_token_id=PAD, do_sample=False)
        assert set(engine.plan.resident) == resident_at_1  # back when the cache shrinks
        engine.wait_loaded()
        engine(ids, attention_mask=mask)
        assert _hooked(engine) == set()


def _hooked(engine) -> set[str]:
    """The units the streamer has hooks on (none on a resident one); with none, the decoder layers have
    no hook at all, as transformers' own."""
    hooked = {u.name for u in engine.units if u.hooks}
    layers = engine.module.get_submodule("model.layers")
    assert hooked or not any(layer._forward_pre_hooks or layer._forward_hooks for layer in layers)
    return hooked


def test_other_dtype_streams_from_a_converted_copy_written_once(models, tmp_path, caplog, aio_backend):
    directory, model = models["llama", torch.float32]
    settings = dict(dtype="bfloat16", max_in_cpu="50KiB", nvme_path=str(tmp_path), disk_gbps=1.0, aio=aio_backend)
    ref = reference(copy.deepcopy(model).to(torch.bfloat16), 1, do_sample=False).sequences.tolist()  # the shared model stays fp32
    for run in range(2):
        with init_inference(directory, **settings) as engine:
            assert engine.plan.streamed and engine.dtype == torch.bfloat16
            assert engine.handle.backend_name == aio_backend["backend"]
            assert engine.checkpoint.directory.startswith(str(tmp_path))
            ours = engine.generate(prompts(1)[0], attention_mask=prompts(1)[1], max_new_tokens=NEW_TOKENS,
                                   pad_token_id=PAD, do_sample=False)
        assert ours.tolist() == ref
        (converted,) = tmp_path.iterdir()
        marker = converted / "converted.json"
        if run == 0:
            written = marker.stat().st_mtime_ns
        assert marker.stat().st_mtime_ns == written  # the second run reused the copy
    assert json.loads(marker.read_text())["dtype"] == "bfloat16"
    # A bit flipped in the copy is named when it is reused, and the copy is written again.
    shard = sorted(converted.glob("*.safetensors"))[-1]
    from tensorio.testing import flip_bit
    flip_bit(shard, shard.stat().st_size - 5)
    with caplog.at_level(logging.WARNING, logger="offload.infer"):
        with init_inference(directory, **settings) as engine:
            ours = engine.generate(prompts(1)[0], attention_mask=prompts(1)[1], max_new_tokens=NEW_TOKENS,
                                   pad_token_id=PAD, do_sample=False)
    assert f"the cache {converted} is corrupt (checksum mismatch (tensor " in caplog.text
    assert ours.tolist() == ref and marker.stat().st_mtime_ns != written


def test_io_bytes_close_and_context_manager(models):
    directory, _ = models["gpt2", torch.float32]
    engine = init_inference(directory, max_in_cpu=tight_budget(directory), buffer_count=2, disk_gbps=1.0)
    assert engine.wait_loaded() >= 0.0
    loaded = engine.io_bytes()
    assert loaded >= engine.plan.resident_bytes
    engine(prompts(1)[0])
    assert engine.io_bytes() - loaded >= engine.plan.read_bytes_per_forward
    engine.close()
    engine.close()  # twice is fine
    with pytest.raises(RuntimeError, match="closed"):
        engine.generate(prompts(1)[0], max_new_tokens=2)


def test_prefetch_bucket_limits_the_reads_in_flight(models):
    directory, model = models["llama", torch.float32]
    layer = max(u.nbytes for u in init_inference(directory, device="cpu", disk_gbps=1.0).units if u.streamable)
    config = {"zero_optimization": {"stage3_prefetch_bucket_size": layer // 4, "offload_param": {"buffer_count": 3}}}
    with init_inference(directory, config, max_in_cpu=tight_budget(directory), disk_gbps=1.0) as engine:
        assert engine.streamer.lookahead == 1
        ids, mask = prompts(1)
        ours = engine.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, pad_token_id=PAD, do_sample=False)
        assert len(engine.streamer.buffers) == 3  # made in the background, each in use once ready
    assert ours.tolist() == reference(model, 1, do_sample=False).sequences.tolist()


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_the_output_head_gets_a_contiguous_input(models, kind):
    """generate passes the head a slice of the last position; with a weight that does not require grad,
    torch.matmul would multiply a non-contiguous one through a copy of the weight per sequence."""
    directory, model = models[kind, torch.float32]
    with init_inference(directory, max_in_cpu=tight_budget(directory, 4), disk_gbps=1.0) as engine:
        head = engine.module.get_output_embeddings()
        seen = []
        head.register_forward_pre_hook(lambda _, args: seen.append(args[0].is_contiguous()))
        ids, mask = prompts(4)
        engine.generate(ids, attention_mask=mask, max_new_tokens=2, pad_token_id=PAD, do_sample=False)
    assert seen and all(seen)


def test_the_first_forward_runs_while_the_resident_weights_load(models, monkeypatch):
    """The last resident layer's memory is only faulted in once the forward has reached the layer
    before it: the forward started before the load finished, and its output is still exact."""
    from offload.infer.stream import resident_load as stream

    directory, model = models["llama", torch.float32]
    reached, prefault = threading.Event(), stream.prefault
    calls, overlapped = [], []
    with init_inference(directory, device="cpu", disk_gbps=1.0) as probe:  # every unit resident, loaded in order
        last = [i for i, u in enumerate(probe.units) if u.streamable][-1]

    def prefault_last_after_the_forward_reached_it(buffer, *args):
        calls.append(buffer)
        if len(calls) == last + 1:
            overlapped.append(reached.wait(timeout=120))  # an event, with a guard against a hang
        return prefault(buffer, *args)

    monkeypatch.setattr(stream, "prefault", prefault_last_after_the_forward_reached_it)
    with init_inference(directory, device="cpu", disk_gbps=1.0) as engine:
        layers = [u for u in engine.units if u.streamable]
        assert layers[-1].state == "loading" and engine.module.model.embed_tokens.weight.device.type == "cpu"
        layers[-2].module.register_forward_pre_hook(lambda *_: reached.set())
        ids, mask = prompts(1)
        ours = engine.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, pad_token_id=PAD,
                               do_sample=False, output_logits=True, return_dict_in_generate=True)
        assert engine.wait_loaded() > 0 and all(u.state == "resident" for u in engine.units)
    assert overlapped == [True]
    assert_same_generation(ours, reference(model, 1, do_sample=False), torch.float32)


def test_with_a_ring_the_load_reads_its_layers_only_after_the_first_forward(models, monkeypatch):
    """Layers 0 and 2 resident, 1 and 3 (and the head) streamed: until the first forward is done the
    load takes on only what cannot stream (embeddings, norm), so that forward reads layers 0 and 2
    through the ring, with the disk and the cores to itself; the load reads them once it is done.
    The generation is exact."""
    from offload.infer.stream import resident_load as stream

    directory, model = models["llama", torch.float32]
    required, kv, _ = required_and_kv(directory, 1)
    with init_inference(directory, device="cpu", disk_gbps=1.0) as probe:
        layer = max(u.nbytes for u in probe.units if u.name.startswith("model.layers."))
    done, read_windows, reads = threading.Event(), stream.read_windows, []

    def recorded(handle, windows, buffer):
        if threading.current_thread().name == "load-resident":
            reads.append((windows, done.is_set()))
        return read_windows(handle, windows, buffer)

    claim, lent = stream.ResidentLoad.claim, []
    monkeypatch.setattr(stream, "read_windows", recorded)
    # Once the first forward is done, the ring lends nothing more (asked first: a lend refused after
    # the real claim would leave the unit claimed and never read).
    monkeypatch.setattr(stream.ResidentLoad, "claim",
                        lambda load, unit: not done.is_set() and claim(load, unit) and not lent.append(unit.name))
    with init_inference(directory, max_in_cpu=f"{required + kv + 2 * layer}B", disk_gbps=1.0) as engine:
        assert sorted(name for name in engine.plan.resident if name.startswith("model.layers.")) == [
            "model.layers.0", "model.layers.2"]
        engine.module.register_forward_hook(lambda *_: done.set(), prepend=True)  # before the engine's own
        ids, mask = prompts(1)
        ours = engine.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, pad_token_id=PAD,
                               do_sample=False, output_logits=True, return_dict_in_generate=True)
        engine.wait_loaded()
        assert {u.name for u in engine.units if u.state == "resident"} == set(engine.plan.resident)
        streamable = {id(u.windows): u.streamable for u in engine.units}
    layer_reads = [after for windows, after in reads if streamable.get(id(windows))]
    assert sorted(set(lent)) == ["model.layers.0", "model.layers.2"]  # lent to the ring before the first forward ended
    assert len(layer_reads) == 2 and all(layer_reads)  # the load's, after the first forward
    assert_same_generation(ours, reference(model, 1, do_sample=False), torch.float32)
