"""Memory and page cache while generating from a model several times the budget, in a fresh process.

The model (a Llama of about 250 MB in fp32) is five times the budget. The child process (the
benchmark's, benchmarks/infer_stream.py) reports its peak RSS (the kernel's VmHWM, reset after importing and
warming up torch and transformers) and its RSS at that point; the difference must stay within the plan (resident
weights + ring buffers + KV cache) plus the engine's activation estimate plus a stated slack of
32 MiB (allocator caching, the model's Python objects, the read of the prompt...). The checkpoint's
own pages in the page cache (mincore) must grow by less than 64 MB: reads are O_DIRECT.
"""

from __future__ import annotations

import pytest
from test_infer_generate import saved_model

from benchmarks.infer_stream import _files, meminfo_cached, page_cache_bytes, run_config
from offload.infer.weights.convert import drop_page_cache

SLACK = 32 << 20
BUDGET = 48 << 20


@pytest.fixture(scope="module")
def big_checkpoint():
    for directory, model in saved_model("llama", "40MB", hidden_size=512, intermediate_size=1536, num_hidden_layers=16,
                                        num_attention_heads=8, num_key_value_heads=8, vocab_size=8192):
        del model
        yield directory


@pytest.mark.subprocess
def test_peak_rss_within_the_plan_and_page_cache_untouched(big_checkpoint):
    files = _files(big_checkpoint)
    weights = sum(p.stat().st_size for p in big_checkpoint.glob("*.safetensors"))
    assert weights >= 200e6 and weights >= 4 * BUDGET
    for path in files:
        drop_page_cache(path)
    cached = meminfo_cached()
    r = run_config({"kind": "ours", "checkpoint": str(big_checkpoint), "budget": BUDGET, "batch": 1, "prompt_tokens": 32,
                    "new_tokens": 8, "buffer_count": 3, "aio": {}, "disk_gbps": 1.0, "offload_folder": ""})
    growth = r["peak_rss"] - r["baseline_rss"]
    bound = r["plan_memory_bytes"] + r["activation_bytes"] + SLACK
    print(f"peak RSS - baseline {growth / 2**20:.1f} MiB; plan {r['plan_memory_bytes'] / 2**20:.1f} MiB + activations "
          f"{r['activation_bytes'] / 2**20:.1f} MiB + slack {SLACK >> 20} MiB = {bound / 2**20:.1f} MiB; checkpoint pages "
          f"cached +{r['checkpoint_cache_growth'] / 1e6:.1f} MB; system Cached {(meminfo_cached() - cached) / 1e6:+.0f} MB")
    assert r["plan_memory_bytes"] < weights / 2  # most of the model is streamed
    assert r["io_bytes"] >= 8 * r["read_bytes_per_forward"]  # it really was read again for every token
    assert growth <= bound
    assert r["checkpoint_cache_growth"] < 64e6
    assert page_cache_bytes(files) < 64e6


def test_page_cache_bytes_sees_a_read_file(tmp_path):
    path = tmp_path / "f.bin"
    path.write_bytes(b"x" * (1 << 20))
    path.read_bytes()
    assert page_cache_bytes([path]) == 1 << 20
    drop_page_cache(path)
    assert page_cache_bytes([path]) < 1 << 20
