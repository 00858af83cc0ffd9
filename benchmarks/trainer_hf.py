"""Hugging Face Trainer benchmark: GPT-2 through plain ``transformers.Trainer`` and through
`OffloadTrainer` with parameters and optimizer state on NVMe, side by side.

    python -m benchmarks.trainer_hf --dir /work/tmp --repeats 3 --out trainer_hf.json

Both train the same randomly initialised GPT-2 (GPT-2 small by default) on the same random tokens with
Trainer's defaults (AdamW with its decay / no-decay groups, ``max_grad_norm`` 1.0, a linear schedule
with warm-up), ``--gas`` micro batches per step. Each configuration runs in its own subprocess, so
that its peak RSS is its own: ``--warmup`` steps, then ``--steps`` timed steps (time between Trainer's
``on_step_end`` callbacks). ``--repeats N`` runs both N times, interleaved, and reports the medians and
the offload / plain ratio within each repeat (project target <= 1.3, with less peak RSS). Peak RSS is
the kernel's high-water mark over the timed steps; CPU per step (user + system, all threads) is
printed beside the time, since it is what other processes on a shared machine disturb least, and so
is the engine's own forward / backward / step time per timed step (``wall_clock_breakdown``), and the
1-minute load average after each run. The
offload config is the Hugging Face "auto" one with ``max_in_cpu`` 0 and a swap budget of two buffers
of the largest parameter.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

from benchmarks._common import high_water_mark, reset_high_water_mark, run_child

MODES = ("trainer", "offload")


def _child(args: dict) -> None:
    """One configuration in this process; print its figures as JSON on the last line."""
    import torch
    import transformers

    from offload.integrations.transformers import OffloadTrainer

    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**args["model"]))
    g = torch.Generator().manual_seed(1)
    total = args["warmup"] + args["steps"]
    ids = torch.randint(0, model.config.vocab_size, (total * args["gas"] * args["batch"], args["seq"]), generator=g)

    class Tokens(torch.utils.data.Dataset):
        def __len__(self):
            return len(ids)

        def __getitem__(self, i):
            return {"input_ids": ids[i], "labels": ids[i]}

    ends: list[float] = []
    cpu: list[float] = []
    peak: dict[str, int] = {}
    phases_at_warmup: dict[str, float] = {}

    class Clock(transformers.TrainerCallback):
        def on_step_end(self, *_: object, **__: object) -> None:
            ends.append(time.perf_counter())
            cpu.append(_cpu_seconds())
            if len(ends) == args["warmup"]:
                peak["reset"] = reset_high_water_mark()
                if args["mode"] == "offload":
                    phases_at_warmup.update(trainer.engine.timers.totals)

    training = transformers.TrainingArguments(
        output_dir=args["out"], max_steps=total, per_device_train_batch_size=args["batch"],
        gradient_accumulation_steps=args["gas"], learning_rate=1e-4, warmup_steps=max(1, total // 4),
        max_grad_norm=args["clip"], save_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True,
        logging_strategy="no", seed=0, dataloader_num_workers=0)
    common = dict(model=model, args=training, train_dataset=Tokens(), callbacks=[Clock()])
    if args["mode"] == "trainer":
        trainer = transformers.Trainer(**common)
    else:
        # The swap budget of engine_step's runs: two buffers of the largest parameter (DeepSpeed's default,
        # 5 x 1e8 elements, would let GPT-2 small's parameters all stay gathered in memory).
        largest = max(p.numel() for p in model.parameters())
        # wall_clock_breakdown: the engine's forward / backward / step seconds per timed step (never printed).
        config = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
                  "gradient_clipping": "auto", "wall_clock_breakdown": True, "steps_per_print": 1 << 30,
                  "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": "auto",
                                        "stage3_prefetch_bucket_size": "auto", "reduce_bucket_size": "auto",
                                        "offload_param": {"device": "nvme", "nvme_path": args["dir"], "max_in_cpu": 0,
                                                          "buffer_count": 2, "buffer_size": largest},
                                        "offload_optimizer": {"device": "nvme", "nvme_path": args["dir"]}}}
        config = _merged(config, args["override"])
        trainer = OffloadTrainer(offload_config=config, **common)
    trainer.train()
    times = [b - a for a, b in zip(ends[args["warmup"] - 1:], ends[args["warmup"]:])]
    result = {"mode": args["mode"], "step_s": statistics.median(times), "times": times,
              "cpu_per_step": (cpu[-1] - cpu[args["warmup"] - 1]) / args["steps"],
              "peak_rss": high_water_mark() if peak.get("reset") else None,
              "load_average": os.getloadavg()[0]}
    if args["mode"] == "offload":
        result["io_bytes"] = trainer.engine.io_bytes()
        result["reads"] = trainer.engine.stats().reads
        result["engine_phases_per_step"] = {name: (seconds - phases_at_warmup.get(name, 0.0)) / args["steps"]
                                            for name, seconds in trainer.engine.timers.totals.items()}
        trainer.engine.close()
    print(json.dumps(result))


def _merged(base: dict, override: dict) -> dict:
    """``base`` with ``override``'s keys set, section by section (nested dicts merged, not replaced)."""
    merged = dict(base)
    for key, value in override.items():
        merged[key] = _merged(merged[key], value) if isinstance(value, dict) and isinstance(merged.get(key), dict) else value
    return merged


def _cpu_seconds() -> float:
    """User and system CPU time of this process so far (every thread: the engine's I/O and optimizer too)."""
    times = os.times()
    return times.user + times.system


def main(argv: list[str] | None = None) -> dict:
    """Run the benchmark; print a table and return the figures (written to ``--out`` too)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", required=True, help="swap directory on the disk under test")
    parser.add_argument("--model-config", default="{}", help="GPT2Config keyword arguments as JSON (default: GPT-2 small)")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--gas", type=int, default=1, help="gradient_accumulation_steps")
    parser.add_argument("--clip", type=float, default=1.0, help="max_grad_norm (Trainer's default 1.0)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--override", default="{}",
                        help="JSON merged into the offload config, section by section (for example '{\"aio\": {\"backend\": \"threads\"}}')")
    parser.add_argument("--out", default=None, help="write the figures as JSON here")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    options = parser.parse_args(argv)
    if options.child is not None:
        _child(json.loads(options.child))
        return {}
    os.makedirs(options.dir, exist_ok=True)
    runs: dict[str, list[dict]] = {mode: [] for mode in MODES}
    with tempfile.TemporaryDirectory(dir=options.dir) as scratch:
        for _ in range(options.repeats):
            for mode in MODES:
                child = dict(mode=mode, model=json.loads(options.model_config), batch=options.batch, seq=options.seq,
                             gas=options.gas, clip=options.clip, warmup=options.warmup, steps=options.steps,
                             override=json.loads(options.override),
                             dir=scratch, out=os.path.join(scratch, "out"))
                runs[mode].append(run_child("benchmarks.trainer_hf", ["--dir", scratch, "--child", json.dumps(child)]))
    ratios = [o["step_s"] / t["step_s"] for t, o in zip(runs["trainer"], runs["offload"])]
    result = {mode: {"step_s": statistics.median(r["step_s"] for r in rs),
                     "cpu_per_step": statistics.median(r["cpu_per_step"] for r in rs),
                     "peak_rss": statistics.median(r["peak_rss"] or 0 for r in rs), "runs": rs}
              for mode, rs in runs.items()}
    result["ratio"] = {"median": statistics.median(ratios), "per_repeat": ratios}
    for mode in MODES:
        print(f"{mode:8s} step {result[mode]['step_s']:.2f} s   CPU {result[mode]['cpu_per_step']:.2f} s/step   "
              f"peak RSS {result[mode]['peak_rss'] / 1e9:.2f} GB")
    phases = {name: statistics.median(r["engine_phases_per_step"][name] for r in runs["offload"])
              for name in runs["offload"][0]["engine_phases_per_step"]}
    result["offload"]["engine_phases_per_step"] = phases
    print("offload: the engine's time per step: " + ", ".join(f"{name} {seconds:.2f} s" for name, seconds in phases.items()))
    loads = [r["load_average"] for mode in MODES for r in runs[mode]]
    print(f"1-minute load average after each run: {min(loads):.2f} to {max(loads):.2f} "
          f"(this machine's cores: {os.cpu_count()}; other processes' work changes both modes' times)")
    plain_cpu = result["trainer"]["cpu_per_step"]  # 0 where a tiny step takes less than the CPU clock's tick
    print(f"offload / plain Trainer: {result['ratio']['median']:.2f}x (per repeat: "
          f"{', '.join(f'{r:.2f}' for r in ratios)}; target <= 1.3); CPU per step "
          + (f"{result['offload']['cpu_per_step'] / plain_cpu:.2f}x" if plain_cpu else "not measurable (0 s plain)"))
    if options.out:
        with open(options.out, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
