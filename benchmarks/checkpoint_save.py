"""What a checkpoint save costs, beside ``torch.save`` and fio on the same disk.

A GPT-2 (``--model``: small, the default, medium or large; or ``--model-config``) with parameters and optimizer
state on NVMe takes one step; then, ``--repeats`` times and alternated so that the disk's swings hit every side
alike:

- **ours**: ``engine.save_checkpoint`` (a new tag each time, removed after): every partition read from the
  swap files and written with its optimizer state, checksummed, written with O_DIRECT (where the file system
  allows: the line printed first says which), fsynced;
- **ours, asynchronous**: ``save_checkpoint(..., async_save=True)`` while training goes on: the steps run
  while the save is in flight against steps without one (each side's median), and the time training
  waits for the save: the call's return (the snapshot) plus the time steps waited for slots the save had
  not read yet (`checkpoint_in_flight().wait_seconds`);
- **torch.save**: the same model's fp32 weights and AdamW's two moments, held in memory (what
  ``offload_optimizer: cpu`` holds), written with ``torch.save`` to one file and fsynced: the bytes on the disk;
- **fio**: fio writing, then reading, the checkpoint's bytes with O_DIRECT in 1 MiB requests, 32 in flight:
  the disk's floor for a save that reads the state from the swap files and writes it again (ours has to; the
  in-memory ``torch.save`` only writes).

Reported: the medians, ours over each, the checkpoint's bytes, and the page cache's growth during our save
(``Cached`` of /proc/meminfo) as a share of the checkpoint; for the asynchronous save, a step during a save
over a step without, and the wait over the synchronous save's time.

    python -m benchmarks.checkpoint_save --dir DIR --repeats 5
    python -m benchmarks.checkpoint_save --dir DIR --model gpt2-medium --repeats 3
    python -m benchmarks.checkpoint_save --dir DIR --model-config '{"n_layer": 2, "n_embd": 64, "n_head": 2}' --no-fio
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import statistics
import tempfile
import time

import torch
import transformers

from benchmarks._common import gpt2_on_nvme_after_a_step

GPT2_SMALL = {"n_layer": 12, "n_embd": 768, "n_head": 12, "vocab_size": 50257, "n_positions": 1024}
MODELS = {"gpt2": GPT2_SMALL, "gpt2-medium": {**GPT2_SMALL, "n_layer": 24, "n_embd": 1024, "n_head": 16},
          "gpt2-large": {**GPT2_SMALL, "n_layer": 36, "n_embd": 1280, "n_head": 20}}
"""GPT-2's sizes by their Hugging Face names (124 M, 355 M and 774 M parameters)."""


def main(argv: list[str] | None = None) -> dict:
    """Run the benchmark; print and return its figures."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", default=None, help="directory on the disk for the swap files and the checkpoints")
    parser.add_argument("--model", choices=sorted(MODELS), default="gpt2", help="GPT-2's size (default gpt2: small)")
    parser.add_argument("--model-config", default=None, help="GPT2Config keywords, JSON (instead of --model)")
    parser.add_argument("--repeats", type=int, default=5, help="saves of each kind; medians reported (default 5)")
    parser.add_argument("--no-fio", action="store_true", help="leave fio out (it is skipped where not installed)")
    parser.add_argument("--out", default=None, help="write the figures to this JSON file")
    args = parser.parse_args(argv)
    model_config = json.loads(args.model_config) if args.model_config else MODELS[args.model]
    root = tempfile.mkdtemp(prefix="checkpoint-save-", dir=args.dir)
    print(f"checkpoint_save: {args.model_config or args.model} in {root}, {args.repeats} repeats, "
          f"fio {'off' if args.no_fio else 'on'}")
    try:
        figures = _measure(root, model_config, args.repeats, fio=not args.no_fio)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"the save wrote its tensor files {figures['write_mode']}")
    line = (f"checkpoint {figures['checkpoint_gb']:.3f} GB: ours {figures['ours_s']:.3f} s, torch.save + fsync "
            f"{figures['torch_save_s']:.3f} s ({figures['ours_over_torch_save']:.2f}x)")
    if figures.get("fio_write_read_s"):
        line += (f", fio write + read {figures['fio_write_read_s']:.3f} s ({figures['ours_over_fio']:.2f}x; "
                 f"write {figures['fio_write_s']:.3f} s, read {figures['fio_read_s']:.3f} s)")
    print(line + f"; page cache grew {figures['page_cache_share']:.1%} of the checkpoint during ours "
                 f"(medians of {args.repeats})")
    print(f"asynchronous: a step {figures['step_s']:.3f} s without a save, {figures['step_during_save_s']:.3f} s "
          f"during one ({figures['step_during_over_without']:.2f}x); training waited {figures['async_wait_s']:.3f} s "
          f"(the call {figures['async_call_s']:.3f} s + slots {figures['async_slot_wait_s']:.3f} s), "
          f"{figures['async_wait_over_sync']:.1%} of the synchronous save")
    if args.out:
        with open(args.out, "w", encoding="utf-8") as file:
            json.dump(figures, file, indent=1)
    return figures


def _measure(root: str, model_config: dict, repeats: int, *, fio: bool) -> dict:
    torch.manual_seed(0)
    shapes = transformers.GPT2LMHeadModel(transformers.GPT2Config(**model_config))
    in_memory = {"model": {k: v.detach().clone() for k, v in shapes.state_dict().items()},
                 "optimizer": {k: {"exp_avg": torch.randn_like(v), "exp_avg_sq": torch.rand_like(v)}
                               for k, v in shapes.named_parameters()}}
    del shapes
    model, engine = gpt2_on_nvme_after_a_step(root, model_config)
    batch = torch.randint(0, model.config.vocab_size, (1, 16))

    def step() -> float:
        began = time.perf_counter()
        engine.backward(engine(batch, labels=batch).loss)
        engine.step()
        return time.perf_counter() - began

    ours, saves, cached, checkpoint_bytes = [], [], [], 0
    fallbacks, logger = _BufferedFiles(), logging.getLogger("offload")
    level = logger.level
    logger.addHandler(fallbacks)
    logger.setLevel(logging.DEBUG)
    steps, during, calls, slot_waits = [], [], [], []
    fio_times: dict[str, list[float]] = {"write": [], "read": []}
    try:
        for repeat in range(repeats):
            before = _cached_bytes()
            began = time.perf_counter()
            path = engine.save_checkpoint(f"{root}/ours", tag=f"r{repeat}")
            ours.append(time.perf_counter() - began)
            cached.append(_cached_bytes() - before)
            checkpoint_bytes = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))
            shutil.rmtree(path)
            target = f"{root}/torch-{repeat}.pt"
            began = time.perf_counter()
            with open(target, "wb") as file:
                torch.save(in_memory, file)
                file.flush()
                os.fsync(file.fileno())
            saves.append(time.perf_counter() - began)
            os.unlink(target)
            if fio:
                for rw, seconds in _fio(root, checkpoint_bytes).items():
                    fio_times[rw].append(seconds)
            steps.extend(step() for _ in range(2))  # no save in flight
            began = time.perf_counter()
            path = engine.save_checkpoint(f"{root}/ours", tag=f"a{repeat}", async_save=True)
            calls.append(time.perf_counter() - began)
            during.append(step())  # at least one step with the save in flight; more while it runs
            while engine.checkpoint_in_flight() is not None:
                during.append(step())
            engine.wait_for_checkpoint()
            slot_waits.append(engine._saves.last_wait_seconds)
            shutil.rmtree(path)
    finally:
        engine.close()
        logger.removeHandler(fallbacks)
        logger.setLevel(level)
    figures = {"checkpoint_gb": checkpoint_bytes / 1e9, "ours_s": statistics.median(ours),
               "write_mode": f"through the page cache ({fallbacks.reasons[0]})" if fallbacks.reasons else "with O_DIRECT",
               "torch_save_s": statistics.median(saves), "ours_runs_s": [round(s, 3) for s in ours],
               "torch_save_runs_s": [round(s, 3) for s in saves],
               "page_cache_share": max(0, statistics.median(cached)) / max(checkpoint_bytes, 1)}
    figures["ours_over_torch_save"] = figures["ours_s"] / figures["torch_save_s"]
    waits = [call + slots for call, slots in zip(calls, slot_waits)]
    figures.update(step_s=statistics.median(steps), step_during_save_s=statistics.median(during),
                   async_call_s=statistics.median(calls), async_slot_wait_s=statistics.median(slot_waits),
                   async_wait_s=statistics.median(waits), steps_during_save=len(during),
                   step_runs_s=[round(s, 3) for s in steps], step_during_runs_s=[round(s, 3) for s in during])
    figures["step_during_over_without"] = figures["step_during_save_s"] / figures["step_s"]
    figures["async_wait_over_sync"] = figures["async_wait_s"] / figures["ours_s"]
    if fio_times["write"] and fio_times["read"]:
        figures.update(fio_write_s=statistics.median(fio_times["write"]), fio_read_s=statistics.median(fio_times["read"]))
        figures["fio_write_read_s"] = figures["fio_write_s"] + figures["fio_read_s"]
        figures["ours_over_fio"] = figures["ours_s"] / figures["fio_write_read_s"]
    return figures


def _fio(directory: str, nbytes: int) -> dict[str, float]:
    """fio's seconds to write then read ``nbytes`` (O_DIRECT, 1 MiB, 32 in flight) in ``directory``; {} without fio."""
    from bench.fio import FILE_PREFIX, FioError, FioJob, run_fio

    size = max(1 << 20, nbytes // (1 << 20) * (1 << 20))
    filename = os.path.join(directory, f"{FILE_PREFIX}checkpoint-save-{os.getpid()}.dat")
    out = {}
    try:
        for rw in ("write", "read"):
            try:
                result = run_fio(FioJob(directory=directory, rw=rw, size=size, block_size=1 << 20, queue_depth=32),
                                 filename=filename)
            except FioError as error:
                print(f"fio {rw}: not measured ({error})")
                return {}
            out[rw] = result.io_bytes / result.bw_bytes if result.bw_bytes else float("nan")
    finally:
        if os.path.exists(filename):
            os.unlink(filename)
    return out


class _BufferedFiles(logging.Handler):
    """Collects the save's debug lines saying that a file was written through the page cache (no O_DIRECT)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.reasons: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if "written through the page cache" in message:
            self.reasons.append(message)


def _cached_bytes() -> int:
    """The page cache's size now (``Cached`` of /proc/meminfo), in bytes."""
    with open("/proc/meminfo", encoding="ascii") as file:
        for line in file:
            if line.startswith("Cached:"):
                return int(line.split()[1]) * 1024
    return 0


if __name__ == "__main__":
    main()
