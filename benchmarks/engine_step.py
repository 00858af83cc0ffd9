"""Engine benchmark: one GPT-2 trained with plain PyTorch, with the stage-3 engine at offload none,
cpu and nvme (parameters and optimizer), and with DeepSpeed on the same JSON, side by side.

    python -m benchmarks.engine_step --dir /work/tmp
    python -m benchmarks.engine_step --dir /work/tmp --modes nvme --model-config '{"n_layer": 24, "n_embd": 1024}'
    python -m benchmarks.engine_step --dir /work/tmp --modes torch,nvme,deepspeed --clip 1.0 --gas 2 --dtype bf16

``--clip`` (gradient_clipping; plain PyTorch calls clip_grad_norm_), ``--gas`` (gradient_accumulation_steps:
a step is that many micro-batches; plain PyTorch backpropagates loss / gas) and ``--dtype bf16`` (the
engines train bf16 weights with fp32 master weights in the optimizer; plain PyTorch runs the forward
under bf16 autocast with fp32 weights) give every mode the same work. ``nvme-unverified`` is ``nvme``
with ``aio.verify: false`` (no checksums on the swap files; not run unless named): beside ``nvme``, what
the checksums cost a step. ``nvme-unverified+hash`` (needs both; runs after them in each repeat) is
``nvme-unverified`` while a thread hashes for, each step, the CPU time ``nvme`` spent hashing, spread
over ``nvme-unverified``'s step (`benchmarks._hash_load`): what that hashing costs on this CPU wherever
it is done, the floor under the checksums' cost. ``deepspeed`` runs DeepSpeed's
stage-3 engine (it must be installed; it JIT-builds its ops on first use) on the same JSON as ``nvme``,
with the model built under its ``zero.Init`` (on the CPU it fails otherwise). Each step's global
gradient norm is recorded: with ``--clip``, "clipped" counts the steps whose norm was above it, the
steps a speculative update (step during backward, redo when the norm turns out too large) would redo.

Each configuration runs in its own subprocess (so that peak RSS is its own): a warm-up step, then
timed steps; ``--repeats N`` runs every configuration N times, interleaved, and reports medians over
the repeats and the nvme / torch ratio within each repeat. Reported per configuration: median step
time, peak RSS (the kernel's high-water mark over the timed steps: no sampling thread competes with them), and the bytes
the process read from and wrote to the disk per step (/proc/<pid>/io), against fio's read and write
speed on the same directory. "over baseline" is the peak minus the RSS of the interpreter with torch
and transformers imported, before the model exists. Headline: nvme step time / plain PyTorch step time (project target <= 1.3).

``torch+fio`` (needs ``torch`` and ``nvme`` in ``--modes``; runs last in each repeat) is plain PyTorch again
while fio reads and writes (O_DIRECT, another process: `bench.fio.fio_load`) the bytes nvme moved per
step, at the pace of plain PyTorch's step in that repeat: what that much disk traffic alone costs the
computation on this machine, which no offload of the same bytes can avoid.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import tempfile
import time

from bench.fio import fio_load, job_for_config, run_fio
from benchmarks._common import RssSampler, run_child, traffic_at_pace
from benchmarks._hash_load import HashLoad

MODES = ("torch", "none", "cpu", "nvme", "deepspeed", "torch+fio", "nvme-unverified", "nvme-unverified+hash")
DEFAULT_MODEL = {"n_layer": 6, "n_embd": 512, "n_head": 8, "vocab_size": 8192, "n_positions": 256}


def _child(args: dict) -> None:
    """One configuration in this process: warm-up, timed steps; print its figures as JSON on the last line."""
    import psutil
    import torch
    import transformers

    import tensorio  # noqa: F401 (imported before the baseline RSS is taken)

    proc = psutil.Process()
    torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))])  # lazy imports (torch._dynamo) before the baseline
    mode, clip, gas, bf16 = args["mode"], args["clip"], args["gas"], args["dtype"] == "bf16"
    aio = dict(args["aio"])
    hash_rate = args.get("hash_rate")  # nvme-unverified+hash: CPU seconds a second hashing beside the steps
    if mode in ("nvme-unverified", "nvme-unverified+hash"):  # nvme with the swap files' checksums off
        mode, aio["verify"] = "nvme", False
    if mode == "deepspeed":
        import deepspeed  # noqa: F401 (its import and accelerator setup before the baseline)
    baseline = proc.memory_info().rss
    torch.manual_seed(0)
    config = transformers.GPT2Config(**args["model"], resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    gen = torch.Generator().manual_seed(1)
    batches = [[torch.randint(0, config.vocab_size, (args["batch"], args["seq"]), generator=gen) for _ in range(gas)]
               for _ in range(args["warmup"] + args["steps"])]
    norms: list[float] = []
    if mode == "torch":
        model = transformers.GPT2LMHeadModel(config)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16)

        def step(micro: list[torch.Tensor]) -> float:
            for batch in micro:
                with autocast:
                    loss = model(batch, labels=batch).loss
                (loss / gas if gas > 1 else loss).backward()
            if clip:
                norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
            opt.step()
            opt.zero_grad()
            return loss.item()
    else:
        zero = {"stage": 3, "stage3_prefetch_bucket_size": args["buffer_size"] * 2,
                "stage3_param_persistence_threshold": args["persistence"],
                "offload_param": {"device": mode}, "offload_optimizer": {"device": mode}}
        if args["reuse_distance"] is not None:
            zero["stage3_max_reuse_distance"] = args["reuse_distance"]
        if args["sub_group_size"] is not None:  # else DeepSpeed's default (1e9; the engine then chooses)
            zero["sub_group_size"] = args["sub_group_size"]
        if mode in ("nvme", "deepspeed"):
            zero["offload_param"].update(device="nvme", nvme_path=args["dir"], max_in_cpu=args["max_in_cpu"],
                                         buffer_count=args["buffer_count"], buffer_size=args["buffer_size"])
            zero["offload_optimizer"].update(device="nvme", nvme_path=args["dir"])  # the rest: each engine's defaults
        ds_config = {"train_micro_batch_size_per_gpu": args["batch"], "gradient_accumulation_steps": gas,
                     "gradient_clipping": clip, "zero_optimization": zero, "aio": aio,
                     "bf16": {"enabled": bf16}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}}
        if mode == "deepspeed":
            engine = _deepspeed_engine(config, ds_config)
        else:
            from offload import initialize

            engine, *_ = initialize(model=transformers.GPT2LMHeadModel(config), config=ds_config)

        def step(micro: list[torch.Tensor]) -> float:
            for i, batch in enumerate(micro):
                loss = engine(batch, labels=batch).loss
                engine.backward(loss)
                if clip and i == gas - 1 and mode != "deepspeed":
                    norms.append(engine.get_global_grad_norm())  # taken as gradients were reduced: cheap
                engine.step()
            if clip and mode == "deepspeed":
                norms.append(float(engine.get_global_grad_norm()))
            return loss.item()
    params = args["params"]
    load = HashLoad(hash_rate) if hash_rate else contextlib.nullcontext()
    with load:
        times, rss, counters = _timed_steps(step, batches, args["warmup"], proc)
    io_before, cpu_before, hashed_before, io_after, cpu_after, hashed_after = counters
    n = len(times)
    path = None
    auto = {}
    if mode in ("none", "cpu", "nvme"):
        path = engine.stats().mode.value
        if engine.plan.max_in_cpu_source:  # max_in_cpu "auto": what it took, and from what
            auto = {"max_in_cpu": engine.plan.max_in_cpu, "max_in_cpu_source": engine.plan.max_in_cpu_source,
                    "in_memory_bytes": engine.plan.in_memory[1], "on_disk_bytes": engine.plan.on_disk[1]}
    if hash_rate:  # the load's bytes and CPU, per step (warm-up included: it ran through both)
        steps = args["warmup"] + n
        auto.update(load_hashed_per_step=load.hashed / steps, load_cpu_per_step=load.cpu_seconds / steps)
    print(json.dumps({**auto, "mode": mode, "params": params, "step_s": statistics.median(times), "times": times,
                      "peak_rss": rss.peak, "baseline_rss": baseline, "norms": norms, "path": path,
                      "clipped": sum(1 for norm in norms if norm > clip) if clip else 0,
                      "cpu_user_per_step": (cpu_after.user - cpu_before.user) / n,
                      "cpu_kernel_per_step": (cpu_after.system - cpu_before.system) / n,
                      "read_per_step": (io_after.read_bytes - io_before.read_bytes) / n,
                      "written_per_step": (io_after.write_bytes - io_before.write_bytes) / n,
                      "hashed_per_step": (hashed_after.nbytes - hashed_before.nbytes) / n,
                      "hash_cpu_per_step": (hashed_after.cpu_seconds - hashed_before.cpu_seconds) / n}))


def _timed_steps(step, batches: list, warmup: int, proc):
    """Run the warm-up steps, then time the rest; return the times, the RSS sampler and the counters
    (I/O, CPU, checksums) before and after the timed steps."""
    import tensorio

    for micro in batches[:warmup]:
        step(micro)
    times = []
    with RssSampler(kernel_peak=True) as rss:  # no sampling thread taking CPU and the GIL from the timed steps
        io_before, cpu_before, hashed_before = proc.io_counters(), os.times(), tensorio.checksum_totals()
        for micro in batches[warmup:]:
            start = time.perf_counter()
            step(micro)
            times.append(time.perf_counter() - start)
        io_after, cpu_after, hashed_after = proc.io_counters(), os.times(), tensorio.checksum_totals()
    return times, rss, (io_before, cpu_before, hashed_before, io_after, cpu_after, hashed_after)


def _deepspeed_engine(model_config, ds_config: dict):
    """DeepSpeed's stage-3 engine on ``ds_config``, the model built under its zero.Init (one process)."""
    import deepspeed
    import transformers

    for key, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29533"), ("RANK", "0"), ("LOCAL_RANK", "0"),
                       ("WORLD_SIZE", "1")):
        os.environ.setdefault(key, value)
    deepspeed.init_distributed(dist_backend="gloo")
    with deepspeed.zero.Init(config_dict_or_path=ds_config):
        model = transformers.GPT2LMHeadModel(model_config)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)
    return engine


def run_mode(mode: str, args: argparse.Namespace, directory: str, *, hash_rate: float = 0.0) -> dict:
    """Run one configuration in a subprocess; return its figures. Raises RuntimeError if it fails."""
    payload = {"mode": mode, "model": args.model_config, "batch": args.batch, "seq": args.seq,
               "warmup": args.warmup, "steps": args.steps, "dir": os.path.abspath(directory),
               "sub_group_size": args.sub_group_size, "buffer_count": args.buffer_count,
               "buffer_size": args.buffer_size, "persistence": args.persistence,
               "max_in_cpu": args.max_in_cpu if args.max_in_cpu == "auto" else int(float(args.max_in_cpu)),
               "aio": {"block_size": args.block_size, "queue_depth": args.queue_depth}, "clip": args.clip,
               "gas": args.gas, "dtype": args.dtype, "params": args.params,
               "reuse_distance": 0 if mode == "deepspeed" else args.reuse_distance, "hash_rate": hash_rate}
    threshold = args.malloc_mmap_threshold if args.malloc_mmap_threshold >= 0 else None
    return run_child("benchmarks.engine_step", ["--child", json.dumps(payload)], mmap_threshold=threshold)


def main(argv: list[str] | None = None) -> dict[str, dict]:
    """Run the benchmark; print the configuration, a table and the headline ratio; return the figures."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-config", type=json.loads, default=DEFAULT_MODEL, help="GPT2Config keys as JSON")
    ap.add_argument("--modes", default=",".join(m for m in MODES if m != "nvme-unverified"),
                    help=f"comma-separated subset of {MODES}")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=1, help="runs of every mode, interleaved; medians are reported")
    ap.add_argument("--dir", default=None, help="directory on the disk to measure (default: a temporary one)")
    ap.add_argument("--sub-group-size", type=int, default=None,
                    help="zero_optimization.sub_group_size (default: not set, DeepSpeed's 1e9, which the engine replaces "
                         "with its own choice)")
    ap.add_argument("--buffer-count", type=int, default=2, help="offload_param.buffer_count")
    ap.add_argument("--buffer-size", type=int, default=None, help="offload_param.buffer_size (default: the largest parameter)")
    ap.add_argument("--persistence", type=int, default=100_000, help="stage3_param_persistence_threshold")
    ap.add_argument("--max-in-cpu", default="0",
                    help="offload_param.max_in_cpu: parameter elements kept in RAM (0: all on NVMe; DeepSpeed's default "
                         "is 1e9), or auto (as many as the host's available memory holds beside the rest of the bound)")
    ap.add_argument("--block-size", type=int, default=1 << 20)
    ap.add_argument("--queue-depth", type=int, default=32)
    ap.add_argument("--clip", type=float, default=0.0, help="gradient_clipping (0: off)")
    ap.add_argument("--gas", type=int, default=1, help="gradient_accumulation_steps: micro-batches per step")
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32",
                    help="bf16: engines train bf16 weights (fp32 masters), plain PyTorch under bf16 autocast")
    ap.add_argument("--reuse-distance", type=int, default=None,
                    help="stage3_max_reuse_distance (default: DeepSpeed's, 1e9; deepspeed mode always gets 0, "
                         "without which it crashes at max_in_cpu 0)")
    ap.add_argument("--fio-size", type=int, default=1 << 30, help="bytes fio moves per direction")
    ap.add_argument("--malloc-mmap-threshold", type=int, default=131072,
                    help="glibc MALLOC_MMAP_THRESHOLD_ for the children, so that RSS follows live memory "
                         "(negative: glibc's default)")
    ap.add_argument("--child", type=json.loads, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        _child(args.child)
        return {}
    model = {**DEFAULT_MODEL, **args.model_config}
    args.model_config = model
    if args.buffer_size is None:
        args.buffer_size = max(model["vocab_size"] * model["n_embd"], 4 * model["n_embd"] ** 2 + 4 * model["n_embd"])
    layer = 12 * model["n_embd"] ** 2 + 13 * model["n_embd"]
    args.params = model["n_layer"] * layer + (model["vocab_size"] + model["n_positions"] + 2) * model["n_embd"]
    modes = [m for m in args.modes.split(",") if m]
    for mode in modes:
        if mode not in MODES:
            raise SystemExit(f"--modes: {mode!r} is not one of {MODES}")
    if "torch+fio" in modes:
        if "torch" not in modes or "nvme" not in modes:
            raise SystemExit("--modes: torch+fio needs torch and nvme as well (it moves nvme's bytes at torch's pace)")
        modes = [m for m in modes if m != "torch+fio"] + ["torch+fio"]
    if "nvme-unverified+hash" in modes:
        if "nvme" not in modes or "nvme-unverified" not in modes:
            raise SystemExit("--modes: nvme-unverified+hash needs nvme and nvme-unverified as well (it hashes for nvme's "
                             "hashing CPU time at nvme-unverified's pace)")
        modes = [m for m in modes if m != "nvme-unverified+hash"] + ["nvme-unverified+hash"]
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="bench-engine-") as directory:
        print(f"model={json.dumps(model)} batch={args.batch} seq={args.seq} gas={args.gas} clip={args.clip} "
              f"dtype={args.dtype} reuse_distance={args.reuse_distance} warmup={args.warmup} steps={args.steps} "
              f"buffer_count={args.buffer_count} buffer_size={args.buffer_size} sub_group_size={args.sub_group_size} "
              f"block_size={args.block_size} queue_depth={args.queue_depth} dir={directory}")
        runs: dict[str, list[dict]] = {mode: [] for mode in modes}
        for repeat in range(args.repeats):
            for mode in modes:
                if mode == "torch+fio":
                    runs[mode].append(_run_beside_io(args, directory, runs["torch"][-1], runs["nvme"][-1]))
                elif mode == "nvme-unverified+hash":
                    rate = runs["nvme"][-1]["hash_cpu_per_step"] / runs["nvme-unverified"][-1]["step_s"]
                    runs[mode].append(run_mode(mode, args, directory, hash_rate=rate))
                else:
                    runs[mode].append(run_mode(mode, args, directory))
            if args.repeats > 1:
                print(f"repeat {repeat + 1}: " + ", ".join(f"{mode} {runs[mode][-1]['step_s']:.3f} s" for mode in modes),
                      flush=True)
        results = {mode: _median_run(rs) for mode, rs in runs.items()}

        class _Aio:  # the settings fio mirrors
            block_size, queue_depth, thread_count, single_submit, overlap_events, direct = (
                args.block_size, args.queue_depth, 1, False, True, True)
        fio_size = max(args.fio_size, args.block_size)
        read_bw = run_fio(job_for_config(_Aio, directory=directory, rw="read", size=fio_size)).bw_bytes
        write_bw = run_fio(job_for_config(_Aio, directory=directory, rw="write", size=fio_size)).bw_bytes
    params = next(iter(results.values()))["params"]
    print(f"parameters: {params / 1e6:.1f} M; fio: read {read_bw / 1e9:.2f} GB/s, write {write_bw / 1e9:.2f} GB/s")
    print(f"{'mode':<9} {'step (s)':>9} {'peak RSS (MB)':>14} {'over baseline':>14} {'read/step (MB)':>15} {'written/step (MB)':>18} "
          f"{'I/O at fio (s)':>15} {'GB/s achieved':>14}")
    for mode, r in results.items():
        io_s = r["read_per_step"] / read_bw + r["written_per_step"] / write_bw
        moved = (r["read_per_step"] + r["written_per_step"]) / r["step_s"] / 1e9
        print(f"{mode:<9} {r['step_s']:>9.3f} {r['peak_rss'] / 1e6:>14.0f} {(r['peak_rss'] - r['baseline_rss']) / 1e6:>14.0f} "
              f"{r['read_per_step'] / 1e6:>15.1f} "
              f"{r['written_per_step'] / 1e6:>18.1f} {io_s:>15.3f} {moved:>14.2f}")
        r["io_at_fio_s"] = io_s
        r["gb_per_s"] = moved
    for mode, r in results.items():
        print(f"{mode}: CPU per step {r['cpu_user_per_step']:.2f} s user, {r['cpu_kernel_per_step']:.2f} s kernel")
        if r.get("hashed_per_step"):
            print(f"{mode}: checksums hashed {r['hashed_per_step'] / 1e9:.2f} GB a step in {r['hash_cpu_per_step']:.3f} s "
                  f"of CPU ({r['hashed_per_step'] / max(r['hash_cpu_per_step'], 1e-9) / 1e9:.1f} GB/s), "
                  f"{r['hash_cpu_per_step'] / r['step_s']:.1%} of the step")
        if r.get("path"):
            print(f"{mode}: the update ran {r['path']}")
        if r.get("max_in_cpu_source"):
            print(f"{mode}: max_in_cpu \"auto\" took {int(r['max_in_cpu']):,} elements ({r['in_memory_bytes'] / 1e6:.0f} MB "
                  f"of partitions in memory, {r['on_disk_bytes'] / 1e6:.0f} MB on NVMe) = {r['max_in_cpu_source']}")
        if args.clip and r["norms"]:
            print(f"{mode}: global gradient norm above gradient_clipping {args.clip} in {r['clipped']} of "
                  f"{len(r['norms'])} steps (a speculative step would be redone that often); norms "
                  + " ".join(f"{x:.2f}" for x in r["norms"]))
    ratios = {}
    if "torch+fio" in results:
        loaded = results["torch+fio"]
        slowdown = loaded["step_s"] / results["torch"]["step_s"]
        per_repeat = [b["step_s"] / a["step_s"] for a, b in zip(runs["torch"], runs["torch+fio"])]
        print(f"torch+fio: fio moved {loaded['fio_read_rate'] / 1e9:.2f} GB/s read, {loaded['fio_write_rate'] / 1e9:.2f} "
              f"GB/s written beside plain PyTorch (nvme's bytes at plain PyTorch's pace): its step took "
              f"{slowdown:.2f}x its own time (per repeat: "
              + " ".join(f"{r:.2f}" for r in per_repeat) + f"); nvme took {results['nvme']['step_s'] / loaded['step_s']:.2f}x "
              "plain PyTorch beside that traffic")
        ratios["beside_io_over_torch"], ratios["beside_io_per_repeat"] = slowdown, per_repeat
    for mode, key in (("nvme", "per_repeat"), ("deepspeed", "deepspeed_per_repeat")):
        if "torch" in results and mode in results:
            ratio = results[mode]["step_s"] / results["torch"]["step_s"]
            per_repeat = [n["step_s"] / t["step_s"] for n, t in zip(runs[mode], runs["torch"])]
            print(f"{mode} / plain PyTorch step time = {ratio:.2f}  (nvme: project target <= 1.3); per repeat: "
                  + " ".join(f"{r:.2f}" for r in per_repeat))
            ratios[f"{mode}_over_torch"], ratios[key] = ratio, per_repeat
    if "nvme" in results and "nvme-unverified" in results:
        cost = _pooled(runs["nvme"]) / _pooled(runs["nvme-unverified"])  # the host's noise: pool every step
        per_repeat = [a["step_s"] / b["step_s"] for a, b in zip(runs["nvme"], runs["nvme-unverified"])]
        print(f"nvme (checksums on) / nvme-unverified (aio.verify false) step time = {cost:.3f} (target <= 1.03; "
              "pooled medians of every step); per repeat: " + " ".join(f"{r:.3f}" for r in per_repeat))
        ratios["verify_cost"], ratios["verify_cost_per_repeat"] = cost, per_repeat
    if "nvme-unverified+hash" in results:
        _print_hash_floor(runs, results, ratios)
    if "nvme" in results and "deepspeed" in results:
        speedup = results["deepspeed"]["step_s"] / results["nvme"]["step_s"]
        saved = results["deepspeed"]["peak_rss"] - results["nvme"]["peak_rss"]
        print(f"deepspeed / nvme step time = {speedup:.2f} (target >= 2); nvme's peak RSS {saved / 1e9:.2f} GB lower")
        ratios["deepspeed_over_nvme"] = speedup
    if ratios:
        results["ratio"] = ratios
    return results


def _print_hash_floor(runs: dict[str, list[dict]], results: dict[str, dict], ratios: dict) -> None:
    """The checksums' floor (nvme-unverified+hash / nvme-unverified) and nvme against it, pooled and per
    repeat (nvme / nvme-unverified is the verify_cost line's)."""
    loaded, off, on = runs["nvme-unverified+hash"], runs["nvme-unverified"], runs["nvme"]
    floor = _pooled(loaded) / _pooled(off)
    against = _pooled(on) / _pooled(loaded)
    r = results["nvme-unverified+hash"]
    print(f"nvme-unverified+hash: a thread hashed {r['load_hashed_per_step'] / 1e9:.2f} GB a step in "
          f"{r['load_cpu_per_step']:.3f} s of CPU beside nvme-unverified: the floor under the checksums' cost "
          f"{floor:.3f} (per repeat: " + " ".join(f"{b['step_s'] / a['step_s']:.3f}" for a, b in zip(off, loaded))
          + f"); nvme against it {against:.3f} (per repeat: "
          + " ".join(f"{a['step_s'] / b['step_s']:.3f}" for a, b in zip(on, loaded)) + "); pooled medians of every step")
    ratios["hash_floor"], ratios["verify_over_floor"] = floor, against


def _pooled(runs: list[dict]) -> float:
    """The median of every timed step of ``runs``."""
    return statistics.median(t for r in runs for t in r["times"])


def _run_beside_io(args: argparse.Namespace, directory: str, plain: dict, nvme: dict) -> dict:
    """The ``torch+fio`` mode: plain PyTorch while fio moves ``nvme``'s bytes per step at ``plain``'s pace."""
    load = traffic_at_pace(directory, nvme["read_per_step"], nvme["written_per_step"], plain["step_s"],
                           block_size=args.block_size)
    with fio_load(load) as run:
        result = run_mode("torch", args, directory)
    result["fio_read_rate"], result["fio_write_rate"] = run.read.bw_bytes, run.write.bw_bytes
    return result


def _median_run(runs: list[dict]) -> dict:
    """One configuration's figures over its repeats: the median of each number."""
    merged = dict(runs[0])
    for key, value in runs[0].items():
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            merged[key] = statistics.median(r[key] for r in runs)
    merged["times"] = [t for r in runs for t in r["times"]]
    return merged


if __name__ == "__main__":
    main()
