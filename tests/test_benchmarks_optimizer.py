"""The optimizer benchmarks run end to end at tiny sizes, so that they never rot (no timing asserted)."""

from __future__ import annotations

import json

import pytest

from bench.fio import fio_path

pytestmark = pytest.mark.bench


@pytest.mark.fio
@pytest.mark.parametrize("drives", [1, 2])
def test_optimizer_step_benchmark_tiny(tmp_path, capsys, drives):
    from benchmarks import optimizer_step

    dirs = [tmp_path / f"drive{i}" for i in range(drives)]
    for directory in dirs:
        directory.mkdir()
    result = optimizer_step.main(["--params", "300000", "--tensors", "3", "--sub-group-size", "65536",
                                  "--warmup", "1", "--steps", "2", "--fio-size", str(4 << 20),
                                  "--dir", *map(str, dirs)])
    out = capsys.readouterr().out
    assert "offloaded / max(I/O bound, in-memory)" in out
    assert all(f"{d}/bench-optimizer-step-" in out for d in dirs)  # a swap directory on each drive given
    assert result["offloaded_s"] > 0 and result["io_bound_s"] > 0 and result["ratio"] > 0
    assert all(list(d.iterdir()) == [] for d in dirs)  # swap and fio files removed


def test_colossal_benchmark_tiny(tmp_path, monkeypatch, capsys):
    """Plain PyTorch, OffloadAdam 1.0 and (with fio) plain PyTorch beside fio, each in its process;
    OffloadAdam 0.0 is the same child with its state in memory (tests/test_offload_adam.py runs it), stood in
    for by figures of its own, which the headline must carry."""
    pytest.importorskip("transformers")
    from benchmarks import optimizer_colossal

    real, ran = optimizer_colossal._run, []

    def run(args, directory, config):
        ran.append(config)
        if config == optimizer_colossal.CONFIGS["OffloadAdam 0.0"]:
            return {"seconds": 2.0, "cpu_seconds": 4.0, "io_wait": 0.0, "peak_rss": 3e9, "read_bytes": 0,
                    "written_bytes": 0}
        return real(args, directory, config)

    monkeypatch.setattr(optimizer_colossal, "_run", run)
    tiny = json.dumps({"n_layer": 1, "n_embd": 32, "n_head": 2, "vocab_size": 256, "n_positions": 16})
    result = optimizer_colossal.main(["--model-config", tiny, "--batch", "1", "--seq", "8", "--steps", "1",
                                      "--repeats", "1", "--sub-group-size", "4096", "--dir", str(tmp_path),
                                      "--malloc-mmap-threshold", "1048576"])
    out = capsys.readouterr().out
    assert ran[:3] == list(optimizer_colossal.CONFIGS.values())
    assert "full offload / no offload" in out and "OffloadAdam 1.0" in out
    if fio_path() is not None:  # plain PyTorch beside fio moving what OffloadAdam moved
        assert ran[3:] == [optimizer_colossal.CONFIGS["torch AdamW (fused)"]]
        assert "torch AdamW + fio" in out and "fio beside plain PyTorch moved" in out
        assert result["plain_beside_io_ratio"] > 0
    assert "MALLOC_MMAP_THRESHOLD_=1048576" in out
    assert result["time_ratio"] > 0 and result["io_wait_seconds"] >= 0
    assert result["rss_saved_bytes"] < 3e9 and f"peak RSS {result['rss_saved_bytes'] / 1e9:.3f} GB lower" in out
    assert list(tmp_path.iterdir()) == []


def test_memory_trace_tiny(tmp_path, capsys):
    pytest.importorskip("transformers")
    from benchmarks import optimizer_memory

    tiny = json.dumps({"n_layer": 1, "n_embd": 32, "n_head": 2, "vocab_size": 256, "n_positions": 16})
    result = optimizer_memory.main(["--model-config", tiny, "--batch", "1", "--seq", "8", "--steps", "1",
                                    "--sub-group-size", "4096", "--dir", str(tmp_path)])
    out = capsys.readouterr().out
    for phase in ("model", "0.forward", "0.backward", "1.step"):
        assert phase in out
    assert result["peak_rss"] > 0 and result["io_wait"] >= 0  # how long I/O blocked depends on the machine's load
    assert result["state_in_ram"] == 0 and result["swap_file_bytes"] > 0  # the tiny state still went to the swap file
    assert result["peak_phase"] in out
    assert list(tmp_path.iterdir()) == []
