"""Benchmark: a decode step with the KV cache on NVMe against its floor, fio side by side.

    python -m benchmarks.infer_kv --dir /work/bench-kv --out infer_kv.json
    python -m benchmarks.infer_kv --dir /tmp/x --scale 0.0125 --layers 2 --shards 1 --batch 1 \\
        --prompt-tokens 96 --new-tokens 4 --fio-size 16MiB --repeats 1              # tiny, as the test runs it

1. A random-weight Llama of benchmarks/infer_stream.py's shape, scaled (by default hidden 512, 16
   layers, bf16), written once and reused; a long context, so that the cache is at least half of
   the bytes a decode step reads (batch 4 x 2048 tokens: 2.7 times the weights by default).
2. fio's O_DIRECT sequential read speed in the same directory, with our aio settings, before each
   pair of runs (the disk's speed swings within minutes).
3. Alternately, each in a fresh process with every file dropped from the page cache first:
   "memory": every weight and the whole cache in memory (the compute floor of a decode step);
   "nvme": every decoder layer and the head streamed (``max_in_cpu`` 0) and the whole cache on
   NVMe (``kv_offload`` device "nvme"), read ahead and written behind. ``--kv-quantize int8|int4``:
   the cache quantized in both (``kv_offload.quantization``).
4. The target: the nvme run's decode step (median over its steps) <= 1.15x max(the memory run's
   step, (weight bytes + cache bytes read per step) / fio), each pair against the fio run beside it,
   the median over ``--repeats``; page-cache growth
   under 256 MB; peak RSS against the plan's memory (resident weights, weight ring, KV ring) plus
   activations.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict
from pathlib import Path

import numpy as np

from benchmarks._common import RssSampler, run_child
from benchmarks.infer_stream import (Spec, _Clock, _files, _gib, fio_read_speed, meminfo_cached, model_parser, page_cache_bytes,
                                     parse_or_run_child, write_checkpoint)

KINDS = ("memory", "nvme")


def engine_vocab(checkpoint: Path) -> int:
    return json.loads((checkpoint / "config.json").read_text())["vocab_size"]


def child(args: dict) -> dict:
    """One run (``args["kind"]`` "memory" or "nvme"): its decode steps and what it read, wrote and held."""
    import psutil
    import torch

    from offload.infer import init_inference

    checkpoint = Path(args["checkpoint"])
    files = _files(checkpoint)
    quantization = args.get("kv_quantize")
    settings = ({"max_in_cpu": "64GiB", "kv_offload": {"device": "cpu", "quantization": quantization}}
                if args["kind"] == "memory" else
                {"max_in_cpu": 0, "kv_offload": {"device": "nvme", "nvme_path": args["kv_dir"], "quantization": quantization}})
    process = psutil.Process()
    baseline = process.memory_info().rss
    cached0, resident0 = meminfo_cached(), page_cache_bytes(files)
    total = args["prompt_tokens"] + args["new_tokens"]
    vocab = engine_vocab(checkpoint)
    ids = torch.randint(3, vocab, (args["batch"], args["prompt_tokens"]), generator=torch.Generator().manual_seed(0))
    clock = _Clock()
    with RssSampler(kernel_peak=True) as rss:
        with init_inference(checkpoint, disk_gbps=args["disk_gbps"], **settings) as engine:
            plan = engine.reserve(args["batch"], total)
            engine.wait_loaded()
            out = engine.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args["new_tokens"],
                                  do_sample=False, pad_token_id=0, streamer=clock)
            kv_read, kv_written, kv_wait = engine.kv_bytes_read, engine.kv_bytes_written, engine.kv_wait_seconds
            weight_wait = engine.read_wait_seconds
            activations = engine.activation_bytes(args["batch"], total)
    steps = np.diff(np.array(clock.times))
    decode_forwards = args["new_tokens"] - 1
    return dict(
        kind=args["kind"], s_per_step=float(np.median(steps)), decode_steps=[float(s) for s in steps],
        tokens=out[:, args["prompt_tokens"]:].tolist(), weight_read_per_step=plan.read_bytes_per_forward,
        kv_read_per_step=kv_read / decode_forwards, kv_written=kv_written, kv_read_wait_s=kv_wait,
        weight_read_wait_s=weight_wait, kv_total_bytes=plan.kv.layers * plan.kv.layer_nbytes,
        kv_nvme_bytes=plan.kv.nvme_bytes, plan=plan.describe(), plan_memory=plan.memory_bytes,
        activation_bytes=activations, peak_rss=rss.peak, baseline_rss=baseline, peak_rss_kernel=rss.kernel_peak,
        cached_growth=meminfo_cached() - cached0, checkpoint_cache_growth=page_cache_bytes(files) - resident0,
        process_read_bytes=process.io_counters().read_bytes)


def main(argv: list[str] | None = None) -> dict:
    """Run the benchmark; print the configuration, the runs and the target; return every figure."""
    from offload.infer.config import InferenceConfig
    from offload.infer.weights.convert import drop_page_cache

    ap = model_parser(__doc__, dir_help="working directory: the checkpoint (written once, reused) and the cache's files",
                      scale=0.1, layers=16, shards=4)  # scale 0.1: hidden 512
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--prompt-tokens", type=int, default=2048)
    ap.add_argument("--new-tokens", type=int, default=12)
    ap.add_argument("--repeats", type=int, default=3, help="runs of each kind, alternated")
    ap.add_argument("--kv-quantize", choices=("int8", "int4"), help="the cache quantized (both kinds alike)")
    args = parse_or_run_child(ap, argv, child, fio_size="2GiB")
    if args is None:
        return {}
    directory = Path(args.dir).resolve()
    spec = Spec.scaled(args.scale, args.layers, args.shards)
    aio = InferenceConfig().aio
    print(f"configuration: {spec}, bf16; batch {args.batch}, prompt {args.prompt_tokens} tokens, {args.new_tokens} new; "
          f"cache {args.kv_quantize or 'bf16'}; aio {aio.to_dict()}")
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())} ({os.cpu_count()} CPUs)")
    checkpoint = write_checkpoint(directory / "checkpoint", spec)
    kv_dir = directory / "kv"
    kv_dir.mkdir(exist_ok=True)
    runs: dict[str, list[dict]] = {kind: [] for kind in KINDS}
    for _ in range(args.repeats):
        fio_bps = fio_read_speed(aio, directory, args.fio_size)  # the disk's speed swings: beside each pair of runs
        for kind in KINDS:
            for path in _files(checkpoint):
                drop_page_cache(path)
            payload = {"kind": kind, "checkpoint": str(checkpoint), "kv_dir": str(kv_dir), "batch": args.batch,
                       "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens,
                       "disk_gbps": fio_bps / 1e9 if fio_bps else 1.0, "kv_quantize": args.kv_quantize}
            r = run_child("benchmarks.infer_kv", ["--child", json.dumps(payload)])
            r["fio_bps"] = fio_bps
            runs[kind].append(r)
            print(f"{kind}: {r['s_per_step']:.4f} s per decode step; weights read {_gib(r['weight_read_per_step'])} "
                  f"+ cache read {_gib(r['kv_read_per_step'])} per step (cache {_gib(r['kv_total_bytes'])}); waits: "
                  f"weights {r['weight_read_wait_s']:.3f} s, cache {r['kv_read_wait_s']:.3f} s; peak RSS "
                  f"{_gib(r['peak_rss'])}, {_gib(r['peak_rss'] - r['baseline_rss'])} over the interpreter's (plan "
                  f"{_gib(r['plan_memory'])} + activations <= {_gib(r['activation_bytes'])}); "
                  f"page cache growth {_gib(r['cached_growth'])} (checkpoint {_gib(r['checkpoint_cache_growth'])})")
    print(runs["nvme"][0]["plan"])
    figures = _summary(runs)
    for line in figures["lines"]:
        print(line)
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    figures.update(spec=asdict(spec), kv_quantize=args.kv_quantize, batch=args.batch, prompt_tokens=args.prompt_tokens, new_tokens=args.new_tokens,
                   runs=runs)
    if args.out:
        Path(args.out).write_text(json.dumps(figures, indent=1))
    return figures


def _summary(runs: dict[str, list[dict]]) -> dict:
    """The medians, the bound and the verdicts: each nvme run against the memory run and fio beside it."""
    ratios, disks = [], []
    for nvme, memory in zip(runs["nvme"], runs["memory"]):
        step_bytes = nvme["weight_read_per_step"] + nvme["kv_read_per_step"]
        disk = step_bytes / nvme["fio_bps"] if nvme["fio_bps"] else 0.0
        disks.append(disk)
        ratios.append(nvme["s_per_step"] / max(memory["s_per_step"], disk))
    compute = float(np.median([r["s_per_step"] for r in runs["memory"]]))
    nvme = float(np.median([r["s_per_step"] for r in runs["nvme"]]))
    ratio = float(np.median(ratios))
    first = runs["nvme"][0]
    step_bytes = first["weight_read_per_step"] + first["kv_read_per_step"]
    same = all(r["tokens"] == runs["memory"][0]["tokens"] for r in runs["nvme"] + runs["memory"])
    growth = max(r["cached_growth"] for r in runs["nvme"])
    cache_share = first["kv_read_per_step"] / step_bytes
    lines = [
        f"decode step: nvme {nvme:.4f} s, compute floor (all in memory) {compute:.4f} s, disk "
        f"{float(np.median(disks)):.4f} s ({_gib(step_bytes)} per step / fio beside each run): per run "
        f"{', '.join(f'{x:.2f}' for x in ratios)}x max(compute, disk), median {ratio:.2f}x "
        f"(target <= 1.15: {'met' if ratio <= 1.15 else 'MISSED'})",
        f"cache share of the bytes a step reads: {cache_share:.0%} (needs >= 50%: {'yes' if cache_share >= 0.5 else 'NO'})",
        f"tokens with the cache on NVMe equal tokens with it in memory: {'yes' if same else 'NO'}",
        f"page cache growth, nvme runs: at most {_gib(growth)} (target < 256 MiB: {'met' if growth < 256 << 20 else 'MISSED'})",
    ]
    return {"compute_s": compute, "nvme_s": nvme, "disk_s": disks, "ratios": ratios, "ratio": ratio,
            "cache_share": cache_share, "tokens_equal": same, "page_cache_growth": growth, "lines": lines}


if __name__ == "__main__":
    main()
