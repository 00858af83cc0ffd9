"""Several GPUs of one node: the engine's training launched by `torchrun --nproc_per_node N`, against world
size 1 with the same global batch (issue 50's several-GPU row).

    python -m benchmarks.gpu.ranks --dir /nvme/tmp                       # N: every GPU torch sees, GPT-2 small
    python -m benchmarks.gpu.ranks --dir /nvme/tmp --nproc 4 --steps 10 --json ranks.json
    python -m benchmarks.gpu.ranks --dir /tmp --device simulated --nproc 2 --tiny   # the CPU test's run

First world size 1 in a child process, then ``torchrun --standalone --nproc_per_node N`` of this module:
every rank trains GPT-2 (random weights, parameters and optimizer state on NVMe under ``--dir``, fp32) on
its share of each global batch of ``--batch`` sequences, the engine starting the process group (NCCL on
CUDA, gloo on the simulated device) and binding the rank to the device of its LOCAL_RANK. Each rank
reports its LOCAL_RANK, the device it computed on, its device memory on every device index as it sees
them (CUDA: the peak, ``torch.cuda.max_memory_allocated(i)``, non-zero on its own index only where every
rank has a GPU of its own; the simulated device: its own index's buffers held after the last step), its
peak RSS and its losses. Printed: a line per
rank, the mean losses beside world size 1's and their largest relative difference. It refuses, saying so,
where CUDA is missing or sees fewer GPUs than ``--nproc`` (``--device cuda``): a GPU's figures cannot be
simulated; ``--device simulated`` runs the same path on CPU processes for the test that keeps it working.

``--stop-at K`` checks the stop instead (NCCL's on GPUs: the default group aborted; gloo's on the simulated
device): rank 1's model raises in its forward at step K, outside the ranks' agreement; every rank must
stop at once, rank 1 with its own error and the others with `RanksStopped` naming rank 1, rather than wait
in their next collective until the process group's timeout. Printed: each rank's error and the seconds
from the start of step K to it.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks._common import RANK_VARIABLES, REPO, child_env
from benchmarks.node_memory import LOSS_RTOL
from offload.device import cuda_available

GPT2_SMALL = {"n_layer": 12, "n_embd": 768, "n_head": 12, "vocab_size": 50257, "n_positions": 1024}
TINY = {"n_layer": 2, "n_embd": 64, "n_head": 4, "vocab_size": 128, "n_positions": 32}


def _config(directory: str, batch: int, world_size: int) -> dict[str, Any]:
    """The DeepSpeed-format config: parameters and optimizer state on NVMe, ``batch`` sequences a step."""
    return {
        "train_batch_size": batch, "train_micro_batch_size_per_gpu": batch // world_size,
        "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
        # eps 1e-6: a zero gradient up to rounding (attention's key bias) stays small under Adam whatever
        # order the ranks' reduction sums in
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01, "eps": 1e-6}},
        "zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": directory},
                              "offload_optimizer": {"device": "nvme", "nvme_path": directory}},
    }


def _rank(spec: dict[str, Any]) -> None:
    """One rank (or world size 1): train, then write this rank's figures to ``spec["out"]``/rank<R>.json."""
    import transformers

    from offload.train.engine import initialize

    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        **spec["model"], bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    directory = os.path.join(spec["dir"], f"world{world_size}-rank{rank}")
    os.makedirs(directory, exist_ok=True)
    engine, *_ = initialize(model=model, config=_config(directory, spec["batch"], world_size),
                            compute_device=spec["device"])
    device = engine.device
    tokens = torch.randint(0, spec["model"]["vocab_size"], (spec["steps"], spec["batch"], spec["seq"]),
                           generator=torch.Generator().manual_seed(1))
    stop_at = spec.get("stop_at")
    if stop_at is not None and rank == 1:
        def fault(module, args, output):
            if engine.global_steps + 1 == stop_at:
                raise ValueError(f"bad batch (injected on rank 1 at step {stop_at})")
        model.transformer.h[0].register_forward_hook(fault)
    losses, stopped = [], None
    for step, batch in enumerate(tokens, start=1):
        share = batch.chunk(world_size)[rank]
        began = time.perf_counter()
        try:
            loss = engine(share, labels=share).loss
            engine.backward(loss)
            engine.step()
        except Exception as error:  # noqa: BLE001 - --stop-at: reported, the check is what it says
            if stop_at is None:
                raise
            stopped = {"error": type(error).__name__, "message": str(error)[:400], "step": step,
                       "seconds": time.perf_counter() - began}
            break
        losses.append(loss.item())
    if device.torch_device.type == "cuda":
        memory = {i: torch.cuda.max_memory_allocated(i) for i in range(torch.cuda.device_count())}
    else:  # the simulated device: its own index's buffers held now, as its allocator counts them
        memory = {device.torch_device.index or 0: device.allocated_bytes}
    figures = {"rank": rank, "local_rank": int(os.environ.get("LOCAL_RANK", "0")), "device": str(device.torch_device),
               "device_memory": memory, "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
               "losses": losses, "stopped": stopped}
    try:
        engine.close()
    except Exception:  # noqa: BLE001 - after a stop its process group is gone; the figures are what count
        if stopped is None:
            raise
    with open(os.path.join(spec["out"], f"rank{rank}.json"), "w", encoding="utf-8") as f:
        json.dump(figures, f)


def _launch(spec: dict[str, Any], nproc: int) -> list[dict[str, Any]]:
    """Run ``nproc`` ranks (torchrun; 1: one plain process) of `_rank`; each rank's figures, in rank order.
    Raises RuntimeError with the end of the launch's output when it fails."""
    out = tempfile.mkdtemp(dir=spec["dir"], prefix=f"out{nproc}-")
    child = [sys.executable, "-m"] + (["torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", "-m"]
                                      if nproc > 1 else []) + ["benchmarks.gpu.ranks", "--rank-child",
                                                              json.dumps({**spec, "out": out})]
    env = child_env(drop=RANK_VARIABLES)  # no rank of an outer launch: torchrun's (or world size 1's) own
    if spec["device"] == "simulated":
        env["OFFLOAD_SIMGPU_COUNT"] = str(nproc)  # a node of nproc simulated devices
    run = subprocess.run(child, env=env, cwd=REPO, capture_output=True, text=True)
    if run.returncode:
        raise RuntimeError(f"world size {nproc} failed (exit {run.returncode}):\n{(run.stdout + run.stderr)[-4000:]}")
    return [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(nproc)]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run world size 1 and N; print and return the figures."""
    ap = argparse.ArgumentParser(prog="python -m benchmarks.gpu.ranks", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", help="a directory on the NVMe drive for the swap files (a fresh folder is made in it)")
    ap.add_argument("--device", choices=["cuda", "simulated"], default="cuda")
    ap.add_argument("--nproc", type=int, default=None, help="ranks (default: every GPU torch sees)")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--batch", type=int, default=8, help="sequences per global batch (a multiple of --nproc)")
    ap.add_argument("--seq", type=int, default=128, help="tokens per sequence")
    ap.add_argument("--tiny", action="store_true", help="a 2-layer GPT-2 of width 64 (the test's size)")
    ap.add_argument("--stop-at", type=int, default=None, metavar="K",
                    help="check the stop instead: rank 1 raises in its forward at step K (at most --steps)")
    ap.add_argument("--json", help="also write the figures here")
    ap.add_argument("--rank-child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.rank_child:
        _rank(json.loads(args.rank_child))
        return {}
    if not args.dir:
        ap.error("--dir is required: a directory on the NVMe drive")
    gpus = torch.cuda.device_count() if cuda_available() else 0
    nproc = args.nproc or (gpus if args.device == "cuda" else 2)
    if args.device == "cuda" and gpus < max(nproc, 2):
        sys.exit(f"benchmarks.gpu.ranks: {'CUDA is not available' if not gpus else f'torch sees {gpus} GPU'} here; "
                 f"this row needs {max(nproc, 2)} GPUs (--device simulated runs the path on the CPU, timings and "
                 f"memory meaning nothing)")
    if nproc < 2 or args.batch % nproc:
        ap.error(f"--nproc {nproc} and --batch {args.batch}: use 2 or more ranks and a batch they divide")
    if args.stop_at is not None and not 1 <= args.stop_at <= args.steps:
        ap.error(f"--stop-at {args.stop_at}: a step from 1 to --steps ({args.steps})")
    seq = min(args.seq, 32) if args.tiny else args.seq
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="bench-ranks-") as directory:
        spec = {"dir": directory, "device": args.device, "model": TINY if args.tiny else GPT2_SMALL,
                "steps": args.steps, "batch": args.batch, "seq": seq, "stop_at": args.stop_at}
        if args.stop_at is not None:
            return _report_stop(_launch(spec, nproc), args)
        one = _launch(spec, 1)[0]
        ranks = _launch(spec, nproc)
    mean = [sum(r["losses"][s] for r in ranks) / nproc for s in range(args.steps)]
    worst = max(abs(a - b) / abs(b) for a, b in zip(mean, one["losses"]))
    print(f"world size {nproc} ({args.device}, {'tiny' if args.tiny else 'GPT-2 small'}, batch {args.batch} x {seq}) "
          f"against world size 1:")
    for r in ranks:
        used = ", ".join(f"{i}: {int(b) / 2**20:.1f} MiB" for i, b in r["device_memory"].items())
        print(f"  rank {r['rank']} (LOCAL_RANK {r['local_rank']}) computed on {r['device']}; device memory per "
              f"index {{{used}}}; peak RSS {r['peak_rss'] / 2**30:.2f} GiB")
    print("  losses, world size 1: " + " ".join(f"{x:.6f}" for x in one["losses"]))
    print(f"  losses, world size {nproc}: " + " ".join(f"{x:.6f}" for x in mean))
    print(f"  largest relative difference {worst:.2e}: {'within' if worst <= LOSS_RTOL else 'NOT within'} "
          f"{LOSS_RTOL:g} (fp32: only the order of the reductions differs)")
    figures = {"world_size_1": one, "ranks": ranks, "mean_losses": mean, "largest_relative_difference": worst}
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=1))
    return figures


def _report_stop(ranks: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    """Print and return how each rank stopped at ``--stop-at``: every one must, rank 1 with its own error and
    the others with RanksStopped naming it."""
    print(f"stop: rank 1 raises in its forward at step {args.stop_at} ({args.device}, {len(ranks)} ranks)")
    for r in ranks:
        how = r["stopped"]
        print(f"  rank {r['rank']} on {r['device']}: " + (f"{how['error']} after {how['seconds']:.2f} s at step "
                                                        f"{how['step']}: {how['message']}" if how else "did not stop"))
    def as_it_should(r: dict[str, Any]) -> bool:  # at step K: rank 1 by its own error, the others naming rank 1
        how = r["stopped"]
        if not how or how["step"] != args.stop_at:
            return False
        return how["error"] == "ValueError" if r["rank"] == 1 else (
            how["error"] == "RanksStopped" and "rank 1 failed" in how["message"])

    agreed = all(as_it_should(r) for r in ranks)
    print(f"  {'every rank stopped at step %d, naming rank 1' % args.stop_at if agreed else 'NOT every rank stopped as it should'}")
    figures = {"ranks": ranks, "stopped_together": agreed}
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=1))
    return figures


if __name__ == "__main__":
    main()
