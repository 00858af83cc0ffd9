"""benchmarks/infer_moe.py at a tiny scale: its checkpoint loads in transformers with the names Mixtral's
checkpoints have, and a run writes it, measures fio, runs ours routed and whole in child processes and
prints the targets (the figures themselves mean nothing at this size). ``--device simulated``: the device tier's
run gives transformers' tokens and reports its tiers and counters; ``--device cuda`` without CUDA refuses in one
line, and the simulated device more than a tiny size."""

from __future__ import annotations

import shutil

import pytest
import torch
import transformers
from test_infer_generate import scratch_dir

from benchmarks.infer_moe import MoESpec, main, write_checkpoint
from offload.device import cuda_available

TINY = dict(hidden=128, intermediate=256, layers=2, vocab=512, heads=2, kv_heads=1, shards=3)


def test_the_checkpoint_has_one_tensor_per_expert_and_loads_in_transformers(tmp_path):
    spec = MoESpec(**TINY)
    directory = write_checkpoint(tmp_path / "ckpt", spec)
    names = set(__import__("json").loads((directory / "model.safetensors.index.json").read_text())["weight_map"])
    assert "model.layers.1.block_sparse_moe.experts.7.w3.weight" in names
    model, info = transformers.AutoModelForCausalLM.from_pretrained(directory, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and model.dtype == torch.bfloat16
    assert model.model.layers[0].mlp.experts.gate_up_proj.shape == (8, 2 * 256, 128)
    o_proj = model.model.layers[0].self_attn.o_proj.weight.float().std().item()
    assert o_proj < 0.5 * model.model.layers[0].self_attn.q_proj.weight.float().std().item()  # scaled residual


@pytest.mark.bench
@pytest.mark.fio
def test_tiny_run_end_to_end(capsys):
    root = scratch_dir("infer-moe-bench-")
    try:
        figures = main(["--dir", str(root), "--layers", "2", "--hidden", "128", "--intermediate", "256", "--vocab",
                        "512", "--accelerate", "none", "--fio-size", "16MiB", "--new-tokens", "4", "--big-batch", "3"])
    finally:
        shutil.rmtree(root, ignore_errors=True)
    runs = {(r["experts"], r["batch"]): r for r in figures["runs"]}
    assert set(runs) == {("routed", 1), ("whole", 1), ("routed", 3)}
    routed, whole = runs[("routed", 1)], runs[("whole", 1)]
    assert routed["per_token"]["picked"] == 2 * 2  # top 2 in each of the 2 layers, per decode step
    assert 0 < routed["per_token"]["io"] < whole["per_token"]["io"]
    assert "experts:" in routed["plan"] and "experts:" not in whole["plan"]
    printed = capsys.readouterr().out
    assert "fio:" in printed and any(line.startswith("bytes read per token") for line in figures["targets"])
    assert any("whole-layer streaming's tokens/s" in line for line in figures["targets"])


@pytest.mark.bench
@pytest.mark.fio
def test_tiny_run_with_int4_reads_packed_experts():
    """``--quantize int4``: our runs read the experts packed (int4 group 64: half a byte a weight, a bf16 scale
    and zero per 64 inputs; one aligned read each), the routed run fewer bytes than the whole layers."""
    root = scratch_dir("infer-moe-bench-int4-")
    try:
        figures = main(["--dir", str(root), "--layers", "2", "--hidden", "128", "--intermediate", "256", "--vocab",
                        "512", "--accelerate", "none", "--fio-size", "16MiB", "--new-tokens", "3", "--big-batch", "2",
                        "--quantize", "int4"])
    finally:
        shutil.rmtree(root, ignore_errors=True)
    runs = {(r["experts"], r["batch"]): r for r in figures["runs"]}
    routed, whole = runs[("routed", 1)], runs[("whole", 1)]
    packed = 3 * 128 * 256 // 2 + (128 // 64) * 512 * 4 + (256 // 64) * 128 * 4  # gate_up [512, 128], down [128, 256]
    assert figures["quantize"] == "int4" and routed["quantize"] == "int4"
    assert routed["expert_read_nbytes"] == -(-packed // 4096) * 4096 < 3 * 128 * 256 * 2  # bf16's: 192 KiB
    assert "quantized: int4" in routed["plan"] and 0 < routed["per_token"]["io"] < whole["per_token"]["io"]


@pytest.mark.bench
@pytest.mark.fio
@pytest.mark.simulated
def test_tiny_run_on_the_simulated_device_gives_transformers_tokens(capsys):
    """``--device simulated``: the device keeps a quarter of the experts (the default budget), pinned host memory
    some more, the rest are read when picked; the tokens at batch 1 and 2 equal transformers' (on the CPU, the
    simulated device's stand-in), and the plan's tiers and the device tier's counters are reported."""
    root = scratch_dir("infer-moe-bench-device-")
    try:
        figures = main(["--dir", str(root), "--layers", "4", "--hidden", "128", "--intermediate", "256", "--vocab", "512",
                        "--fio-size", "16MiB", "--new-tokens", "3", "--device", "simulated", "--runs", "routed,big",
                        "--big-batch", "2"])
    finally:
        shutil.rmtree(root, ignore_errors=True)
    runs = {(r["experts"], r["batch"]): r for r in figures["runs"]}
    assert set(runs) == {("routed", 1), ("routed", 2)} and figures["device"] == "simulated"
    assert runs[("routed", 2)]["tiers"]["on_device"] == 8  # round(0.25 x 4 layers x 8 experts), at the largest batch
    for r in runs.values():
        tiers = r["tiers"]
        assert r["tokens_equal"] and r["device"] == "simulated" and r["device_budget"] == figures["device_budget"]
        assert 8 <= tiers["on_device"] < tiers["experts"] == 32 and tiers["streamed"] > 0
        assert tiers["on_device"] + tiers["in_host_memory"] + tiers["streamed"] == 32
        counts = r["device_counts"]
        assert set(counts) == {"hits", "copies", "bytes_copied", "kept", "demoted", "dropped", "staged_ahead",
                               "staged_ahead_used"}
        assert counts["hits"] > 0 and counts["copies"] > 0 and counts["kept"] > 0 and 0 < r["device_kept_now"] <= 8 + 8
        assert {f"device_{k}" for k in counts} <= set(r["per_token"]) and r["per_token"]["device_hits"] > 0
    assert figures["transformers"]["on"] == "cpu" and set(figures["transformers"]["tokens"]) == {"1", "2"}
    assert any(line.startswith("tokens equal transformers' on the cpu") and line.endswith(": met")
               for line in figures["targets"])
    assert any(line.startswith("device tier, routed batch 1: ") for line in figures["targets"])
    assert not any(line.endswith(": met") and "s/token" in line for line in figures["targets"])  # no time judged
    printed = capsys.readouterr().out
    assert "the simulated device's times are not GPU figures" in printed and "Accelerate: not run" in printed


@pytest.mark.skipif(cuda_available(), reason="CUDA is available: the benchmark would run")
def test_device_cuda_without_cuda_refuses_in_one_line(tmp_path):
    with pytest.raises(SystemExit, match=r"^benchmarks.infer_moe: --device cuda needs a GPU, and CUDA is not available "
                                         r"here \(torch .*\); nothing was measured") as refused:
        main(["--dir", str(tmp_path), "--device", "cuda"])
    assert "\n" not in str(refused.value) and not any(tmp_path.iterdir())  # nothing written


def test_the_simulated_device_refuses_more_than_a_tiny_size(tmp_path):
    with pytest.raises(SystemExit, match=r"--device simulated runs tiny sizes only: this checkpoint would be 6\d{3} MiB"):
        main(["--dir", str(tmp_path), "--device", "simulated"])  # the default 6.3 GB model
    assert not any(tmp_path.iterdir())
