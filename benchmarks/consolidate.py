"""Benchmark: offline consolidation of a training checkpoint into from_pretrained weights, beside fio.

    python -m benchmarks.consolidate --dir /work/bench-consolidate --out consolidate.json    # 3.1 B GPT-2
    python -m benchmarks.consolidate --dir /tmp/x --scale tiny --fio-size 16MiB              # as the test runs it
    python -m benchmarks.consolidate --dir /work/x --layers 3   # 3.1 B's tensors, 3 of its 26 layers

1. Writes a checkpoint in the layout `Engine.save_checkpoint` writes: at ``--scale 3b`` the 3.1 B
   GPT-2 of README.md (26 layers, hidden 3072, vocab 50257; fp32: 12.4 GB of parameter partitions)
   by writing its rank files directly, tensor by tensor (the engine at this size takes hours here);
   its optimizer file holds the real header with its data left sparse (fp32 consolidation does not
   read it; 24.8 GB that the disk need not hold). At ``--scale tiny`` the engine itself trains a
   tiny GPT-2 and saves it, and the consolidated weights are checked against the engine's logits
   through ``from_pretrained``.
2. Before each run, fio's O_DIRECT sequential write and read, and reads mixed half and half with
   writes, in the same directory on as many bytes as the checkpoint's parameter files hold
   (``--fio-size`` to change it), with the reader's settings (8 MiB blocks, 8 in flight): the disk's
   speed swings within minutes, so each run's ratio is to the fio runs just before it, and the
   median ratio is reported.
3. ``--runs`` consolidations (``convert_zero_checkpoint_to_fp32_state_dict``, as
   ``python -m offload.checkpoint consolidate`` runs it), each in a fresh process with its peak RSS
   (the kernel's high-water mark), the output removed between runs.
4. Checks the output: every tensor's shape, and at 3b a sample of tensors byte for byte against the
   partitions they came from; at tiny, from_pretrained's logits equal the engine's.
5. Prints the figures and the targets: peak RSS < 2 GB; read speed (checkpoint bytes read / time)
   >= 0.8x fio's sequential read of as many bytes. Consolidation also writes as many bytes as it
   reads; fio's read speed while it writes as much (the half-and-half job: a copy's floor on one
   disk) is printed beside.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch

GB = 1e9
TARGET_RSS = 2 * GB
TARGET_RATIO = 0.8
SCALES = {"3b": {"n_layer": 26, "n_embd": 3072, "n_head": 24, "vocab_size": 50257, "n_positions": 1024},
          "tiny": {"n_layer": 2, "n_embd": 64, "n_head": 2, "vocab_size": 256, "n_positions": 32, "bos_token_id": 0,
                   "eos_token_id": 0}}
TAG = "global_step1"
_TILE = 1 << 24
"""Elements of the random block each written tensor repeats (the values do not change the speed)."""


def gpt2_config(scale: str, layers: int | None = None):
    """GPT-2 at ``scale``, with ``layers`` decoder layers instead of the scale's when given."""
    import transformers

    return transformers.GPT2Config(**{**SCALES[scale], **({"n_layer": layers} if layers else {})})


def write_checkpoint(save_dir: Path, scale: str, world_size: int, layers: int | None = None) -> int:
    """Write a checkpoint of GPT-2 at ``scale`` (``layers`` decoder layers if given) into ``save_dir``
    as the engine lays it out; return the bytes of its parameter files. Rank files, states,
    config.json and ``latest``."""
    import transformers

    from offload.params.partition import partition_bounds, partition_numel
    from offload.storage import SafetensorsWriter
    from offload.storage.safetensors_writer import DirectSafetensorsWriter
    from tensorio import AioHandle
    from offload.train.checkpoint.rank_state import model_config
    from offload.train.checkpoint.files import RANK_FILE_ALIGN, optimizer_file, params_file, states_file

    config = gpt2_config(scale, layers)
    with torch.device("meta"):
        model = transformers.GPT2LMHeadModel(config)
    seen, params = set(), []
    names = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    for name, p in model.named_parameters():
        if id(p) not in seen:
            seen.add(id(p))
            params.append((name, names[id(p)], tuple(p.shape), p.numel()))
    tag_dir = save_dir / TAG
    tag_dir.mkdir(parents=True)
    tile = torch.randn(_TILE, generator=torch.Generator().manual_seed(0)) * 0.02
    written = 0
    for rank in range(world_size):
        layout = {name: (torch.float32, (partition_numel(numel, world_size),)) for name, _, _, numel in params}
        with AioHandle(block_size=8 << 20, queue_depth=8) as handle, \
                DirectSafetensorsWriter(tag_dir / params_file(rank), layout, None, handle,
                                        data_align=RANK_FILE_ALIGN) as out:
            for index, (name, _, _, numel) in enumerate(params):
                start, end = partition_bounds(numel, world_size, rank)
                for first in range(start, min(end, numel), _TILE):
                    count = min(_TILE, min(end, numel) - first)
                    out.write(name, _values(index, first, count, tile))
                if end > numel:  # the last partitions' padding
                    out.write(name, torch.zeros(end - max(start, numel)))
        written += os.path.getsize(tag_dir / params_file(rank))
        moments = {f"{i}.{key}": (torch.float32, (partition_numel(numel, world_size),))
                   for i, (_, _, _, numel) in enumerate(params) for key in ("exp_avg", "exp_avg_sq")}
        SafetensorsWriter(tag_dir / optimizer_file(rank), moments, data_align=RANK_FILE_ALIGN).close()  # header only: the data stays sparse
        # Format 1 without checksums (as saved before they were recorded): consolidated unverified, one warning.
        state = {"format": 1, "global_steps": 1, "micro_steps": 1, "skipped_steps": 0, "world_size": world_size,
                 "loss_scaler": None, "lr_scheduler": None, "client_state": {},
                 "optimizer": {"steps": {str(i): 1.0 for i in range(len(params))},
                               "param_groups": [{"lr": 1e-4, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0,
                                                 "amsgrad": False, "params": list(range(len(params)))}]},
                 "parameters": [{"name": name, "names": all_names, "shape": list(shape), "dtype": "float32",
                                 "optimizer_index": i} for i, (name, all_names, shape, _) in enumerate(params)]}
        (tag_dir / states_file(rank)).write_text(json.dumps(state))
    (tag_dir / "config.json").write_text(json.dumps(model_config(model)))
    (save_dir / "latest").write_text(TAG)
    return written


def _values(index: int, first: int, count: int, tile: torch.Tensor) -> torch.Tensor:
    """Elements [first, first + count) of parameter ``index``: the tile, shifted per parameter."""
    offset = (first + index * 7919) % _TILE
    if offset + count <= _TILE:
        return tile[offset:offset + count]
    return torch.cat([tile[offset:], tile[:count - (_TILE - offset)]])


def train_tiny(save_dir: Path, swap: Path) -> torch.Tensor:
    """Train a tiny GPT-2 with the engine for 2 steps, save it to ``save_dir``; return its logits on a batch."""
    import transformers

    from offload.train.engine import initialize

    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(gpt2_config("tiny"))
    zero = {"stage": 3, "stage3_param_persistence_threshold": 0,
            "offload_param": {"device": "nvme", "nvme_path": str(swap), "max_in_cpu": 0, "buffer_size": 65536},
            "offload_optimizer": {"device": "nvme", "nvme_path": str(swap)}}
    engine, *_ = initialize(model=model, config={"train_micro_batch_size_per_gpu": 2, "zero_optimization": zero,
                                                 "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
                                                 "gradient_clipping": 0.0})  # as the recorded figures ran
    batch = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    for _ in range(2):
        engine.backward(engine(batch, labels=batch).loss)
        engine.step()
    engine.save_checkpoint(save_dir, tag=TAG)
    engine.eval()
    with torch.no_grad():
        logits = engine(batch).logits
    engine.close()
    return logits


def child(args: argparse.Namespace) -> None:
    """One consolidation in this (fresh) process; prints its figures as one JSON line."""
    from benchmarks._common import RssSampler
    from offload.train.checkpoint.consolidate import convert_zero_checkpoint_to_fp32_state_dict

    with RssSampler(kernel_peak=True) as rss:
        start = time.perf_counter()
        convert_zero_checkpoint_to_fp32_state_dict(args.child, args.output, max_shard_size=args.max_shard_size,
                                                   safe_serialization=True)
        seconds = time.perf_counter() - start
    print(json.dumps({"seconds": seconds, "peak_rss": rss.peak}))


def fio_speeds(directory: Path, size: int) -> dict[str, float]:
    """fio's O_DIRECT sequential speeds (bytes/s) on ``size`` bytes with the reader's settings, one
    file laid out once: "write", "read", and "mix_read" / "mix_write", reads and writes half and
    half at once (what a copy on one disk asks of it). A job fio cannot run is left out."""
    from bench.fio import FILE_PREFIX, FioError, FioJob, run_fio

    out = {}
    filename = directory / f"{FILE_PREFIX}consolidate-{os.getpid()}.dat"
    try:
        for rw in ("write", "read", "rw"):
            try:
                result = run_fio(FioJob(directory=directory, rw=rw, size=size, block_size=8 << 20, queue_depth=8,
                                        overwrite=rw != "read"), filename=filename)
            except FioError as error:
                print(f"fio {rw}: not measured ({error})")
                continue
            if rw == "rw":
                out.update(mix_read=result.bw_bytes, mix_write=result.mix_write_bw_bytes)
            else:
                out[rw] = result.bw_bytes
    finally:
        filename.unlink(missing_ok=True)
    return out


def check_output(output: Path, save_dir: Path, scale: str, logits: torch.Tensor | None) -> str:
    """Check the consolidated weights; return what was checked. Raises AssertionError."""
    from safetensors import safe_open

    from offload.train.checkpoint.reader import CheckpointReader

    index = output / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else ["model.safetensors"]
    with CheckpointReader(save_dir / TAG) as reader:
        shapes = {p["name"]: p["shape"] for p in reader.state["parameters"]}
        found = {}
        for file in files:
            with safe_open(output / file, framework="pt") as f:
                assert f.metadata() == {"format": "pt"}
                for name in f.keys():
                    found[name] = (file, list(f.get_slice(name).get_shape()))
        assert {n: s for n, (_, s) in found.items()} == shapes, "names or shapes differ"
        sample = list(shapes)[:: max(1, len(shapes) // 6)]
        for name in sample:  # byte for byte against the partitions
            numel = math.prod(shapes[name])
            expected = reader.read("params", name, 0, numel, numel=numel).result()
            with safe_open(output / found[name][0], framework="pt") as f:
                assert torch.equal(f.get_tensor(name).reshape(-1), expected), name
    what = f"{len(found)} tensors' names and shapes, {len(sample)} tensors byte for byte"
    if logits is not None:
        import transformers

        model = transformers.AutoModelForCausalLM.from_pretrained(output).eval()
        batch = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            assert torch.equal(model(batch).logits, logits), "from_pretrained's logits differ from the engine's"
        what += ", from_pretrained's logits equal the engine's"
    return what


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", required=True, help="scratch directory on the disk (removed afterwards unless --keep)")
    ap.add_argument("--scale", choices=sorted(SCALES), default="3b")
    ap.add_argument("--world-size", type=int, default=1, help="ranks the 3b checkpoint is written for")
    ap.add_argument("--layers", type=int, help="decoder layers of the 3b model instead of 26 (its tensors, the largest "
                                               "included, keep their sizes)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--fio-size", help="bytes each fio job moves (default: the checkpoint's parameter bytes)")
    ap.add_argument("--max-shard-size", default="5GB")
    ap.add_argument("--keep", action="store_true", help="keep the checkpoint and output")
    ap.add_argument("--out", help="write the figures as JSON here")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--output", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        child(args)
        return {}
    from benchmarks._common import run_child
    from tensorio import parse_size

    root = Path(args.dir)
    root.mkdir(parents=True, exist_ok=True)
    save_dir, output = root / "checkpoint", root / "consolidated"
    shutil.rmtree(save_dir, ignore_errors=True)
    try:
        start = time.perf_counter()
        logits = None
        if args.scale == "tiny":
            logits = train_tiny(save_dir, root)
        else:
            write_checkpoint(save_dir, args.scale, args.world_size, args.layers)
        source = sum(os.path.getsize(save_dir / TAG / f) for f in os.listdir(save_dir / TAG)
                     if f.endswith("_params.safetensors"))
        print(f"checkpoint: {save_dir / TAG} ({source / GB:.2f} GB of parameter partitions, {args.world_size if args.scale != 'tiny' else 1} "
              f"rank(s)) ready in {time.perf_counter() - start:.1f} s")
        fio_size = (parse_size(args.fio_size) if args.fio_size else source) // (8 << 20) * (8 << 20) or (8 << 20)
        runs = []
        for run in range(args.runs):  # fio right before each run: the disk's speed swings within minutes
            shutil.rmtree(output, ignore_errors=True)
            fio = fio_speeds(root, fio_size)
            figures = run_child("benchmarks.consolidate", ["--dir", str(root), "--child", str(save_dir), "--output",
                                                           str(output), "--max-shard-size", args.max_shard_size])
            figures.update(read_bps=source / figures["seconds"], fio_read_bps=fio.get("read"),
                           fio_write_bps=fio.get("write"), fio_mix_read_bps=fio.get("mix_read"),
                           fio_mix_write_bps=fio.get("mix_write"))
            runs.append(figures)
            print(f"run {run + 1}: {figures['seconds']:.1f} s, {figures['read_bps'] / GB:.3f} GB/s read, "
                  f"peak RSS {figures['peak_rss'] / GB:.2f} GB; fio just before ({fio_size / GB:.2f} GB a job): read "
                  f"{(fio.get('read') or 0) / GB:.3f} GB/s, write {(fio.get('write') or 0) / GB:.3f} GB/s, "
                  f"half and half {(fio.get('mix_read') or 0) / GB:.3f} GB/s read while writing "
                  f"{(fio.get('mix_write') or 0) / GB:.3f} GB/s")
        checked = check_output(output, save_dir, args.scale, logits)
        print(f"checked: {checked}")
    finally:
        if not args.keep:
            shutil.rmtree(save_dir, ignore_errors=True)
            shutil.rmtree(output, ignore_errors=True)
    measured = [r for r in runs if r["fio_read_bps"] and r["fio_mix_read_bps"]]
    read = statistics.median(r["fio_read_bps"] for r in measured) if measured else None
    write = statistics.median(r["fio_write_bps"] for r in measured) if measured else None
    mix_read = statistics.median(r["fio_mix_read_bps"] for r in measured) if measured else None
    speed = statistics.median(r["read_bps"] for r in runs)
    peak = max(r["peak_rss"] for r in runs)
    result = {"scale": args.scale, "layers": args.layers, "source_bytes": source, "runs": runs, "median_read_bps": speed, "peak_rss": peak,
              "fio_read_bps": read, "fio_write_bps": write, "fio_mix_read_bps": mix_read, "checked": checked,
              "command": "python -m benchmarks.consolidate " + " ".join(argv if argv is not None else sys.argv[1:])}
    print(f"peak RSS {peak / GB:.2f} GB (target < {TARGET_RSS / GB:.0f} GB): {'met' if peak < TARGET_RSS else 'NOT met'}")
    if measured:
        ratio = statistics.median(r["read_bps"] / r["fio_read_bps"] for r in measured)
        mix_ratio = statistics.median(r["read_bps"] / r["fio_mix_read_bps"] for r in measured)
        result.update(ratio_to_fio_read=ratio, ratio_to_fio_mix_read=mix_ratio)
        print(f"read speed {speed / GB:.3f} GB/s; median of the runs' ratios to fio's read just before: {ratio:.2f}x "
              f"(target >= {TARGET_RATIO}x): {'met' if ratio >= TARGET_RATIO else 'NOT met'}; to fio's read while it "
              f"writes as much (a copy's floor on one disk): {mix_ratio:.2f}x")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
