"""Benchmark: int8 / int4 weights on the stream against bf16 streaming, Accelerate and fio, in one run.

    python -m benchmarks.infer_quant --dir /work/bench-llama --out infer_quant.json   # the 28.6 GB Llama, 2 GiB
    python -m benchmarks.infer_quant --dir /tmp/x --scale 0.025 --layers 4 --shards 5 --budget 1MiB \\
        --fio-size 16MiB --floor-layers 1                                           # tiny, as the test runs it

The full comparison takes longer than one quiet hold of the machine; ``--variants`` and ``--floors``
run it in parts (each with its own fio), e.g. ``--variants bf16,int4 --accelerate none --floors none``,
then ``--variants int4 --floors none`` (int4 beside Accelerate), then ``--variants int8 --accelerate none``.

1. The random-weight Llama of benchmarks/infer_stream.py (hidden 5120, 44 layers, bf16, 28.6 GB),
   written once and reused.
2. fio's O_DIRECT sequential read speed in the same directory, with our aio settings.
3. The int8 (per channel) and int4 (group 64, asymmetric; ``--int4-group``) caches, written once each under
   ``DIR/quantized`` by a process of their own: time, peak RSS (the quantization's memory bound) and
   size. Reused by later runs while the checkpoint is unchanged.
4. Each configuration in a fresh process, every file dropped from the page cache first: ours in
   bf16, int8 and int4 at ``--budget`` (batch 1), and Accelerate's
   ``from_pretrained(device_map="auto")`` with the same ``max_memory`` and disk offload (the child of
   benchmarks/infer_stream.py: seconds per token is the median of the decode steps).
5. KL(bf16 || int8) and KL(bf16 || int4) of the next-token distributions at the prompt's positions
   (one more forward of the prompt in each of our runs, after its figures are taken), and top-1 agreement.
6. The compute floor of each: a model of the same shape with 2 and with 2 + ``--floor-layers``
   decoder layers, all in memory (quantized alike), its decode steps timed (median); the floor is
   the smaller model's step plus the per-layer difference times the other layers.
7. The targets: int8 >= 1.8x and int4 >= 3x bf16's tokens/s; each <= 1.15 x max(bytes streamed per
   token / fio, its compute floor); int4 >= 6x Accelerate's tokens/s; page-cache growth < 256 MB.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np

from benchmarks._cgroup import UNBOUNDED
from benchmarks._common import ChildError, RssSampler, run_child
from benchmarks.infer_stream import (Spec, _files, _gib, child, compute_floor, describe_floor, fio_read_speed,
                                     meminfo, model_parser, parse_or_run_child, run_config, write_checkpoint)
from tensorio import parse_size

VARIANTS = {"bf16": None, "int8": "int8", "int4": "int4"}


# ---- children ---------------------------------------------------------------------------------------


def quantize_child(args: dict) -> dict:
    """Write (or find) the cache of ``args["quantize"]``: seconds, peak RSS, the cache's bytes."""
    from offload.infer import init_inference

    with RssSampler(kernel_peak=True) as rss:
        start = time.perf_counter()
        with init_inference(args["checkpoint"], weight_quantization=args["quantize"], nvme_path=args["nvme_path"],
                            max_in_cpu=f"{args['budget']}B", disk_gbps=1.0) as engine:
            seconds = time.perf_counter() - start
            directory = engine.checkpoint.directory
    size = sum(os.path.getsize(f) for f in _files(Path(directory)))
    return {"seconds": seconds, "peak_rss": rss.peak, "cache_bytes": size, "cache": directory}


# ---- the run --------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> dict:
    """Run the benchmark; print the configuration, the runs and the targets; return every figure."""
    from offload.infer.config import InferenceConfig

    ap = model_parser(__doc__, dir_help="working directory: the checkpoint, the quantized caches (written once, reused)")
    ap.add_argument("--budget", default="2GiB", help="max_in_cpu for ours and max_memory for Accelerate")
    ap.add_argument("--accelerate", default="auto", help="\"auto\" (from_pretrained(device_map='auto')) or none")
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=8)
    ap.add_argument("--floor-layers", type=int, default=4, help="decoder layers added for the compute floor's slope")
    ap.add_argument("--variants", default=",".join(VARIANTS),
                    help="which of ours to run, comma-separated (default all: bf16,int8,int4); a part of the comparison")
    ap.add_argument("--int4-group", type=int, default=64, help="the int4 variant's group_size (default 64)")
    ap.add_argument("--floors", default=None,
                    help="whose compute floors to measure, comma-separated (default: the variants run; none: skip)")
    args = parse_or_run_child(ap, argv, lambda p: quantize_child(p) if p["kind"] == "quantize" else child(p),
                              fio_size="4GiB")
    if args is None:
        return {}
    quantization = dict(VARIANTS, int4={"num_bits": 4, "group_size": args.int4_group})
    variants = _names(args.variants, "--variants")
    floor_variants = variants if args.floors is None else [] if args.floors == "none" else _names(args.floors, "--floors")
    directory = Path(args.dir).resolve()
    spec = Spec.scaled(args.scale, args.layers, args.shards)
    budget = parse_size(args.budget)
    aio = InferenceConfig().aio
    print(f"configuration: {spec}, bf16; prompt {args.prompt_tokens} tokens, {args.new_tokens} new; budget "
          f"{_gib(budget)}, batch 1; Accelerate: {args.accelerate}; aio {aio.to_dict()}")
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())} ({os.cpu_count()} CPUs)")

    # 1. The checkpoint; 2. fio.
    checkpoint = write_checkpoint(directory / "checkpoint", spec)
    size = sum(os.path.getsize(f) for f in _files(checkpoint) if f.endswith(".safetensors"))
    print(f"checkpoint: {checkpoint} ({size / 1e9:.2f} GB)")
    fio_bps = fio_read_speed(aio, directory, args.fio_size)

    # 3. The caches, once.
    caches = directory / "quantized"
    caches.mkdir(exist_ok=True)
    quantized = {}
    for name in variants:
        q = quantization[name]
        if q is None:
            continue
        payload = {"kind": "quantize", "checkpoint": str(checkpoint), "quantize": q, "nvme_path": str(caches),
                   "budget": budget}
        quantized[name] = run_child("benchmarks.infer_quant", ["--child", json.dumps(payload)])
        r = quantized[name]
        print(f"{name} cache: {r['cache_bytes'] / 1e9:.2f} GB, {r['seconds']:.1f} s to write or find (peak RSS "
              f"{_gib(r['peak_rss'])}): {r['cache']}")

    # 4. The runs, each in a fresh process, every file cold.
    offload_folder = directory / "accelerate-offload"
    runs = [("ours", name) for name in variants] + [(f"accelerate-{k}", "bf16") for k in args.accelerate.split(",")
                                                    if k and k != "none"]
    results = []
    for kind, name in runs:
        _make_cold([checkpoint, caches, offload_folder])
        payload = {"kind": kind, "checkpoint": str(checkpoint), "budget": budget, "batch": 1,
                   "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens, "buffer_count": None,
                   "aio": aio.to_dict(), "disk_gbps": fio_bps / 1e9 if fio_bps else None,
                   "offload_folder": str(offload_folder), "quantize": quantization[name], "nvme_path": str(caches)}
        if kind == "ours":
            payload["log_probs_path"] = str(directory / f"log-probs-{name}.npy")
            Path(payload["log_probs_path"]).unlink(missing_ok=True)  # none left from an earlier run is compared
        available = meminfo("MemAvailable")
        try:
            result = run_config(payload)
        except ChildError as exc:
            result = {"kind": kind, "error": exc.one_line()}
        result.update(variant=name, mem_available_before=available)
        if kind != "ours":  # benchmarks.infer_stream --peer-rows equal measures the peer at equal memory
            result["memory_label"] = UNBOUNDED
        results.append(result)
        if "plan" in result:
            print(result["plan"])
        _print_row(result)

    # 5. The next-token distributions of the prompt against bf16's.
    divergence = _divergence({name: directory / f"log-probs-{name}.npy" for name in variants})
    for name, d in divergence.items():
        print(f"{name} against bf16, the prompt's {d['positions']} next-token distributions: KL(bf16 || {name}) mean "
              f"{d['kl_mean']:.5f} nats, max {d['kl_max']:.5f}; top-1 agreement {d['top1_agreement']:.0%}")

    # 6. The compute floors.
    floors = {}
    for name in floor_variants:
        floors[name] = compute_floor(spec, quantize=quantization[name], batch=1, prompt_tokens=args.prompt_tokens,
                                     new_tokens=args.new_tokens, floor_layers=args.floor_layers)
        print(f"compute floor, {name}: {describe_floor(floors[name], spec.layers)}")

    targets = _targets(results, floors, fio_bps)
    print("targets:\n  " + "\n  ".join(targets))
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    figures = {"spec": asdict(spec), "checkpoint_bytes": size, "fio_bps": fio_bps, "budget": budget,
               "quantized": quantized, "runs": results, "divergence": divergence, "floors": floors, "targets": targets}
    if args.out:
        Path(args.out).write_text(json.dumps(figures, indent=1))
    return figures


def _names(value: str, option: str) -> list[str]:
    """The variants named in ``value`` (comma-separated), in `VARIANTS`' order. Raises SystemExit naming
    ``option`` and the unknown name."""
    names = [name for name in value.split(",") if name]
    unknown = [name for name in names if name not in VARIANTS]
    if unknown or not names:
        raise SystemExit(f"{option}: {unknown[0] if unknown else value!r} is not one of {', '.join(VARIANTS)}")
    return [name for name in VARIANTS if name in names]


def _divergence(paths: dict[str, Path]) -> dict[str, dict]:
    """KL(bf16 || each quantized variant) of the next-token distributions the runs saved (log-probabilities,
    [prompt positions, vocab]): mean and max over the positions in nats, and how often the top token agrees.
    Variants whose run saved nothing are left out."""
    if "bf16" not in paths or not paths["bf16"].is_file():
        return {}
    reference = np.load(paths["bf16"], allow_pickle=False).astype(np.float64)
    figures = {}
    for name, path in paths.items():
        if name == "bf16" or not path.is_file():
            continue
        ours = np.load(path, allow_pickle=False).astype(np.float64)
        kl = (np.exp(reference) * (reference - ours)).sum(axis=-1)
        figures[name] = {"positions": int(kl.size), "kl_mean": float(kl.mean()), "kl_max": float(kl.max()),
                         "top1_agreement": float((reference.argmax(-1) == ours.argmax(-1)).mean())}
    return figures


def _make_cold(directories: list[Path]) -> None:
    from offload.infer.weights.convert import drop_page_cache

    for folder in directories:
        if folder.exists():
            for path in _files(folder):
                drop_page_cache(path)


def _print_row(r: dict) -> None:
    if "error" in r:
        print(f"{r['kind']:>20} {r['variant']:>5}: FAILED, {r['error']}")
        return
    print(f"{r['kind']:>20} {r['variant']:>5}: load {r['load_s']:.2f} s, first token {r['ttft_s']:.2f} s, "
          f"{r['s_per_token']:.3f} s/token (steps {' '.join(f'{s:.2f}' for s in r['decode_steps'])}), "
          f"{r['tokens_per_s']:.3f} tokens/s, peak RSS {_gib(r['peak_rss'])}, page cache "
          f"+{r['cached_growth'] / 1e6:.0f} MB, read {r['read_bytes'] / 1e9:.2f} GB")


def _targets(results: list[dict], floors: dict, fio_bps: float | None) -> list[str]:
    ours = {r["variant"]: r for r in results if r["kind"] == "ours" and "error" not in r}
    lines = [f"{r['kind']} {r['variant']}: not measured ({r['error']})" for r in results if "error" in r]

    def verdict(ok: bool) -> str:
        return "met" if ok else "NOT met"

    bf16 = ours.get("bf16")
    for name, factor in (("int8", 1.8), ("int4", 3.0)):
        r = ours.get(name)
        if r and bf16:
            ratio = r["tokens_per_s"] / bf16["tokens_per_s"]
            lines.append(f"{name}: {ratio:.2f}x bf16's tokens/s ({r['tokens_per_s']:.3f} against "
                         f"{bf16['tokens_per_s']:.3f}); target >= {factor}x: {verdict(ratio >= factor)}")
    for name, r in ours.items():
        disk = r["read_bytes_per_forward"] / fio_bps if fio_bps else 0.0
        floor = floors[name]["floor_s"] if name in floors else None
        bound = max(disk, floor or 0.0)
        which = "compute floor" if floor is not None and floor >= disk else "disk bound"
        floor_text = f"{floor:.3f} s" if floor is not None else "not measured in this run"
        lines.append(f"{name}: {r['s_per_token']:.3f} s/token = {r['s_per_token'] / bound:.2f}x max(disk "
                     f"{disk:.3f} s = {r['read_bytes_per_forward'] / 1e9:.2f} GB / fio, compute floor {floor_text}), "
                     f"the {which}; target <= 1.15x: {verdict(r['s_per_token'] <= 1.15 * bound)}")
        growth = max(r["cached_growth"], r["checkpoint_cache_growth"])
        lines.append(f"{name}: page cache +{growth / 1e6:.0f} MB; target < 256 MB: {verdict(growth < 256e6)}")
    accelerate = next((r for r in results if r["kind"].startswith("accelerate") and "error" not in r), None)
    if accelerate and ours.get("int4"):
        ratio = ours["int4"]["tokens_per_s"] / accelerate["tokens_per_s"]
        lines.append(f"int4: {ratio:.2f}x {accelerate['kind']}'s tokens/s ({UNBOUNDED}: +{accelerate['cached_growth'] / 1e6:.0f} "
                     f"MB there); target >= 6x: {verdict(ratio >= 6)}")
    return lines


if __name__ == "__main__":
    main()
