"""Benchmark: decode with every weight in memory (compute-bound), ours beside transformers' own model.

    python -m benchmarks.infer_resident --dir /work/bench-resident --rounds 3
    python -m benchmarks.infer_resident --dir /nvme/bench-resident --device cuda   # both sides on a GPU
    python -m benchmarks.infer_resident --dir /tmp/x --scale 0.025 --layers 2 --shards 1 --rounds 1 \\
        --new-tokens 3                                                         # tiny, as the test runs it

With the memory to hold the model, ours is transformers' model with its weights where the engine put
them: views of the buffers they were read into with O_DIRECT, at their offsets in the file. This
measures what that costs against transformers' own loading.

1. Writes, once, the random bf16 Llama of benchmarks/infer_stream.py (here by default ``--scale 0.5
   --layers 16``: hidden 2560, intermediate 6912, 2.7 GB in 4 shards), and counts the checkpoint's
   tensors that start off a 64-byte boundary in their file (safetensors aligns to 8 bytes only).
2. Runs, in alternating fresh processes, ``--rounds`` times: ours (``init_inference``, ``max_in_cpu``
   "auto", every weight loaded before the timed call) and ``transformers.AutoModelForCausalLM.
   from_pretrained`` in memory; each reports seconds per decode step (the median of the steps of
   ``--new-tokens``), its greedy tokens, and how many of its weights start on a 64-byte boundary.
3. Prints each side's median and the ratio ours / transformers (target <= 1.05).

``--device cuda`` puts both on the GPU: ours with ``max_memory={0: "auto", "cpu": "auto"}`` (every
weight on the device), transformers' model moved there; without CUDA it refuses.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np

from benchmarks._common import run_child
from benchmarks.infer_stream import Spec, _Clock, _files, model_parser, parse_or_run_child, write_checkpoint

TARGET = 1.05


def misaligned_tensors(checkpoint: Path, align: int = 64) -> tuple[int, int]:
    """(tensors of ``checkpoint`` whose bytes start off an ``align``-byte boundary in their file, tensors)."""
    from offload.storage.safetensors_reader import SafetensorsCheckpoint
    from tensorio import AioHandle

    with AioHandle() as handle:
        entries = SafetensorsCheckpoint(checkpoint, handle).entries.values()
        return sum(entry.offset % align != 0 for entry in entries), len(entries)


def child(args: dict) -> dict:
    """One side in this process: ``args["kind"]`` "ours" or "transformers"."""
    import torch
    import transformers

    checkpoint = args["checkpoint"]
    config = transformers.AutoConfig.from_pretrained(checkpoint)
    ids = torch.randint(3, config.vocab_size, (1, args["prompt_tokens"]), generator=torch.Generator().manual_seed(0))
    device = args.get("device", "cpu")
    if args["kind"] == "ours":
        from offload.infer import init_inference

        tiers = {"max_memory": {0: "auto", "cpu": "auto"}} if device == "cuda" else {"max_in_cpu": "auto"}
        model = init_inference(checkpoint, compute_device=device, **tiers)
        model.wait_loaded()
        weights = list(model.module.parameters())
        figures = {"streamed": len(model.plan.streamed)}
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16).to(device)
        weights = list(model.parameters())
        figures = {}
    ids = ids.to(device)
    clock = _Clock()
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args["new_tokens"],
                             do_sample=False, pad_token_id=0, streamer=clock)
    figures.update(kind=args["kind"], s_per_step=float(np.median(np.diff(clock.times))),
                   tokens=out[0, ids.shape[1]:].tolist(),
                   aligned=sum(p.data_ptr() % 64 == 0 for p in weights), weights=len(weights))
    if args["kind"] == "ours":
        model.close()
    return figures


def main(argv: list[str] | None = None) -> dict:
    """Run the benchmark (see the module docstring); return every figure."""
    ap = model_parser(__doc__, dir_help="checkpoint directory (written once, then reused)", scale=0.5, layers=16,
                      shards=4)
    ap.add_argument("--rounds", type=int, default=3, help="pairs of runs, ours first in each")
    ap.add_argument("--prompt-tokens", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=12)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where both sides compute")
    args = parse_or_run_child(ap, argv, child, fio_size="0")
    if args is None:
        return {}
    from offload.device import cuda_available

    if args.device == "cuda" and not cuda_available():
        raise SystemExit("benchmarks.infer_resident: --device cuda needs a GPU, and CUDA is not available here; "
                         "nothing was measured")
    spec = Spec.scaled(args.scale, args.layers, args.shards)
    checkpoint = write_checkpoint(Path(args.dir).resolve() / "checkpoint", spec)
    size = sum(os.path.getsize(f) for f in _files(checkpoint) if f.endswith(".safetensors"))
    off, total = misaligned_tensors(checkpoint)
    print(f"configuration: {spec}, bf16, {size / 1e9:.2f} GB, on the {args.device}; prompt {args.prompt_tokens} tokens, {args.new_tokens} "
          f"new; {off} of {total} tensors start off a 64-byte boundary in their file")
    payload = {"checkpoint": str(checkpoint), "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens,
               "device": args.device}
    runs: dict[str, list[dict]] = {"ours": [], "transformers": []}
    for round_ in range(args.rounds):
        for kind in runs:
            start = time.perf_counter()
            result = run_child("benchmarks.infer_resident", ["--child", json.dumps(dict(payload, kind=kind))])
            runs[kind].append(result)
            print(f"round {round_ + 1}: {kind:12s} {result['s_per_step']:.4f} s/step, {result['aligned']} of "
                  f"{result['weights']} weights on a 64-byte boundary ({time.perf_counter() - start:.0f} s in all)")
    medians = {kind: float(np.median([r["s_per_step"] for r in rs])) for kind, rs in runs.items()}
    ratio = medians["ours"] / medians["transformers"]
    same = all(r["tokens"] == runs["transformers"][0]["tokens"] for rs in runs.values() for r in rs)
    streamed = max(r["streamed"] for r in runs["ours"])
    print(f"median s/step: ours {medians['ours']:.4f}, transformers {medians['transformers']:.4f}; ours / "
          f"transformers {ratio:.3f} (target <= {TARGET}): {'met' if ratio <= TARGET else 'NOT met'}; the same "
          f"greedy tokens: {'yes' if same else 'no'}" + (f"; ours streamed {streamed} units" if streamed else ""))
    figures = {"spec": asdict(spec), "checkpoint_bytes": size, "misaligned_tensors": off, "tensors": total,
               "runs": runs, "medians": medians, "ratio": ratio, "same_tokens": same}
    if args.out:
        Path(args.out).write_text(json.dumps(figures, indent=1))
    return figures


if __name__ == "__main__":
    main()
