"""Benchmark 1: ColossalAI's NVMe-offload example, GPT-2 small on the CPU, no offload against full offload.

    python -m benchmarks.optimizer_colossal --dir /work/tmp --repeats 3

ColossalAI trained GPT-2 small (``transformers.GPT2Config()``, 124M parameters, random init) with
batch 4, sequence 128 for 3 steps: 7.7 s / 5966 MB RSS without offload, 8.5 s / 4968 MB with the
whole optimizer state on NVMe. Here each configuration runs in its own subprocess (so that its peak
RSS, the kernel's high-water mark from before the model is built to the end, is its own), one warm-up step
then 3 timed steps, repeated and interleaved; medians are printed. Both OffloadAdam runs are the
README's example plus ``overlap_backward=True``: each sub-group is updated during backward as soon as
its gradients are final, its state read ahead and written behind; ``sub_group_size`` and
``buffer_count`` are OffloadAdam's own choice unless ``--sub-group-size`` / ``--buffer-count`` are
given. Targets: time(1.0) / time(0.0) <= 1.05 and peak RSS(0.0) - peak RSS(1.0) >= 0.9 GB.

What the disk traffic alone costs: "torch AdamW + fio" runs plain PyTorch again while fio reads and
writes (O_DIRECT, in another process, `bench.fio.fio_load`) at the rates OffloadAdam 1.0 would need
to match it: the bytes OffloadAdam 1.0 moved over its timed steps in that repeat, per second of
plain PyTorch's time for them. fio itself takes a few percent of one core; whatever more the plain
run loses is what that much I/O costs the computation on this machine, a floor no offload of the
same bytes can go under. It is left out when fio is not installed (or with ``--no-fio-load``).

Besides wall time (noisy on a shared machine) each run reports its CPU time and, for OffloadAdam,
the seconds the training thread was blocked on swap I/O (``io_wait_seconds()``), which other
processes' load affects less. ``--malloc-mmap-threshold`` runs every configuration with glibc's
``MALLOC_MMAP_THRESHOLD_`` fixed, so that freed tensors go back to the system at once and peak RSS
counts live memory rather than what the heap happened to retain (see docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

from bench.fio import fio_load, fio_path
from benchmarks._common import RssSampler, run_child, traffic_at_pace

CONFIGS = {
    "torch AdamW (fused)": dict(optimizer="torch", fraction=0.0),
    "OffloadAdam 0.0": dict(optimizer="offload", fraction=0.0),
    "OffloadAdam 1.0": dict(optimizer="offload", fraction=1.0),
}


def add_run_arguments(ap: argparse.ArgumentParser) -> None:
    """The options of one run that `build_run` and the training loop read (optimizer_memory has them too)."""
    ap.add_argument("--dir", default=None, help="directory on the NVMe disk for the swap file")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--sub-group-size", type=int, default=None, help="default: OffloadAdam's own choice")
    ap.add_argument("--buffer-count", type=int, default=None, help="default: OffloadAdam's own choice")
    ap.add_argument("--model-config", default="{}", help="JSON overrides of GPT2Config (tests use a tiny model)")


def build_run(args: argparse.Namespace):
    """The benchmark's (model, optimizer, tokens) for one configuration, seeded alike for every one."""
    import torch
    import transformers

    from offload import OffloadAdam

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = transformers.GPT2Config(**json.loads(args.model_config))
    model = transformers.GPT2LMHeadModel(config).train()
    if args.optimizer == "torch":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0, fused=True)
    else:
        # The README's example plus overlap_backward=True; the swap sizes are OffloadAdam's unless given.
        sizes = {key: value for key, value in (("sub_group_size", args.sub_group_size),
                                                ("buffer_count", args.buffer_count)) if value is not None}
        opt = OffloadAdam(model.parameters(), lr=1e-4, nvme_offload_fraction=args.fraction,
                          nvme_offload_dir=args.dir, overlap_backward=True, **sizes)
    tokens = torch.randint(0, config.vocab_size, (args.batch, args.seq), generator=torch.Generator().manual_seed(1))
    return model, opt, tokens


def _child(args: argparse.Namespace) -> None:
    """One configuration in this process: print {"seconds", "cpu_seconds", "io_wait", "peak_rss",
    "read_bytes", "written_bytes"} (over the timed steps) as JSON on the last line."""
    import psutil

    from offload import OffloadAdam

    with RssSampler(kernel_peak=True) as rss:  # no sampling thread taking CPU and the GIL from the timed steps
        model, opt, tokens = build_run(args)

        def train_step() -> None:
            model(input_ids=tokens, labels=tokens).loss.backward()
            opt.step()
            opt.zero_grad()

        train_step()  # warm-up: the state is created here
        offloaded = isinstance(opt, OffloadAdam)
        waited = opt.io_wait_seconds() if offloaded else 0.0
        io_start = psutil.Process().io_counters()
        start, cpu_start = time.perf_counter(), time.process_time()
        for _ in range(args.steps):
            train_step()
        if offloaded:
            opt.synchronize()  # the last step's updates and write-behind are part of the time
        seconds, cpu = time.perf_counter() - start, time.process_time() - cpu_start
        io_end = psutil.Process().io_counters()
        io_wait = opt.io_wait_seconds() - waited if offloaded else 0.0
        if offloaded:
            opt.close()  # not timed: removing the swap file is teardown (slow on ext4 mounted with discard)
    print(json.dumps({"seconds": seconds, "cpu_seconds": cpu, "io_wait": io_wait, "peak_rss": rss.peak,
                      "read_bytes": io_end.read_bytes - io_start.read_bytes,
                      "written_bytes": io_end.write_bytes - io_start.write_bytes}))


def main(argv: list[str] | None = None) -> dict[str, float]:
    """Run every configuration ``--repeats`` times; print medians and the two ratios; return them."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_arguments(ap)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-fio-load", action="store_true",
                    help="leave out plain PyTorch beside fio moving OffloadAdam's bytes")
    ap.add_argument("--malloc-mmap-threshold", type=int, default=None, metavar="BYTES",
                    help="run every configuration with MALLOC_MMAP_THRESHOLD_=BYTES (glibc); default: unset")
    ap.add_argument("--child", choices=["torch", "offload"], dest="optimizer", help=argparse.SUPPRESS)
    ap.add_argument("--fraction", type=float, default=0.0, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.optimizer:
        _child(args)
        return {}
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="bench-optimizer-colossal-") as directory:
        print(f"GPT-2 {args.model_config} batch={args.batch} seq={args.seq} steps={args.steps} (+1 warm-up) "
              f"repeats={args.repeats} sub_group_size={args.sub_group_size} buffer_count={args.buffer_count} "
              f"cpus={os.cpu_count()} MALLOC_MMAP_THRESHOLD_={args.malloc_mmap_threshold} dir={directory}")
        with_load = not args.no_fio_load and fio_path() is not None
        if not args.no_fio_load and not with_load:
            print("fio is not installed (apt-get install fio): plain PyTorch beside fio's traffic is left out")
        results: dict[str, list[dict[str, float]]] = {name: [] for name in CONFIGS}
        if with_load:
            results[LOADED] = []
        for _ in range(args.repeats):  # interleaved, so that noise hits every configuration alike
            for name, config in CONFIGS.items():
                results[name].append(_run(args, directory, config))
            if with_load:
                plain, full = results["torch AdamW (fused)"][-1], results["OffloadAdam 1.0"][-1]
                with fio_load(traffic_at_pace(directory, full["read_bytes"], full["written_bytes"],
                                              plain["seconds"])) as run:
                    loaded = _run(args, directory, CONFIGS["torch AdamW (fused)"])
                loaded["fio_read_rate"], loaded["fio_write_rate"] = run.read.bw_bytes, run.write.bw_bytes
                results[LOADED].append(loaded)
    medians = {}
    for name, runs in results.items():
        medians[name] = {key: statistics.median(r[key] for r in runs) for key in runs[0]}
        m = medians[name]
        print(f"{name:22s} {m['seconds']:7.3f} s  cpu {m['cpu_seconds']:7.3f} s  io wait {m['io_wait']:6.3f} s  "
              f"peak RSS {m['peak_rss'] / 1e6:7.0f} MB   (runs: {', '.join(format(r['seconds'], '.2f') for r in runs)})")
    none, full = medians["OffloadAdam 0.0"], medians["OffloadAdam 1.0"]
    paired = [b["seconds"] / a["seconds"] for a, b in zip(results["OffloadAdam 0.0"], results["OffloadAdam 1.0"])]
    print(f"full offload / no offload: time {full['seconds'] / none['seconds']:.3f}x (target <= 1.05; "
          f"per repeat {', '.join(format(r, '.3f') for r in paired)}), cpu {full['cpu_seconds'] / none['cpu_seconds']:.3f}x, "
          f"peak RSS {(none['peak_rss'] - full['peak_rss']) / 1e9:.3f} GB lower (target >= 0.9)")
    figures = {"time_ratio": full["seconds"] / none["seconds"], "rss_saved_bytes": none["peak_rss"] - full["peak_rss"],
               "io_wait_seconds": full["io_wait"]}
    if LOADED in medians:
        plain, loaded = medians["torch AdamW (fused)"], medians[LOADED]
        per_repeat = [b["seconds"] / a["seconds"] for a, b in zip(results["torch AdamW (fused)"], results[LOADED])]
        print(f"OffloadAdam 1.0 moved {full['read_bytes'] / 1e9:.2f} GB read and {full['written_bytes'] / 1e9:.2f} GB "
              f"written; fio beside plain PyTorch moved {loaded['fio_read_rate'] / 1e9:.2f} / "
              f"{loaded['fio_write_rate'] / 1e9:.2f} GB/s: plain PyTorch took {loaded['seconds'] / plain['seconds']:.3f}x "
              f"its own time (per repeat {', '.join(format(r, '.3f') for r in per_repeat)}); OffloadAdam 1.0 took "
              f"{full['seconds'] / loaded['seconds']:.3f}x plain PyTorch beside that traffic")
        figures["plain_beside_io_ratio"] = loaded["seconds"] / plain["seconds"]
    return figures


LOADED = "torch AdamW + fio"
"""Plain PyTorch run while fio moves OffloadAdam 1.0's bytes at plain PyTorch's pace (the module docstring)."""


def _run(args: argparse.Namespace, directory: str, config: dict) -> dict[str, float]:
    """One configuration in a fresh interpreter; its figures (`_child`)."""
    child = ["--child", config["optimizer"], "--fraction", str(config["fraction"]), "--dir", directory,
             "--batch", str(args.batch), "--seq", str(args.seq), "--steps", str(args.steps),
             *(["--sub-group-size", str(args.sub_group_size)] if args.sub_group_size else []),
             *(["--buffer-count", str(args.buffer_count)] if args.buffer_count else []),
             "--model-config", args.model_config]
    return run_child("benchmarks.optimizer_colossal", child, mmap_threshold=args.malloc_mmap_threshold)


if __name__ == "__main__":
    main()
