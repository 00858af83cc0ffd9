"""benchmarks/engine_dist.py at a tiny size: every configuration runs in its own processes, the floor (two
world-size-1 processes at once, half the batch each) among them, and the ratios are printed."""

from __future__ import annotations

import pytest


@pytest.mark.bench
@pytest.mark.multiprocess
def test_tiny_run_with_its_floor(capsys, tmp_path):
    from benchmarks.engine_dist import CONFIGS, main

    results = main(["--model-config", '{"n_layer": 1, "n_embd": 64, "n_head": 2, "vocab_size": 256, "n_positions": 32}',
                    "--seq", "16", "--steps", "1", "--dir", str(tmp_path)])
    assert set(results) == set(CONFIGS) and "floor: 2 alone" in results
    assert all(r["step_s"] > 0 for r in results.values())
    assert results["floor: 2 alone"]["comm_s"] == 0  # nothing exchanged
    out = capsys.readouterr().out
    assert "x its floor" in out and "collectives alone take" in out
    assert results["collectives alone"]["calls"] > 0  # one step's collectives recorded, then replayed
