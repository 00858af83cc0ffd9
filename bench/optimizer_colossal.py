"""Benchmark 1: ColossalAI's NVMe-offload example, GPT-2 small on the CPU, no offload against full offload.

    python -m bench.optimizer_colossal --dir /work/tmp --repeats 3

ColossalAI trained GPT-2 small (``transformers.GPT2Config()``, 124M parameters, random init) with
batch 4, sequence 128 for 3 steps: 7.7 s / 5966 MB RSS without offload, 8.5 s / 4968 MB with the
whole optimizer state on NVMe. Here each configuration runs in its own subprocess (so that its peak
RSS, VmHWM, is its own), one warm-up step then 3 timed steps, repeated and interleaved; medians are
printed. Both OffloadAdam runs use ``overlap_backward=True``: each sub-group is updated during
backward as soon as its gradients are final, its state read ahead and written behind. Targets:
time(1.0) / time(0.0) <= 1.05 and peak RSS(0.0) - peak RSS(1.0) >= 0.9 GB.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

CONFIGS = {
    "torch AdamW (fused)": dict(optimizer="torch", fraction=0.0),
    "OffloadAdam 0.0": dict(optimizer="offload", fraction=0.0),
    "OffloadAdam 1.0": dict(optimizer="offload", fraction=1.0),
}


def _peak_rss_bytes() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def _child(args: argparse.Namespace) -> None:
    """One configuration in this process: print {"seconds", "peak_rss"} as JSON on the last line."""
    import torch
    import transformers

    from offload.adam import OffloadAdam

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = transformers.GPT2Config(**json.loads(args.model_config))
    model = transformers.GPT2LMHeadModel(config).train()
    if args.optimizer == "torch":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0, fused=True)
    else:
        opt = OffloadAdam(model.parameters(), lr=1e-4, nvme_offload_fraction=args.fraction,
                          nvme_offload_dir=args.dir, sub_group_size=args.sub_group_size,
                          buffer_count=args.buffer_count, overlap_backward=True)
    tokens = torch.randint(0, config.vocab_size, (args.batch, args.seq), generator=torch.Generator().manual_seed(1))

    def train_step() -> None:
        model(input_ids=tokens, labels=tokens).loss.backward()
        opt.step()
        opt.zero_grad()

    train_step()  # warm-up: the state is created here
    start = time.perf_counter()
    for _ in range(args.steps):
        train_step()
    if isinstance(opt, OffloadAdam):
        opt.close()  # the last step's write-behind is part of the time
    seconds = time.perf_counter() - start
    print(json.dumps({"seconds": seconds, "peak_rss": _peak_rss_bytes()}))


def main(argv: list[str] | None = None) -> dict[str, float]:
    """Run every configuration ``--repeats`` times; print medians and the two ratios; return them."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default=None, help="directory on the NVMe disk for the swap file")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--sub-group-size", type=int, default=1 << 21)
    ap.add_argument("--buffer-count", type=int, default=4)
    ap.add_argument("--model-config", default="{}", help="JSON overrides of GPT2Config (tests use a tiny model)")
    ap.add_argument("--child", choices=["torch", "offload"], dest="optimizer", help=argparse.SUPPRESS)
    ap.add_argument("--fraction", type=float, default=0.0, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.optimizer:
        _child(args)
        return {}
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="bench-optimizer-colossal-") as directory:
        print(f"GPT-2 {args.model_config} batch={args.batch} seq={args.seq} steps={args.steps} (+1 warm-up) "
              f"repeats={args.repeats} sub_group_size={args.sub_group_size} buffer_count={args.buffer_count} "
              f"cpus={os.cpu_count()} dir={directory}")
        results: dict[str, list[dict[str, float]]] = {name: [] for name in CONFIGS}
        for _ in range(args.repeats):  # interleaved, so that noise hits every configuration alike
            for name, config in CONFIGS.items():
                command = [sys.executable, "-m", "bench.optimizer_colossal", "--child", config["optimizer"],
                           "--fraction", str(config["fraction"]), "--dir", directory, "--batch", str(args.batch),
                           "--seq", str(args.seq), "--steps", str(args.steps),
                           "--sub-group-size", str(args.sub_group_size), "--buffer-count", str(args.buffer_count),
                           "--model-config", args.model_config]
                done = subprocess.run(command, capture_output=True, text=True, check=False)
                if done.returncode:
                    raise RuntimeError(f"{name} failed:\n{done.stderr[-3000:]}")
                results[name].append(json.loads(done.stdout.strip().splitlines()[-1]))
    medians = {}
    for name, runs in results.items():
        seconds = statistics.median(r["seconds"] for r in runs)
        rss = statistics.median(r["peak_rss"] for r in runs)
        medians[name] = (seconds, rss)
        print(f"{name:22s} {seconds:7.3f} s  peak RSS {rss / 1e6:7.0f} MB   "
              f"(runs: {', '.join(format(r['seconds'], '.2f') for r in runs)})")
    (t0, rss0), (t1, rss1) = medians["OffloadAdam 0.0"], medians["OffloadAdam 1.0"]
    print(f"full offload / no offload: time {t1 / t0:.3f}x (target <= 1.05), "
          f"peak RSS {(rss0 - rss1) / 1e9:.3f} GB lower (target >= 0.9)")
    return {"time_ratio": t1 / t0, "rss_saved_bytes": rss0 - rss1}


if __name__ == "__main__":
    main()
