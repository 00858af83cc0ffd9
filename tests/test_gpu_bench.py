"""``python -m benchmarks.gpu``: the inference part end to end at a tiny size on the simulated device,
its refusal without a GPU, and a clear message where a part is not in the checkout."""

from __future__ import annotations

import importlib

import pytest

from offload.device import cuda_available

gpu_main = importlib.import_module("benchmarks.gpu.__main__").main

TINY = ["--scale", "0.025", "--layers", "4", "--shards", "2", "--prompt-tokens", "4", "--new-tokens", "3",
        "--fio-size", "16MiB", "--copy-size", "64KiB"]


@pytest.mark.bench
@pytest.mark.simulated
def test_inference_on_the_simulated_device_at_a_tiny_size(tmp_path, capsys):
    figures = gpu_main(["infer", "--dir", str(tmp_path), "--device", "simulated", "--gpu-budget", "1536KiB",
                        "--host-budget", "512KiB", *TINY])["infer"]
    ours = figures["runs"]["ours"]
    assert "error" not in ours, ours.get("error")
    assert ours["s_per_token"] > 0 and ours["device_reserved_bytes"] <= 1536 << 10
    assert ours["h2d_bytes_per_token"] > 0 and ours["nvme_bytes_per_token"] > 0  # all three tiers in use
    out = capsys.readouterr().out
    assert "device: budget 1.5 MiB (max_memory[0])" in out and "per token: nvme->host" in out
    assert "not judged: the simulated device's times are not GPU figures" in out
    assert "accelerate" not in figures["runs"]  # no Accelerate GPU run without a GPU


@pytest.mark.skipif(cuda_available(), reason="CUDA is available: the benchmark would run")
def test_without_a_gpu_it_refuses_and_measures_nothing(tmp_path):
    with pytest.raises(SystemExit, match=r"needs a GPU, and CUDA is not available here .* nothing was measured"):
        gpu_main(["infer", "--dir", str(tmp_path), *TINY])
    assert not any(tmp_path.iterdir())  # nothing written

