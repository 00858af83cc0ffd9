"""What a checkpoint save costs, beside ``torch.save`` and fio on the same disk.

A GPT-2 (``--model``: small, the default, medium or large; or ``--model-config``) with parameters and optimizer
state on NVMe takes one step; then, ``--repeats`` times and alternated so that the disk's swings hit every side
alike:

- **ours**: ``engine.save_checkpoint`` (a new tag each time, removed after): every partition read from the
  swap files and written with its optimizer state, checksummed, written with O_DIRECT (where the file system
  allows: the line printed first says which), fsynced;
- **torch.save**: the same model's fp32 weights and AdamW's two moments, held in memory (what
  ``offload_optimizer: cpu`` holds), written with ``torch.save`` to one file and fsynced: the bytes on the disk;
- **fio**: fio writing, then reading, the checkpoint's bytes with O_DIRECT in 1 MiB requests, 32 in flight:
  the disk's floor for a save that reads the state from the swap files and writes it again (ours has to; the
  in-memory ``torch.save`` only writes);
- **ours, asynchronous**: ``save_checkpoint(..., async_save=True)`` while training goes on: the steps run
  while the save is in flight against steps without one (each side's median), and the time training
  waits for the save: the call's return (the snapshot) plus the time steps waited for slots the save had
  not read yet (`checkpoint_in_flight().wait_seconds`);
- **the floor of the asynchronous save**: the same steps while fio (tensorio where fio is off or missing)
  moves the save's bytes: reads the checkpoint's bytes and writes as many, at once, started where the
  save starts and paced to last as long as that repeat's asynchronous save ran (`benchmarks._save_traffic`:
  reads of 1 MiB, 8 in flight, as the engine's swap handle reads the state ahead; writes of 8 MiB, 4 in
  flight, into a new preallocated file fsynced at the end, as the save's staging chunks; O_DIRECT). A step
  during that traffic over a step without is what the disk alone costs a step; ours is set beside it.

Reported: the medians, ours over each, the checkpoint's bytes, and the page cache's growth during our save
(``Cached`` of /proc/meminfo) as a share of the checkpoint; for the asynchronous save, a step during a save
over a step without, the same during the floor's traffic, ours over the floor, and the wait over the
synchronous save's time.

**The large mode** (``--model gpt2-3b``, or ``--large`` for the sizes of ``--model`` / ``--model-config``):
the model is built as `benchmarks.train_large` builds it (under ``offload.zero.Init``, its DeepSpeed config:
parameters and optimizer state on NVMe, ``max_in_cpu`` 0; clipping off here so that the step's update runs
within the step), for the 3.1 B GPT-2 whose training state does not fit in RAM (``--layers`` takes fewer
of its layers; ``--model-config`` gets train_large's "tiny" settings, every parameter on NVMe). It prints
the checkpoint's size and the disk it needs (the swap files plus one checkpoint; 112.5 GB for the 3.1 B
model) and refuses to start where the directory's file system has less free. After one step (so that the
optimizer state exists), per repeat: ours, synchronous (its time and its peak RSS over the RSS before it,
the kernel's high-water mark), the checkpoint removed at once (one on the disk at a time), then fio
writing and reading as many bytes. ``torch.save`` (the state does not fit in memory) and the asynchronous
save (a step of the 3.1 B model takes about a minute) are skipped, and say so.

    python -m benchmarks.checkpoint_save --dir DIR --repeats 5
    python -m benchmarks.checkpoint_save --dir DIR --model gpt2-medium --repeats 3
    python -m benchmarks.checkpoint_save --dir DIR --model gpt2-3b --repeats 1
    python -m benchmarks.checkpoint_save --dir DIR --model-config '{"n_layer": 2, "n_embd": 64, "n_head": 2}' --no-fio
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import shutil
import statistics
import tempfile
import threading
import time
from typing import Iterator

import psutil
import torch
import transformers

from benchmarks._common import RssSampler, gpt2_on_nvme_after_a_step
from benchmarks._save_traffic import SHAPE, SaveTraffic

GPT2_SMALL = {"n_layer": 12, "n_embd": 768, "n_head": 12, "vocab_size": 50257, "n_positions": 1024}
MODELS = {"gpt2": GPT2_SMALL, "gpt2-medium": {**GPT2_SMALL, "n_layer": 24, "n_embd": 1024, "n_head": 16},
          "gpt2-large": {**GPT2_SMALL, "n_layer": 36, "n_embd": 1280, "n_head": 20}}
"""GPT-2's sizes by their Hugging Face names (124 M, 355 M and 774 M parameters)."""

LARGE = "gpt2-3b"
"""The 3.1 B GPT-2 of `benchmarks.train_large` (its "3b" scale), measured in the large mode."""

GB = 1e9
TARGET_LARGE_OVER_FIO = 1.2
TARGET_LARGE_RSS_GROWTH = 1 * GB
SLACK = 256 << 20
"""Disk the large mode asks for beyond its estimate: headers, JSON, each swap-file extent's page padding."""


def main(argv: list[str] | None = None) -> dict:
    """Run the benchmark; print and return its figures. Raises SystemExit when the large mode's disk lacks room."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", default=None, help="directory on the disk for the swap files and the checkpoints")
    parser.add_argument("--model", choices=sorted([*MODELS, LARGE]), default="gpt2",
                        help=f"GPT-2's size (default gpt2: small; {LARGE}: train_large's 3.1 B, in the large mode)")
    parser.add_argument("--model-config", default=None, help="GPT2Config keywords, JSON (instead of --model)")
    parser.add_argument("--large", action="store_true",
                        help="the large mode for the model of --model / --model-config (implied by --model gpt2-3b)")
    parser.add_argument("--layers", type=int, default=None,
                        help="large mode: this many of the 3.1 B model's layers (26) where the disk lacks room")
    parser.add_argument("--repeats", type=int, default=5, help="saves of each kind; medians reported (default 5)")
    parser.add_argument("--no-fio", action="store_true",
                        help="leave fio out (it is skipped where not installed); the floor's traffic then comes "
                             "from tensorio")
    parser.add_argument("--out", default=None, help="write the figures to this JSON file")
    args = parser.parse_args(argv)
    large = args.large or args.model == LARGE
    if args.repeats < 1:
        parser.error(f"--repeats {args.repeats}: use 1 or more")
    if args.layers is not None and (args.model != LARGE or args.model_config or args.layers < 1):
        parser.error("--layers goes with --model gpt2-3b (a positive number of its layers)")
    model_config = json.loads(args.model_config) if args.model_config else MODELS.get(args.model)
    root = tempfile.mkdtemp(prefix="checkpoint-save-", dir=args.dir)
    print(f"checkpoint_save: {args.model_config or args.model}{' (large mode)' if large else ''} in {root}, "
          f"{args.repeats} repeats, fio {'off' if args.no_fio else 'on'}")
    try:
        if large:
            spec = _large_spec(model_config, args.layers, knobs="tiny" if args.model_config else "3b")
            figures = _measure_large(root, spec, args.repeats, fio=not args.no_fio)
        else:
            figures = _measure(root, model_config, args.repeats, fio=not args.no_fio)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"the save wrote its tensor files {figures['write_mode']}")
    if large:
        _print_large(figures, args.repeats)
    else:
        _print(figures, args.repeats)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as file:
            json.dump(figures, file, indent=1)
    return figures


def _print(figures: dict, repeats: int) -> None:
    line = (f"checkpoint {figures['checkpoint_gb']:.3f} GB: ours {figures['ours_s']:.3f} s, torch.save + fsync "
            f"{figures['torch_save_s']:.3f} s ({figures['ours_over_torch_save']:.2f}x)")
    if figures.get("fio_write_read_s"):
        line += (f", fio write + read {figures['fio_write_read_s']:.3f} s ({figures['ours_over_fio']:.2f}x; "
                 f"write {figures['fio_write_s']:.3f} s, read {figures['fio_read_s']:.3f} s)")
    print(line + f"; page cache grew {figures['page_cache_share']:.1%} of the checkpoint during ours "
                 f"(medians of {repeats})")
    print(f"asynchronous: a step {figures['step_s']:.3f} s without a save, {figures['step_during_save_s']:.3f} s "
          f"during one ({figures['step_during_over_without']:.2f}x); training waited {figures['async_wait_s']:.3f} s "
          f"(the call {figures['async_call_s']:.3f} s + slots {figures['async_slot_wait_s']:.3f} s), "
          f"{figures['async_wait_over_sync']:.1%} of the synchronous save")
    note = f"; {figures['floor_note']}" if figures["floor_note"] else ""
    print(f"the floor: {figures['floor_mover']} reading {figures['floor_gb']:.3f} GB and writing as many ({SHAPE}{note}), "
          f"paced to the asynchronous save's {figures['async_span_s']:.3f} s (it ran {figures['floor_span_s']:.3f} s): "
          f"a step {figures['step_during_floor_s']:.3f} s during it ({figures['step_during_floor_over_without']:.2f}x "
          f"a step without) against {figures['step_during_over_without']:.2f}x during the save: ours "
          f"{figures['step_during_save_over_floor']:.2f}x the floor")


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
    steps, during, calls, slot_waits, spans = [], [], [], [], []
    floor_during, floor_runs, traffic = [], [], None
    fio_times: dict[str, list[float]] = {"write": [], "read": []}
    try:
        with _write_modes() as fallbacks:
            for repeat in range(repeats):
                before = _cached_bytes()
                began = time.perf_counter()
                path = engine.save_checkpoint(f"{root}/ours", tag=f"r{repeat}")
                ours.append(time.perf_counter() - began)
                cached.append(_cached_bytes() - before)
                checkpoint_bytes = _tree_bytes(path)
                shutil.rmtree(path)
                if traffic is None:  # the floor's file to read, laid out once, outside every timing
                    traffic = SaveTraffic(root, checkpoint_bytes, use_fio=fio)
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
                ended = _SaveEnd(engine)
                during.append(step())  # at least one step with the save in flight; more while it runs
                while engine.checkpoint_in_flight() is not None:
                    during.append(step())
                engine.wait_for_checkpoint()
                spans.append(ended.wait() - began)
                slot_waits.append(engine._saves.last_wait_seconds)
                shutil.rmtree(path)
                # The floor: the save's bytes moved at the save's pace, beside the same steps.
                traffic.start(spans[-1])
                floor_during.append(step())  # at least one step with the traffic running; more while it runs
                while traffic.running():
                    floor_during.append(step())
                floor_runs.append(traffic.finish())
    finally:
        engine.close()
        if traffic is not None:
            traffic.close()
    figures = {"checkpoint_gb": checkpoint_bytes / GB, "ours_s": statistics.median(ours),
               "write_mode": fallbacks.mode(), "torch_save_s": statistics.median(saves),
               "ours_runs_s": [round(s, 3) for s in ours], "torch_save_runs_s": [round(s, 3) for s in saves],
               "page_cache_share": max(0, statistics.median(cached)) / max(checkpoint_bytes, 1)}
    figures["ours_over_torch_save"] = figures["ours_s"] / figures["torch_save_s"]
    waits = [call + slots for call, slots in zip(calls, slot_waits)]
    figures.update(step_s=statistics.median(steps), step_during_save_s=statistics.median(during),
                   async_call_s=statistics.median(calls), async_slot_wait_s=statistics.median(slot_waits),
                   async_wait_s=statistics.median(waits), steps_during_save=len(during),
                   async_span_s=statistics.median(spans), async_span_runs_s=[round(s, 3) for s in spans],
                   step_runs_s=[round(s, 3) for s in steps], step_during_runs_s=[round(s, 3) for s in during])
    figures["step_during_over_without"] = figures["step_during_save_s"] / figures["step_s"]
    figures["async_wait_over_sync"] = figures["async_wait_s"] / figures["ours_s"]
    figures.update(floor_mover=traffic.mover, floor_note=traffic.note, floor_shape=SHAPE, floor_gb=traffic.nbytes / GB,
                   floor_span_s=statistics.median(run["span_s"] for run in floor_runs),
                   floor_read_s=statistics.median(run["read_s"] for run in floor_runs),
                   floor_write_s=statistics.median(run["write_s"] for run in floor_runs),
                   floor_span_runs_s=[round(run["span_s"], 3) for run in floor_runs],
                   step_during_floor_s=statistics.median(floor_during), steps_during_floor=len(floor_during),
                   step_during_floor_runs_s=[round(s, 3) for s in floor_during])
    figures["step_during_floor_over_without"] = figures["step_during_floor_s"] / figures["step_s"]
    figures["step_during_save_over_floor"] = figures["step_during_save_s"] / figures["step_during_floor_s"]
    if fio_times["write"] and fio_times["read"]:
        figures.update(fio_write_s=statistics.median(fio_times["write"]), fio_read_s=statistics.median(fio_times["read"]))
        figures["fio_write_read_s"] = figures["fio_write_s"] + figures["fio_read_s"]
        figures["ours_over_fio"] = figures["ours_s"] / figures["fio_write_read_s"]
    return figures


# ---- the large mode ---------------------------------------------------------------------------------------

def _large_spec(model_config: dict | None, layers: int | None, *, knobs: str = "3b") -> dict:
    """`benchmarks.train_large`'s spec of the model to build: the sizes of its "3b" scale (``layers`` of them
    if given) for ``model_config`` None, else ``model_config``'s (GPT2Config keywords); its other settings
    (parameters kept in memory, sub-group size, learning rate) from its scale ``knobs`` ("tiny": every parameter
    on NVMe, small sub-groups, for a tiny model); one sequence a batch, clipping off (the update runs within
    the step, not in the next call)."""
    from benchmarks.train_large import SCALES

    spec = dict(SCALES[knobs])
    if model_config is None:
        spec.update({key: SCALES["3b"][key] for key in ("layers", "hidden", "heads", "vocab", "seq")})
    else:
        config = transformers.GPT2Config(**model_config)
        spec.update(layers=config.n_layer, hidden=config.n_embd, heads=config.n_head, vocab=config.vocab_size,
                    seq=config.n_positions)
    if layers is not None:
        spec["layers"] = layers
    del spec["batch"]
    largest = max(spec["vocab"] * spec["hidden"], 4 * spec["hidden"] ** 2)  # as train_large's buffer_size
    spec.update(batches=[1], clipping=0.0, buffer_count=2, buffer_size=largest, block_size=1 << 20, queue_depth=32)
    return spec


def _free_bytes(directory: str) -> int:
    """Bytes free for this user on ``directory``'s file system (a seam: the tests fake a full disk)."""
    return shutil.disk_usage(directory).free


def _large_after_a_step(root: str, spec: dict):
    """The engine of train_large's model of ``spec`` (built under ``offload.zero.Init`` with train_large's config,
    swap files in ``root``) after one step on train_large's batch, so that the optimizer state exists."""
    import offload
    from benchmarks.train_large import _data, _gpt2_config, ds_config

    config = ds_config(spec, root)
    torch.manual_seed(0)
    with offload.zero.Init(config_dict_or_path=config):
        model = transformers.GPT2LMHeadModel(_gpt2_config(spec, spec["layers"]))
    engine, *_ = offload.initialize(model=model, config=config)
    batch = _data(spec)[:1]
    engine.backward(engine(batch, labels=batch).loss)
    engine.step()
    return engine


def _measure_large(root: str, spec: dict, repeats: int, *, fio: bool) -> dict:
    from benchmarks.train_large import STATE_BYTES, disk_needed, gpt2_parameters

    params = gpt2_parameters(spec["layers"], spec["hidden"], spec["vocab"], spec["seq"])
    expected = 12 * params  # fp32 partitions (4 bytes a parameter) and AdamW's two moments (8)
    swap = disk_needed(params, spec)["offload"]
    need, free = swap + expected + SLACK, _free_bytes(root)
    state, ram = STATE_BYTES * params, psutil.virtual_memory().total
    print(f"model: train_large's GPT-2, {spec['layers']} layers x {spec['hidden']}, {spec['heads']} heads, vocab "
          f"{spec['vocab']}, positions {spec['seq']}: {params / 1e9:.3f} B parameters, fp32, built under "
          f"offload.zero.Init, parameters and optimizer state on NVMe (max_in_cpu 0), clipping off")
    print(f"checkpoint: {expected / GB:.2f} GB (partitions {4 * params / GB:.2f} GB + two moments "
          f"{8 * params / GB:.2f} GB); disk needed: {need / GB:.2f} GB (swap files {swap / GB:.2f} GB + one "
          f"checkpoint + {SLACK >> 20} MiB; fio's file takes the checkpoint's room after it is removed), "
          f"{free / GB:.2f} GB free in {root}",
          flush=True)
    if need > free:
        raise SystemExit(f"checkpoint_save: not enough disk space in {root}: the large mode needs {need / GB:.2f} GB "
                         f"(swap files {swap / GB:.2f} GB + one checkpoint {expected / GB:.2f} GB + {SLACK >> 20} MiB), the "
                         f"file system has "
                         f"{free / GB:.2f} GB free; free {(need - free) / GB:.2f} GB, pass a --dir on a larger disk, or "
                         f"measure fewer layers (--layers)")
    print(f"torch.save: skipped: it writes the weights and both moments held in memory, and this training state "
          f"({state / GB:.2f} GB with the gradients) is meant not to fit ({ram / 2**30:.1f} GiB of RAM here)")
    print("asynchronous save: skipped: a step of the 3.1 B model takes about a minute (docs/benchmarks.md, "
          "train_large), so steps beside a save are not measured here; the small models measure them", flush=True)
    began = time.perf_counter()
    engine = _large_after_a_step(root, spec)
    built = time.perf_counter() - began
    swap_on_disk = _tree_bytes(root, allocated=True)
    print(f"built and stepped in {built:.1f} s; swap files {swap_on_disk / GB:.2f} GB on the disk", flush=True)
    ours, growth, checkpoint_bytes = [], [], 0
    fio_times: dict[str, list[float]] = {"write": [], "read": []}
    try:
        with _write_modes() as fallbacks:
            for repeat in range(repeats):
                with RssSampler(kernel_peak=True) as rss:
                    began = time.perf_counter()
                    path = engine.save_checkpoint(f"{root}/ours", tag=f"r{repeat}")
                    ours.append(time.perf_counter() - began)
                growth.append(rss.peak - rss.samples[0][1])  # over the RSS as the save began
                checkpoint_bytes = _tree_bytes(path)
                shutil.rmtree(path)  # one checkpoint on the disk at a time
                print(f"repeat {repeat + 1}: ours {ours[-1]:.2f} s, peak RSS +{growth[-1] / GB:.3f} GB", flush=True)
                if fio:
                    for rw, seconds in _fio(root, checkpoint_bytes).items():
                        fio_times[rw].append(seconds)
    finally:
        engine.close()
    figures = {"mode": "large", "params": params, "spec": spec, "checkpoint_gb": checkpoint_bytes / GB,
               "disk_needed_gb": need / GB, "disk_free_gb": free / GB, "swap_gb": swap_on_disk / GB,
               "build_and_step_s": built, "write_mode": fallbacks.mode(),
               "ours_s": statistics.median(ours), "ours_runs_s": [round(s, 3) for s in ours],
               "rss_growth_gb": max(growth) / GB, "rss_growth_runs_gb": [round(g / GB, 4) for g in growth],
               "torch_save": "skipped: the state does not fit in memory",
               "async": "skipped: a step takes about a minute"}
    if fio_times["write"] and fio_times["read"]:
        figures.update(fio_write_s=statistics.median(fio_times["write"]), fio_read_s=statistics.median(fio_times["read"]))
        figures["fio_write_read_s"] = figures["fio_write_s"] + figures["fio_read_s"]
        figures["ours_over_fio"] = figures["ours_s"] / figures["fio_write_read_s"]
    return figures


def _print_large(figures: dict, repeats: int) -> None:
    line = (f"checkpoint {figures['checkpoint_gb']:.3f} GB: ours {figures['ours_s']:.3f} s "
            f"({figures['checkpoint_gb'] / figures['ours_s']:.2f} GB/s)")
    if figures.get("fio_write_read_s"):
        met = "met" if figures["ours_over_fio"] <= TARGET_LARGE_OVER_FIO else "NOT met"
        line += (f", fio write + read {figures['fio_write_read_s']:.3f} s (write {figures['fio_write_s']:.3f} s, read "
                 f"{figures['fio_read_s']:.3f} s): {figures['ours_over_fio']:.2f}x (target <= {TARGET_LARGE_OVER_FIO}x: "
                 f"{met})")
    met = "met" if figures["rss_growth_gb"] * GB < TARGET_LARGE_RSS_GROWTH else "NOT met"
    print(line + f"; peak RSS growth during ours {figures['rss_growth_gb']:.3f} GB, the highest of {repeats} "
                 f"(target < {TARGET_LARGE_RSS_GROWTH / GB:.0f} GB: {met}); times are medians of {repeats}")


# ---- shared -----------------------------------------------------------------------------------------------

class _SaveEnd:
    """When the engine's asynchronous save in flight ends: a thread asks `checkpoint_in_flight` every 5 ms."""

    def __init__(self, engine) -> None:
        self._at = 0.0
        self._thread = threading.Thread(target=self._watch, args=(engine,), name="save-end", daemon=True)
        self._thread.start()

    def _watch(self, engine) -> None:
        while engine.checkpoint_in_flight() is not None:
            time.sleep(0.005)
        self._at = time.perf_counter()

    def wait(self) -> float:
        """The save's end (``time.perf_counter()``); waits for it."""
        self._thread.join()
        return self._at


def _tree_bytes(path: str, *, allocated: bool = False) -> int:
    """Bytes of the files under ``path`` (``allocated``: the disk blocks they hold, as ``du``)."""
    total = 0
    for folder, _, names in os.walk(path):
        for name in names:
            status = os.stat(os.path.join(folder, name))
            total += status.st_blocks * 512 if allocated else status.st_size
    return total


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

    def mode(self) -> str:
        """How the saves wrote their tensor files, as the benchmark prints it."""
        return f"through the page cache ({self.reasons[0]})" if self.reasons else "with O_DIRECT"


@contextlib.contextmanager
def _write_modes() -> Iterator[_BufferedFiles]:
    """Within: the "offload" logger's debug lines go to the yielded `_BufferedFiles` too."""
    handler, logger = _BufferedFiles(), logging.getLogger("offload")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def _cached_bytes() -> int:
    """The page cache's size now (``Cached`` of /proc/meminfo), in bytes."""
    with open("/proc/meminfo", encoding="ascii") as file:
        for line in file:
            if line.startswith("Cached:"):
                return int(line.split()[1]) * 1024
    return 0


if __name__ == "__main__":
    main()
