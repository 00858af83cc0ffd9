"""The inference engine fixes glibc's mmap threshold, so that host tensors of 1-32 MiB freed during a
prefill go back to the system instead of staying in the heap (offload/host_malloc.py); a user's
``MALLOC_MMAP_THRESHOLD_`` is left alone. Each case in a fresh process: the threshold is the process's."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")

_CHILD = r'''
import ctypes, json, sys
import torch, transformers

libc = ctypes.CDLL(None)
class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
                                               "uordblks", "fordblks", "keepcost")]
libc.mallinfo2.restype = MallInfo2

def mapped_alone(nbytes):
    """Whether a tensor of nbytes gets a mapping of its own (glibc's mmapped bytes grow by it)."""
    before = libc.mallinfo2().hblkhd
    tensor = torch.empty(nbytes, dtype=torch.uint8)
    grown = libc.mallinfo2().hblkhd - before
    del tensor
    return grown >= nbytes

first = torch.empty(16 << 20, dtype=torch.uint8)
del first  # freeing a mapped 16 MiB raises glibc's threshold to 16 MiB: 2 MiB now comes from the heap
before = mapped_alone(2 << 20)
config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2, vocab_size=256)
transformers.AutoModelForCausalLM.from_config(config).save_pretrained(sys.argv[1])
from offload.host_malloc import fix_mmap_threshold
from offload.infer import init_inference
with init_inference(sys.argv[1], disk_gbps=1.0) as engine:
    print(json.dumps({"before": before, "after": mapped_alone(2 << 20), "small": mapped_alone(256 << 10),
                      "outcome": fix_mmap_threshold()}))
'''


def _run(directory, env: dict) -> dict:
    run = subprocess.run([sys.executable, "-c", _CHILD, str(directory / "llama")], capture_output=True, text=True,
                         env=env)
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.mark.subprocess
def test_the_engine_maps_freed_megabytes_alone(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_MMAP_THRESHOLD_"}
    figures = _run(tmp_path, env)
    assert figures["before"] is False  # glibc's dynamic threshold: the heap would keep it
    assert figures["after"] is True, figures  # the engine fixed the threshold at 1 MiB
    assert figures["small"] is False  # under 1 MiB: the heap, as before
    assert figures["outcome"] == "fixed at 1 MiB"


@pytest.mark.subprocess
def test_a_users_threshold_is_left_as_it_is(tmp_path):
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(4 << 20)}
    figures = _run(tmp_path, env)
    assert figures["after"] is False  # 2 MiB is under the user's 4 MiB
    assert figures["outcome"] == f"left at the user's MALLOC_MMAP_THRESHOLD_={4 << 20}"
