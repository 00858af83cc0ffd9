"""Benchmark: generation from a checkpoint larger than RAM, weights streamed from NVMe, beside fio and Accelerate.

    python -m benchmarks.infer_stream --dir /work/bench-llama --out infer_stream.json   # the full run (28.6 GB)
    python -m benchmarks.infer_stream --dir /tmp/x --scale 0.025 --layers 4 --shards 5 --budgets 1MiB \\
        --big-batch-budget 1MiB --accelerate-budget 1MiB --fio-size 16MiB     # tiny, as the test runs it

1. Writes, once, a random-weight Llama checkpoint (hidden 5120, intermediate 13824, 44 layers, 40
   heads, vocab 32000, bf16: 28.6 GB in 46 shards), one tensor at a time and each shard dropped from
   the page cache once written; ``--scale`` shrinks hidden, intermediate and vocab. Reused by later
   runs (``bench-checkpoint.json`` records what was written).
2. Measures fio's O_DIRECT sequential read speed in the same directory, with our aio settings.
3. Runs each configuration in a fresh process, the checkpoint's pages dropped from the page cache
   first: ours at each budget (batch 1) and at ``--big-batch`` (16); Accelerate's
   ``load_checkpoint_and_dispatch`` and ``from_pretrained(device_map="auto")`` with the same
   max_memory and disk offload. Each reports load time (and its CPU time: kernel time there is mostly
   faulting fresh memory in), time to first token, seconds per token
   (median of the decode steps), peak RSS (the kernel's high-water mark from after the warm-up: `RssSampler`
   with ``kernel_peak``), page-cache growth (/proc/meminfo Cached, and the checkpoint's own pages by
   mincore) and bytes read.
4. Times the big batch's compute floor: a model of the same shape with 2 and with 2 + ``--floor-layers``
   decoder layers in memory, its decode steps at the big batch (median), extrapolated to every layer.
5. Prints a table, then the targets: batch-1 s/token <= 1.1 x (bytes streamed per token / fio);
   at the Accelerate budget >= 1.6x load_checkpoint_and_dispatch's and >= 1.2x from_pretrained's
   tokens/s; page-cache growth < 256 MB; batch 16 >= 12x the tokens/s of batch 1; time to first
   token <= 1.2 x (resident bytes / fio) + the first forward, the latter timed in a process of its
   own whose weights are loaded first (same prompt, same plan), and, stricter, as one more first
   token in the run itself once everything is in memory. Our resident weights load in the
   background while the first forward runs, so "load" is the time until the engine is ready.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

from benchmarks._cgroup import UNBOUNDED
from benchmarks._common import ChildError, RssSampler, run_child
from benchmarks._peers import ROWS, PeerRunner, peer_targets
from benchmarks._stream_targets import stream_targets
from benchmarks._page_cache import _files, meminfo, meminfo_cached, page_cache_bytes  # noqa: F401 (imported from here)
from tensorio import parse_size

MARKER = "bench-checkpoint.json"


# ---- 1. the checkpoint ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Spec:
    """The random Llama written for the benchmark."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    vocab: int
    shards: int
    seed: int = 0

    @classmethod
    def scaled(cls, scale: float, layers: int, shards: int) -> "Spec":
        """The 28.6 GB model (scale 1), or one whose hidden, intermediate and vocab sizes are scaled."""
        hidden = max(64, int(5120 * scale) // 64 * 64)
        head_dim = 128 if hidden >= 128 else 32
        return cls(hidden, max(64, int(13824 * scale) // 2 * 2), layers, hidden // head_dim,
                   max(256, int(32000 * scale)), shards)

    def config(self):
        import transformers

        return transformers.LlamaConfig(
            hidden_size=self.hidden, intermediate_size=self.intermediate, num_hidden_layers=self.layers,
            num_attention_heads=self.heads, num_key_value_heads=self.heads, vocab_size=self.vocab,
            max_position_embeddings=4096, dtype="bfloat16", tie_word_embeddings=False,
            bos_token_id=1, eos_token_id=2)


def write_checkpoint(directory: Path, spec: Spec) -> Path:
    """Write ``spec``'s random bf16 checkpoint to ``directory`` (once: reused when its marker matches).

    The model is never whole in memory: tensors are generated one at a time and written with
    `SafetensorsWriter`, shard by shard in state-dict order (as ``save_pretrained`` shards); each
    finished shard is synced and dropped from the page cache.
    """
    import torch
    import transformers

    from offload.infer.weights.convert import drop_page_cache
    from offload.storage.safetensors_writer import atomic_safetensors

    marker = directory / MARKER
    if marker.is_file() and json.loads(marker.read_text()) == asdict(spec):
        return directory
    directory.mkdir(parents=True, exist_ok=True)
    config = spec.config()
    with torch.device("meta"):
        skeleton = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    tensors = [(name, tuple(p.shape)) for name, p in skeleton.named_parameters()]
    total = sum(int(np.prod(shape)) * 2 for _, shape in tensors)
    shards: dict[int, list[tuple[str, tuple]]] = {}
    offset = 0
    for name, shape in tensors:  # a tensor goes to the shard its first byte falls in: spec.shards even shards
        shards.setdefault(offset * spec.shards // total, []).append((name, shape))
        offset += int(np.prod(shape)) * 2
    shards = list(shards.values())
    generator = torch.Generator().manual_seed(spec.seed)
    weight_map = {}
    for number, members in enumerate(shards, 1):
        file = f"model-{number:05d}-of-{len(shards):05d}.safetensors"
        members = sorted(members)  # safetensors orders a file's tensors by name
        layout = {name: (torch.bfloat16, shape) for name, shape in members}
        with atomic_safetensors(directory / file, layout, {"format": "pt"}) as out:
            for name, shape in members:
                if name.endswith("norm.weight"):
                    value = torch.ones(shape, dtype=torch.bfloat16)
                else:
                    value = torch.empty(shape, dtype=torch.bfloat16).normal_(0.0, 0.02, generator=generator)
                out.write(name, value)
                del value
        drop_page_cache(directory / file)
        weight_map.update({name: file for name, _ in members})
    (directory / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    config.save_pretrained(directory)
    marker.write_text(json.dumps(asdict(spec)))
    return directory


# ---- 3. one configuration, in a fresh process ---------------------------------------------------------


class _Clock:
    """A transformers streamer that records when each new token arrives."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._prompt = True

    def put(self, value) -> None:
        if self._prompt:
            self._prompt = False
            return
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


class _FirstToken:
    """A transformers stopping criterion: stop after the first new token."""

    def __call__(self, input_ids, scores, **kwargs):
        import torch

        return torch.ones(input_ids.shape[0], dtype=torch.bool)


def _first_token_seconds(model, ids, new_tokens: int) -> float:
    """Seconds ``model.generate`` takes to its first new token, asked for ``new_tokens`` (so that our
    engine keeps the plan of the full run) and stopped there."""
    import torch
    import transformers

    clock, begin = _Clock(), time.perf_counter()
    model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False,
                   pad_token_id=0, streamer=clock, stopping_criteria=transformers.StoppingCriteriaList([_FirstToken()]))
    return clock.times[0] - begin


def child(args: dict) -> dict:
    """Run one configuration (``args["kind"]``: "ours", "accelerate-dispatch" or "accelerate-auto"), or
    time the compute floor ("floor": `floor_child`)."""
    if args["kind"] == "floor":
        return floor_child(args)
    import psutil
    import torch
    import transformers

    checkpoint = Path(args["checkpoint"])
    config = transformers.AutoConfig.from_pretrained(checkpoint)
    # Warm up torch and the model's code on a tiny copy, so that neither counts in load or first token.
    tiny = transformers.AutoModelForCausalLM.from_config(
        config.__class__(**{**config.to_dict(), "num_hidden_layers": 1, "hidden_size": 64, "intermediate_size": 64,
                            "num_attention_heads": 2, "num_key_value_heads": 2, "vocab_size": 64}))
    tiny.generate(torch.ones(1, 4, dtype=torch.long), max_new_tokens=2, do_sample=False, pad_token_id=0)
    del tiny
    if args["kind"] != "ours":
        import accelerate  # noqa: F401 - imported before the clock starts
    else:
        import offload.infer  # noqa: F401
    if args.get("idle"):  # benchmarks/_peers.py: the side's own overhead, nothing loaded (its cgroup's peak)
        return {"kind": args["kind"], "idle": True}
    process = psutil.Process()
    baseline = process.memory_info().rss
    files = _files(checkpoint)
    cached0, resident0, io0 = meminfo_cached(), page_cache_bytes(files), process.io_counters().read_bytes
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(3, config.vocab_size, (args["batch"], args["prompt_tokens"]), generator=generator)
    budget = args["budget"]
    clock = _Clock()
    if args.get("first_forward_only"):  # the reference: the first forward of a process whose weights are in
        model = _load(args["kind"], checkpoint, config, args)
        model.wait_loaded()
        seconds = _first_token_seconds(model, ids, args["new_tokens"])
        model.close()
        return {"first_forward_loaded_s": seconds}
    if args.get("plan_only"):  # benchmarks/_peers.py: our plan's memory, for the cgroup of our own bound
        model = _load(args["kind"], checkpoint, config, args)
        figures = {"plan_memory_bytes": model.plan.memory_bytes, "activation_bytes": model.activation_bytes(
            args["batch"], args["prompt_tokens"] + args["new_tokens"]), "resident_bytes": model.plan.resident_bytes}
        model.close()
        return figures
    # The peak from here on: loading and generating, not the imports and the warm-up.
    with RssSampler(kernel_peak=True) as rss:
        start, cpu0 = time.perf_counter(), os.times()
        model = _load(args["kind"], checkpoint, config, args)
        load_s, cpu1 = time.perf_counter() - start, os.times()
        begin = time.perf_counter()
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args["new_tokens"], do_sample=False,
                       pad_token_id=0, streamer=clock)
        if args["kind"] == "ours":
            # The first forward on its own: one more first token, every weight loaded, the same plan (batch 1
            # only: the time-to-first-token target is batch 1's, and a big batch's prefill takes minutes).
            full_load_s = model.wait_loaded()
            loaded_first_token_s = _first_token_seconds(model, ids, args["new_tokens"]) if args["batch"] == 1 else None
    steps = np.diff(np.array(clock.times))
    s_per_token = float(np.median(steps)) if len(steps) else None
    figures = dict(
        kind=args["kind"], budget=budget, batch=args["batch"], load_s=load_s,
        load_kernel_s=cpu1.system - cpu0.system, load_user_s=cpu1.user - cpu0.user, first_token_s=clock.times[0] - begin,
        ttft_s=load_s + clock.times[0] - begin, s_per_token=s_per_token,
        tokens_per_s=args["batch"] / s_per_token if s_per_token else None, decode_steps=[float(s) for s in steps],
        peak_rss=rss.peak, peak_rss_kernel=rss.kernel_peak, baseline_rss=baseline,
        cached_growth=meminfo_cached() - cached0, checkpoint_cache_growth=page_cache_bytes(files) - resident0,
        read_bytes=process.io_counters().read_bytes - io0)
    if args["kind"] == "ours":
        plan = model.plan
        # The steps that began once every resident weight was in (those before it read more than the plan's bytes).
        loaded = [float(s) for t, s in zip(clock.times, steps) if t >= start + full_load_s]
        figures.update(loaded_decode_steps=loaded, loaded_s_per_token=float(np.median(loaded)) if loaded else None)
        if args.get("side_by_side") and plan.read_bytes_per_forward:
            from benchmarks._floor import side_by_side

            figures.update(side_by_side(model, ids, args["new_tokens"]))  # the run's length: the run's plan
        figures.update(full_load_s=full_load_s, loaded_first_token_s=loaded_first_token_s,
                       resident_bytes=plan.resident_bytes, read_bytes_per_forward=plan.read_bytes_per_forward,
                       plan_memory_bytes=plan.memory_bytes, read_wait_s=model.read_wait_seconds,
                       plan_budget=plan.budget, budget_source=plan.budget_source,
                       activation_bytes=model.activation_bytes(args["batch"], args["prompt_tokens"] + args["new_tokens"]),
                       io_bytes=model.io_bytes(), plan=plan.describe(), quantization=plan.quantization,
                       unquantized_read_bytes_per_forward=plan.unquantized_read_bytes,
                       expert_counts=dataclasses.asdict(model.experts.counts) if model.experts is not None else None)
        if args.get("log_probs_path"):  # benchmarks/infer_quant.py: the prompt's next-token distributions, for KL
            np.save(args["log_probs_path"], torch.log_softmax(model(ids).logits[0].float(), dim=-1).numpy())
        model.close()
    return figures


def floor_child(args: dict) -> dict:
    """Seconds per decode step of the model in memory, ``args["layers"]`` decoder layers, quantized as
    asked, at batch ``args["batch"]``."""
    import torch
    import transformers

    from offload.infer.config import WeightQuantization
    from offload.infer.weights.quantize import QuantLinear, block_linears, quantize_weight

    config = Spec(**args["spec"]).config()
    config.num_hidden_layers = args["layers"]
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    spec = WeightQuantization.parse(args["quantize"])
    if spec is not None:
        for path in list(block_linears(model, "model.layers", spec)):
            linear = model.get_submodule(path)
            layer = QuantLinear(linear.in_features, linear.out_features, spec, torch.bfloat16, bias=False, device="cpu")
            for name, value in quantize_weight(linear.weight.data, spec, torch.bfloat16).items():
                getattr(layer, name).data = value
            parent, _, attr = path.rpartition(".")
            setattr(model.get_submodule(parent), attr, layer)
    ids = torch.randint(3, config.vocab_size, (args["batch"], args["prompt_tokens"]), generator=torch.Generator().manual_seed(0))
    clock = _Clock()
    with torch.no_grad():
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args["new_tokens"], do_sample=False,
                       pad_token_id=0, streamer=clock)
    return {"s_per_step": float(np.median(np.diff(clock.times)))}


def compute_floor(spec: Spec, *, quantize: str | None, batch: int, prompt_tokens: int, new_tokens: int,
                  floor_layers: int) -> dict:
    """The compute floor of a decode step of ``spec`` (all weights in memory), each in a child process: the
    step of a model with 2 and with 2 + ``floor_layers`` decoder layers timed (median), the floor the
    first plus the per-layer difference times the other layers. Raises ChildError where a child fails."""
    steps = {}
    for layers in (2, 2 + floor_layers):
        payload = {"kind": "floor", "spec": asdict(spec), "layers": layers, "quantize": quantize, "batch": batch,
                   "prompt_tokens": prompt_tokens, "new_tokens": new_tokens}
        steps[layers] = run_child("benchmarks.infer_stream", ["--child", json.dumps(payload)])["s_per_step"]
    per_layer = max(0.0, (steps[2 + floor_layers] - steps[2]) / floor_layers)
    return {"batch": batch, "steps": steps, "per_layer_s": per_layer, "floor_s": steps[2] + per_layer * (spec.layers - 2)}


def describe_floor(floor: dict, layers: int) -> str:
    """One line of `compute_floor`'s figures."""
    two, *_ = floor["steps"].values()
    return (f"{floor['floor_s']:.3f} s per step at batch {floor['batch']} ({two:.3f} s with 2 layers, "
            f"{floor['per_layer_s']:.4f} s per layer more, {layers} layers; weights in memory)")


def _load(kind: str, checkpoint: Path, config, args: dict):
    """The model of configuration ``kind``, loaded with ``args["budget"]`` bytes of memory; with
    ``args["setting"]`` "auto" ours takes "auto" and Accelerate no ``max_memory`` (each side's default)."""
    import torch
    import transformers

    budget = args["budget"]
    auto = args.get("setting") == "auto"
    if kind == "ours":
        from offload.infer import init_inference

        ring = {"buffer_count": args["buffer_count"]} if args["buffer_count"] else {}
        if args.get("quantize"):  # benchmarks/infer_quant.py: the quantized cache, written before the run
            ring.update(weight_quantization=args["quantize"], nvme_path=args["nvme_path"])
        if args.get("block_schedule"):
            ring.update(block_schedule=args["block_schedule"])
        if args.get("experts"):  # benchmarks/infer_moe.py: "routed" or "whole"
            ring.update(experts=args["experts"])
        return init_inference(checkpoint, max_in_cpu="auto" if auto else f"{budget}B", aio=args["aio"],  # bytes
                              disk_gbps=args["disk_gbps"], **ring)
    max_memory = None if auto else {"cpu": budget}
    if kind == "accelerate-dispatch":
        from accelerate import init_empty_weights, load_checkpoint_and_dispatch

        with init_empty_weights():
            empty = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        return load_checkpoint_and_dispatch(empty, str(checkpoint), device_map="auto", max_memory=max_memory,
                                            offload_folder=args["offload_folder"], dtype=torch.bfloat16,
                                            no_split_module_classes=["LlamaDecoderLayer"])
    return transformers.AutoModelForCausalLM.from_pretrained(
        checkpoint, device_map="auto", max_memory=max_memory, offload_folder=args["offload_folder"],
        dtype=torch.bfloat16)


def run_config(payload: dict) -> dict:
    """`child` (payload) in a fresh interpreter, its peak RSS its own; its figures. Raises RuntimeError."""
    return run_child("benchmarks.infer_stream", ["--child", json.dumps(payload)])


# ---- the run --------------------------------------------------------------------------------------


def _gib(nbytes: float) -> str:
    from offload.infer.plan.host import format_bytes

    return format_bytes(nbytes)


def model_parser(description: str, *, dir_help: str, scale: float = 1.0, layers: int = 44,
                 shards: int = 46) -> argparse.ArgumentParser:
    """The argument parser every inference benchmark starts from: its working directory and the shape of
    the synthetic Llama it writes there (the defaults: the 28.6 GB model)."""
    ap = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", help=dir_help)
    ap.add_argument("--scale", type=float, default=scale,
                    help=f"scale hidden, intermediate and vocab (default {scale}; 1: the 28.6 GB model)")
    ap.add_argument("--layers", type=int, default=layers)
    ap.add_argument("--shards", type=int, default=shards)
    return ap


def fio_read_speed(aio: Any, directory: Path, size: str) -> float | None:
    """fio's O_DIRECT sequential read of ``size`` bytes in ``directory`` with ``aio``'s settings, in bytes
    per second (printed with fio's command line); None, saying why, where fio cannot run."""
    from bench.fio import FioError, job_for_config, run_fio
    from tensorio import AioConfig

    try:
        fio = run_fio(job_for_config(AioConfig.from_dict(aio.to_dict()), directory=directory, rw="read",
                                     size=parse_size(size)))
    except FioError as exc:
        print(f"fio: not measured ({exc}); the disk-bound figures are left out")
        return None
    print(f"fio: {fio.gb_per_s:.3f} GB/s O_DIRECT sequential read ({' '.join(fio.command[1:])})")
    return fio.bw_bytes


def parse_or_run_child(ap: argparse.ArgumentParser, argv: list[str] | None, child: Callable[[dict], dict], *,
                       fio_size: str) -> argparse.Namespace | None:
    """Add the arguments every inference benchmark ends with (``--fio-size``, ``--out``, the hidden
    ``--child``) and parse ``argv``. In a child process: run ``child`` on its JSON payload, print its
    figures as JSON and return None. Otherwise the arguments; exits with a usage error without ``--dir``."""
    ap.add_argument("--fio-size", default=fio_size, help="bytes fio reads (its own file, removed afterwards)")
    ap.add_argument("--out", help="write every figure to this JSON file")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return None
    if not args.dir:
        ap.error("--dir is required")
    return args


def main(argv: list[str] | None = None) -> dict:
    """Run the benchmark; print the configuration, a table and the targets; return every figure."""
    from offload.infer.config import InferenceConfig
    from tensorio import AioConfig

    ap = model_parser(__doc__, dir_help="checkpoint directory (written once, then reused); on the disk to measure")
    ap.add_argument("--budgets", default="1GiB,8GiB,16GiB", help="our budgets (max_in_cpu) at batch 1")
    ap.add_argument("--big-batch", type=int, default=16)
    ap.add_argument("--big-batch-budget", default="8GiB")
    ap.add_argument("--big-batch-target", type=float, default=12.0,
                    help="the big batch's tokens/s against batch 1's that is the target (issue 28: 30 at batch 64)")
    ap.add_argument("--floor-layers", type=int, default=4,
                    help="the big batch's compute floor: decoder layers added to a 2-layer in-memory model for the "
                         "slope (0: not measured)")
    ap.add_argument("--micro-batch-size", type=int, default=None,
                    help="the big batch's block schedule: sequences per micro-batch (default: the engine's choice)")
    ap.add_argument("--accelerate", default="dispatch,auto",
                    help="Accelerate runs beside ours, each side without a memory cgroup (page cache unbounded): "
                         "dispatch, auto, or none")
    ap.add_argument("--peer-rows", default="equal,defaults,bound",
                    help="benchmarks/_peers.py's rows, each side in a memory cgroup: equal (the budget + each side's "
                         "overhead; ours \"auto\"), defaults (ours \"auto\", Accelerate without max_memory), bound "
                         "(ours in a cgroup of its own bound + 10%%), or none")
    ap.add_argument("--sides", default="ours,accelerate-auto",
                    help="the peer rows' sides: ours, accelerate-auto, accelerate-dispatch (one per run keeps it short)")
    ap.add_argument("--no-cgroups", action="store_true", help="run the peer rows without memory cgroups (labelled)")
    ap.add_argument("--previous", nargs="*", default=[],
                    help="--out files of earlier runs whose peer rows join this run's for the targets")
    ap.add_argument("--accelerate-budget", default="8GiB", help="max_memory for Accelerate (and our comparison run)")
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=8)
    ap.add_argument("--buffer-count", type=int, default=None, help="ring buffers (default: the engine's)")
    ap.add_argument("--aio", type=json.loads, help="aio settings as JSON (default: the engine's, 8 MiB pieces, 8 in flight)")
    ap.add_argument("--side-by-side", action="store_true",
                    help="after each of our runs, in its process: the ring's reads alone and the compute alone "
                         "(benchmarks/_floor.py), the floor its decode steps are held to")
    args = parse_or_run_child(ap, argv, child, fio_size="4GiB")
    if args is None:
        return {}

    directory = Path(args.dir).resolve()
    spec = Spec.scaled(args.scale, args.layers, args.shards)
    budgets = [parse_size(b) for b in args.budgets.split(",") if b]
    big_budget = parse_size(args.big_batch_budget)
    acc_budget = parse_size(args.accelerate_budget)
    accelerate_kinds = [k for k in args.accelerate.split(",") if k and k != "none"]
    aio = AioConfig.from_dict(args.aio) if args.aio else InferenceConfig().aio
    args.aio = aio.to_dict()
    print(f"configuration: {spec}, bf16; prompt {args.prompt_tokens} tokens, {args.new_tokens} new; budgets "
          f"{', '.join(map(_gib, budgets))}; batch {args.big_batch} at {_gib(big_budget)}; Accelerate "
          f"({', '.join(accelerate_kinds) or 'none'}) at {_gib(acc_budget)}; aio {args.aio}; {args.buffer_count or InferenceConfig().buffer_count} buffers")
    load_before = os.getloadavg()
    print(f"load average before: {' '.join(f'{x:.2f}' for x in load_before)} ({os.cpu_count()} CPUs)")

    # 1. The checkpoint, once.
    start = time.perf_counter()
    checkpoint = write_checkpoint(directory / "checkpoint", spec)
    size = sum(os.path.getsize(f) for f in _files(checkpoint) if f.endswith(".safetensors"))
    print(f"checkpoint: {checkpoint} ({size / 1e9:.2f} GB, {len(list(checkpoint.glob('*.safetensors')))} shards; "
          f"ready in {time.perf_counter() - start:.1f} s)")

    # 2. fio's O_DIRECT read speed on the same disk, with our aio settings.

    fio_bps = fio_read_speed(aio, directory, args.fio_size)

    # 3. Each configuration in its own process, the checkpoint cold.
    runs = [("ours", b, 1) for b in budgets] + ([("ours", big_budget, args.big_batch)] if args.big_batch > 1 else [])
    if accelerate_kinds and ("ours", acc_budget, 1) not in runs:
        runs.append(("ours", acc_budget, 1))
    runs += [(f"accelerate-{k}", acc_budget, 1) for k in accelerate_kinds]
    results = []
    for kind, budget, batch in runs:
        offload_folder = directory / "accelerate-offload"
        _make_cold(checkpoint, offload_folder)
        payload = {"kind": kind, "checkpoint": str(checkpoint), "budget": budget, "batch": batch,
                   "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens, "buffer_count": args.buffer_count,
                   "aio": args.aio, "disk_gbps": fio_bps / 1e9 if fio_bps else None, "offload_folder": str(offload_folder),
                   "side_by_side": args.side_by_side}
        if batch > 1 and args.micro_batch_size:
            payload["block_schedule"] = {"micro_batch_size": args.micro_batch_size}
        available = meminfo("MemAvailable")
        try:
            result = run_config(payload)
        except ChildError as exc:  # one configuration failing (the OOM killer, on a shared machine) loses only its row
            result = {"kind": kind, "budget": budget, "batch": batch, "error": exc.one_line()}
        result["mem_available_before"] = available
        if kind == "ours" and batch == 1 and "error" not in result:  # the first forward alone, for the TTFT target
            _make_cold(checkpoint, offload_folder)
            try:
                result.update(run_config({**payload, "first_forward_only": True}))
            except ChildError as exc:
                result["first_forward_error"] = exc.one_line()
        if kind != "ours":
            result["memory_label"] = UNBOUNDED
        results.append(result)
        if "plan" in result:
            print(result["plan"])
        _print_row(result)

    # 3b. Ours beside Accelerate at equal memory and as each side's default, each in its own memory cgroup.
    peer_rows = [r for r in args.peer_rows.split(",") if r in ROWS]
    peer_results = []
    if peer_rows:
        offload_folder = directory / "accelerate-offload"
        runner = PeerRunner(lambda payload, group: run_child("benchmarks.infer_stream", ["--child", json.dumps(payload)],
                                                             cgroup=group),
                            use_cgroups=not args.no_cgroups, before_each=lambda: _make_cold(checkpoint, offload_folder))
        base = {"checkpoint": str(checkpoint), "batch": 1, "prompt_tokens": args.prompt_tokens,
                "new_tokens": args.new_tokens, "buffer_count": args.buffer_count, "aio": args.aio,
                "disk_gbps": fio_bps / 1e9 if fio_bps else None, "offload_folder": str(offload_folder),
                "side_by_side": args.side_by_side}
        peer_results = runner.rows(peer_rows, [k for k in args.sides.split(",") if k], base, acc_budget)
    earlier = [r for path in args.previous for r in json.loads(Path(path).read_text()).get("peer_runs", [])]

    # 4. The big batch's compute floor (every weight in memory), beside its step.
    floor = None
    if args.floor_layers and args.big_batch > 1:
        floor = compute_floor(spec, quantize=None, batch=args.big_batch, prompt_tokens=args.prompt_tokens,
                              new_tokens=args.new_tokens, floor_layers=args.floor_layers)
        print(f"compute floor: {describe_floor(floor, spec.layers)}")

    # 5. The targets.
    targets = stream_targets(results, fio_bps, budgets, big_budget, args.big_batch, acc_budget, args.big_batch_target, floor)
    targets += peer_targets(earlier + peer_results, fio_bps, acc_budget)
    print("targets:")
    for line in targets:
        print("  " + line)
    load_after = os.getloadavg()
    print(f"load average after: {' '.join(f'{x:.2f}' for x in load_after)}")
    figures = {"spec": asdict(spec), "checkpoint_bytes": size, "fio_bps": fio_bps, "runs": results, "floor": floor,
               "peer_runs": peer_results,
               "targets": targets,
               "load_average": {"before": load_before, "after": load_after}}
    if args.out:
        Path(args.out).write_text(json.dumps(figures, indent=1))
    return figures


def _make_cold(checkpoint: Path, offload_folder: Path) -> None:
    """Drop the checkpoint's files (and Accelerate's offload folder's) from the page cache."""
    from offload.infer.weights.convert import drop_page_cache

    for path in _files(checkpoint) + (_files(offload_folder) if offload_folder.exists() else []):
        drop_page_cache(path)


def _print_row(r: dict) -> None:
    if "error" in r:
        print(f"{r['kind']:>20} budget {_gib(r['budget']):>10} batch {r['batch']:>3}: FAILED, {r['error']} "
              f"(MemAvailable {_gib(r['mem_available_before'])} when it started)")
        return
    s = r["s_per_token"]
    print(f"{r['kind']:>20} budget {_gib(r['budget']):>10} batch {r['batch']:>3}: load {r['load_s']:7.2f} s "
          f"(CPU: kernel {r['load_kernel_s']:.1f} s, user {r['load_user_s']:.1f} s), "
          f"first token {r['ttft_s']:7.2f} s, {s if s is None else round(s, 3)} s/token, "
          f"{r['tokens_per_s'] or 0:.3f} tokens/s, peak RSS {_gib(r['peak_rss'])} (baseline {_gib(r['baseline_rss'])}), "
          f"page cache +{r['cached_growth'] / 1e6:.0f} MB (checkpoint +{r['checkpoint_cache_growth'] / 1e6:.0f} MB), "
          f"read {r['read_bytes'] / 1e9:.2f} GB" + (f" [{r['memory_label']}]" if r.get("memory_label") else ""))


if __name__ == "__main__":
    main()
