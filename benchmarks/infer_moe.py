"""Benchmark: a mixture-of-experts model from NVMe, only the experts the router picks read, beside
whole-layer streaming of the same model, the disk (fio) and Accelerate.

    python -m benchmarks.infer_moe --dir /work/bench-moe            # the 6.3 GB Mixtral-shaped model
    python -m benchmarks.infer_moe --dir /tmp/x --layers 2 --hidden 128 --intermediate 256 --vocab 512 \\
        --accelerate none --fio-size 16MiB                          # tiny, as the test runs it

1. Writes, once, a random Mixtral-shaped checkpoint with one tensor per expert, as checkpoints on the Hub are
   (hidden 1024, intermediate 3584, 8 experts, top 2, 34 layers, 16 heads, 4 KV heads, vocab 32000, bf16:
   6.3 GB), one tensor at a time, each shard dropped from the page cache once written.
2. Measures fio's O_DIRECT sequential read speed on the same disk, with the engine's aio settings.
3. Runs, each in a fresh process with the checkpoint's pages dropped: ours with ``experts: "routed"`` (the
   default) at batch 1 and at ``--big-batch``, and ``experts: "whole"`` (every expert streamed with its layer,
   as Accelerate and ZeRO-Inference read) at batch 1, all at ``--fraction`` of the checkpoint's bytes. Each
   decodes ``--new-tokens`` tokens after a warm-up generate on another prompt; the figures are the decode's
   (counted before each forward: the prefill's left out). Bytes read per token (the engine's own count), the
   bytes that were needed (the streamed layers' + the picked experts'), and the experts' counts (picked,
   found in the cache, guessed, guessed right).
4. Accelerate (``from_pretrained(device_map="auto")`` with disk offload) and ours, each in a memory cgroup of
   the same budget + its own overhead (benchmarks/_peers.py's "equal" row; ours "auto" in it).
5. Prints the targets (issue 48): bytes per token <= 1.15 x the needed bytes; s/token <= 1.2 x (bytes per
   token / fio); routed >= 2.2 x whole's tokens/s; >= 2.5 x Accelerate's at equal memory.

``--quantize int4|int8``: our three runs with ``weight_quantization`` (the experts packed per expert, the
quantized cache written once under ``--dir``, by the first run); the budget stays the fraction of the bf16
checkpoint's bytes, and the Accelerate comparison (step 4) stays in bf16.

``--device cuda|simulated`` (issue 48's GPU target): our runs compute on that device with ``max_memory={0:
--device-budget, "cpu": the fraction's bytes}``: the device keeps the most used experts, pinned host memory
the next, the rest are read from NVMe when picked (offload/infer/experts/device.py). The default device
budget holds every unit but the experts, the KV cache and activations of the largest run, the experts' copy
slots and ``--device-experts`` of the experts (a quarter), measured on a CPU engine that routes them. Each run
adds the plan's experts per tier, the device tier's counters per token (hits there, copies and their bytes,
kept, demoted, dropped, staged ahead and used) and whether its tokens equal transformers' on the same device
(its model loaded there, once, in a process of its own; on ``simulated`` on the CPU, the simulated device's
stand-in). Accelerate is not run (benchmarks.gpu infer compares with it on a GPU). Without CUDA ``--device
cuda`` refuses; ``simulated`` runs tiny sizes only, and its times are not GPU figures.

    python -m benchmarks.infer_moe --dir /nvme/bench-moe --device cuda --layers 16 --new-tokens 8 \\
        --fio-size 1GiB                                             # 3.03 GB: scripts/gpu_check.sh --parts moe
    python -m benchmarks.infer_moe --dir /tmp/x --device simulated --layers 4 --hidden 128 --intermediate 256 \\
        --vocab 512 --fio-size 16MiB --new-tokens 3 --runs routed,big --big-batch 2   # tiny, as the test runs it
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from benchmarks._common import ChildError, run_child
from benchmarks._page_cache import _files
from benchmarks._peers import PeerRunner
from benchmarks.infer_stream import _Clock, _make_cold, fio_read_speed

MARKER = "bench-moe-checkpoint.json"


@dataclass(frozen=True)
class MoESpec:
    """The random Mixtral-shaped model written for the benchmark."""

    hidden: int = 1024
    intermediate: int = 3584
    experts: int = 8
    top_k: int = 2
    layers: int = 34
    heads: int = 16
    kv_heads: int = 4
    vocab: int = 32000
    shards: int = 24
    seed: int = 0
    scaled_residual: bool = True
    """The projections that write to the residual stream (``o_proj``, the experts' ``w2``) drawn with std
    0.02 / sqrt(2 x layers), as GPT-2 and Megatron initialise them, so that each layer changes the residual
    stream by a share of it as in trained models (0.02 everywhere makes every layer rewrite it: the next
    layer's router, applied early, then guesses no better than chance)."""

    def nbytes(self) -> int:
        """The bf16 checkpoint's tensor bytes."""
        return sum(int(np.prod(shape)) * 2 for _, shape in self.tensors())

    def config(self):
        import transformers

        return transformers.MixtralConfig(
            hidden_size=self.hidden, intermediate_size=self.intermediate, num_local_experts=self.experts,
            num_experts_per_tok=self.top_k, num_hidden_layers=self.layers, num_attention_heads=self.heads,
            num_key_value_heads=self.kv_heads, vocab_size=self.vocab, max_position_embeddings=4096,
            tie_word_embeddings=False, dtype="bfloat16", bos_token_id=1, eos_token_id=2)

    def tensors(self) -> list[tuple[str, tuple[int, ...]]]:
        """The checkpoint's tensors as Mixtral checkpoints name them (one per expert), in forward order."""
        h, i, head = self.hidden, self.intermediate, self.hidden // self.heads
        out = [("model.embed_tokens.weight", (self.vocab, h))]
        for n in range(self.layers):
            p = f"model.layers.{n}"
            out += [(f"{p}.input_layernorm.weight", (h,)), (f"{p}.post_attention_layernorm.weight", (h,)),
                    (f"{p}.self_attn.q_proj.weight", (h, h)), (f"{p}.self_attn.k_proj.weight", (self.kv_heads * head, h)),
                    (f"{p}.self_attn.v_proj.weight", (self.kv_heads * head, h)), (f"{p}.self_attn.o_proj.weight", (h, h)),
                    (f"{p}.block_sparse_moe.gate.weight", (self.experts, h))]
            for e in range(self.experts):
                q = f"{p}.block_sparse_moe.experts.{e}"
                out += [(f"{q}.w1.weight", (i, h)), (f"{q}.w2.weight", (h, i)), (f"{q}.w3.weight", (i, h))]
        return out + [("model.norm.weight", (h,)), ("lm_head.weight", (self.vocab, h))]


def write_checkpoint(directory: Path, spec: MoESpec) -> Path:
    """Write ``spec``'s random bf16 checkpoint to ``directory`` once (reused when its marker matches)."""
    import torch

    from offload.infer.weights.convert import drop_page_cache
    from offload.storage.safetensors_writer import atomic_safetensors

    marker = directory / MARKER
    if marker.is_file() and json.loads(marker.read_text()) == asdict(spec):
        return directory
    directory.mkdir(parents=True, exist_ok=True)
    tensors = spec.tensors()
    total = spec.nbytes()
    shards: dict[int, list] = {}
    offset = 0
    for name, shape in tensors:
        shards.setdefault(offset * spec.shards // total, []).append((name, shape))
        offset += int(np.prod(shape)) * 2
    generator = torch.Generator().manual_seed(spec.seed)
    weight_map = {}
    groups = list(shards.values())
    for number, members in enumerate(groups, 1):
        file = f"model-{number:05d}-of-{len(groups):05d}.safetensors"
        members = sorted(members)
        with atomic_safetensors(directory / file, {n: (torch.bfloat16, s) for n, s in members}, {"format": "pt"}) as out:
            for name, shape in members:
                std = 0.02 / (2 * spec.layers) ** 0.5 if spec.scaled_residual and name.endswith(
                    ("o_proj.weight", "w2.weight")) else 0.02
                value = (torch.ones(shape, dtype=torch.bfloat16) if name.endswith("norm.weight")
                         else torch.empty(shape, dtype=torch.bfloat16).normal_(0.0, std, generator=generator))
                out.write(name, value)
        drop_page_cache(directory / file)
        weight_map.update({name: file for name, _ in members})
    (directory / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    spec.config().save_pretrained(directory)
    marker.write_text(json.dumps(asdict(spec)))
    return directory


# ---- one run of ours, in a fresh process -----------------------------------------------------------------


def _snapshot(engine) -> dict:
    store = engine.experts
    counts = dataclasses.asdict(store.counts) if store is not None else {}
    if store is not None and store.device is not None:  # the device tier's counters, "device_" before each
        counts.update({f"device_{k}": v for k, v in dataclasses.asdict(store.device.counts).items()})
    return {"io": engine.io_bytes(), **counts}


def _delta(after: dict, before: dict) -> dict:
    return {k: after[k] - before.get(k, 0) for k in after}


def _prompts(args: dict, batch: int):
    """The measured prompt and the warm-up's (seeds 0 and 1), on the CPU: the same for ours and transformers."""
    import torch

    return tuple(torch.randint(3, args["vocab"], (batch, args["prompt_tokens"]),
                               generator=torch.Generator().manual_seed(seed)) for seed in (0, 1))


def _memory(args: dict) -> dict:
    """The engine's budget settings: ``max_in_cpu`` on the CPU (named: "auto" would pick a GPU where there is
    one), else ``max_memory`` {0: device, "cpu": host}."""
    if args.get("device", "cpu") == "cpu":
        return {"compute_device": "cpu", "max_in_cpu": f"{args['budget']}B"}
    return {"compute_device": args["device"], "max_memory": {0: args["device_budget"], "cpu": args["budget"]}}


def child(args: dict) -> dict:
    """Ours: load at ``args["budget"]`` with ``args["experts"]`` (on ``args["device"]`` with its budget), warm up
    on another prompt, then a generate of ``new_tokens`` whose forwards are each counted: the decode's figures
    per token (the prefill's forward left out). ``args["kind"]`` "transformers": `transformers_tokens`."""
    import torch

    from offload.infer import init_inference

    if args.get("kind") == "transformers":
        return transformers_tokens(args)
    ids, warm = _prompts(args, args["batch"])
    mask = torch.ones_like(ids)
    quantized = {"weight_quantization": args["quantize"], "nvme_path": args["nvme_path"]} if args.get("quantize") else {}
    with init_inference(args["checkpoint"], disk_gbps=args["disk_gbps"], experts=args["experts"], **_memory(args),
                        **quantized) as engine:
        engine.generate(warm, attention_mask=torch.ones_like(warm), max_new_tokens=2, do_sample=False,
                        pad_token_id=0)  # another prompt
        engine.wait_loaded()
        snapshots = []  # before each forward of the measured generate: its reads and counts so far
        engine.module.register_forward_pre_hook(lambda *_: snapshots.append(_snapshot(engine)))
        clock = _Clock()
        out = engine.generate(ids, attention_mask=mask, max_new_tokens=args["new_tokens"], do_sample=False,
                              pad_token_id=0, min_new_tokens=args["new_tokens"], streamer=clock)
        snapshots.append(_snapshot(engine))
        steps = len(snapshots) - 2  # the decode's forwards: all but the prefill's
        per = {k: v / steps for k, v in _delta(snapshots[-1], snapshots[1]).items()}
        plan = engine.plan
        streamed = sum(u.read_nbytes for u in plan.streamed)
        expert_read = plan.experts.expert_read_nbytes if plan.experts is not None else 0
        result = {"experts": args["experts"], "batch": args["batch"], "budget": args["budget"],
                  "quantize": args.get("quantize"), "device": args.get("device", "cpu"),
                  "s_per_token": float(np.median(np.diff(np.array(clock.times)))), "per_token": per,
                  "needed_bytes_per_token": streamed + per.get("picked", 0) * expert_read,
                  "streamed_layer_bytes": streamed, "expert_read_nbytes": expert_read, "plan": plan.describe(),
                  "tokens": out.cpu().tolist()}
        if args.get("device", "cpu") != "cpu":
            tier = engine.experts.device if engine.experts is not None else None
            result.update(device_budget=args["device_budget"], tiers=_tiers(plan.experts),
                          device_counts=dataclasses.asdict(tier.counts) if tier is not None else None,
                          device_kept_now=len(tier.kept) if tier is not None else 0)
        return result


def _tiers(experts) -> dict | None:
    """The plan's experts per tier (None: no expert routed, e.g. ``experts: "whole"``)."""
    if experts is None:
        return None
    return {"experts": experts.experts, "on_device": experts.on_device, "in_host_memory": experts.in_host_memory,
            "streamed": experts.streamed}


def transformers_tokens(args: dict) -> dict:
    """transformers' greedy tokens for each of ``args["batches"]`` (the prompts ours measures), its bf16 model
    loaded on ``args["device"]`` (the CPU for "simulated", its stand-in), ``min_new_tokens`` as ours."""
    import torch
    import transformers

    on = "cuda" if args["device"] == "cuda" else "cpu"
    start = time.perf_counter()
    model = transformers.AutoModelForCausalLM.from_pretrained(args["checkpoint"], dtype=torch.bfloat16).to(on).eval()
    load_s = time.perf_counter() - start
    tokens = {}
    with torch.no_grad():
        for batch in args["batches"]:
            ids, _ = _prompts(args, batch)
            out = model.generate(ids.to(on), attention_mask=torch.ones_like(ids).to(on), max_new_tokens=args["new_tokens"],
                                 min_new_tokens=args["new_tokens"], do_sample=False, pad_token_id=0)
            tokens[str(batch)] = out.cpu().tolist()
    return {"kind": "transformers", "on": on, "load_s": load_s, "tokens": tokens}


def device_budget_for(checkpoint: Path, share: float, *, batch: int, tokens: int, settings: dict) -> dict:
    """The device budget that holds every unit but the experts (each as the device's buffer), the KV cache and
    activations of ``batch`` x ``tokens`` (the prefill's, the last position's logits), the experts' copy slots
    and ``share`` of the experts (at least one), packed as the device keeps them: {"budget", "keep", "experts",
    "packed"}. Measured on a CPU engine that routes every decoder layer's experts (its units are the device's
    without them), so ``settings`` (quantization) must be the runs'."""
    from offload.infer import init_inference
    from offload.infer.experts.device import ExpertLayout

    with init_inference(checkpoint, compute_device="cpu", max_in_cpu=0, disk_gbps=1.0, **settings) as probe:
        if probe.experts is None:
            raise SystemExit(f"benchmarks.infer_moe: {checkpoint}: no expert is routed on a CPU engine that streams "
                             f"every layer; pass --device-budget")
        layers = probe.experts.layers
        packed = max(ExpertLayout.of(layer).nbytes for layer in layers)
        count = sum(layer.count for layer in layers)
        slots = probe.settings.buffer_count * max(layer.top_k for layer in layers) * packed
        fixed = (sum(u.buffer_nbytes for u in probe.units) + probe.kv_bytes(batch, tokens) + slots
                 + probe.activation_bytes(batch, tokens, logits=1, context=tokens))
    keep = max(1, round(share * count))
    return {"budget": fixed + keep * packed, "keep": keep, "experts": count, "packed": packed}


# ---- the run ---------------------------------------------------------------------------------------------


RUNS = {"routed": ("routed", 1), "whole": ("whole", 1), "big": ("routed", None)}
"""``--runs``: our configurations, (experts, batch); "big" at ``--big-batch``."""
SIMULATED_MAX = 64 << 20
"""Checkpoint bytes the simulated device runs at most (it checks every operation: tiny sizes only)."""


def main(argv: list[str] | None = None) -> dict:
    """Run the benchmark; print each run, then the targets; return every figure. Exits saying why for
    ``--device cuda`` without CUDA, and for ``--device simulated`` at more than a tiny size."""
    from offload.device import cuda_available
    from offload.infer.config import InferenceConfig
    from tensorio import parse_size

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", help="where the checkpoint is written (once) and fio runs: the disk to measure")
    for name in ("hidden", "intermediate", "experts", "layers", "vocab"):
        ap.add_argument(f"--{name}", type=int, default=getattr(MoESpec, name))
    ap.add_argument("--fraction", type=float, default=0.25,
                    help="our (host) budget as a share of the checkpoint's bytes; with --device, max_memory['cpu']")
    ap.add_argument("--prompt-tokens", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=12)
    ap.add_argument("--big-batch", type=int, default=8)
    ap.add_argument("--runs", default=",".join(RUNS),
                    help="our configurations: routed (batch 1), whole (batch 1), big (routed at --big-batch)")
    ap.add_argument("--accelerate", default="auto", help="auto: Accelerate beside ours at equal memory (CPU only); none")
    ap.add_argument("--quantize", choices=("none", "int4", "int8"), default="none",
                    help="our runs' weight_quantization (the experts packed per expert); Accelerate's stays bf16")
    ap.add_argument("--device", choices=("cpu", "cuda", "simulated"), default="cpu",
                    help="where our runs compute: the CPU (default), cuda (refused without CUDA), or simulated (tiny "
                         "sizes only, no GPU figures)")
    ap.add_argument("--device-budget", help="with --device: max_memory[0] (e.g. 2GiB); default: room for "
                                            "--device-experts of the experts beside everything else")
    ap.add_argument("--device-experts", type=float, default=0.25,
                    help="with --device and no --device-budget: the share of the experts the device keeps")
    ap.add_argument("--fio-size", default="4GiB")
    ap.add_argument("--out", help="write every figure to this JSON file (after each run)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return {}
    if args.device == "cuda" and not cuda_available():
        import torch

        raise SystemExit(f"benchmarks.infer_moe: --device cuda needs a GPU, and CUDA is not available here (torch "
                         f"{torch.__version__}, {'a CPU build' if torch.version.cuda is None else 'no GPU visible'}); "
                         f"nothing was measured. --device simulated runs the same path at a tiny size (no GPU figures)")
    on_device = args.device != "cpu"
    if args.device_budget and not on_device:
        ap.error("--device-budget: only with --device cuda or simulated (on the CPU the budget is --fraction's)")
    chosen = args.runs.split(",")
    if unknown := [r for r in chosen if r not in RUNS]:
        ap.error(f"--runs: {', '.join(unknown)} not among {', '.join(RUNS)}")
    if not args.dir:
        ap.error("--dir is required")
    directory = Path(args.dir).resolve()
    spec = MoESpec(hidden=args.hidden, intermediate=args.intermediate, experts=args.experts, layers=args.layers,
                   vocab=args.vocab, heads=max(1, args.hidden // 64), kv_heads=max(1, args.hidden // 256))
    if args.device == "simulated" and spec.nbytes() > SIMULATED_MAX:
        raise SystemExit(f"benchmarks.infer_moe: --device simulated runs tiny sizes only: this checkpoint would be "
                         f"{spec.nbytes() / 2**20:.0f} MiB (at most {SIMULATED_MAX >> 20} MiB); shrink it with --layers, "
                         f"--hidden, --intermediate, --vocab")
    start = time.perf_counter()
    checkpoint = write_checkpoint(directory / "checkpoint", spec)
    size = sum(os.path.getsize(f) for f in _files(checkpoint) if f.endswith(".safetensors"))
    budget = int(size * args.fraction)
    quantize = None if args.quantize == "none" else args.quantize
    print(f"checkpoint: {checkpoint} ({size / 1e9:.2f} GB, {spec}; ready in {time.perf_counter() - start:.1f} s); "
          f"budget {budget / 2**30:.2f} GiB ({args.fraction:.0%}); weights {quantize or 'bf16'}")
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())} ({os.cpu_count()} CPUs)")
    fio_bps = fio_read_speed(InferenceConfig().aio, directory, args.fio_size)
    configurations = [(RUNS[r][0], RUNS[r][1] or args.big_batch) for r in chosen]
    device_budget = None
    if on_device:  # 2b. the device's budget: given, or room for a share of the experts beside the rest
        if args.device_budget:
            device_budget, how = parse_size(args.device_budget), "given"
        else:
            found = device_budget_for(checkpoint, args.device_experts, settings={"weight_quantization": quantize,
                                      "nvme_path": str(directory)} if quantize else {},
                                      batch=max(b for _, b in configurations), tokens=args.prompt_tokens + args.new_tokens)
            device_budget = found["budget"]
            how = f"room for {found['keep']} of {found['experts']} experts beside every other unit, the KV cache and slots"
        print(f"device: {args.device}, max_memory {{0: {device_budget / 2**30:.3f} GiB ({how}), 'cpu': "
              f"{budget / 2**30:.3f} GiB}}" + ("; the simulated device's times are not GPU figures" if
                                                args.device == "simulated" else ""))
        if args.accelerate == "auto":
            print("Accelerate: not run with --device (benchmarks.gpu infer compares with it on a GPU)")
    figures = {"spec": asdict(spec), "checkpoint_bytes": size, "budget": budget, "fio_bps": fio_bps, "quantize": args.quantize,
               "device": args.device, "device_budget": device_budget, "runs": [], "peers": [], "transformers": None}
    results = figures["runs"]
    for experts, batch in configurations:
        _make_cold(checkpoint, directory / "accelerate-offload")
        payload = {"checkpoint": str(checkpoint), "budget": budget, "batch": batch, "experts": experts,
                   "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens, "vocab": spec.vocab,
                   "disk_gbps": fio_bps / 1e9 if fio_bps else 1.0, "quantize": quantize, "nvme_path": str(directory),
                   "device": args.device, "device_budget": device_budget}
        try:
            result = run_child("benchmarks.infer_moe", ["--child", json.dumps(payload)])
        except ChildError as exc:
            result = {"experts": experts, "batch": batch, "error": exc.one_line()}
        results.append(result)
        _print(result, fio_bps)
        _write(figures, args.out)  # the figures so far: a time limit keeps them
    if on_device:  # 3b. transformers' tokens on the same device, once per batch
        figures["transformers"] = _compare(results, {"checkpoint": str(checkpoint), "device": args.device,
                                                     "vocab": spec.vocab, "prompt_tokens": args.prompt_tokens,
                                                     "new_tokens": args.new_tokens}, quantize)
    elif args.accelerate == "auto":
        offload_folder = directory / "accelerate-offload"
        runner = PeerRunner(lambda payload, group: run_child("benchmarks.infer_stream", ["--child", json.dumps(payload)],
                                                             cgroup=group),
                            before_each=lambda: _make_cold(checkpoint, offload_folder))
        base = {"checkpoint": str(checkpoint), "batch": 1, "prompt_tokens": args.prompt_tokens,
                "new_tokens": max(4, args.new_tokens // 3), "buffer_count": None, "aio": InferenceConfig().aio.to_dict(),
                "disk_gbps": fio_bps / 1e9 if fio_bps else None, "offload_folder": str(offload_folder)}
        figures["peers"] = runner.rows(["equal"], ["ours", "accelerate-auto"], base, budget)
    figures["targets"] = targets(results, figures["peers"], fio_bps, device=args.device,
                                 reference=figures["transformers"])
    print("\n".join(figures["targets"]))
    _write(figures, args.out)
    return figures


def _write(figures: dict, out: str | None) -> None:
    if out:
        Path(out).write_text(json.dumps(figures, indent=1))


def _compare(results: list[dict], payload: dict, quantize: str | None) -> dict:
    """transformers' tokens for each run's batch (a process of its own), and each run's ``tokens_equal``."""
    if quantize:
        return {"error": f"not compared: our runs are {quantize}, transformers' model bf16"}
    batches = sorted({r["batch"] for r in results if "error" not in r})
    if not batches:
        return {"error": "not compared: no run of ours gave tokens"}
    try:
        reference = run_child("benchmarks.infer_moe", ["--child", json.dumps({**payload, "kind": "transformers",
                                                                               "batches": batches})])
    except ChildError as exc:
        return {"error": f"transformers failed: {exc.one_line()}"}
    for r in results:
        if "error" not in r:
            r["tokens_equal"] = r["tokens"] == reference["tokens"][str(r["batch"])]
    print(f"transformers on the {reference['on']} (loaded in {reference['load_s']:.1f} s): "
          + ", ".join(f"{r['experts']} batch {r['batch']} tokens {'equal' if r['tokens_equal'] else 'DIFFER'}"
                      for r in results if "tokens_equal" in r))
    return reference


def _print(r: dict, fio_bps: float | None) -> None:
    if "error" in r:
        print(f"experts {r['experts']:>6} batch {r['batch']:>2}: FAILED, {r['error']}")
        return
    per = r["per_token"]
    line = (f"experts {r['experts']:>6} batch {r['batch']:>2}: {r['s_per_token']:.3f} s/token, "
            f"{r['batch'] / r['s_per_token']:.2f} tokens/s, {per['io'] / 2**20:.1f} MiB read per token")
    if r["experts"] == "routed":
        calls = max(per.get("calls", 0), 1e-9)
        line += (f" (needed {r['needed_bytes_per_token'] / 2**20:.1f} MiB: layers {r['streamed_layer_bytes'] / 2**20:.1f} + "
                 f"{per['picked']:.1f} picked experts; {per['picked'] / calls:.2f} picked a layer, "
                 f"{per['hits'] / max(per['picked'], 1e-9):.0%} in the cache, {per['guessed']:.1f} guessed, "
                 f"{per['guessed_used'] / max(per['guessed'], 1e-9):.0%} of them right)")
    if fio_bps:
        line += f"; disk floor {per['io'] / fio_bps:.3f} s/token"
    print(line)
    if r.get("tiers"):
        t = r["tiers"]
        print(f"    device tier: of {t['experts']} experts {t['on_device']} on the device, {t['in_host_memory']} in pinned "
              f"host memory, {t['streamed']} from NVMe; per token {per.get('device_hits', 0):.1f} hits on the device, "
              f"{per.get('device_copies', 0):.1f} copies ({per.get('device_bytes_copied', 0) / 2**20:.1f} MiB), "
              f"{per.get('device_kept', 0):.1f} kept, {per.get('device_demoted', 0):.1f} demoted, "
              f"{per.get('device_dropped', 0):.1f} dropped, {per.get('device_staged_ahead', 0):.1f} staged ahead "
              f"({per.get('device_staged_ahead_used', 0):.1f} used); {r['device_kept_now']} kept at the end")


def targets(runs: list[dict], peers: list[dict], fio_bps: float | None, *, device: str = "cpu",
            reference: dict | None = None) -> list[str]:
    """The issue's targets, one line each, with the figures they compare. With a ``device``: issue 48's GPU
    target too (each run's tokens equal transformers' there, ``reference``), and the device tier's figures;
    on the simulated device no time is judged."""
    def find(experts: str, batch: int) -> dict | None:
        return next((r for r in runs if r.get("experts") == experts and r.get("batch") == batch and "error" not in r), None)

    def verdict(ok: bool, timed: bool = True) -> str:
        if timed and device == "simulated":
            return "not judged (the simulated device's times are not GPU figures)"
        return "met" if ok else "NOT met"

    lines = []
    routed, whole = find("routed", 1), find("whole", 1)
    if routed:
        ratio = routed["per_token"]["io"] / routed["needed_bytes_per_token"]
        lines.append(f"bytes read per token {ratio:.2f}x the needed bytes (target <= 1.15): {verdict(ratio <= 1.15, False)}")
        floor = routed["per_token"]["io"] / fio_bps if fio_bps else 0
        if floor:
            lines.append(f"s/token {routed['s_per_token']:.3f} = {routed['s_per_token'] / floor:.2f}x its bytes at fio's "
                         f"speed (target <= 1.2): {verdict(routed['s_per_token'] <= 1.2 * floor)}")
    if routed and whole:
        ratio = whole["s_per_token"] / routed["s_per_token"]
        lines.append(f"routed {ratio:.2f}x whole-layer streaming's tokens/s (target >= 2.2): {verdict(ratio >= 2.2)}")
    big = find("routed", max((r.get("batch", 1) for r in runs), default=1))
    if big and big is not routed:
        per = big["per_token"]
        lines.append(f"batch {big['batch']}: {per['picked'] / max(per['calls'], 1e-9):.2f} distinct experts a layer "
                     f"per step, {per['io'] / 2**20:.1f} MiB read per step, {big['batch'] / big['s_per_token']:.2f} tokens/s")
    if device != "cpu":
        lines += _device_targets(runs, device, reference, verdict)
    ours = next((p for p in peers if p.get("kind") == "ours" and "error" not in p), None)
    acc = next((p for p in peers if p.get("kind") == "accelerate-auto" and "error" not in p), None)
    if ours and acc and ours.get("s_per_token") and acc.get("s_per_token"):
        ratio = acc["s_per_token"] / ours["s_per_token"]
        lines.append(f"{ratio:.2f}x Accelerate's tokens/s at equal memory (target >= 2.5): {verdict(ratio >= 2.5)}")
    elif peers:
        failed = [f"{p.get('kind')}: {p.get('error')}" for p in peers if "error" in p]
        lines.append(f"Accelerate at equal memory: not compared ({'; '.join(failed) or 'no figures'})")
    return lines


def _device_targets(runs: list[dict], device: str, reference: dict | None, verdict) -> list[str]:
    """Issue 48's GPU target (tokens equal transformers' on the device) and the device tier's figures."""
    on = (reference or {}).get("on", device)
    name = f"tokens equal transformers' on the {on} (issue 48: routed, the {device} device tier)"
    routed = [r for r in runs if r.get("experts") == "routed"]
    failed = [f"{r['experts']} batch {r['batch']} failed" for r in routed if "error" in r]
    each = ", ".join(f"{r['experts']} batch {r['batch']} {'equal' if r['tokens_equal'] else 'DIFFER'}"
                     for r in runs if "tokens_equal" in r)  # whole-layer streaming's shown too, not judged
    if routed and not failed and (reference is None or "error" in reference):
        lines = [f"{name}: not judged ({(reference or {}).get('error', 'transformers not run')})"]
    elif routed:  # a routed run that failed misses the target
        ok = not failed and all(r["tokens_equal"] for r in routed)
        lines = [f"{name}: {'; '.join(filter(None, [each, *failed]))}: {verdict(ok, False)}"]
    else:
        lines = [f"{name}: not judged (no routed run)"]
    for r in runs:
        if r.get("tiers"):
            t, per = r["tiers"], r["per_token"]
            lines.append(f"device tier, {r['experts']} batch {r['batch']}: {t['on_device']} of {t['experts']} experts on "
                         f"the device, {t['in_host_memory']} pinned, {t['streamed']} from NVMe; per token "
                         f"{per.get('device_hits', 0):.1f} of {per.get('picked', 0):.1f} picked found on the device, "
                         f"{per.get('device_bytes_copied', 0) / 2**20:.1f} MiB copied to it, {r['s_per_token']:.4f} s/token")
    return lines


if __name__ == "__main__":
    main()
