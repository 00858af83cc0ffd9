"""``python -m benchmarks.gpu``: its refusal without a GPU. (The inference part end to end at a tiny size on
the simulated device, ``benchmarks.gpu.check.TINY_INFER``, is checked by tests/test_gpu_check.py, whose
command runs it.) The check's mixture-of-experts part (``--parts moe``, benchmarks/infer_moe.py with a device):
skipped without CUDA, and at a tiny size on the simulated device its moe.json and summary.md's section."""

from __future__ import annotations

import importlib
import json
import shutil

import pytest
from test_infer_generate import scratch_dir

from benchmarks.gpu import check
from offload.device import cuda_available

gpu_main = importlib.import_module("benchmarks.gpu.__main__").main
no_cuda = pytest.mark.skipif(cuda_available(), reason="CUDA is available: the benchmark would run")

TINY = ["--scale", "0.025", "--layers", "4", "--shards", "2", "--prompt-tokens", "4", "--new-tokens", "3",
        "--fio-size", "16MiB", "--copy-size", "64KiB"]


@no_cuda
def test_without_a_gpu_it_refuses_and_measures_nothing(tmp_path):
    with pytest.raises(SystemExit, match=r"needs a GPU, and CUDA is not available here .* nothing was measured"):
        gpu_main(["infer", "--dir", str(tmp_path), *TINY])
    assert not any(tmp_path.iterdir())  # nothing written


@no_cuda
def test_the_moe_part_runs_when_named_and_is_skipped_without_cuda(tmp_path):
    assert "moe" in check.PARTS and "moe" not in check.DEFAULT_PARTS  # with the others it would pass 9 minutes
    assert check.MOE[:2] == ["--device", "cuda"] and check.LIMITS["moe"] <= 180
    assert check.main([str(tmp_path / "out"), "--parts", "moe"]) == 1
    summary = (tmp_path / "out" / "summary.md").read_text()
    assert "| moe | skipped (no CUDA) | 0 | - |" in summary and "Mixture of experts" not in summary


@pytest.mark.bench
@pytest.mark.subprocess
@pytest.mark.fio
@pytest.mark.simulated
@no_cuda
def test_the_moe_part_at_a_tiny_size_writes_its_figures_and_summary(tmp_path):
    work = scratch_dir("gpu-check-moe-")
    try:
        code = check.main([str(tmp_path / "out"), "--parts", "moe", "--tiny", "--dir", str(work)])
    finally:
        shutil.rmtree(work, ignore_errors=True)
    out = tmp_path / "out"
    assert code == 0, (out / "moe.log").read_text()[-3000:]
    figures = json.loads((out / "moe.json").read_text())
    assert figures["device"] == "simulated" and all(r["tokens_equal"] for r in figures["runs"])
    summary = (out / "summary.md").read_text()
    assert "Mixture of experts (benchmarks.infer_moe --device simulated, issue 48)" in summary
    assert "| routed, batch 1 |" in summary and "| yes |" in summary
    assert "- tokens equal transformers' on the cpu (issue 48: routed, the simulated device tier)" in summary
