"""Benchmark: generation from NVMe at this tree against an earlier revision, on the same checkpoint, alternated.

    python -m benchmarks.infer_revisions --dir /work/bench-llama --rev 9720ff8~1 --budget 8GiB
    python -m benchmarks.infer_revisions --dir /work/bench-llama --rev 9720ff8~1 --budget 2GiB --quantize int4
    python -m benchmarks.infer_revisions --dir /tmp/x --scale 0.025 --layers 2 --shards 1 --rev HEAD \\
        --budget 1MiB --new-tokens 2 --repeats 1         # tiny, as tests/test_infer_bench.py runs it

"No slower than before" for a change that was not meant to touch a path (issue 48: the dense families
after the loader's conversion, the activation estimate and the routed experts):

1. Writes, once, `benchmarks.infer_stream`'s random bf16 Llama (``--scale`` 1: the 28.6 GB model).
2. Checks out ``--rev`` in a git worktree of its own (removed at the end) and runs ``python -m
   offload.generate --json`` from it and from this tree in turn, ``--repeats`` rounds, the order swapped
   every round, each a fresh process with the same prompt, budget and options; with ``--quantize`` each
   side first writes its own quantized cache (a warm-up run, not counted, under its own ``--nvme-path``),
   so that the two never replace each other's: in a temporary directory, or kept under ``--cache-dir``
   (``DIR/revision``, ``DIR/this-tree``) and reused by later runs. Before every run the checkpoint and both
   caches are dropped from the page cache: a reused quantized cache is read whole to check its checksums
   before the first token, and without the drop a side that ran just before could find its cache in
   memory where the other read its from the disk (28.6 GB model, int4: 11-13 s to the first token with
   the cache in memory, 29-42 s cold), an order effect larger than the difference being measured.
3. Prints each side's median seconds per token (decode) and time to first token, and this tree's
   over the revision's: within noise is what "no slower" means here (the disk's speed swings, so only
   the alternated medians count).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks._common import REPO
from benchmarks.infer_stream import Spec, write_checkpoint


def generate(tree: Path, checkpoint: Path, options: list[str]) -> dict[str, Any]:
    """``python -m offload.generate CHECKPOINT *options --json`` run from ``tree`` (its code, not this one's);
    the JSON figures it printed. Raises RuntimeError with the end of its error output where it fails."""
    done = subprocess.run([sys.executable, "-m", "offload.generate", str(checkpoint), *options, "--json"], cwd=tree,
                          env={**os.environ, "PYTHONPATH": str(tree)}, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"offload.generate from {tree} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _drop_from_page_cache(checkpoint: Path, caches: list[Path]) -> None:
    """Drop the checkpoint's safetensors files and the caches' from the page cache (the next run reads
    them from the disk)."""
    from offload.infer.weights.convert import drop_page_cache

    for path in [*checkpoint.glob("*.safetensors"), *(p for cache in caches for p in cache.rglob("*.safetensors"))]:
        drop_page_cache(path)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the comparison (see the module docstring); print the table; return every figure."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", required=True, help="checkpoint directory (written once, then reused)")
    ap.add_argument("--rev", required=True, help="the git revision to compare with (e.g. the commit before a change)")
    ap.add_argument("--scale", type=float, default=1.0)
    ap.add_argument("--layers", type=int, default=44)
    ap.add_argument("--shards", type=int, default=46)
    ap.add_argument("--budget", default="8GiB", help="--max-in-cpu of both sides")
    ap.add_argument("--quantize", choices=["int4", "int8"], help="both sides' --quantize (each its own cache)")
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3, help="rounds (each side once a round, the order swapped)")
    ap.add_argument("--disk-gbps", type=float, default=2.0, help="both sides' plan bound (so that none probes the disk)")
    ap.add_argument("--cache-dir", help="keep the sides' quantized caches here (DIR/revision, DIR/this-tree), "
                                        "reused by later runs; default: a temporary directory, removed")
    ap.add_argument("--out", help="write every figure to this JSON file")
    args = ap.parse_args(argv)

    checkpoint = write_checkpoint(Path(args.dir), Spec.scaled(args.scale, args.layers, args.shards))
    prompt = ",".join(str(3 + (7 * i) % 1000) for i in range(args.prompt_tokens))
    common = ["--prompt-ids", prompt, "--max-new-tokens", str(args.new_tokens), "--max-in-cpu", args.budget,
              "--disk-gbps", str(args.disk_gbps)]
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="revisions-") as work:
        old = Path(work) / "tree"
        subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(old), args.rev], check=True,
                       capture_output=True)
        try:
            sides = {f"{args.rev}": old, "this tree": REPO}
            options = {}
            caches = []
            for name, tree in sides.items():
                options[name] = list(common)
                if args.quantize:
                    where = Path(args.cache_dir) if args.cache_dir else Path(work)
                    cache = where / ("this-tree" if tree == REPO else "revision")
                    cache.mkdir(parents=True, exist_ok=True)
                    caches.append(cache)
                    options[name] += ["--quantize", args.quantize, "--nvme-path", str(cache)]
                    generate(tree, checkpoint, [*options[name], "--max-new-tokens", "1"])  # writes (or checks) its cache
            runs: dict[str, list[dict[str, Any]]] = {name: [] for name in sides}
            for round_ in range(args.repeats):
                for name in (list(sides) if round_ % 2 == 0 else list(sides)[::-1]):
                    _drop_from_page_cache(checkpoint, caches)  # no side finds the files the one before read
                    runs[name].append(generate(sides[name], checkpoint, options[name]))
                    run = runs[name][-1]
                    print(f"round {round_ + 1} {name}: {run['s_per_token']:.4f} s/token, first token "
                          f"{run['time_to_first_token_s']:.3f} s (ready {run['init_s']:.3f} s + first forward "
                          f"{run['first_token_s']:.3f} s), load average {os.getloadavg()[0]:.2f}", flush=True)
        finally:
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(old)], check=False,
                           capture_output=True)
    medians = {name: {"s_per_token": statistics.median(r["s_per_token"] for r in rs),
                      "time_to_first_token_s": statistics.median(r["time_to_first_token_s"] for r in rs),
                      "init_s": statistics.median(r["init_s"] for r in rs),
                      "first_token_s": statistics.median(r["first_token_s"] for r in rs),
                      "same_tokens": all(r["tokens"] == rs[0]["tokens"] for r in rs)} for name, rs in runs.items()}
    old_m, new_m = medians[args.rev], medians["this tree"]
    figures = {"args": vars(args), "runs": runs, "medians": medians,
               "same_tokens": old_m["same_tokens"] and new_m["same_tokens"]
               and runs[args.rev][0]["tokens"] == runs["this tree"][0]["tokens"],
               "ratio_s_per_token": new_m["s_per_token"] / old_m["s_per_token"],
               "ratio_first_token": new_m["time_to_first_token_s"] / old_m["time_to_first_token_s"]}
    print("| side | s/token (median) | time to first token (median) | ready (median) | first forward (median) |\n"
          "|---|---|---|---|---|")
    for name, m in medians.items():
        print(f"| {name} | {m['s_per_token']:.4f} | {m['time_to_first_token_s']:.3f} s | {m['init_s']:.3f} s | "
              f"{m['first_token_s']:.3f} s |")
    print(f"this tree / {args.rev}: s/token {figures['ratio_s_per_token']:.3f}x, first token "
          f"{figures['ratio_first_token']:.3f}x; the same tokens: {figures['same_tokens']}")
    if args.out:
        Path(args.out).write_text(json.dumps(figures, indent=1))
    return figures


if __name__ == "__main__":
    main()
