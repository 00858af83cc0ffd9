"""The Trainer benchmark runs end to end at a tiny size, so that it never rots (no timing asserted)."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.bench


def test_trainer_benchmark_tiny(tmp_path, capsys):
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from benchmarks import trainer_hf

    tiny = json.dumps({"n_layer": 1, "n_embd": 32, "n_head": 2, "vocab_size": 128, "n_positions": 16})
    result = trainer_hf.main(["--model-config", tiny, "--batch", "1", "--seq", "8", "--warmup", "1", "--steps", "2",
                              "--gas", "2", "--dir", str(tmp_path), "--out", str(tmp_path / "out.json")])
    assert "offload / plain Trainer" in capsys.readouterr().out
    for mode in ("trainer", "offload"):
        assert result[mode]["step_s"] > 0 and result[mode]["peak_rss"] > 0
        assert len(result[mode]["runs"][0]["times"]) == 2
    assert result["offload"]["runs"][0]["io_bytes"]["read"] > 0  # the parameters were on NVMe
    assert json.loads((tmp_path / "out.json").read_text())["ratio"]["per_repeat"]
    assert [p.name for p in tmp_path.iterdir()] == ["out.json"]  # swap files removed
