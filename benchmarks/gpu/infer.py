"""Benchmark: generation on a GPU budget smaller than the model (GPU, pinned host and NVMe tiers),
seconds per token against the tiers' bound, beside Accelerate with the same ``max_memory``.

    python -m benchmarks.gpu infer --dir /nvme/bench-gpu                       # a GPU machine
    python -m benchmarks.gpu infer --dir /tmp/x --device simulated --scale 0.025 --layers 4 --shards 2 \\
        --gpu-budget 1536KiB --host-budget 512KiB --fio-size 16MiB --new-tokens 3   # the smoke test's size

1. Writes, once, the random-weight bf16 Llama of benchmarks/infer_stream.py (``--scale 0.5``, 44
   layers: about 7 GB; reused by later runs).
2. Measures fio's O_DIRECT read speed on the same disk (where fio is missing, a tensorio sequential
   write/read of the same size, and says so), and the host-to-device speed of a plain
   pinned copy through the device seam (the link's ceiling).
3. Runs, each in a fresh process and a memory cgroup of its own (benchmarks/_peers.py): at equal
   memory, ours with ``max_memory={0: GPU budget, "cpu": "auto"}`` in a cgroup of the host budget +
   its overhead measured with nothing loaded (the plan printed: what the GPU keeps, what pinned host
   memory keeps, what streams, the bytes per token over each link), and Accelerate's
   ``from_pretrained(device_map="auto", max_memory={0: GPU budget, "cpu": host budget})`` with disk
   offload in a cgroup of the host budget + its overhead (its page cache counted); then each side's
   default (``--rows defaults``): ours ``{0: "auto", "cpu": "auto"}``, Accelerate without
   ``max_memory``. Without cgroups each peer figure says "page cache unbounded". Each reports
   seconds per token (the median of the decode steps), time to first token and peak RSS; ours also
   the tiers' bound: max(NVMe bytes / fio, host-to-device bytes / the pinned copy's speed) per token.
4. Prints the targets: s/token <= 1.15x the bound; at equal memory >= 2x Accelerate's tokens/s; each
   side's default >= 1.0x.

Refuses to run without a GPU: nothing here fakes GPU figures. ``--device simulated`` runs our path on
the simulated device (offload/device) at a tiny size, as a smoke test; its times are not GPU figures
and no target is judged.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np

from benchmarks._common import RssSampler, run_child
from benchmarks._peers import PeerRunner, memory_note
from benchmarks.disk_floor import disk_rates
from benchmarks.infer_stream import Spec, _Clock, _files, _gib, model_parser, parse_or_run_child, write_checkpoint
from tensorio import AioConfig, parse_size

TARGET_BOUND = 1.15
TARGET_ACCELERATE = 2.0
TARGET_DEFAULTS = 1.0


def copy_speed(device, nbytes: int, repeats: int = 5) -> float:
    """Bytes per second of a plain pinned host-to-device copy of ``nbytes`` on ``device`` (the median
    of ``repeats``, after one warm-up): the host-to-device link's speed as the engine can use it."""
    host = device.pinned_empty(nbytes)
    target = device.empty(nbytes, name="copy-speed probe")
    stream = device.new_stream("copy-speed")
    try:
        times = []
        for _ in range(repeats + 1):
            start = time.perf_counter()
            device.to_device(target, host, stream=stream).synchronize()
            times.append(time.perf_counter() - start)
        return nbytes / float(np.median(times[1:]))
    finally:
        device.synchronize()
        device.free(target)
        device.free_pinned(host)


def child(args: dict) -> dict:
    """One configuration in this process: ``args["kind"]`` "ours" or "accelerate"."""
    import torch
    import transformers

    checkpoint = Path(args["checkpoint"])
    config = transformers.AutoConfig.from_pretrained(checkpoint)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(3, config.vocab_size, (args["batch"], args["prompt_tokens"]), generator=generator)
    auto = args.get("setting") == "auto"
    if args["kind"] == "ours":  # equal memory: its host tier "auto", reading its cgroup; defaults: both tiers
        max_memory = {0: "auto" if args.get("row") == "defaults" else args["gpu_budget"],
                      "cpu": "auto" if auto else args["host_budget"]}
    else:
        max_memory = None if auto else {0: args["gpu_budget"], "cpu": args["host_budget"]}
    if args.get("idle"):  # benchmarks/_peers.py: the side's own overhead with nothing loaded
        import accelerate  # noqa: F401
        import offload.infer  # noqa: F401
        if args["device"] == "cuda":  # the CUDA runtime's host memory (context, cuBLAS, attention) is each side's
            from offload.device import CudaDevice

            CudaDevice().load_runtime(torch.bfloat16)
        return {"kind": args["kind"], "idle": True}
    clock = _Clock()
    with RssSampler() as rss:
        start = time.perf_counter()
        if args["kind"] == "ours":
            from offload.infer import init_inference

            model = init_inference(checkpoint, compute_device=args["device"], max_memory=max_memory,
                                   disk_gbps=args["disk_gbps"], host_to_device_gbps=args["h2d_bps"] / 1e9)
        else:
            model = transformers.AutoModelForCausalLM.from_pretrained(
                checkpoint, device_map="auto", max_memory=max_memory, offload_folder=args["offload_folder"],
                dtype=torch.bfloat16)
            ids = ids.to(model.device)
        load_s = time.perf_counter() - start
        begin = time.perf_counter()
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args["new_tokens"], do_sample=False,
                       pad_token_id=0, streamer=clock)
    steps = np.diff(np.array(clock.times))
    s_per_token = float(np.median(steps)) if len(steps) else None
    figures = dict(kind=args["kind"], load_s=load_s, first_token_s=clock.times[0] - begin, s_per_token=s_per_token,
                   tokens_per_s=args["batch"] / s_per_token if s_per_token else None, peak_rss=rss.peak)
    if args["kind"] == "ours":
        plan = model.plan
        figures.update(plan=plan.describe(), bound_s=plan.bound_seconds(), links_s=plan.link_seconds(),
                       nvme_bytes_per_token=plan.read_bytes_per_forward,
                       h2d_bytes_per_token=plan.host_to_device_bytes_per_forward,
                       device_reserved_bytes=plan.device.used_bytes, device_budget=plan.device.budget,
                       device_buffers_bytes=model.compute.allocated_bytes, read_wait_s=model.read_wait_seconds,
                       plan_budget=plan.budget, budget_source=plan.budget_source)
        model.close()
    return figures


def main(argv: list[str] | None = None) -> dict:
    """Run the benchmark (see the module docstring); return every figure. Exits saying why without a GPU."""
    from offload.device import cuda_available, device_for
    from offload.infer.config import InferenceConfig

    ap = model_parser(__doc__, dir_help="working directory on the NVMe disk (checkpoint written once, then reused)",
                      scale=0.5, layers=44, shards=16)
    ap.add_argument("--device", choices=("cuda", "simulated"), default="cuda",
                    help="cuda (default; refused without one), or simulated: the smoke test, no GPU figures")
    ap.add_argument("--gpu-budget", default="2GiB", help="max_memory[0]: the GPU's budget, smaller than the model")
    ap.add_argument("--host-budget", default="3GiB", help="max_memory['cpu']: pinned host memory for weights")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=8)
    ap.add_argument("--copy-size", default="256MiB", help="bytes of the pinned host-to-device copy measured")
    ap.add_argument("--accelerate", action=argparse.BooleanOptionalAction, default=True,
                    help="run Accelerate beside ours (GPU only)")
    ap.add_argument("--rows", default="equal,defaults",
                    help="equal (each side in a cgroup of the host budget + its overhead), defaults (each side's "
                         "default: ours \"auto\", Accelerate without max_memory)")
    ap.add_argument("--no-cgroups", action="store_true", help="run without memory cgroups (peer figures labelled)")
    args = parse_or_run_child(ap, argv, child, fio_size="1GiB")
    if args is None:
        return {}
    if args.device == "cuda" and not cuda_available():
        import torch

        raise SystemExit(f"benchmarks.gpu infer: needs a GPU, and CUDA is not available here (torch {torch.__version__}, "
                         f"{'a CPU build' if torch.version.cuda is None else 'no GPU visible'}); nothing was measured. "
                         f"--device simulated runs the same path on the simulated device as a smoke test (no GPU figures)")
    simulated = args.device == "simulated"
    directory = Path(args.dir).resolve()
    spec = Spec.scaled(args.scale, args.layers, args.shards)
    gpu, host = parse_size(args.gpu_budget), parse_size(args.host_budget)
    print(f"configuration: {spec}, bf16; batch {args.batch}, prompt {args.prompt_tokens} tokens, {args.new_tokens} new; "
          f"max_memory {{0: {_gib(gpu)}, 'cpu': {_gib(host)}}} on the {args.device} device")

    # 1. The checkpoint, once.
    checkpoint = write_checkpoint(directory / "checkpoint", spec)
    size = sum(os.path.getsize(f) for f in _files(checkpoint) if f.endswith(".safetensors"))
    print(f"checkpoint: {checkpoint} ({size / 1e9:.3f} GB; the GPU budget is {gpu / size:.0%} of it)")

    # 2. The links' speeds: fio on the disk (tensorio where fio is missing), a plain pinned copy to the device.
    disk = disk_rates(AioConfig.from_dict(InferenceConfig().aio.to_dict()), directory, parse_size(args.fio_size))
    fio_bps = disk.read_bps
    print(disk.describe())
    with device_for(args.device) as device:
        h2d_bps = copy_speed(device, min(parse_size(args.copy_size), gpu // 2))
    print(f"host->device: {h2d_bps / 1e9:.2f} GB/s, a plain pinned copy of {_gib(min(parse_size(args.copy_size), gpu // 2))}"
          + (" (simulated device: not a GPU figure)" if simulated else ""))

    # 3. Each configuration in its own process.
    payload = {"checkpoint": str(checkpoint), "device": args.device, "gpu_budget": gpu, "host_budget": host,
               "batch": args.batch, "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens,
               "disk_gbps": fio_bps / 1e9 if fio_bps else None, "h2d_bps": h2d_bps,
               "offload_folder": str(directory / "accelerate-offload")}
    kinds = ["ours"] + (["accelerate"] if args.accelerate and not simulated else [])
    runner = PeerRunner(lambda p, group: run_child("benchmarks.gpu.infer", ["--child", json.dumps(p)], cgroup=group),
                        use_cgroups=not args.no_cgroups)  # the smoke test too: its path, labelled where none
    rows = [row for row in args.rows.split(",") if row in ("equal", "defaults") and not (simulated and row != "equal")]
    figures = {"spec": asdict(spec), "checkpoint_bytes": size, "fio_bps": fio_bps, "disk_source": disk.source,
               "fio_missing": disk.fio_missing, "h2d_bps": h2d_bps, "device": args.device}
    results: list[dict] = []
    for row in rows:
        for kind in kinds:  # one at a time, the figures so far written after each: a time limit keeps them
            results += runner.rows([row], [kind], payload, host)
            if "plan" in results[-1]:
                print(results[-1]["plan"], flush=True)
            _finish(figures, results, simulated, args.out, final=False)
    return _finish(figures, results, simulated, args.out, final=True)


def _finish(figures: dict, results: list[dict], simulated: bool, out: str | None, *, final: bool) -> dict:
    """``figures`` with the runs so far and their targets (printed when ``final``), written to ``out``."""
    runs = {r["kind"]: r for r in results if r["row"] == "equal"}
    defaults = {r["kind"]: r for r in results if r["row"] == "defaults"}
    targets = _targets(runs, simulated) + _default_targets(defaults)
    if final:
        print("targets:")
        for line in targets:
            print("  " + line)
    figures.update(runs=runs, defaults=defaults, targets=targets, complete=final)
    if out:
        Path(out).write_text(json.dumps(figures, indent=1))
    return figures


def _targets(runs: dict, simulated: bool) -> list[str]:
    ours = runs.get("ours", {})
    if "error" in ours or not ours.get("s_per_token"):
        oom = f", {ours['cgroup_oom_kills']} OOM kills in its cgroup" if ours.get("cgroup_oom_kills") else ""
        return [f"not judged: our run gave no seconds per token ({ours.get('error', 'no figure')}{oom})"]
    bound = ours["bound_s"]
    lines = []
    if simulated:
        lines.append("not judged: the simulated device's times are not GPU figures")
    if bound:
        ratio = ours["s_per_token"] / bound
        lines.append(f"s/token {ours['s_per_token']:.4f} = {ratio:.2f}x the tiers' bound {bound:.4f} (target <= "
                     f"{TARGET_BOUND}x): " + ("-" if simulated else "met" if ratio <= TARGET_BOUND else "NOT met"))
    else:
        lines.append("the tiers' bound is unknown (fio did not run)")
    accelerate = runs.get("accelerate")
    if accelerate and accelerate.get("tokens_per_s"):
        ratio = ours["tokens_per_s"] / accelerate["tokens_per_s"]
        lines.append(f"equal memory ({memory_note(accelerate)}): tokens/s {ratio:.2f}x Accelerate's (target >= "
                     f"{TARGET_ACCELERATE}x): " + ("met" if ratio >= TARGET_ACCELERATE else "NOT met"))
    elif not simulated:
        lines.append("Accelerate: not run" + (f" ({accelerate['error']})" if accelerate else ""))
    return lines


def _default_targets(defaults: dict) -> list[str]:
    ours, accelerate = defaults.get("ours", {}), defaults.get("accelerate", {})
    if not ours.get("tokens_per_s") or not accelerate.get("tokens_per_s"):
        return []
    ratio = ours["tokens_per_s"] / accelerate["tokens_per_s"]
    return [f"each side's default ({memory_note(accelerate)}): tokens/s {ratio:.2f}x Accelerate's (target >= "
            f"{TARGET_DEFAULTS}x): " + ("met" if ratio >= TARGET_DEFAULTS else "NOT met")]


if __name__ == "__main__":
    main()
