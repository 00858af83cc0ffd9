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
import contextlib
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
from benchmarks.gpu import _trace
from benchmarks.gpu._waits import NvmeWaits
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
        "wall_clock_breakdown": True, "steps_per_print": 1 << 30,  # phase totals (engine.timers), never logged
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
    before: dict[str, dict[str, float]] = {}
    with RssSampler(kernel_peak=True) as rss, NvmeWaits() as waits:
        for i in range(args.warmup + args.steps):
            if i == args.warmup:
                io_before, to_device_before, to_host_before = _moved(engine)
                before = _clocks(engine, waits)
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
        after = _clocks(engine, waits)
        io_after, to_device_after, to_host_after = _moved(engine)
        profiled = profile_step(engine, tokens, device, args.steps_profiled)
    engine.close()
    step = statistics.median(times)
    nvme = (io_after - io_before) / args.steps
    to_device = (to_device_after - to_device_before) / args.steps
    to_host = (to_host_after - to_host_before) / args.steps
    nvme_floor = nvme / min(rates["fio_read"], rates["fio_write"])
    copy_floor = (to_device + to_host) / rates["pinned_copy"]
    bound = max(compute or 0.0, nvme_floor, copy_floor)
    per_step = {group: {k: (after[group].get(k, 0.0) - before[group].get(k, 0.0)) / args.steps for k in after[group]}
                for group in after}
    breakdown = {"step_s": statistics.median(times), "compute_s": compute,
                 "to_device_floor_s": to_device / rates["pinned_copy"], "to_host_floor_s": to_host / rates["pinned_copy"],
                 "nvme_floor_s": nvme_floor, "phases_s": per_step["phases"],
                 "nvme_read_wait_s": per_step["waits"]["read"], "nvme_write_wait_s": per_step["waits"]["write"],
                 "nvme_wait_other_threads_s": per_step["waits"]["other_read"] + per_step["waits"]["other_write"],
                 "optimizer_s": per_step["phases"].get("step", 0.0),
                 "optimizer_io_wait_s": per_step["optimizer"].get("io_wait", 0.0), "profiled": profiled["breakdown"]}
    return {"breakdown": breakdown, "tables": profiled["tables"],
            "model": name, "params": params, "step_s": step, "tflops": 6 * params * tokens.numel() / step / 1e12,
            "nvme_bytes": nvme, "to_device_bytes": to_device, "to_host_bytes": to_host,
            "nvme_gbps": nvme / step / 1e9, "to_device_gbps": to_device / step / 1e9, "compute_s": compute,
            "nvme_floor_s": nvme_floor, "copy_floor_s": copy_floor, "bound_s": bound, "over_bound": step / bound,
            "device_peak_bytes": device_peak, "device_used_peak_bytes": used_peak, "host_peak_rss": rss.peak}


def _clocks(engine: Any, waits: NvmeWaits) -> dict[str, dict[str, float]]:
    """The running totals a step's breakdown is the difference of: the engine's phases (forward,
    backward, step: each with the device work it queued), the NVMe waits, the optimizer's swap waits."""
    io_wait = getattr(engine.optimizer, "io_wait_seconds", None)
    return {"phases": engine.timers.totals, "waits": waits.snapshot(),
            "optimizer": {"io_wait": io_wait() if callable(io_wait) else 0.0}}


def profile_step(engine: Any, tokens: torch.Tensor, device: Device, steps: int) -> dict[str, Any]:
    """``steps`` more steps under torch.profiler (with CUDA's activity on CUDA): their per-step breakdown
    (benchmarks/gpu/_trace.py) and top-20 tables; not part of the timed steps."""
    cuda = device.name == "cuda"
    prof = _trace.profiler(cuda)
    counting = contextlib.nullcontext(None)
    if isinstance(device, SimulatedDevice):
        from offload.device import count_host_syncs

        counting = count_host_syncs()
    device.synchronize()
    start = time.perf_counter()
    with counting as syncs, prof:
        for _ in range(steps):
            loss = engine(tokens, labels=tokens).loss
            engine.backward(loss)
            engine.step()
        device.synchronize()
    wall = time.perf_counter() - start
    tables = {"operators by self CPU time": _trace.top_rows(prof, by="cpu")}
    if cuda:
        tables["kernels and copies by device time"] = _trace.top_rows(prof, by="device")
    return {"breakdown": _trace.breakdown(prof, wall_s=wall, units=steps, cuda=cuda,
                                         host_syncs=dict(syncs.by_cause) if syncs is not None else None),
            "tables": tables}


def _moved(engine: Any) -> tuple[int, int, int]:
    """(NVMe bytes read + written over every swap file, host -> device bytes, device -> host bytes) so far."""
    stats = engine.stats()
    nvme = sum(v["read"] + v["written"] for v in stats.io.values())
    return nvme, stats.device_bytes["to_device"], stats.device_bytes["to_host"]


BREAKDOWN_ROWS = (
    ("step (median of the timed steps)", lambda b: b["step_s"]),
    ("GPU compute: plain PyTorch, model resident", lambda b: b["compute_s"]),
    ("GPU compute: kernels in the profiled step", lambda b: b["profiled"]["kernels_s"] if _cuda(b) else None),
    ("host->device: bytes / pinned copy (floor)", lambda b: b["to_device_floor_s"]),
    ("host->device: copies in the profiled step", lambda b: b["profiled"]["to_device_s"]),
    ("device->host: bytes / pinned copy (floor)", lambda b: b["to_host_floor_s"]),
    ("device->host: copies in the profiled step", lambda b: b["profiled"]["to_host_s"]),
    ("NVMe: bytes / disk floor", lambda b: b["nvme_floor_s"]),
    ("NVMe read waits (training thread)", lambda b: b["nvme_read_wait_s"]),
    ("NVMe write waits (training thread)", lambda b: b["nvme_write_wait_s"]),
    ("NVMe waits (other threads: optimizer, writes behind)", lambda b: b["nvme_wait_other_threads_s"]),
    ("forward (phase, device work included)", lambda b: b["phases_s"].get("forward")),
    ("backward (phase, updates during backward included)", lambda b: b["phases_s"].get("backward")),
    ("optimizer: step() (phase: the update's remainder)", lambda b: b["optimizer_s"]),
    ("optimizer: its swap waits", lambda b: b["optimizer_io_wait_s"]),
    ("synchronisations in the profiled step (count)", lambda b: b["profiled"]["syncs"]),
    ("host overhead in the profiled step (the rest)", lambda b: b["profiled"]["host_s"] if _cuda(b) else None),
)
"""The per-step breakdown's rows: (label, the figure from a model's ``breakdown``; None: not measured)."""


def _cuda(b: dict) -> bool:
    return b["profiled"]["basis"].startswith("cuda")


def breakdown_table(results: dict[str, dict]) -> str:
    """A markdown table of each model's per-step breakdown (seconds; counts for synchronisations)."""
    names = list(results)
    out = ["| per step (s) | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    for label, figure in BREAKDOWN_ROWS:
        cells = []
        for n in names:
            value = figure(results[n]["breakdown"])
            cells.append("n/a" if value is None else f"{value:.1f}" if "count" in label else f"{value:.4f}")
        out.append(f"| {label} | " + " | ".join(cells) + " |")
    out += ["", "n/a: not measured here (the kernels, copies and host overhead of a step need CUDA's activity; "
            "plain PyTorch's compute needs the model to fit the device)."]
    return "\n".join(out)


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
    ap.add_argument("--steps-profiled", type=int, default=1,
                    help="steps run under torch.profiler after the timed ones, for the breakdown and the tables")
    ap.add_argument("--tables", default=None, help="directory for the per-step tables and breakdown (default: "
                                                   "--out's; none without either)")
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
    if args.steps_profiled < 1:
        ap.error(f"--steps-profiled {args.steps_profiled}: at least 1")
    tables = Path(args.tables or Path(args.out).parent).resolve() if (args.tables or args.out) else None
    if tables is not None:
        tables.mkdir(parents=True, exist_ok=True)
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
            if tables is not None:
                _trace.write_tables(tables / f"train-{name}.md", f"{name}: one training step under torch.profiler, "
                                    f"per step ({device.name})", r["tables"], args.steps_profiled, "step")
            if args.out:
                Path(args.out).write_text(json.dumps({"device": device.name, **results}, indent=1))
        text = breakdown_table({n: r for n, r in results.items() if "breakdown" in r})
        print(text, flush=True)
        if tables is not None:
            (tables / "train-breakdown.md").write_text(f"# Training: per step ({device.name})\n\n{text}\n")
    device.close()
    results["rates"] = rates
    return results


if __name__ == "__main__":
    main(sys.argv[1:])
