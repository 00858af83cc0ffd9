"""``python -m benchmarks.gpu``: its refusal without a GPU. (The inference part end to end at a tiny size on
the simulated device, ``benchmarks.gpu.check.TINY_INFER``, is checked by tests/test_gpu_check.py, whose
command runs it.)"""

from __future__ import annotations

import importlib

import pytest

from offload.device import cuda_available

gpu_main = importlib.import_module("benchmarks.gpu.__main__").main

TINY = ["--scale", "0.025", "--layers", "4", "--shards", "2", "--prompt-tokens", "4", "--new-tokens", "3",
        "--fio-size", "16MiB", "--copy-size", "64KiB"]


@pytest.mark.skipif(cuda_available(), reason="CUDA is available: the benchmark would run")
def test_without_a_gpu_it_refuses_and_measures_nothing(tmp_path):
    with pytest.raises(SystemExit, match=r"needs a GPU, and CUDA is not available here .* nothing was measured"):
        gpu_main(["infer", "--dir", str(tmp_path), *TINY])
    assert not any(tmp_path.iterdir())  # nothing written

