"""`tensorio-bench compare`: the default and the tuned aio on the engine itself, a few steps or tokens each.

A sweep measures the disk; this measures what the answer does to training or decoding. Each round
runs the default aio and then the tuned one (the order alternates between rounds), each in a fresh
process (`python -m bench.compare --child`), with swap files (training) or the streamed checkpoint's
reads (inference) on the directory given:

- ``training``: a GPT-2 (small by default: 12 layers, 768 wide) under the stage-3 engine with its
  parameters and optimizer state offloaded to NVMe; a warm-up step, then ``--steps`` timed steps.
- ``inference``: ``--checkpoint DIR`` loaded by the inference engine with ``--budget`` bytes of memory,
  so that its layers stream from the disk; a warm-up token, then ``--steps`` decoded tokens timed.

Reported per side: the median step (or token) time over the rounds, the disk GB/s the process moved
(``/proc/self/io`` over the timed steps), its CPU per step; the noise is how far one side's rounds lie
apart ((max - min) / median, the larger side's), and the verdict says whether the tuned one is no
slower than the default within it.
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
from pathlib import Path
from typing import Any

from ._errors import EXIT_USAGE, CliError

__all__ = ["add_compare_parser", "cmd_compare", "verdict"]

GPT2_SMALL = {"n_layer": 12, "n_embd": 768, "n_head": 12, "vocab_size": 50257, "n_positions": 1024}


def verdict(default_s: list[float], tuned_s: list[float]) -> tuple[float, float, str]:
    """(noise, tuned / default, one sentence) from each side's step times over the rounds: the noise is
    the larger side's (max - min) / median (0 with one round)."""
    def spread(values: list[float]) -> float:
        return (max(values) - min(values)) / statistics.median(values) if len(values) > 1 else 0.0

    noise = max(spread(default_s), spread(tuned_s))
    ratio = statistics.median(tuned_s) / statistics.median(default_s)
    if len(default_s) < 2 or len(tuned_s) < 2:
        text = (f"tuned / default = {ratio:.2f} from one round: no noise figure to judge it by; use --rounds 3")
    elif ratio <= 1 + noise:
        text = (f"tuned / default = {ratio:.2f}: the tuned aio is no slower than the default within the noise "
                f"({noise:.0%})")
    else:
        text = (f"tuned / default = {ratio:.2f}: the tuned aio is slower than the default by more than the noise "
                f"({noise:.0%}); sweep again with --workload and a larger --size, or keep the default")
    return noise, ratio, text


def add_compare_parser(sub: Any, add_aio: Any) -> None:
    """The `compare` subcommand's parser."""
    p = sub.add_parser("compare", help="the default and the tuned aio on the engine: step time, disk GB/s, CPU",
                       description="Run a few training steps (GPT-2 small, NVMe offload) or decoded tokens (a "
                                   "checkpoint streamed from the disk) with the default aio and with the tuned one, "
                                   "alternating in fresh processes, and say whether the tuned one is slower.")
    p.add_argument("directory", type=Path, metavar="DIR", help="where the swap files (training) go")
    p.add_argument("--tuned", type=Path, required=True, metavar="FILE", help="the tuned aio (configs/aio_tuned.json)")
    p.add_argument("--baseline", type=Path, metavar="FILE", help="the aio to compare with (default: the defaults)")
    p.add_argument("--workload", choices=("training", "inference"), default="training")
    p.add_argument("--checkpoint", type=Path, metavar="DIR", help="inference: the checkpoint to stream")
    p.add_argument("--budget", default="1GiB", help="inference: max_in_cpu, small enough that layers stream")
    p.add_argument("--model-config", type=json.loads, default=GPT2_SMALL, help="training: GPT2Config keys as JSON")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--steps", type=int, default=3, help="timed steps (training) or tokens (inference) per run")
    p.add_argument("--rounds", type=int, default=2, help="runs of each side, interleaved; medians reported")
    p.add_argument("--json", action="store_true", help="print the figures as one JSON document on stdout")
    p.set_defaults(func=cmd_compare)


def cmd_compare(args: argparse.Namespace) -> int:
    """Run the comparison and print it; raises CliError for bad input or a failed child."""
    from .configfile import read_aio_config
    from tensorio import AioConfig

    say = (lambda text: print(text, file=sys.stderr)) if args.json else print
    if args.workload == "inference" and args.checkpoint is None:
        raise CliError("--workload inference needs --checkpoint DIR (the model to stream)", EXIT_USAGE)
    if args.steps < 1 or args.rounds < 1:
        raise CliError(f"--steps {args.steps} and --rounds {args.rounds} must be >= 1", EXIT_USAGE)
    if not args.directory.is_dir():
        raise CliError(f"{args.directory}: no such directory; create it on the disk the swap files will use")
    try:
        sides = {"default": read_aio_config(args.baseline).to_dict() if args.baseline else AioConfig().to_dict(),
                 "tuned": read_aio_config(args.tuned).to_dict()}
    except FileNotFoundError as exc:
        raise CliError(f"{exc.filename}: no such file", EXIT_USAGE) from None
    except ValueError as exc:
        raise CliError(str(exc), EXIT_USAGE) from None
    what = (f"GPT-2 {json.dumps(args.model_config)}, batch {args.batch} x {args.seq}, {args.steps} timed steps"
            if args.workload == "training" else f"{args.checkpoint}, budget {args.budget}, {args.steps} tokens")
    say(f"tensorio-bench compare {args.directory}: {args.workload} ({what}), {args.rounds} rounds, alternating")
    for name, aio in sides.items():
        say(f"  {name:<8} aio {json.dumps(aio)}")
    runs: dict[str, list[dict[str, Any]]] = {"default": [], "tuned": []}
    for r in range(args.rounds):
        for name in (("default", "tuned") if r % 2 == 0 else ("tuned", "default")):
            with tempfile.TemporaryDirectory(prefix="tensorio-compare-", dir=args.directory) as swap:
                payload = {"workload": args.workload, "dir": swap, "aio": sides[name], "steps": args.steps,
                           "model": args.model_config, "batch": args.batch, "seq": args.seq,
                           "checkpoint": str(args.checkpoint) if args.checkpoint else None, "budget": args.budget}
                runs[name].append(_child_process(payload))
            say(f"  round {r + 1} {name:<8} {runs[name][-1]['step_s']:.3f} s per step")
    noise, ratio, text = verdict([r["step_s"] for r in runs["default"]], [r["step_s"] for r in runs["tuned"]])
    summary = {name: _summary(rs) for name, rs in runs.items()}
    if args.json:
        print(json.dumps({"tool": "tensorio-bench compare", "workload": args.workload, "aio": sides, "runs": runs,
                          "median": summary, "noise": round(noise, 4), "ratio": round(ratio, 4),
                          "verdict": text}, indent=2))
        return 0
    unit = "step" if args.workload == "training" else "token"
    print(f"{'':<9}{unit + ' s':>9}{'disk GB/s':>11}{'read/' + unit:>12}{'written/' + unit:>14}{'CPU s/' + unit:>12}")
    for name, s in summary.items():
        print(f"{name:<9}{s['step_s']:>9.3f}{s['disk_gb_per_s']:>11.2f}{s['read_per_step'] / 1e9:>10.2f}GB"
              f"{s['written_per_step'] / 1e9:>12.2f}GB{s['cpu_per_step']:>12.2f}")
    print(text)
    return 0


def _summary(runs: list[dict[str, Any]]) -> dict[str, float]:
    step = statistics.median(r["step_s"] for r in runs)
    read = statistics.median(r["read_per_step"] for r in runs)
    written = statistics.median(r["written_per_step"] for r in runs)
    return {"step_s": step, "read_per_step": read, "written_per_step": written,
            "disk_gb_per_s": (read + written) / step / 1e9, "cpu_per_step": statistics.median(r["cpu_per_step"]
                                                                                            for r in runs)}


def _child_process(payload: dict[str, Any]) -> dict[str, Any]:
    """`_child` in a fresh interpreter; its figures. Raises CliError with the end of its errors."""
    command = [sys.executable, "-m", "bench.compare", "--child", json.dumps(payload)]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode:
        raise CliError(f"compare: the {payload['workload']} run failed (exit status {done.returncode}): "
                       f"{done.stderr.strip().splitlines()[-1] if done.stderr.strip() else 'no error output'}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _io_bytes() -> tuple[int, int]:
    fields = dict(line.split(": ") for line in Path("/proc/self/io").read_text().splitlines())
    return int(fields["read_bytes"]), int(fields["write_bytes"])


def _child(payload: dict[str, Any]) -> dict[str, Any]:
    """One side in this process: build, warm up, time ``steps``; the figures per step."""
    import torch

    torch.manual_seed(0)
    if payload["workload"] == "training":
        import transformers

        from offload import initialize

        config = transformers.GPT2Config(**payload["model"], resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        zero = {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": payload["dir"]},
                "offload_optimizer": {"device": "nvme", "nvme_path": payload["dir"]}}
        ds_config = {"train_micro_batch_size_per_gpu": payload["batch"], "zero_optimization": zero,
                     "aio": payload["aio"], "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}}
        engine, *_ = initialize(model=transformers.GPT2LMHeadModel(config), config=ds_config)
        batch = torch.randint(0, config.vocab_size, (payload["batch"], payload["seq"]))

        def step() -> None:
            loss = engine(batch, labels=batch).loss
            engine.backward(loss)
            engine.step()
    else:
        from offload.infer import init_inference

        engine = init_inference(payload["checkpoint"], max_in_cpu=payload["budget"], aio=payload["aio"])
        ids = torch.randint(0, engine.module.config.vocab_size, (1, 16))

        def step() -> None:
            engine.generate(ids, max_new_tokens=1, do_sample=False)
    step()  # warm-up
    io0, cpu0 = _io_bytes(), os.times()
    times = []
    for _ in range(payload["steps"]):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    io1, cpu1 = _io_bytes(), os.times()
    n = len(times)
    return {"step_s": statistics.median(times), "times": times, "read_per_step": (io1[0] - io0[0]) / n,
            "written_per_step": (io1[1] - io0[1]) / n,
            "cpu_per_step": (cpu1.user - cpu0.user + cpu1.system - cpu0.system) / n}


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        print(json.dumps(_child(json.loads(sys.argv[2]))))
    else:
        sys.exit("usage: tensorio-bench compare (this module's --child is for its own use)")
