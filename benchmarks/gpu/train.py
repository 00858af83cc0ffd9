"""GPU training benchmark: GPT-2 small to 1.5 B trained by the engine with the compute on a GPU and the
parameters and optimizer state on NVMe (ZeRO-Infinity's layout), against the floors it cannot beat.

    python -m benchmarks.gpu.train --dir /mnt/nvme/tmp                      # every size, on CUDA
    python -m benchmarks.gpu.train --dir /mnt/nvme/tmp --models gpt2-xl --steps 5
    python -m benchmarks.gpu.train --dir /tmp --device simulated --model-config '{"n_layer": 1, "n_embd": 32}'

Per model (random weights; GPT-2 small 124 M, medium 355 M, large 774 M, xl 1.5 B), after ``--warmup``
steps, the median of ``--steps`` timed steps of the engine, and beside it:

- model TFLOPS: 6 x parameters x tokens per step / step time (forward and backward, no attention term);
- bytes moved per step: NVMe read and written (every swap file), host -> device and device -> host;
- NVMe GB/s against fio (O_DIRECT, io_uring) reading and writing the same directory: the floor
  "NVMe bytes / fio" (where fio is missing, a tensorio sequential write/read of the same size stands
  in, and the output says so: benchmarks/disk_floor.py);
- host -> device GB/s against a plain copy from pinned memory of the largest partition's size: the
  floor "host-device bytes / pinned copy";
- GPU compute: the same forward and backward in plain PyTorch with the model resident on the GPU
  (where it fits the GPU, else not measured);
- the bound max(compute, NVMe floor, copy floor) and step / bound (issue 25's target: <= 1.2);
- peak device memory (the engine's device buffers, and the device's used memory) and peak host RSS.

It refuses, saying so, where CUDA is not available: a GPU's figures cannot be simulated. ``--device
simulated`` runs the whole path on the simulated device (docs/device.md) at a tiny size, for the test
that keeps this script from rotting; its timings mean nothing.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks._common import RssSampler
from benchmarks.disk_floor import disk_rates
from offload.device import Device, SimulatedDevice, cuda_available, device_for
from tensorio import AioConfig

MODELS = {
    "gpt2": {"n_layer": 12, "n_embd": 768, "n_head": 12},
    "gpt2-medium": {"n_layer": 24, "n_embd": 1024, "n_head": 16},
    "gpt2-large": {"n_layer": 36, "n_embd": 1280, "n_head": 20},
    "gpt2-xl": {"n_layer": 48, "n_embd": 1600, "n_head": 25},
}
"""GPT-2's four sizes (vocabulary 50257, 1024 positions)."""

_BASE = {"vocab_size": 50257, "n_positions": 1024, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}


def engine_config(directory: str, args: argparse.Namespace, largest: int) -> dict[str, Any]:
    """The DeepSpeed-format config: parameters and optimizer state on NVMe under ``directory``."""
    return {
        "train_micro_batch_size_per_gpu": args.batch, "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,  # the updates during backward, as the recorded figures ran
        "bf16": {"enabled": args.dtype == "bf16"}, "fp16": {"enabled": args.dtype == "fp16"},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01}},
        "zero_optimization": {
            "stage": 3, "stage3_param_persistence_threshold": 0,
            "offload_param": {"device": "nvme", "nvme_path": directory, "max_in_cpu": 0, "buffer_count": 4,
                              "buffer_size": largest},
            "offload_optimizer": {"device": "nvme", "nvme_path": directory},
        },
        "aio": {"block_size": args.block_size, "queue_depth": args.queue_depth},
    }


def pinned_copy_rate(device: Device, nbytes: int, repeats: int = 5) -> float:
    """Bytes per second of a plain host -> device copy from pinned memory (the median of ``repeats``)."""
    host = device.pinned_empty(nbytes)
    target = device.empty(nbytes, name="pinned copy probe")
    side = device.new_stream("probe")
    rates = []
    for _ in range(repeats):
        start = time.perf_counter()
        device.to_device(target, host, stream=side).synchronize()
        rates.append(nbytes / (time.perf_counter() - start))
    device.free(target)
    return statistics.median(rates)


def compute_seconds(model_config: dict, args: argparse.Namespace, device: Device, tokens: torch.Tensor) -> float | None:
    """Plain PyTorch's forward and backward with the model resident on the device (median step), or
    None where its weights and gradients would not fit in the device's free memory."""
    import transformers

    params = _parameter_count(model_config)
    free, _ = device.memory_info()
    if 2 * params * (2 if args.dtype != "fp32" else 4) * 1.5 > free:
        return None
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**model_config)).to(device.torch_device, dtype)
    times = []
    for i in range(args.warmup + args.steps):
        device.synchronize()
        start = time.perf_counter()
        model(tokens, labels=tokens).loss.backward()
        device.synchronize()
        if i >= args.warmup:
            times.append(time.perf_counter() - start)
        model.zero_grad(set_to_none=True)
    del model
    return statistics.median(times)


def run_model(name: str, model_config: dict, args: argparse.Namespace, device: Device, directory: str,
              rates: dict[str, float]) -> dict[str, Any]:
    """Train ``model_config`` for warm-up and timed steps; return its figures."""
    import transformers

    from offload.train.engine import initialize

    params = _parameter_count(model_config)
    largest = max(model_config["vocab_size"] * model_config["n_embd"], 4 * model_config["n_embd"] ** 2)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, model_config["vocab_size"], (args.batch, args.seq), generator=g)
    compute = compute_seconds(model_config, args, device, tokens.to(device.torch_device))
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**model_config))
    engine, *_ = initialize(model=model, config=engine_config(directory, args, largest), compute_device=device)
    times, device_peak, used_peak = [], 0, 0
    io_before = to_device_before = to_host_before = 0
    total = device.memory_info()[1]
    with RssSampler(kernel_peak=True) as rss:
        for i in range(args.warmup + args.steps):
            if i == args.warmup:
                io_before, to_device_before, to_host_before = _moved(engine)
            device.synchronize()
            start = time.perf_counter()
            loss = engine(tokens, labels=tokens).loss
            device_peak = max(device_peak, device.allocated_bytes)
            used_peak = max(used_peak, total - device.memory_info()[0])
            engine.backward(loss)
            engine.step()
            device.synchronize()
            if i >= args.warmup:
                times.append(time.perf_counter() - start)
    io_after, to_device_after, to_host_after = _moved(engine)
    engine.close()
    step = statistics.median(times)
    nvme = (io_after - io_before) / args.steps
    to_device = (to_device_after - to_device_before) / args.steps
    to_host = (to_host_after - to_host_before) / args.steps
    nvme_floor = nvme / min(rates["fio_read"], rates["fio_write"])
    copy_floor = (to_device + to_host) / rates["pinned_copy"]
    bound = max(compute or 0.0, nvme_floor, copy_floor)
    return {"model": name, "params": params, "step_s": step, "tflops": 6 * params * tokens.numel() / step / 1e12,
            "nvme_bytes": nvme, "to_device_bytes": to_device, "to_host_bytes": to_host,
            "nvme_gbps": nvme / step / 1e9, "to_device_gbps": to_device / step / 1e9, "compute_s": compute,
            "nvme_floor_s": nvme_floor, "copy_floor_s": copy_floor, "bound_s": bound, "over_bound": step / bound,
            "device_peak_bytes": device_peak, "device_used_peak_bytes": used_peak, "host_peak_rss": rss.peak}


def _moved(engine: Any) -> tuple[int, int, int]:
    """(NVMe bytes read + written over every swap file, host -> device bytes, device -> host bytes) so far."""
    stats = engine.stats()
    nvme = sum(v["read"] + v["written"] for v in stats.io.values())
    return nvme, stats.device_bytes["to_device"], stats.device_bytes["to_host"]


def _parameter_count(c: dict) -> int:
    layer = 12 * c["n_embd"] ** 2 + 13 * c["n_embd"]
    return c["n_layer"] * layer + (c["vocab_size"] + c["n_positions"] + 2) * c["n_embd"]


def main(argv: list[str] | None = None) -> dict[str, dict]:
    """Run the benchmark; print the configuration, a table per model and the ratio to the bound; return
    the figures by model. Exits with a message where CUDA is not available (``--device cuda``)."""
    ap = argparse.ArgumentParser(prog="python -m benchmarks.gpu.train", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=",".join(MODELS), help=f"comma-separated subset of {', '.join(MODELS)}")
    ap.add_argument("--model-config", type=json.loads, default=None,
                    help="GPT2Config keys as JSON: one model of that shape instead of --models")
    ap.add_argument("--device", choices=["cuda", "simulated"], default="cuda",
                    help="cuda, or simulated: the device path on the CPU (a smoke test; its timings mean nothing)")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--dir", default=None, help="directory on the NVMe to measure (default: a temporary one)")
    ap.add_argument("--block-size", type=int, default=1 << 20)
    ap.add_argument("--queue-depth", type=int, default=32)
    ap.add_argument("--fio-size", type=int, default=1 << 30,
                    help="bytes fio (or tensorio, where fio is missing) moves per direction for the disk's floor")
    ap.add_argument("--out", default=None, help="write every figure to this JSON file (after each model)")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not cuda_available():
        raise SystemExit("benchmarks.gpu.train: CUDA is not available here (torch "
                         f"{torch.__version__}); this benchmark measures a GPU and will not report figures without "
                         "one. Run it on a machine with CUDA, or --device simulated for a smoke test of the path")
    if args.model_config is not None:
        models = {"custom": {**_BASE, "n_head": 2, **args.model_config}}
    else:
        unknown = [m for m in args.models.split(",") if m not in MODELS]
        if unknown:
            raise SystemExit(f"--models: {', '.join(unknown)} not among {', '.join(MODELS)}")
        models = {m: {**_BASE, **MODELS[m]} for m in args.models.split(",")}
    device = SimulatedDevice(max_delay_s=0.0) if args.device == "simulated" else device_for("cuda")
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="bench-gpu-train-") as directory:
        print(f"device={device.name} models={','.join(models)} batch={args.batch} seq={args.seq} dtype={args.dtype} "
              f"warmup={args.warmup} steps={args.steps} block_size={args.block_size} queue_depth={args.queue_depth} "
              f"dir={directory}", flush=True)

        aio = AioConfig(block_size=args.block_size, queue_depth=args.queue_depth)  # fio mirrors it (O_DIRECT)
        disk = disk_rates(aio, directory, max(args.fio_size, args.block_size))
        largest = max(max(c["vocab_size"] * c["n_embd"], 4 * c["n_embd"] ** 2) for c in models.values())
        rates = {"fio_read": disk.read_bps, "fio_write": disk.write_bps, "pinned_copy": pinned_copy_rate(device, largest * 2)}
        print(f"{disk.describe()}; pinned host -> device copy {rates['pinned_copy'] / 1e9:.2f} GB/s", flush=True)
        results["floors"] = {"disk_source": disk.source, "fio_missing": disk.fio_missing, **rates}
        print(f"{'model':<12} {'params':>8} {'step (s)':>9} {'TFLOPS':>7} {'NVMe GB/step':>13} {'NVMe GB/s':>10} "
              f"{'H2D GB/s':>9} {'compute (s)':>12} {'bound (s)':>10} {'/bound':>7} {'dev peak':>9} {'host peak':>10}")
        for name, config in models.items():
            r = results[name] = run_model(name, config, args, device, directory, rates)
            compute = f"{r['compute_s']:.3f}" if r["compute_s"] is not None else "n/a"
            print(f"{name:<12} {r['params'] / 1e6:>7.0f}M {r['step_s']:>9.3f} {r['tflops']:>7.2f} "
                  f"{r['nvme_bytes'] / 1e9:>13.2f} {r['nvme_gbps']:>10.2f} {r['to_device_gbps']:>9.2f} {compute:>12} "
                  f"{r['bound_s']:>10.3f} {r['over_bound']:>7.2f} {r['device_peak_bytes'] / 2**30:>8.2f}G "
                  f"{r['host_peak_rss'] / 2**30:>9.2f}G", flush=True)
            if args.out:
                Path(args.out).write_text(json.dumps({"device": device.name, **results}, indent=1))
    device.close()
    results["rates"] = rates
    return results


if __name__ == "__main__":
    main(sys.argv[1:])
