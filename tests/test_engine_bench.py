"""The engine benchmark runs end to end at a tiny size, so that it never rots (no timing asserted)."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.bench


@pytest.mark.fio
def test_engine_step_benchmark_tiny(tmp_path, capsys):
    pytest.importorskip("transformers")
    from benchmarks import engine_step

    tiny = json.dumps({"n_layer": 1, "n_embd": 32, "n_head": 2, "vocab_size": 128, "n_positions": 16})
    result = engine_step.main(["--model-config", tiny, "--modes", "torch+fio,torch,nvme", "--batch", "1", "--seq", "8",
                               "--warmup", "1", "--steps", "1", "--persistence", "0", "--sub-group-size", "4096",
                               "--fio-size", str(4 << 20), "--repeats", "2",
                               "--dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert "GB/s achieved" in out and "nvme" in out
    # plain PyTorch again beside fio moving nvme's bytes (run last in each repeat, whatever --modes' order)
    assert "beside plain PyTorch" in out and len(result["ratio"]["beside_io_per_repeat"]) == 2
    assert result["torch+fio"]["fio_read_rate"] > 0 and result["torch+fio"]["fio_write_rate"] > 0
    assert result["nvme"]["step_s"] > 0 and result["nvme"]["read_per_step"] > 0
    assert len(result["ratio"]["per_repeat"]) == 2 and len(result["nvme"]["times"]) == 2  # one step per repeat
    assert list(tmp_path.iterdir()) == []  # swap and fio files removed


@pytest.mark.fio
def test_engine_step_benchmark_with_clipping_and_accumulation_tiny(tmp_path, capsys):
    """--clip and --gas give both modes the same work; the engine's update runs in the next forward and
    the clipped steps are counted (what a speculative update would redo)."""
    pytest.importorskip("transformers")
    from benchmarks import engine_step

    tiny = json.dumps({"n_layer": 1, "n_embd": 32, "n_head": 2, "vocab_size": 128, "n_positions": 16})
    result = engine_step.main(["--model-config", tiny, "--modes", "torch,nvme", "--batch", "1", "--seq", "8",
                               "--warmup", "1", "--steps", "2", "--persistence", "0", "--sub-group-size", "4096",
                               "--fio-size", str(4 << 20), "--clip", "0.5", "--gas", "2", "--dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert "nvme: the update ran in the next forward" in out
    assert result["nvme"]["path"] == "in the next forward"
    assert len(result["nvme"]["norms"]) == len(result["torch"]["norms"]) == 3  # warm-up and timed steps
    assert result["nvme"]["norms"] == pytest.approx(result["torch"]["norms"], rel=1e-5)
    assert result["nvme"]["clipped"] == sum(norm > 0.5 for norm in result["nvme"]["norms"])


def test_engine_dist_benchmark_tiny(tmp_path, capsys):
    pytest.importorskip("transformers")
    from benchmarks import engine_dist

    tiny = json.dumps({"n_layer": 1, "n_embd": 32, "n_head": 2, "vocab_size": 128, "n_positions": 16})
    result = engine_dist.main(["--model-config", tiny, "--batch", "2", "--seq", "8", "--warmup", "1", "--steps", "1",
                               "--dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert "with buckets against" in out
    assert set(result) == set(engine_dist.CONFIGS)
    assert result["world 1"]["comm_s"] == 0 and result["world 2, buckets"]["step_s"] > 0
    assert list(tmp_path.iterdir()) == []


def test_clip_redo_benchmark_tiny(capsys):
    pytest.importorskip("transformers")
    from benchmarks import clip_redo

    tiny = json.dumps({"n_layer": 1, "n_embd": 16, "n_head": 2, "n_positions": 16})
    result = clip_redo.main(["--model-config", tiny, "--batch", "2", "--seq", "16", "--warmup-steps", "3",
                             "--min-warmup-steps", "1", "--finetune-steps", "2", "--window", "2"])
    out = capsys.readouterr().out
    assert "fine-tune: 2 steps" in out
    assert 1 <= result["warmup"]["steps"] <= 3 and 0 <= result["finetune"]["above"] <= 2


def test_engine_step_beside_io_needs_the_modes_it_compares():
    from benchmarks import engine_step

    with pytest.raises(SystemExit, match="torch\\+fio needs torch and nvme"):
        engine_step.main(["--modes", "torch,torch+fio"])
