"""benchmarks/consolidate.py at a tiny size: the engine's checkpoint consolidated in a child process,
checked against the engine's logits through from_pretrained, beside fio."""

from __future__ import annotations

import pytest

from bench.fio import fio_path
from benchmarks import consolidate


@pytest.mark.bench
def test_tiny_run_end_to_end(disk_dir, capsys):
    result = consolidate.main(["--dir", str(disk_dir / "bench"), "--scale", "tiny", "--runs", "1", "--fio-size", "8MiB",
                               "--out", str(disk_dir / "out.json")])
    assert result["checked"].endswith("from_pretrained's logits equal the engine's")
    assert len(result["runs"]) == 1 and result["peak_rss"] > 0 and result["median_read_bps"] > 0
    if fio_path() is not None:
        assert result["fio_read_bps"] > 0 and result["fio_mix_read_bps"] > 0
        assert "ratio_to_fio_read" in result and "ratio_to_fio_mix_read" in result
    assert not (disk_dir / "bench" / "checkpoint").exists()  # removed afterwards
    assert "peak RSS" in capsys.readouterr().out


def test_the_directly_written_layout_is_the_engines(disk_dir):
    """The 3b run writes its checkpoint without the engine: at a tiny size, for 2 ranks, the engine
    (1 rank) loads it, and consolidation gives the same weights."""
    import torch
    import transformers

    from offload.train.checkpoint.consolidate import get_fp32_state_dict_from_zero_checkpoint
    from offload.train.engine import initialize

    consolidate.write_checkpoint(disk_dir / "ckpt", "tiny", world_size=2)
    zero = {"stage": 3, "stage3_param_persistence_threshold": 0, "offload_param": {"device": "nvme",
            "nvme_path": str(disk_dir), "max_in_cpu": 0, "buffer_size": 65536}}
    engine, *_ = initialize(model=transformers.GPT2LMHeadModel(consolidate.gpt2_config("tiny")),
                            config={"zero_optimization": zero, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}})
    engine.load_checkpoint(disk_dir / "ckpt")
    state = get_fp32_state_dict_from_zero_checkpoint(disk_dir / "ckpt")
    assert all(torch.equal(state[name], value) for name, value in engine.full_parameters())
    assert engine.global_steps == 1
    engine.close()
