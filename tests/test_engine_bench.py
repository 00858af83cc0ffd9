"""The engine benchmark runs end to end at a tiny size, so that it never rots (no timing asserted)."""

from __future__ import annotations

import json

import pytest

from bench.fio import fio_path


@pytest.mark.skipif(fio_path() is None, reason="fio not installed: apt-get install fio")
def test_engine_step_benchmark_tiny(tmp_path, capsys):
    pytest.importorskip("transformers")
    from benchmarks import engine_step

    tiny = json.dumps({"n_layer": 1, "n_embd": 32, "n_head": 2, "vocab_size": 128, "n_positions": 16})
    result = engine_step.main(["--model-config", tiny, "--modes", "torch,nvme", "--batch", "1", "--seq", "8",
                               "--warmup", "1", "--steps", "1", "--persistence", "0", "--sub-group-size", "4096",
                               "--fio-size", str(4 << 20), "--repeats", "2",
                               "--dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert "GB/s achieved" in out and "nvme" in out
    assert result["nvme"]["step_s"] > 0 and result["nvme"]["read_per_step"] > 0
    assert len(result["ratio"]["per_repeat"]) == 2 and len(result["nvme"]["times"]) == 2  # one step per repeat
    assert list(tmp_path.iterdir()) == []  # swap and fio files removed
