"""The GPU training benchmark runs end to end on the simulated device at a tiny size, so that it never
rots (no timing asserted), and refuses without CUDA."""

from __future__ import annotations

import json

import pytest

from offload.device import cuda_available

pytestmark = [pytest.mark.bench, pytest.mark.simulated]


def test_gpu_train_benchmark_tiny_on_the_simulated_device(tmp_path, capsys):
    pytest.importorskip("transformers")
    from benchmarks.gpu import train

    tiny = json.dumps({"n_layer": 1, "n_embd": 32, "vocab_size": 128, "n_positions": 16, "bos_token_id": 0,
                       "eos_token_id": 0})
    result = train.main(["--device", "simulated", "--model-config", tiny, "--batch", "1", "--seq", "8", "--warmup", "1",
                         "--steps", "2", "--fio-size", str(4 << 20), "--dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert "device=simulated" in out and "/bound" in out and "custom" in out
    r = result["custom"]
    assert r["step_s"] > 0 and r["nvme_bytes"] > 0 and r["to_device_bytes"] > 0 and r["to_host_bytes"] > 0
    assert r["device_peak_bytes"] > 0 and r["host_peak_rss"] > 0 and r["bound_s"] > 0
    assert list(tmp_path.iterdir()) == []  # swap and fio files removed


@pytest.mark.skipif(cuda_available(), reason="checks the refusal where CUDA is missing")
def test_gpu_train_benchmark_refuses_without_cuda(tmp_path):
    from benchmarks.gpu import train

    with pytest.raises(SystemExit, match="CUDA is not available here"):
        train.main(["--dir", str(tmp_path)])
    assert list(tmp_path.iterdir()) == []
