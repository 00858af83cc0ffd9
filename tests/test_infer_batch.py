"""Continuous batching (offload/infer/batch/): requests that join a running batch and leave it get, token for
token, the greedy answer they get alone (and transformers' own generate gives), while the batch reads the
streamed weights once per step for all of them: N requests together cost one generation's reads, not N.

Tiny random Llama and GPT-2 checkpoints with every decoder layer streamed (``max_in_cpu`` 0: nothing but
the embeddings and norms resident, so every forward reads the same bytes), prompts of 1 to 9 tokens.
Requests join mid-run deterministically: a sink submits them when an earlier request's n-th token comes.
"""

from __future__ import annotations

import shutil
import threading

import pytest
import torch
import transformers
from test_infer_generate import (  # noqa: F401 - one_thread: the module's autouse fixture
    PAD, build_model, one_thread, save_checkpoint, scratch_dir, write_tokenizer)

from offload.infer import init_inference
from offload.infer.answer import Answer
from offload.infer.answer_text import AnswerText
from offload.infer.batch import Batcher, QueueFull, Update, check_settings
from offload.infer.batch.cache_rows import add_rows, append_rows, keep_rows, right_align
from offload.infer.batch.length_groups import length_groups, padded_positions
from offload.infer.config import InferenceConfig
from offload.infer.sampling import SamplingParams

PROMPTS = [[5, 17, 99, 3], [7, 8, 9, 10, 11, 12, 13, 14, 15], [42], [100, 101, 102], [3, 3, 3, 3, 3, 3]]

CHAT_TEMPLATE = ("{% for m in messages %}<s> {{ m['content'] }} {% endfor %}"
                 "{% if add_generation_prompt %}w9{% endif %}")


def write_chat_tokenizer(directory):
    """`write_tokenizer`'s word-level tokenizer with a chat template: "<s> CONTENT " per message, then "w9"."""
    tokenizer = write_tokenizer(directory)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(directory)
    return tokenizer


def reference(model, prompt: list[int], new: int) -> list[int]:
    """transformers' greedy generate of ``new`` tokens on the in-memory model (no end-of-sequence stop)."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                             do_sample=False, pad_token_id=PAD)
    return out[0, len(prompt):].tolist()


class Collector:
    """Sinks that record every request's updates; `wait` returns once ``expected`` requests finished."""

    def __init__(self, expected: int) -> None:
        self.updates: dict[object, list[Update]] = {}
        self.expected, self._done, self._finished = expected, threading.Event(), 0
        self._lock = threading.Lock()
        self.hooks: dict[object, tuple[int, callable]] = {}

    def sink(self, key):
        def take(update: Update) -> None:
            with self._lock:
                self.updates.setdefault(key, []).append(update)
                count = len(self.updates[key])
                if update.last:
                    self._finished += 1
                    if self._finished == self.expected:
                        self._done.set()
            hook = self.hooks.get(key)
            if hook is not None and hook[0] == count:
                hook[1]()
        return take

    def tokens(self, key) -> list[int]:
        return [u.token for u in self.updates[key] if u.token is not None]

    def wait(self) -> None:
        assert self._done.wait(120), f"only {self._finished} of {self.expected} requests finished"


@pytest.fixture(scope="module")
def checkpoints():
    root = scratch_dir("batch-")
    built = {}
    for kind in ("llama", "gpt2"):
        model = build_model(kind)
        built[kind] = (save_checkpoint(model, root / kind), model)
    yield built
    shutil.rmtree(root, ignore_errors=True)


def greedy(new: int) -> SamplingParams:
    return SamplingParams(max_tokens=new, temperature=0, ignore_eos=True)


def alone(engine, prompt: list[int], params: SamplingParams) -> list[int]:
    """The answer the batcher gives ``prompt`` when it is the only request."""
    collector = Collector(1)
    with Batcher(engine) as batcher:
        batcher.submit(prompt, params, collector.sink(0))
        collector.wait()
    return collector.tokens(0)


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_joining_a_running_batch_gives_the_answer_alone(checkpoints, kind):
    directory, model = checkpoints[kind]
    new = [12, 10, 8, 9, 5]
    collector = Collector(len(PROMPTS))
    with init_inference(directory, max_in_cpu=0, disk_gbps=1.0) as engine:
        assert engine.plan.streamed
        with Batcher(engine, max_batch=8, start=False) as batcher:
            submit = lambda i: batcher.submit(PROMPTS[i], greedy(new[i]), collector.sink(i))  # noqa: E731
            collector.hooks[0] = (3, lambda: submit(2))               # joins at request 0's 4th step
            collector.hooks[2] = (2, lambda: (submit(3), submit(4)))  # two join the three running
            submit(0)
            submit(1)
            batcher.start()
            collector.wait()
            stats = batcher.stats()
        assert stats["joined_running"] == 3 and stats["largest_batch"] == 5 and stats["running"] == 0
        for i, prompt in enumerate(PROMPTS):
            expected = reference(model, prompt, new[i])
            assert collector.tokens(i) == expected, f"request {i}"
            assert alone(engine, prompt, greedy(new[i])) == expected
            last = collector.updates[i][-1]
            assert last.finish_reason == "length"
            assert last.usage == {"prompt_tokens": len(prompt), "completion_tokens": new[i],
                                  "total_tokens": len(prompt) + new[i]}


def test_requests_together_share_each_read_of_the_weights(checkpoints):
    """N requests of M tokens: M forwards, each reading the streamed layers once: the reads of one request alone."""
    directory, _ = checkpoints["llama"]
    new, count = 8, 5
    with init_inference(directory, max_in_cpu=0, disk_gbps=1.0) as engine:
        engine.wait_loaded()  # the resident weights' background reads are done before counting
        per_forward = engine.plan.read_bytes_per_forward
        assert per_forward > 0
        start = engine.io_bytes()
        one = alone(engine, PROMPTS[0], greedy(new))
        one_reads = engine.io_bytes() - start
        assert one_reads == new * per_forward

        collector = Collector(count)
        start = engine.io_bytes()
        with Batcher(engine, start=False) as batcher:
            for i in range(count):
                batcher.submit(PROMPTS[i], greedy(new), collector.sink(i))
            batcher.start()
            collector.wait()
            steps = batcher.stats()["steps"]
        together_reads = engine.io_bytes() - start
        assert steps == new
        assert together_reads == one_reads  # not count x one_reads
        assert collector.tokens(0) == one


def test_the_kv_budget_bounds_the_batch_and_the_rest_waits(checkpoints):
    directory, model = checkpoints["llama"]
    new = 6
    with init_inference(directory, max_in_cpu="1GiB", disk_gbps=1.0) as probe:
        must = sum(u.nbytes for u in probe.units if not u.streamable)
        two = probe.kv_bytes(2, max(len(p) for p in PROMPTS) + new)
    collector = Collector(len(PROMPTS))
    with init_inference(directory, max_in_cpu=f"{must + two}B", disk_gbps=1.0) as engine:
        with Batcher(engine, start=False) as batcher:
            for i, prompt in enumerate(PROMPTS):
                batcher.submit(prompt, greedy(new), collector.sink(i))
            batcher.start()
            collector.wait()
            assert batcher.stats()["largest_batch"] == 2
    for i, prompt in enumerate(PROMPTS):
        assert collector.tokens(i) == reference(model, prompt, new)


def test_a_request_whose_cache_never_fits_fails_with_the_figures(checkpoints):
    directory, model = checkpoints["llama"]
    with init_inference(directory, max_in_cpu="1GiB", disk_gbps=1.0) as probe:
        must = sum(u.nbytes for u in probe.units if not u.streamable)
        small = probe.kv_bytes(1, 8)
    collector = Collector(2)
    with init_inference(directory, max_in_cpu=f"{must + small}B", disk_gbps=1.0) as engine:
        with Batcher(engine) as batcher:
            batcher.submit(PROMPTS[1], greedy(60), collector.sink("big"))
            batcher.submit(PROMPTS[0], greedy(3), collector.sink("small"))
            collector.wait()
    (failed,) = collector.updates["big"]
    assert "KV cache of batch 1 x 69 tokens" in failed.error and "--max-in-cpu" in failed.error
    assert collector.tokens("small") == reference(model, PROMPTS[0], 3)


def test_cancelled_requests_leave_and_their_cache_rows_go(checkpoints):
    """50 requests cancelled after their first token (as clients that go away mid-stream), 3 at a time: the
    batch empties, its cache is dropped, and the next request still gets its answer alone."""
    directory, model = checkpoints["gpt2"]
    collector = Collector(0)
    tickets = {}
    gone = threading.Event()
    with init_inference(directory, max_in_cpu=0, disk_gbps=1.0) as engine:
        with Batcher(engine, max_batch=3, start=False) as batcher:
            def cancel(i):
                tickets[i].cancel()
                if i == 49:
                    gone.set()
            for i in range(50):
                collector.hooks[i] = (1, lambda i=i: cancel(i))
                tickets[i] = batcher.submit(PROMPTS[i % len(PROMPTS)], greedy(40), collector.sink(i))
            batcher.start()  # every ticket is known before its first token comes
            assert gone.wait(120)
            final = Collector(1)
            batcher.submit(PROMPTS[1], greedy(7), final.sink(0))
            final.wait()
            stats = batcher.stats()
            assert stats["running"] == 0 and stats["waiting"] == 0 and batcher._cache is None
    assert all(len(collector.updates[i]) <= 2 for i in range(50))  # none ran to its 40 tokens
    assert final.tokens(0) == reference(model, PROMPTS[1], 7)


def test_a_seed_gives_the_same_sample_alone_and_in_a_batch(checkpoints):
    directory, _ = checkpoints["llama"]
    params = SamplingParams(max_tokens=10, temperature=1.5, top_p=0.9, top_k=40, seed=1234, ignore_eos=True)
    with init_inference(directory, max_in_cpu=0, disk_gbps=1.0) as engine:
        lone = alone(engine, PROMPTS[0], params)
        collector = Collector(3)
        with Batcher(engine, start=False) as batcher:
            batcher.submit(PROMPTS[1], SamplingParams(max_tokens=10, temperature=1.0, seed=7), collector.sink(1))
            batcher.submit(PROMPTS[0], params, collector.sink(0))
            batcher.submit(PROMPTS[2], greedy(4), collector.sink(2))
            batcher.start()
            collector.wait()
        other = alone(engine, PROMPTS[0], SamplingParams(max_tokens=10, temperature=1.5, seed=99, ignore_eos=True))
    assert collector.tokens(0) == lone
    assert other != lone  # another seed, another sample (10 tokens from 256 at temperature 1.5)


def test_text_stop_strings_and_the_end_of_sequence(checkpoints, tmp_path):
    directory, model = checkpoints["llama"]
    tokenizer = write_tokenizer(tmp_path)
    expected = reference(model, PROMPTS[0], 12)
    full = tokenizer.decode(expected, skip_special_tokens=True)
    stop = " ".join(full.split()[3:5])
    before = full[:full.index(stop)]  # the answer ends where the stop string first appears
    collector = Collector(2)
    with init_inference(directory, max_in_cpu=0, disk_gbps=1.0) as engine:
        with Batcher(engine, tokenizer, start=False) as batcher:
            batcher.submit(PROMPTS[0], SamplingParams(max_tokens=12, temperature=0, stop=[stop]), collector.sink("s"))
            batcher.submit(PROMPTS[0], greedy(12), collector.sink("all"))
            batcher.start()
            collector.wait()
    text = "".join(u.text for u in collector.updates["s"])
    assert text == before and collector.updates["s"][-1].finish_reason == "stop"
    assert len(collector.updates["s"]) < 12
    assert "".join(u.text for u in collector.updates["all"]) == full
    eos = Answer(2, SamplingParams(max_tokens=5), tokenizer, eos_token_ids=[2])
    assert eos.add(7) == "w7" and eos.add(2) == "" and eos.finish_reason == "stop" and eos.usage()["completion_tokens"] == 2


def test_answer_text_holds_back_a_possible_stop_string(tmp_path):
    tokenizer = write_tokenizer(tmp_path)
    text = AnswerText(tokenizer, stop=("w9 w10",))
    assert text.add(5) == "w5"
    assert text.add(9) == " "         # "w9" may begin the stop string: held back
    assert text.add(11) == "w9 w11"   # it did not
    assert text.add(9) == " " and text.add(10) == "" and text.stopped
    assert text.text == "w5 w9 w11 " and text.finish() == ""


def test_cache_rows_join_leave_and_right_align():
    cache = transformers.DynamicCache()
    keys = torch.arange(2 * 1 * 3 * 2, dtype=torch.float32).reshape(2, 1, 3, 2)
    cache.update(keys, keys + 100, 0)
    mask = torch.tensor([[0, 1, 1], [1, 1, 1]])
    mask = add_rows(cache, mask, 1)
    assert cache.layers[0].keys.shape == (3, 1, 3, 2) and mask.tolist()[2] == [0, 0, 0]
    mask[2, 2] = 1  # the newcomer's one prompt token, as the join step writes it
    mask = keep_rows(cache, mask, [0, 2])
    aligned = right_align(cache, mask)
    assert aligned.tolist() == [[1, 1], [0, 1]]
    assert torch.equal(cache.layers[0].keys[0, 0], keys[0, 0, 1:])  # row 0's two real tokens, in order
    assert torch.equal(cache.layers[0].values[0, 0], keys[0, 0, 1:] + 100)


def test_append_rows_left_pads_the_shorter_cache():
    cache, other = transformers.DynamicCache(), transformers.DynamicCache()
    keys = torch.arange(1 * 1 * 2 * 2, dtype=torch.float32).reshape(1, 1, 2, 2) + 1
    cache.update(keys, keys + 100, 0)
    longer = torch.arange(2 * 1 * 3 * 2, dtype=torch.float32).reshape(2, 1, 3, 2) + 50
    other.update(longer, longer + 100, 0)
    mask = append_rows(cache, torch.tensor([[1, 1]]), other, torch.tensor([[0, 1, 1], [1, 1, 1]]))
    assert mask.tolist() == [[0, 1, 1], [0, 1, 1], [1, 1, 1]]
    assert cache.layers[0].keys.shape == (3, 1, 3, 2) and cache.layers[0].get_seq_length() == 3
    assert torch.equal(cache.layers[0].keys[0, 0], torch.cat([torch.zeros(1, 2), keys[0, 0]]))
    assert torch.equal(cache.layers[0].values[1:], longer + 100)


def test_length_groups_bound_the_padding_with_the_fewest_forwards():
    lengths = sorted(4 + 28 * i // 63 for i in range(64))  # the benchmark's 64 prompts of 4 to 32 tokens
    real = sum(lengths)
    assert length_groups(lengths, 1.0) == [range(64)]  # 64 x 32 = 2,048 positions: within 2 x 1,124
    groups = length_groups(lengths, 0.25)
    assert len(groups) == 4 and padded_positions(lengths, groups) <= 1.25 * real
    assert not any(padded_positions(lengths, [range(0, a), range(a, b), range(b, 64)]) <= 1.25 * real
                   for a in range(1, 63) for b in range(a + 1, 64))  # no three forwards would do
    assert [lengths[g[-1]] for g in length_groups(lengths, 0.0)] == sorted(set(lengths))  # one per length
    assert length_groups([1, 1, 1, 16], 0.25) == [range(0, 3), range(3, 4)]  # decode rows apart from a prefill
    assert length_groups([5, 5, 5], 0.0) == [range(0, 3)] and length_groups([], 0.25) == []
    for lengths, padding in (([3, 2], 0.1), ([0, 2], 0.1), ([1, 2], -0.5)):
        with pytest.raises(ValueError):
            length_groups(lengths, padding)


@pytest.mark.parametrize("kv", [None, "int8"])
@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_with_max_padding_prompts_prefill_by_length_and_answer_alone(checkpoints, kind, kv):
    """``max_padding``: prompts of 1 to 12 tokens that join together are prefilled in forwards by length (the
    padding computed at most that fraction of the real tokens), two long ones joining five running rows get a
    forward of their own, and every request still gets its answer alone (a quantized cache too)."""
    directory, model = checkpoints[kind]
    if kv is not None and kind == "gpt2":
        pytest.skip("the quantized cache is checked on one model")
    prompts = [*PROMPTS, list(range(30, 42)), list(range(50, 61))]
    new = [6, 5, 7, 4, 6, 5, 6]
    collector = Collector(len(prompts))
    options = {} if kv is None else {"kv_offload": {"device": "auto", "quantization": kv}}
    with init_inference(directory, max_in_cpu=0, disk_gbps=1.0, **options) as engine:
        with Batcher(engine, max_batch=8, max_padding=0.25, start=False) as batcher:
            submit = lambda i: batcher.submit(prompts[i], greedy(new[i]), collector.sink(i))  # noqa: E731
            collector.hooks[0] = (2, lambda: (submit(5), submit(6)))  # join the five running rows
            for i in range(5):
                submit(i)
            batcher.start()
            collector.wait()
            stats = batcher.stats()
        first, second = sorted(len(p) for p in PROMPTS), [1] * 5 + [11, 12]
        forwards = len(length_groups(first, 0.25)) + len(length_groups(second, 0.25))
        assert forwards == 3 + 2 and stats["joined_running"] == 2
        assert stats["steps"] == 8 + forwards - 2  # 8 steps (the last joined at the 3rd, for 6 tokens), 3 forwards more
        assert stats["padding"] <= 0.25 * (sum(first) + sum(second))  # one forward each: 22 + 56 padded
        for i, prompt in enumerate(prompts):
            expected = alone(engine, prompt, greedy(new[i]))
            assert collector.tokens(i) == expected, f"request {i}"
            if kv is None:
                assert expected == reference(model, prompt, new[i])


def test_settings_the_batcher_cannot_honour_are_refused():
    for options, named in [({"kv_offload": "nvme"}, "--kv-offload nvme"),
                           ({"block_schedule": {"micro_batch_size": 2}}, "--micro-batch-size")]:
        with pytest.raises(ValueError, match=named) as refused:
            check_settings(InferenceConfig.from_dict(None, **options))
        message = str(refused.value)
        assert "\n" not in message and "offload.generate --prompt --batch-size N" in message and "--kv-quantize" in message
    with pytest.raises(ValueError, match="--kv-offload cpu"):
        check_settings(InferenceConfig.from_dict(None, kv_offload="cpu"), separate_memory=True)
    check_settings(InferenceConfig.from_dict(None, kv_offload="cpu"))
    check_settings(InferenceConfig.from_dict(None, kv_offload={"device": "auto", "quantization": "int4"}))


@pytest.mark.parametrize("bits", ["int8", "int4"])
def test_a_quantized_kv_cache_gives_what_generate_gives_with_it(checkpoints, bits):
    """``--kv-quantize``: requests joining and leaving a batch whose cache holds int8 / int4 bytes get, token for
    token, what the engine's generate (``offload.generate --kv-quantize``) answers each alone; the padding rows of a
    join decode to zeros (not NaN), and the cache holds bytes."""
    directory, _ = checkpoints["llama"]
    new = [9, 7, 6, 8, 5]
    collector = Collector(len(PROMPTS))
    with init_inference(directory, max_in_cpu=0, disk_gbps=1.0,
                        kv_offload={"device": "auto", "quantization": bits}) as engine:
        expected = []
        for prompt, count in zip(PROMPTS, new):
            ids = torch.tensor([prompt])
            out = engine.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=count,
                                  min_new_tokens=count, do_sample=False, pad_token_id=PAD)
            expected.append(out[0, len(prompt):].tolist())
        seen = []
        with Batcher(engine, max_batch=8, start=False) as batcher:
            submit = lambda i: batcher.submit(PROMPTS[i], greedy(new[i]), collector.sink(i))  # noqa: E731
            collector.hooks[0] = (2, lambda: (submit(2), submit(3)))  # join the two running: padding rows
            collector.hooks[2] = (1, lambda: (submit(4), seen.append(batcher._cache.layers[0].keys.dtype)))
            submit(0)
            submit(1)
            batcher.start()
            collector.wait()
            assert batcher.stats()["joined_running"] == 3
    assert seen == [torch.uint8]
    for i in range(len(PROMPTS)):
        assert collector.tokens(i) == expected[i], f"request {i}"


def test_a_full_queue_refuses_with_queue_full(checkpoints):
    directory, _ = checkpoints["gpt2"]
    with init_inference(directory, max_in_cpu=0, disk_gbps=1.0) as engine:
        with Batcher(engine, max_queue=2, start=False) as batcher:
            for _ in range(2):
                batcher.submit(PROMPTS[0], greedy(2), lambda update: None)
            with pytest.raises(QueueFull, match="--max-queue 2"):
                batcher.submit(PROMPTS[0], greedy(2), lambda update: None)
        with pytest.raises(RuntimeError, match="closed"):
            batcher.submit(PROMPTS[0], greedy(2), lambda update: None)


@pytest.mark.simulated
def test_on_a_device_the_cache_lives_there_within_its_budget(checkpoints):
    """Compute on the simulated GPU (offload/device): the batch's cache is on the device, the engine's device
    tier decides whether it fits, and the answers are those of transformers on the CPU."""
    directory, model = checkpoints["llama"]
    collector = Collector(4)
    with init_inference(directory, compute_device="simulated", max_memory={0: "600KiB", "cpu": 0},
                        disk_gbps=1.0) as engine:
        assert engine.plan.device is not None and engine.device.type != "cpu"
        with Batcher(engine, start=False) as batcher:
            for i in range(3):
                batcher.submit(PROMPTS[i], greedy(6), collector.sink(i))
            batcher.submit(PROMPTS[0], greedy(100_000 // 1024), collector.sink("big"))
            batcher.start()
            collector.wait()
    for i in range(3):
        assert collector.tokens(i) == reference(model, PROMPTS[i], 6)
    (big,) = collector.updates["big"]
    assert big.error.startswith("max_memory[0]: the device budget of 600.0 KiB cannot hold")  # the engine's figures
    assert "lower the batch size or the number of tokens" in big.error


def test_prefills_beyond_the_activation_bound_join_one_step_after_another(checkpoints):
    """``block_schedule.max_activation_bytes`` holding one prompt's prefill: three requests waiting together
    join one per step (the first alone, the others beside it), and still get their answers alone."""
    directory, model = checkpoints["gpt2"]
    with init_inference(directory, max_in_cpu=0, disk_gbps=1.0) as probe:
        one = probe.activation_bytes(1, len(PROMPTS[1]), logits=1)
    collector = Collector(3)
    with init_inference(directory, max_in_cpu=0, disk_gbps=1.0, block_schedule={"max_activation_bytes": one}) as engine:
        with Batcher(engine, start=False) as batcher:
            for i in range(3):
                batcher.submit(PROMPTS[i], greedy(5), collector.sink(i))
            batcher.start()
            collector.wait()
            stats = batcher.stats()
    assert stats["joined_running"] == 2 and stats["steps"] == 5 + 2
    for i in range(3):
        assert collector.tokens(i) == reference(model, PROMPTS[i], 5)
