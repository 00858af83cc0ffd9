"""Training a model twice the RAM (issue 12): a GPT-2 of 3.1 B parameters, whose fp32 training state
(16 bytes a parameter: weights, gradients and Adam's two moments, 49.6 GB) is twice this machine's
24 GiB, built under `offload.zero.Init` and trained with parameters and optimizer state on NVMe.

    python -m benchmarks.train_large --nvme-dir /work/tmp/train-large --out train_large.json
    python -m benchmarks.train_large --nvme-dir /work/tmp/train-large --layers 8 --deepspeed
    python -m benchmarks.train_large --scale tiny --nvme-dir /tmp/x          # what the test runs

One DeepSpeed JSON config serves both engines: parameters and optimizer on NVMe (``max_in_cpu`` 0),
``gradient_clipping`` 1.0 (``--clipping``), fp32, AdamW. Steps: ``--steps`` on one repeated batch for each size of
``--batch`` (default 1 x 128, then 4 x 128: the first row of the larger batch is the smaller one);
``--checkpointing`` turns Hugging Face's activation checkpointing on in every run.

Each part runs in its own child process, so that its peak RSS is its own: fio reads and writes in
``--nvme-dir`` (before and after each engine, and by the engine's child before its first step and after
every step, outside the steps' timing), plain PyTorch on ``--ref-layers`` layers of the same width (fused AdamW,
clipping), the engine, and with ``--deepspeed`` DeepSpeed (``deepspeed.zero.Init``, the gloo
backend). A parent watchdog kills a child whose RSS passes ``--rss-limit`` or when the machine has
less than 1 GiB available, so that an out-of-memory child does not take others' jobs with it.

Reported: the build's peak RSS over the interpreter's before it (target <= 2 GB), then per step its
time, loss, bytes read and written by the process (/proc/self/io, which counts O_DIRECT I/O) and by
the parameter swap file alone (``engine.io_bytes()``; the rest is the optimizer's swap file), its peak
RSS, its forward / backward / step split, the process's CPU seconds, the optimizer's I/O wait and the
share of the step (and of its forward and backward) the disk was busy (`DiskBusy`).
The summary takes, per batch size, the medians of the steps after the run's first two (the first has
no update to apply: with clipping a step's update runs during the next forward; the second's finds
the optimizer state never written, so reads none of it) and marks the targets: peak RSS while training <= 10% of
the training state; the loss lower at the last step than at the first; step time <= 1.3 x max(the
step's bytes at fio's speed (read / fio read + written / fio write), the plain-PyTorch step time of
the reference scaled by the parameter ratio). fio's speed is taken beside each step (the faster of the
measurements just before and just after it): this disk's read speed moves by several times within a run.
The same target against the fastest fio figure of the whole run is printed beside it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

from bench.fio import FioJob, run_fio
from benchmarks._common import REPO, RssSampler, free_port
from benchmarks._hash_load import HashLoad

GB = 1e9
STATE_BYTES = 16
"""fp32 training state per parameter: weights, gradients, exp_avg, exp_avg_sq."""

SCALES = {
    "3b": {"layers": 26, "hidden": 3072, "heads": 24, "vocab": 50257, "seq": 128, "batch": "1,4", "steps": 4,
           "ref_layers": 4, "ref_steps": 2, "persistence": 100_000, "sub_group_size": 1 << 22, "fio_size": 1 << 30, "lr": 1e-4,
           "clipping": 1.0},
    "tiny": {"layers": 2, "hidden": 64, "heads": 2, "vocab": 512, "seq": 16, "batch": "1,2", "steps": 3,
             "ref_layers": 1, "ref_steps": 1, "persistence": 0, "sub_group_size": 4096, "fio_size": 4 << 20, "lr": 1e-3,
             "clipping": 1.0},
}
TARGET_BUILD_RSS = 2 * GB
TARGET_STATE_SHARE = 0.10
TARGET_STEP_RATIO = 1.3


def gpt2_parameters(layers: int, hidden: int, vocab: int, positions: int) -> int:
    """Distinct parameters of GPT2LMHeadModel (lm_head tied to the token embedding)."""
    block = 12 * hidden * hidden + 13 * hidden  # ln_1, c_attn, attn.c_proj, ln_2, c_fc, mlp.c_proj
    return vocab * hidden + positions * hidden + layers * block + 2 * hidden


def ds_config(spec: dict, nvme_dir: str) -> dict:
    """The DeepSpeed-format config both engines get."""
    return {
        "train_micro_batch_size_per_gpu": spec["batches"][0],
        "gradient_accumulation_steps": 1,
        "gradient_clipping": spec["clipping"],
        "optimizer": {"type": "AdamW", "params": {"lr": spec["lr"], "betas": [0.9, 0.999], "eps": 1e-8,
                                                  "weight_decay": 0.0}},
        "zero_optimization": {
            "stage": 3,
            "sub_group_size": spec["sub_group_size"],
            "stage3_param_persistence_threshold": spec["persistence"],
            "stage3_prefetch_bucket_size": spec["buffer_size"] * 2,
            # 0: DeepSpeed 0.19.8 crashes with "Not enough buffers 0 for swapping 1" at max_in_cpu 0
            # otherwise (../shared/ANCHORS.md); ours then reads the tied embedding twice a step.
            "stage3_max_reuse_distance": 0,
            "offload_param": {"device": "nvme", "nvme_path": nvme_dir, "max_in_cpu": 0, "pin_memory": True,
                              "buffer_count": spec["buffer_count"], "buffer_size": spec["buffer_size"]},
            "offload_optimizer": {"device": "nvme", "nvme_path": nvme_dir, "pin_memory": True, "buffer_count": 4},
        },
        "aio": {"block_size": spec["block_size"], "queue_depth": spec["queue_depth"],
                **({"verify": False} if spec.get("no_verify") else {})},  # ours only: checksums off
    }


# ---- children ---------------------------------------------------------------------------------------------

def _gpt2_config(spec: dict, layers: int):
    import transformers

    return transformers.GPT2Config(n_layer=layers, n_embd=spec["hidden"], n_head=spec["heads"],
                                   vocab_size=spec["vocab"], n_positions=spec["seq"], resid_pdrop=0.0,
                                   embd_pdrop=0.0, attn_pdrop=0.0)


def _data(spec: dict):
    """The repeated batch: the largest batch size; a smaller one is its first rows."""
    import torch

    gen = torch.Generator().manual_seed(1)
    return torch.randint(0, spec["vocab"], (max(spec["batches"]), spec["seq"]), generator=gen)


def _checkpointing(model, spec: dict) -> None:
    """``--checkpointing``: Hugging Face's activation checkpointing (non-reentrant), for every run alike."""
    if spec.get("checkpointing"):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def _baseline() -> int:
    """RSS of the interpreter with torch and transformers imported, before any model exists."""
    import torch
    import transformers  # noqa: F401

    torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))])  # lazy imports (torch._dynamo) first
    return psutil.Process().memory_info().rss


def _child_reference(spec: dict) -> dict:
    """Plain PyTorch, ``ref_layers`` layers of the same width: seconds per step at each batch size."""
    import torch
    import transformers

    baseline = _baseline()
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(_gpt2_config(spec, spec["ref_layers"]))
    _checkpointing(model, spec)
    opt = torch.optim.AdamW(model.parameters(), lr=spec["lr"], weight_decay=0.0, fused=True)
    data = _data(spec)
    seconds, losses = {}, {}
    with RssSampler(kernel_peak=True) as rss:
        for batch in spec["batches"]:
            x = data[:batch]
            times = []
            for step in range(1 + spec["ref_steps"]):  # one warm-up
                start = time.perf_counter()
                loss = model(x, labels=x).loss
                loss.backward()
                if spec["clipping"] > 0:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), spec["clipping"])
                opt.step()
                opt.zero_grad(set_to_none=True)
                times.append(time.perf_counter() - start)
                losses.setdefault(batch, []).append(loss.item())
                print(f"[reference] {spec['ref_layers']} layers, batch {batch} step {step + 1}: {times[-1]:.2f} s, "
                      f"loss {losses[batch][-1]:.4f}", flush=True)
            seconds[batch] = statistics.median(times[1:])
    return {"params": sum(p.numel() for p in model.parameters()), "seconds": seconds, "losses": losses,
            "peak_rss": rss.peak, "baseline_rss": baseline}


def _child_train(spec: dict, save) -> dict:
    """Build under the engine's Init, initialize, train; figures of the build and of every step, passed
    to ``save`` after each phase (so that a run that fails later keeps them)."""
    import torch
    import transformers

    import tensorio

    out: dict = {"engine": spec["engine"], "baseline_rss": _baseline(), "steps": []}
    proc = psutil.Process()
    config = ds_config(spec, spec["nvme_dir"])
    if spec["engine"] == "deepspeed":
        import deepspeed

        for key, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(free_port())), ("RANK", "0"),
                           ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):
            os.environ.setdefault(key, value)
        deepspeed.init_distributed(dist_backend="gloo")
        out["baseline_rss"] = proc.memory_info().rss
        zero_init, initialize = deepspeed.zero.Init, deepspeed.initialize
        out["version"] = deepspeed.__version__
    else:
        import offload

        zero_init, initialize = offload.zero.Init, offload.initialize
    torch.manual_seed(0)
    # 1. Build, partition by partition.
    start = time.perf_counter()
    with RssSampler(kernel_peak=True) as rss:  # the kernel's high-water mark: no peak missed
        with zero_init(config_dict_or_path=config):
            model = transformers.GPT2LMHeadModel(_gpt2_config(spec, spec["layers"]))
    _checkpointing(model, spec)
    out["build_s"], out["build_peak_rss"] = time.perf_counter() - start, rss.peak
    save(out)
    print(f"[{spec['engine']}] build: {out['build_s']:.1f} s, peak RSS {rss.peak / GB:.2f} GB "
          f"({(rss.peak - out['baseline_rss']) / GB:.2f} GB over the interpreter)", flush=True)
    # 2. The engine.
    start = time.perf_counter()
    with RssSampler(kernel_peak=True) as rss:
        if spec["engine"] == "deepspeed":
            engine, opt, _, _ = initialize(model=model, model_parameters=model.parameters(), config=config)
        else:
            engine, opt, _, _ = initialize(model=model, config=config)
    out["initialize_s"], out["initialize_peak_rss"] = time.perf_counter() - start, rss.peak
    save(out)
    print(f"[{spec['engine']}] initialize: {out['initialize_s']:.1f} s, peak RSS {rss.peak / GB:.2f} GB", flush=True)
    # 3. Steps on the repeated batch, each batch size in turn.
    data = _data(spec)
    param_io = getattr(engine, "io_bytes", None) if spec["engine"] == "offload" else None
    io_wait = getattr(opt, "io_wait_seconds", None)
    disk = DiskBusy(spec["nvme_dir"])
    load = HashLoad(spec["hash_cpu_rate"]) if spec.get("hash_cpu_rate") else contextlib.nullcontext()
    out["fio_before_steps"] = _fio_beside_steps(spec)
    for batch in spec["batches"]:
        x = data[:batch]
        for step in range(spec["steps"]):
            io0, p0, w0 = proc.io_counters(), param_io() if param_io else None, io_wait() if io_wait else 0.0
            cpu0, hashed0 = proc.cpu_times(), tensorio.checksum_totals().cpu_seconds
            with RssSampler(kernel_peak=True) as rss, load:  # the hash load (if any) during the step only
                t0, busy0 = time.perf_counter(), disk.busy_ms()
                loss = engine(x, labels=x).loss
                t1, busy1 = time.perf_counter(), disk.busy_ms()
                engine.backward(loss)
                t2, busy2 = time.perf_counter(), disk.busy_ms()
                engine.step()
                t3, busy3 = time.perf_counter(), disk.busy_ms()
            io1, p1, cpu1 = proc.io_counters(), param_io() if param_io else None, proc.cpu_times()
            row = {"batch": batch, "step": step + 1, "seconds": t3 - t0, "forward_s": t1 - t0, "backward_s": t2 - t1,
                   "step_s": t3 - t2, "cpu_s": cpu1.user + cpu1.system - cpu0.user - cpu0.system,
                   "hash_cpu_s": tensorio.checksum_totals().cpu_seconds - hashed0,
                   "loss": loss.item(), "peak_rss": rss.peak,
                   "read": io1.read_bytes - io0.read_bytes, "written": io1.write_bytes - io0.write_bytes,
                   "io_wait": (io_wait() - w0) if io_wait else None,
                   "disk_busy": disk.share(busy0, busy3, t3 - t0), "disk_busy_forward": disk.share(busy0, busy1, t1 - t0),
                   "disk_busy_backward": disk.share(busy1, busy2, t2 - t1)}
            if p0 is not None:
                row["param_read"], row["param_written"] = p1["read"] - p0["read"], p1["written"] - p0["written"]
            row["fio_after"] = _fio_beside_steps(spec)
            out["steps"].append(row)
            save(out)
            params = (f" (parameter file {row['param_read'] / GB:.2f} / {row['param_written'] / GB:.2f})"
                      if p0 is not None else "")
            io_notes = f", optimizer io wait {row['io_wait']:.2f} s" if io_wait else ""
            if row["hash_cpu_s"]:
                io_notes += f", checksums {row['hash_cpu_s']:.2f} s of CPU"
            if row["disk_busy"] is not None:
                io_notes += (f", disk busy {row['disk_busy']:.0%} (forward {row['disk_busy_forward']:.0%}, backward "
                         f"{row['disk_busy_backward']:.0%})")
            print(f"[{spec['engine']}] batch {batch} step {step + 1}: {row['seconds']:.2f} s (forward "
                  f"{row['forward_s']:.1f}, backward {row['backward_s']:.1f}, step {row['step_s']:.1f}; CPU "
                  f"{row['cpu_s']:.1f} s), loss {row['loss']:.4f}, read {row['read'] / GB:.2f} GB, written "
                  f"{row['written'] / GB:.2f} GB{params}, peak RSS {rss.peak / GB:.2f} GB{io_notes}", flush=True)
    start = time.perf_counter()
    if hasattr(engine, "close"):
        engine.close()
    elif hasattr(engine, "destroy"):
        engine.destroy()
    out["close_s"] = time.perf_counter() - start
    return out


class DiskBusy:
    """The share of a time the block device holding ``directory`` had a request in flight: the kernel's
    ``io_ticks`` (/sys/dev/block/MAJOR:MINOR/stat, field 10). A step that keeps it near 100% is
    bound by the disk whatever speed fio saw before or after it. Unavailable (None) where the
    directory's file system has no block device (tmpfs, overlay)."""

    def __init__(self, directory: str) -> None:
        dev = os.stat(directory).st_dev
        path = Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}/stat")
        self._path = path if path.exists() else None

    def busy_ms(self) -> int | None:
        """Milliseconds the device has been busy since boot (None: unavailable)."""
        return int(self._path.read_text().split()[9]) if self._path else None

    @staticmethod
    def share(before: int | None, after: int | None, seconds: float) -> float | None:
        """Busy share of ``seconds`` between two `busy_ms` readings."""
        return None if before is None or seconds <= 0 else (after - before) / 1000 / seconds


def _fio_beside_steps(spec: dict) -> dict:
    """fio's speed in the swap directory between two steps (outside their timing): this disk's speed
    moves by several times within a run, so a step is compared with the disk as it was around it."""
    return measure_fio(spec["nvme_dir"], spec["fio_size"], spec["block_size"], spec["queue_depth"])


# ---- the parent -------------------------------------------------------------------------------------------

def run_child(kind: str, spec: dict, *, rss_limit: int, timeout: float | None, mmap_threshold: int | None,
              log: Path) -> dict:
    """Run ``kind`` in a fresh interpreter, echoing its output lines; return its figures, with
    ``"error"`` (and the figures saved before) when it fails, is killed by the watchdog (RSS over
    ``rss_limit``, the machine under 1 GiB available) or runs past ``timeout`` seconds. Its error
    output goes to ``log``."""
    env = dict(os.environ)
    env.pop("MALLOC_MMAP_THRESHOLD_", None)
    if mmap_threshold is not None:
        env["MALLOC_MMAP_THRESHOLD_"] = str(mmap_threshold)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    with tempfile.NamedTemporaryFile("r", suffix=".json", prefix="train-large-") as result, open(log, "w") as err:
        command = [sys.executable, "-m", "benchmarks.train_large", "--child", kind, json.dumps(spec), result.name]
        child = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=err, text=True, env=env)
        killed: list[str] = []
        watchdog = threading.Thread(target=_watch, args=(child, rss_limit, timeout, killed), daemon=True)
        watchdog.start()
        for line in child.stdout:
            print(line, end="", flush=True)
        code = child.wait()
        watchdog.join()
        figures = json.loads(result.read() or "{}")
        if killed:
            figures["error"] = killed[0]
        elif code:
            tail = Path(log).read_text()[-2000:]
            figures["error"] = f"exit status {code} ({_signal_name(code)}); end of its error output ({log}):\n{tail}"
        return figures


def _watch(child: subprocess.Popen, rss_limit: int, timeout: float | None, killed: list[str]) -> None:
    start = time.monotonic()
    try:
        process = psutil.Process(child.pid)
        while child.poll() is None:
            rss = process.memory_info().rss
            available = psutil.virtual_memory().available
            reason = (f"killed by the watchdog: RSS {rss / GB:.2f} GB over the limit {rss_limit / GB:.2f} GB"
                      if rss > rss_limit else
                      f"killed by the watchdog: the machine had {available / GB:.2f} GB available"
                      if available < (1 << 30) else
                      f"killed by the watchdog: still running after {timeout:.0f} s"
                      if timeout and time.monotonic() - start > timeout else None)
            if reason:
                killed.append(reason)
                child.kill()
                return
            time.sleep(0.25)
    except psutil.NoSuchProcess:
        return


def _signal_name(code: int) -> str:
    if code < 0 and -code in {int(s) for s in signal.Signals}:
        return signal.Signals(-code).name
    return "exit"


def measure_fio(directory: str, size: int, block_size: int, queue_depth: int) -> dict:
    """fio's sequential read and write speed (bytes/s) in ``directory`` with the config's aio settings."""
    speeds = {}
    for rw in ("read", "write"):
        job = FioJob(directory=directory, rw=rw, size=max(size // block_size, 1) * block_size,
                     block_size=block_size, queue_depth=queue_depth, overwrite=rw == "write")
        speeds[rw] = run_fio(job).bw_bytes
    print(f"fio in {directory}: read {speeds['read'] / GB:.2f} GB/s, write {speeds['write'] / GB:.2f} GB/s", flush=True)
    return speeds


def disk_needed(params: int, spec: dict) -> dict[str, int]:
    """Swap bytes each engine writes for this fp32 model (the persistent parameters are counted too: an
    upper bound by well under 0.1%)."""
    dropped = spec["vocab"] * spec["hidden"] * 4  # GPT-2's lm_head, built then replaced by the tied embedding
    # Ours: each on-disk partition and its optimizer state (exp_avg, exp_avg_sq) in two slots, the
    # committed one and the one a step writes (docs/engine.md, docs/optimizer_offload.md).
    ours = {"params": 2 * 4 * params + dropped, "optimizer": 2 * 8 * params}
    # DeepSpeed on this CPU swaps parameters as bf16; its optimizer swap holds the fp32 master copy and
    # both moments, and its gradient swap the fp32 gradients.
    deepspeed = {"params": params * 2, "optimizer": 12 * params, "gradients": 4 * params}
    return {"offload": sum(ours.values()), "deepspeed": sum(deepspeed.values())}


def main(argv: list[str] | None = None) -> dict:
    """Run the benchmark; print the configuration, the steps and a summary of the targets; return the figures."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scale", choices=sorted(SCALES), default="3b", help="defaults for every size below")
    for key in ("layers", "hidden", "heads", "vocab", "seq", "steps", "ref_layers", "ref_steps", "persistence",
                "sub_group_size", "fio_size"):
        ap.add_argument("--" + key.replace("_", "-"), type=int)
    ap.add_argument("--batch", help="comma-separated batch sizes, each trained for --steps (default 1,4)")
    ap.add_argument("--lr", type=float)
    ap.add_argument("--clipping", type=float, help="gradient_clipping (default 1.0; 0 turns it off)")
    ap.add_argument("--checkpointing", action="store_true",
                    help="activation checkpointing (model.gradient_checkpointing_enable) in every run, the "
                         "reference included: activations of one layer at a time instead of all")
    ap.add_argument("--buffer-count", type=int, default=2, help="offload_param.buffer_count")
    ap.add_argument("--buffer-size", type=int, help="offload_param.buffer_size (default: the largest parameter)")
    ap.add_argument("--block-size", type=int, default=1 << 20)
    ap.add_argument("--queue-depth", type=int, default=32)
    ap.add_argument("--nvme-dir", default=None, help="swap directory on the disk to measure (default: a temporary one)")
    ap.add_argument("--deepspeed", action="store_true", help="also run DeepSpeed with deepspeed.zero.Init")
    ap.add_argument("--skip-reference", action="store_true", help="no plain-PyTorch reference (no compute bound)")
    ap.add_argument("--rss-limit", type=float, default=None,
                    help="GB; a child above it is killed (default: 85%% of the machine's memory)")
    ap.add_argument("--timeout", type=float, default=None, help="seconds per child (default: none)")
    ap.add_argument("--malloc-mmap-threshold", type=int, default=131072,
                    help="glibc MALLOC_MMAP_THRESHOLD_ for the children, so that RSS follows live memory "
                         "(negative: glibc's default)")
    ap.add_argument("--no-verify", action="store_true",
                    help="aio.verify false: no checksums on the swap files (to measure what they cost)")
    ap.add_argument("--hash-cpu-rate", type=float, default=None,
                    help="a thread hashes memory for this share of a core's time during each step (with --no-verify: "
                         "the checksums' floor, benchmarks.verify_cost)")
    ap.add_argument("--out", help="write every figure to this JSON file")
    ap.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        kind, spec, path = args.child

        def save(figures: dict) -> None:
            Path(path).write_text(json.dumps(figures))
        spec = json.loads(spec)
        result = _child_reference(spec) if kind == "reference" else _child_train(spec, save)
        save(result)
        return result

    spec = dict(SCALES[args.scale])
    for key in spec:
        if getattr(args, key, None) is not None:
            spec[key] = getattr(args, key)
    spec["batches"] = [int(b) for b in str(spec.pop("batch")).split(",") if b]
    params = gpt2_parameters(spec["layers"], spec["hidden"], spec["vocab"], spec["seq"])
    ref_params = gpt2_parameters(spec["ref_layers"], spec["hidden"], spec["vocab"], spec["seq"])
    largest = max(spec["vocab"] * spec["hidden"], 4 * spec["hidden"] ** 2)
    spec.update(checkpointing=args.checkpointing, buffer_count=args.buffer_count, buffer_size=args.buffer_size or largest,
                block_size=args.block_size, queue_depth=args.queue_depth, no_verify=args.no_verify,
                hash_cpu_rate=args.hash_cpu_rate)
    mmap = args.malloc_mmap_threshold if args.malloc_mmap_threshold >= 0 else None
    rss_limit = int(args.rss_limit * GB) if args.rss_limit else int(0.85 * psutil.virtual_memory().total)
    state = STATE_BYTES * params
    memory = psutil.virtual_memory().total

    if args.nvme_dir:
        os.makedirs(args.nvme_dir, exist_ok=True)
    logs = Path(args.out).resolve().parent if args.out else Path(tempfile.gettempdir())
    with tempfile.TemporaryDirectory(dir=args.nvme_dir, prefix="train-large-") as directory:
        free = shutil.disk_usage(directory).free
        need = disk_needed(params, spec)
        print(f"model: GPT-2, {spec['layers']} layers x {spec['hidden']}, {spec['heads']} heads, vocab {spec['vocab']}, "
              f"positions {spec['seq']}: {params / 1e9:.3f} B parameters, fp32; training state {state / GB:.1f} GB "
              f"= {state / memory:.2f} x this machine's {memory / 2**30:.1f} GiB of RAM")
        print(f"training: batches {spec['batches']} x {spec['seq']} tokens, {spec['steps']} steps each on a repeated "
              f"batch, AdamW lr {spec['lr']}, gradient_clipping {spec['clipping']}, activation checkpointing "
              f"{'on' if spec['checkpointing'] else 'off'}; reference: plain PyTorch, {spec['ref_layers']} "
              f"layers ({ref_params / 1e9:.3f} B parameters), scaled x {params / ref_params:.2f}")
        print(f"config: {json.dumps(ds_config(spec, directory))}")
        print(f"disk: {directory}, {free / GB:.1f} GB free; swap files need {need['offload'] / GB:.1f} GB here "
              f"(parameters and optimizer state, two slots each), about {need['deepspeed'] / GB:.1f} GB for DeepSpeed; "
              f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}; MALLOC_MMAP_THRESHOLD_={mmap}", flush=True)
        if need["offload"] + spec["fio_size"] > free:
            raise SystemExit(f"not enough disk: {need['offload'] / GB:.1f} GB of swap files and fio's "
                             f"{spec['fio_size'] / GB:.1f} GB, {free / GB:.1f} GB free in {directory}")
        results: dict = {"spec": spec, "params": params, "state_bytes": state, "ram_bytes": memory,
                         "disk_free": free, "disk_needed": need, "load_before": os.getloadavg()}
        fio = [measure_fio(directory, spec["fio_size"], args.block_size, args.queue_depth)]
        if not args.skip_reference:
            results["reference"] = run_child("reference", spec, rss_limit=rss_limit, timeout=args.timeout,
                                             mmap_threshold=mmap, log=logs / "train-large-reference.err")
        results["offload"] = run_child("train", {**spec, "engine": "offload", "nvme_dir": directory},
                                       rss_limit=rss_limit, timeout=args.timeout, mmap_threshold=mmap,
                                       log=logs / "train-large-offload.err")
        fio.append(measure_fio(directory, spec["fio_size"], args.block_size, args.queue_depth))
        if args.deepspeed:
            results["deepspeed"] = run_child("train", {**spec, "engine": "deepspeed", "nvme_dir": directory},
                                             rss_limit=rss_limit, timeout=args.timeout, mmap_threshold=mmap,
                                             log=logs / "train-large-deepspeed.err")
        left = sorted(os.listdir(directory))
    beside = [f for run in (results.get("offload", {}), results.get("deepspeed", {}))
              for f in [run.get("fio_before_steps")] + [r.get("fio_after") for r in run.get("steps", [])] if f]
    fio += beside
    results["fio"] = {"runs": fio, "read": max(f["read"] for f in fio), "write": max(f["write"] for f in fio)}
    results["swap_files_left"] = left
    results["load_after"] = os.getloadavg()
    results["summary"] = summarize(results)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
    return results


def io_seconds_beside(run: dict, row: dict) -> float:
    """Seconds ``row``'s bytes take at fio's speed measured just before and just after it (the faster of
    each)."""
    index = run["steps"].index(row)
    around = [run["steps"][index - 1]["fio_after"] if index else run["fio_before_steps"], row["fio_after"]]
    return (row["read"] / max(f["read"] for f in around) + row["written"] / max(f["write"] for f in around))


def steady_steps(rows: list[dict], batch: int) -> list[dict]:
    """A batch size's steps after the run's first two (or its last, if none is left): the first step has
    no update to apply (with clipping an update runs in the next forward), the second's update finds the
    optimizer state never written (both engines then read none of it)."""
    mine = [r for r in rows[2:] if r["batch"] == batch]
    return mine or [r for r in rows if r["batch"] == batch][-1:]


def summarize(results: dict) -> dict:
    """Print the summary table and the targets; return them."""
    spec, fio, state = results["spec"], results["fio"], results["state_bytes"]
    ref = results.get("reference", {})
    scale = results["params"] / ref["params"] if "params" in ref else None
    summary: dict = {}
    print(f"\nsummary: {results['params'] / 1e9:.3f} B parameters, training state {state / GB:.1f} GB; fio read "
          f"{fio['read'] / GB:.2f} GB/s, write {fio['write'] / GB:.2f} GB/s (faster of "
          f"{len(fio['runs'])} runs); load average {' '.join(f'{x:.2f}' for x in results['load_before'])} before, "
          f"{' '.join(f'{x:.2f}' for x in results['load_after'])} after")
    if "error" in ref:
        print(f"reference: FAILED: {ref['error']}")
        scale = None
    elif ref:
        print(f"reference (plain PyTorch, {spec['ref_layers']} layers, {ref['params'] / 1e9:.3f} B parameters, peak RSS "
              f"{ref['peak_rss'] / GB:.2f} GB): " + ", ".join(
                  f"batch {b} {t:.2f} s per step, x {scale:.2f} = {t * scale:.2f} s" for b, t in ref["seconds"].items()))
    for engine in ("offload", "deepspeed"):
        run = results.get(engine)
        if run is None:
            continue
        if "error" in run:
            print(f"{engine}: FAILED: {run['error']}")
            summary[engine] = {"error": run["error"]}
            if not run.get("steps"):
                continue
        s = summary.setdefault(engine, {})
        s.update({"build_s": run["build_s"], "build_rss_over": run["build_peak_rss"] - run["baseline_rss"],
                  "train_peak_rss": max(r["peak_rss"] for r in run["steps"]), "batches": {}})
        print(f"{engine}: build {run['build_s']:.1f} s, peak RSS {run['build_peak_rss'] / GB:.2f} GB, "
              f"{s['build_rss_over'] / GB:.2f} GB over the interpreter's {run['baseline_rss'] / GB:.2f} GB "
              f"(target <= {TARGET_BUILD_RSS / GB:.0f} GB: {_met(s['build_rss_over'] <= TARGET_BUILD_RSS)}); "
              f"initialize {run.get('initialize_s', float('nan')):.1f} s; close {run.get('close_s', float('nan')):.1f} s")
        print(f"{engine}: peak RSS while training {s['train_peak_rss'] / GB:.2f} GB = "
              f"{s['train_peak_rss'] / state:.1%} of the training state ({(s['train_peak_rss'] - run['baseline_rss']) / GB:.2f} "
              f"GB over the interpreter; target <= {TARGET_STATE_SHARE:.0%}: "
              f"{_met(s['train_peak_rss'] <= TARGET_STATE_SHARE * state)})")
        print(f"  {'batch':>5} {'step (s)':>9} {'fwd/bwd/step (s)':>17} {'CPU (s)':>7} {'read GB':>8} {'written GB':>10} "
              f"{'param file r/w GB':>17} {'I/O beside':>10} {'fastest':>8} {'compute (s)':>11} {'step / bound':>12} "
              f"{'/ fastest':>9} "
              f"{'loss first -> last':>20}  targets")
        for batch in spec["batches"]:
            rows = steady_steps(run["steps"], batch)
            if not rows:
                continue
            step = statistics.median(r["seconds"] for r in rows)
            phases = "/".join(f"{statistics.median(r[k] for r in rows):.1f}" for k in ("forward_s", "backward_s", "step_s"))
            cpu = statistics.median(r["cpu_s"] for r in rows)
            read = statistics.median(r["read"] for r in rows)
            written = statistics.median(r["written"] for r in rows)
            io_s = read / fio["read"] + written / fio["write"]
            compute = ref["seconds"][str(batch)] * scale if scale else None
            strict = max(io_s, compute or 0.0)
            beside = [io_seconds_beside(run, r) for r in rows]
            io_beside = statistics.median(beside)
            ratio = statistics.median(r["seconds"] / max(io, compute or 0.0) for r, io in zip(rows, beside))
            param = ((statistics.median(r["param_read"] for r in rows), statistics.median(r["param_written"] for r in rows))
                     if "param_read" in rows[0] else None)
            losses = [r["loss"] for r in run["steps"] if r["batch"] == batch]
            b = s["batches"][batch] = {"step_s": step, "phases": phases, "cpu_s": cpu, "read": read, "written": written, "param_file": param,
                                       "io_at_fio_s": io_s, "io_beside_s": io_beside, "compute_s": compute,
                                       "ratio": ratio, "ratio_strict": step / strict, "losses": losses,
                                       "step_met": ratio <= TARGET_STEP_RATIO,
                                       "step_met_strict": step <= TARGET_STEP_RATIO * strict,
                                       "loss_met": len(losses) > 1 and losses[-1] < losses[0],
                                       "disk_busy": {k: statistics.median(r[k] for r in rows) if rows[0].get(k) is not None
                                                     else None for k in ("disk_busy", "disk_busy_forward",
                                                                         "disk_busy_backward")}}
            param_s = f"{param[0] / GB:.2f} / {param[1] / GB:.2f}" if param else "-"
            print(f"  {batch:>5} {step:>9.2f} {phases:>17} {cpu:>7.1f} {read / GB:>8.2f} {written / GB:>10.2f} "
                  f"{param_s:>17} {io_beside:>10.2f} {io_s:>8.2f} "
                  f"{compute if compute is not None else float('nan'):>11.2f} {ratio:>12.2f} {b['ratio_strict']:>9.2f} "
                  f"{losses[0]:>9.4f} -> {losses[-1]:<8.4f}  step <= {TARGET_STEP_RATIO} x bound: {_met(b['step_met'])} "
                  f"(against the run's fastest fio: {_met(b['step_met_strict'])}); loss down: {_met(b['loss_met'])}")
            busy = b["disk_busy"]
            if busy["disk_busy"] is not None:
                print(f"  {'':>5} disk busy {busy['disk_busy']:.0%} of the step (forward {busy['disk_busy_forward']:.0%}, "
                      f"backward {busy['disk_busy_backward']:.0%})")
    if results["swap_files_left"]:
        print(f"left in the swap directory: {results['swap_files_left']}")
    return summary


def _met(ok: bool | None) -> str:
    return "no bound measured" if ok is None else "met" if ok else "NOT met"


if __name__ == "__main__":
    main()
