"""Benchmark: generation with each side's default (every weight on the GPU), traced with torch.profiler,
ours beside Accelerate, with a per-token breakdown side by side (issue 51).

    python -m benchmarks.gpu profile --dir /nvme/bench-gpu --tables OUTDIR         # a GPU machine
    python -m benchmarks.gpu profile --dir /tmp/x --tables /tmp/x --device simulated --scale 0.025 \\
        --layers 4 --shards 2 --prompt-tokens 4 --new-tokens 4                      # the smoke test's size

1. Writes, once, the random-weight bf16 Llama of benchmarks/gpu/infer.py (the same directory and shape
   reuse its checkpoint).
2. Runs each side in a fresh process with its default: ours ``init_inference(max_memory={0: "auto",
   "cpu": "auto"})``; Accelerate ``from_pretrained(device_map="auto")`` without ``max_memory`` (on the
   simulated device, which Accelerate cannot place on, plain transformers moved there, and labelled
   so). Each: one warm-up generate, a timed generate (seconds per token: the median of its decode
   steps), then the same generate with its decode steps (after the first new token) under
   torch.profiler, counting the simulated device's host synchronisations there.
3. Writes to ``--tables``: ``profile-<side>.md`` (the top 20 operators by self CPU time, and on CUDA the
   top 20 kernels by device time, per token) and ``generation-breakdown.md`` (per token, side by side:
   kernels, copies, synchronisations, host overhead: benchmarks/gpu/_trace.py), and every figure to
   ``--out``. No raw trace is kept.
4. The target (issue 51): ours' tokens/s >= 1.0x Accelerate's, judged on CUDA only.

Refuses to run without a GPU unless ``--device simulated`` (the smoke test: no GPU figure, no target
judged).
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np

from benchmarks._common import ChildError, run_child
from benchmarks.gpu import _trace
from benchmarks.infer_stream import Spec, model_parser, parse_or_run_child, write_checkpoint

TARGET_DEFAULTS = 1.0
TOP = 20


class _Steps:
    """A transformers streamer: the time of each new token; starts ``on_first`` at the first new token
    and calls ``on_end`` at the end (the decode steps after the first token are what it brackets)."""

    def __init__(self, on_first=None, on_end=None) -> None:
        self.times: list[float] = []
        self._prompt = True
        self._on_first, self._on_end = on_first, on_end

    def put(self, value) -> None:
        if self._prompt:
            self._prompt = False
            return
        self.times.append(time.perf_counter())
        if len(self.times) == 1 and self._on_first is not None:
            self._on_first()

    def end(self) -> None:
        if self._on_end is not None and self.times:
            self._on_end()


def _load(args: dict, checkpoint: Path):
    """(model, the torch device its inputs go to or None, what to close, its label) for ``args["kind"]``."""
    import torch
    import transformers

    if args["kind"] == "ours":
        from offload.infer import init_inference

        model = init_inference(checkpoint, compute_device=args["device"], max_memory={0: "auto", "cpu": "auto"})
        return model, None, model.close, "ours"
    if args["device"] == "cuda":
        model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, device_map="auto", dtype=torch.bfloat16)
        return model, model.device, lambda: None, "accelerate"
    from offload.device import SimulatedDevice  # Accelerate cannot place on it: plain transformers, moved there

    device = SimulatedDevice()
    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16).to(device.torch_device)
    return model, device.torch_device, device.close, "transformers"


def child(args: dict) -> dict:
    """One side (``args["kind"]``: "ours" or "peer") in this process: load, warm up, time, profile."""
    import contextlib

    import torch
    import transformers

    checkpoint = Path(args["checkpoint"])
    config = transformers.AutoConfig.from_pretrained(checkpoint)
    cuda = args["device"] == "cuda"
    ids = torch.randint(3, config.vocab_size, (args["batch"], args["prompt_tokens"]),
                        generator=torch.Generator().manual_seed(0))
    start = time.perf_counter()
    model, place, close, label = _load(args, checkpoint)
    load_s = time.perf_counter() - start
    if place is not None:
        ids = ids.to(place)
    mask = torch.ones_like(ids)

    def generate(tokens: int, streamer=None):
        return model.generate(ids, attention_mask=mask, max_new_tokens=tokens, do_sample=False, pad_token_id=0,
                              streamer=streamer)

    try:
        generate(2)  # 1. warm-up: kernels chosen, caches made
        timed = _Steps()  # 2. timed, not profiled
        generate(args["new_tokens"], timed)
        steps = np.diff(np.array(timed.times))
        s_per_token = float(np.median(steps)) if len(steps) else None
        # 3. profiled: the decode steps after the first new token
        prof = _trace.profiler(cuda)
        counting = contextlib.nullcontext(None)
        if args["device"] == "simulated":
            from offload.device import count_host_syncs

            counting = count_host_syncs()
        with counting as syncs:
            marks: dict = {}

            def first() -> None:
                marks["syncs"] = dict(syncs.by_cause) if syncs is not None else {}
                prof.start()

            def end() -> None:
                prof.stop()
                marks["end"] = dict(syncs.by_cause) if syncs is not None else {}

            profiled = _Steps(first, end)
            generate(args["new_tokens"], profiled)
        units = len(profiled.times) - 1
        figures = {"kind": args["kind"], "label": label, "load_s": load_s, "s_per_token": s_per_token,
                   "tokens_per_s": args["batch"] / s_per_token if s_per_token else None}
        if units < 1:
            return {**figures, "error": f"too few new tokens to profile a decode step ({len(profiled.times)})"}
        wall = profiled.times[-1] - profiled.times[0]
        during = {k: v - marks["syncs"].get(k, 0) for k, v in marks.get("end", {}).items()}
        figures["breakdown"] = _trace.breakdown(prof, wall_s=wall, units=units, cuda=cuda,
                                                host_syncs={k: v for k, v in during.items() if v})
        figures["tables"] = {"operators by self CPU time": _trace.top_rows(prof, TOP, by="cpu")}
        if cuda:
            figures["tables"]["kernels and copies by device time"] = _trace.top_rows(prof, TOP, by="device")
        figures["profiled_tokens"] = units
        if args["kind"] == "ours":
            figures["plan"] = model.plan.describe()
        return figures
    finally:
        close()


def main(argv: list[str] | None = None) -> dict:
    """Run the benchmark (see the module docstring); return every figure. Exits saying why without a GPU."""
    from offload.device import cuda_available

    ap = model_parser(__doc__, dir_help="working directory on the NVMe disk (checkpoint written once, then reused)",
                      scale=0.5, layers=44, shards=16)
    ap.add_argument("--device", choices=("cuda", "simulated"), default="cuda",
                    help="cuda (default; refused without one), or simulated: the smoke test, no GPU figures")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=16, help="new tokens per generate (at least 3)")
    ap.add_argument("--tables", default=None, help="directory for the tables (default: --out's, else --dir)")
    ap.add_argument("--peer", action=argparse.BooleanOptionalAction, default=True,
                    help="run Accelerate (plain transformers on the simulated device) beside ours")
    args = parse_or_run_child(ap, argv, child, fio_size="1GiB")
    if args is None:
        return {}
    if args.new_tokens < 3:
        ap.error(f"--new-tokens {args.new_tokens}: at least 3 (the first new token, then decode steps to profile)")
    if args.device == "cuda" and not cuda_available():
        import torch

        raise SystemExit(f"benchmarks.gpu profile: needs a GPU, and CUDA is not available here (torch "
                         f"{torch.__version__}, {'a CPU build' if torch.version.cuda is None else 'no GPU visible'}); "
                         f"nothing was measured. --device simulated runs the same path on the simulated device as a "
                         f"smoke test (no GPU figures)")
    directory = Path(args.dir).resolve()
    tables = Path(args.tables or (Path(args.out).parent if args.out else directory)).resolve()
    tables.mkdir(parents=True, exist_ok=True)
    spec = Spec.scaled(args.scale, args.layers, args.shards)
    print(f"configuration: {spec}, bf16; batch {args.batch}, prompt {args.prompt_tokens} tokens, {args.new_tokens} "
          f"new; each side's default (every weight on the {args.device} device); tables in {tables}", flush=True)
    checkpoint = write_checkpoint(directory / "checkpoint", spec)
    payload = {"checkpoint": str(checkpoint), "device": args.device, "batch": args.batch,
               "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens}
    sides: dict[str, dict] = {}
    for kind in ["ours"] + (["peer"] if args.peer else []):
        try:
            sides[kind] = run_child("benchmarks.gpu.profile", ["--child", json.dumps({**payload, "kind": kind})])
        except ChildError as exc:
            sides[kind] = {"kind": kind, "error": exc.one_line()}
        r = sides[kind]
        name = r.get("label", kind)
        if "error" in r:
            print(f"{name}: FAILED, {r['error']}", flush=True)
            continue
        print(f"{name}: {r['s_per_token']:.4f} s/token, {r['tokens_per_s']:.2f} tokens/s (loaded in "
              f"{r['load_s']:.1f} s)", flush=True)
        path = _trace.write_tables(tables / f"profile-{name}.md", f"{name}: generation with its default, per token "
                                   f"({r['profiled_tokens']} decode steps profiled, {args.device})", r["tables"],
                                   r["profiled_tokens"], "token")
        print(f"  tables: {path}")
    done = {r["label"]: r["breakdown"] for r in sides.values() if "breakdown" in r}
    breakdown_md = None
    if done:
        breakdown_md = tables / "generation-breakdown.md"
        text = _trace.side_by_side(done, "token")
        breakdown_md.write_text(f"# Generation with each side's default: per token ({args.device})\n\n{text}\n")
        print(text)
    targets = default_targets(sides, judged=args.device == "cuda")
    print("targets:\n" + "\n".join(f"  {t}" for t in targets))
    figures = {"spec": asdict(spec), "device": args.device, "sides": sides, "targets": targets,
               "breakdown_md": str(breakdown_md) if breakdown_md else None, "tables_dir": str(tables)}
    if args.out:
        Path(args.out).write_text(json.dumps(figures, indent=1))
    return figures


def default_targets(sides: dict, judged: bool) -> list[str]:
    """The target line: ours' tokens/s against the peer's with each side's default."""
    ours, peer = sides.get("ours", {}), sides.get("peer", {})
    if not ours.get("tokens_per_s"):
        return [f"each side's default: not measured (ours: {ours.get('error', 'no figure')})"]
    if not peer.get("tokens_per_s"):
        return [f"each side's default: not measured (the peer: {peer.get('error', 'not run')})"]
    ratio = ours["tokens_per_s"] / peer["tokens_per_s"]
    verdict = ("met" if ratio >= TARGET_DEFAULTS else "not met") if judged and peer.get("label") == "accelerate" else \
        "not measured (the simulated device's times are not a GPU's)"
    return [f"each side's default: ours {ratio:.2f}x {peer['label']}'s tokens/s ({ours['s_per_token']:.4f} against "
            f"{peer['s_per_token']:.4f} s/token; target >= {TARGET_DEFAULTS}x): {verdict}"]


if __name__ == "__main__":
    main()
