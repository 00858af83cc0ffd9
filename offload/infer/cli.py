"""``python -m offload.generate``: generate from a checkpoint larger than memory, streaming its weights.

    python -m offload.generate CHECKPOINT --prompt "Once upon a time" --max-new-tokens 32 --max-in-cpu 8GiB
    python -m offload.generate CHECKPOINT --prompt-ids 1,450,4996 --batch-size 16 --config ds.json
    python -m offload.generate CHECKPOINT --prompt "Once upon a time" --max-memory 0=6GiB,cpu=16GiB

Prints the plan, then the tokens as they come (the first sequence's; text where the checkpoint
directory has a tokenizer), then time to first token, seconds per token, the read speed during
decoding and that speed against the disk's (measured with a short O_DIRECT read of the checkpoint,
or --disk-gbps).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

import torch

from offload.cli_errors import add_debug_flag
from offload.device import DEVICE_CHOICES
from offload.infer.config import InferenceConfig
from offload.infer.engine import init_inference


class _Printer:
    """A transformers streamer (``put``/``end``) that prints the first sequence's new tokens as they
    come and records when each arrived. With a tokenizer it prints text, otherwise token ids."""

    def __init__(self, tokenizer: Any, out) -> None:
        self.tokenizer, self.out = tokenizer, out
        self.times: list[float] = []
        self.tokens: list[int] = []
        self._printed = ""
        self._prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if not self._prompt_seen:  # generate() hands the prompt over first
            self._prompt_seen = True
            return
        self.times.append(time.perf_counter())
        self.tokens.append(int(value.reshape(value.shape[0], -1)[0, -1]) if value.dim() else int(value))
        if self.tokenizer is None:
            self.out.write(f"{self.tokens[-1]} ")
        else:
            text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
            self.out.write(text[len(self._printed):])
            self._printed = text
        self.out.flush()

    def end(self) -> None:
        self.out.write("\n")
        self.out.flush()


def parse_max_memory(text: str) -> dict[str, str]:
    """``--max-memory 0=6GiB,cpu=16GiB`` as the mapping Accelerate's ``max_memory`` is; the keys and
    sizes are checked by `InferenceConfig` (which names the key). Raises ValueError for a part without "="."""
    pairs = [part.strip() for part in text.split(",") if part.strip()]
    bad = [part for part in pairs if "=" not in part]
    if bad or not pairs:
        raise ValueError(f"--max-memory: {bad[0] if bad else text!r} is not KEY=SIZE; write e.g. 0=6GiB,cpu=16GiB")
    return {key.strip(): size.strip() for key, size in (part.split("=", 1) for part in pairs)}


def _overrides(args: argparse.Namespace) -> dict[str, Any]:
    values: dict[str, Any] = {}
    if args.max_memory is not None:
        values["max_memory"] = parse_max_memory(args.max_memory)
    if args.max_in_cpu is not None:
        values["max_in_cpu"] = int(args.max_in_cpu) if args.max_in_cpu.isdigit() else args.max_in_cpu
    for key in ("buffer_count", "dtype", "disk_gbps", "nvme_path", "compute_device", "host_to_device_gbps"):
        if getattr(args, key) is not None:
            values[key] = getattr(args, key)
    if args.quantize is not None:
        values["weight_quantization"] = args.quantize if args.quantize_group_size is None else {
            "num_bits": 4, "group_size": args.quantize_group_size}
    if args.micro_batch_size is not None:
        values["block_schedule"] = {"micro_batch_size": args.micro_batch_size}
    if any(v is not None for v in (args.kv_offload, args.kv_cpu_percent, args.kv_quantize, args.kv_buffer_count)):
        values["kv_offload"] = {"device": args.kv_offload or ("nvme" if args.kv_cpu_percent is not None else "auto")}
        if args.kv_buffer_count is not None:
            values["kv_offload"]["buffer_count"] = args.kv_buffer_count
        if args.kv_cpu_percent is not None:
            values["kv_offload"]["cpu_percent"] = args.kv_cpu_percent
        if args.kv_quantize is not None:
            values["kv_offload"]["quantization"] = args.kv_quantize
    return values


def main(argv: list[str] | None = None, out=None) -> dict[str, Any]:
    """Run the command; print as it goes; return the figures (also printed as JSON with --json)."""
    out = out or sys.stdout
    ap = argparse.ArgumentParser(prog="python -m offload.generate", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint", help="directory with config.json and the safetensors file(s)")
    prompt = ap.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="prompt text (needs a tokenizer in the checkpoint directory)")
    prompt.add_argument("--prompt-ids", help="prompt token ids, comma-separated (no tokenizer needed)")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--batch-size", type=int, default=1, help="the prompt repeated this many times")
    ap.add_argument("--max-in-cpu", help="memory budget: elements, bytes such as 8GiB, or auto (the default unless "
                                         "--config or --max-memory gives one: the host's available memory, or the "
                                         "cgroup's room, less the ring buffers and a margin; the plan prints it)")
    ap.add_argument("--max-memory", help="the tiers' budgets as Accelerate's max_memory: DEVICE=SIZE for the GPU's "
                                         "(weights kept there, its copy ring, the KV cache, activations), cpu=SIZE for "
                                         "pinned host memory (as --max-in-cpu), e.g. 0=6GiB,cpu=16GiB")
    ap.add_argument("--compute-device", choices=DEVICE_CHOICES,
                    help="where the model computes (default auto: a GPU where one is available)")
    ap.add_argument("--host-to-device-gbps", type=float,
                    help="the host-to-device link's speed in GB/s, for the plan's bound (default: unknown)")
    ap.add_argument("--buffer-count", type=int, help="locked buffers in the prefetch ring")
    ap.add_argument("--dtype", help="compute dtype (default: the checkpoint's)")
    ap.add_argument("--nvme-path", help="directory for a converted copy when --dtype differs from the checkpoint's, "
                                           "and for the quantized cache of --quantize")
    ap.add_argument("--quantize", choices=("int8", "int4", "none"),
                    help="decoder weights as int8 (per channel) or int4 (group 64), quantized once into a cache "
                         "under --nvme-path (default: the checkpoint's directory)")
    ap.add_argument("--quantize-group-size", type=int,
                    help="with --quantize int4: weights per scale and zero, 32, 64 (default, ZeRO-Inference's), 128 "
                         "(GPTQ's and AWQ's: about 6%% fewer bytes per token than 64) or 256")
    ap.add_argument("--kv-offload", choices=("auto", "cpu", "nvme"),
                    help="where the KV cache lives: auto (default: in memory while the budget holds it, the layers "
                         "beyond it on NVMe), cpu (all in memory), nvme (on NVMe but --kv-cpu-percent of the layers); "
                         "its files go under --nvme-path (default: the checkpoint's directory)")
    ap.add_argument("--kv-cpu-percent", type=float,
                    help="with --kv-offload nvme: the share of layers (0-100) whose cache stays in memory")
    ap.add_argument("--kv-buffer-count", type=int,
                    help="buffers of the read-ahead ring of a KV cache on NVMe, one layer's cache each (default 2)")
    ap.add_argument("--kv-quantize", choices=("int8", "int4", "none"),
                    help="the KV cache's keys and values stored as int8 or int4 (group 64 along the head dimension, "
                         "asymmetric), in memory and on NVMe alike")
    ap.add_argument("--micro-batch-size", type=int,
                    help="block schedule: run the batch through each layer's one read in micro-batches of this many "
                         "sequences (default: as large as 1 GiB of activations allows)")
    ap.add_argument("--config", help="DeepSpeed-style JSON config (command-line options override it)")
    ap.add_argument("--disk-gbps", type=float, help="the disk's read speed in GB/s (default: measure it)")
    ap.add_argument("--do-sample", action="store_true", help="sample instead of greedy decoding")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--top-k", type=int, default=50)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true",
                    help="print the figures as one JSON line on stdout, everything else on stderr")
    add_debug_flag(ap)  # read by offload.cli_errors.run_command (python -m offload.generate)
    args = ap.parse_args(argv)
    if args.batch_size < 1 or args.max_new_tokens < 1:
        ap.error("--batch-size and --max-new-tokens must be at least 1")
    if args.quantize_group_size is not None and args.quantize != "int4":
        ap.error(f"--quantize-group-size {args.quantize_group_size} needs --quantize int4 (int8 weights get one scale "
                 f"per output channel)")
    if args.max_memory is not None:
        try:
            parse_max_memory(args.max_memory)
        except ValueError as exc:
            ap.error(str(exc))

    tokenizer = None
    if args.prompt is not None:
        import transformers

        names = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
        if not any(os.path.isfile(os.path.join(args.checkpoint, name)) for name in names):
            ap.error(f"--prompt needs a tokenizer in {args.checkpoint} (none of {', '.join(names)}); "
                     f"use --prompt-ids instead")
        try:
            tokenizer = transformers.AutoTokenizer.from_pretrained(args.checkpoint)
        except (OSError, ValueError) as exc:
            ap.error(f"--prompt: the tokenizer in {args.checkpoint} cannot be loaded ({exc}); use --prompt-ids instead")
        ids = tokenizer(args.prompt, return_tensors="pt").input_ids
    else:
        try:
            ids = torch.tensor([[int(t) for t in args.prompt_ids.split(",") if t.strip()]])
        except ValueError:
            ap.error(f"--prompt-ids: {args.prompt_ids!r} is not a comma-separated list of integers")
    _check_prompt_ids(ap, ids, args.checkpoint)
    ids = ids.repeat(args.batch_size, 1)
    if args.nvme_path is not None and not os.path.isdir(args.nvme_path):
        ap.error(f"--nvme-path: {args.nvme_path} is not an existing directory; create it or pass one that exists")
    if args.json:  # stdout carries the JSON line alone (| jq); the plan and the tokens go to stderr
        out, json_out = sys.stderr, out
    else:
        json_out = out

    overrides = _overrides(args)
    if InferenceConfig.from_dict(args.config, **overrides).max_in_cpu is None:
        overrides["max_in_cpu"] = "auto"  # the host's available memory less a margin; the plan says how much
    with init_inference(args.checkpoint, args.config, **overrides) as engine:
        plan = engine.reserve(args.batch_size, ids.shape[1] + args.max_new_tokens)
        print(plan.describe(), file=out)
        print(f"ready in {engine.init_seconds:.2f} s; the resident weights load in the background, each "
              f"forward waiting only for the layers it reaches", file=out)
        print(f"generating {args.max_new_tokens} tokens for batch {args.batch_size} (the first sequence shown):", file=out)
        printer = _Printer(tokenizer, out)
        torch.manual_seed(args.seed)
        start = time.perf_counter()
        read_start = engine.io_bytes()
        sampling = {"do_sample": True, "temperature": args.temperature, "top_k": args.top_k} if args.do_sample else {"do_sample": False}
        pad = engine.module.generation_config.pad_token_id
        if pad is None:
            pad = engine.module.generation_config.eos_token_id
        engine.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.max_new_tokens, streamer=printer,
                        pad_token_id=pad if isinstance(pad, int) else (pad[0] if pad else 0), **sampling)
        end = time.perf_counter()
        read_end = engine.io_bytes()
        figures = _figures(engine, printer, start, end, read_start, read_end, args.batch_size)
    _report(figures, out)
    if args.json:
        print(json.dumps(figures), file=json_out)
    return figures


def _check_prompt_ids(ap: argparse.ArgumentParser, ids: torch.Tensor, checkpoint: str) -> None:
    """Refuse (one line, through ``ap.error``) prompt ids outside the model's vocabulary, which the
    embedding would fail on deep inside generate()."""
    path = os.path.join(checkpoint, "config.json")
    try:
        with open(path, encoding="utf-8") as f:
            vocab = json.load(f).get("vocab_size")
    except (OSError, ValueError):
        return  # init_inference names what is wrong with the checkpoint
    if ids.numel() == 0:
        ap.error("--prompt-ids: no ids given; pass at least one, such as --prompt-ids 1")
    bad = [int(t) for t in ids.flatten() if t < 0 or (isinstance(vocab, int) and t >= vocab)]
    if bad:
        ap.error(f"--prompt-ids: {bad[0]} is outside the model's vocabulary (vocab_size {vocab} in {path}); "
                 f"use ids from 0 to {vocab - 1 if isinstance(vocab, int) else '...'}")


def _figures(engine, printer: _Printer, start: float, end: float, read_start: int, read_end: int, batch: int) -> dict:
    times = printer.times
    first = times[0] - start if times else end - start
    decode_s = (times[-1] - times[0]) if len(times) > 1 else 0.0
    steps = max(len(times) - 1, 0)
    plan = engine.plan
    per_forward = plan.read_bytes_per_forward
    return {
        "tokens": printer.tokens, "batch": batch, "init_s": engine.init_seconds, "first_token_s": first,
        "load_s": engine.wait_loaded(),
        "time_to_first_token_s": engine.init_seconds + first,
        "s_per_token": decode_s / steps if steps else None,
        "tokens_per_s": batch * steps / decode_s if decode_s else None,
        "read_bytes": read_end - read_start, "read_bytes_per_forward": per_forward,
        "read_gbps": per_forward * steps / decode_s / 1e9 if decode_s and per_forward else 0.0,
        "disk_gbps": plan.disk_bps / 1e9 if plan.disk_bps else None, "disk_source": plan.disk_source,
        "disk_s_per_forward": plan.disk_seconds_per_forward, "read_wait_s": engine.read_wait_seconds,
        "resident_bytes": plan.resident_bytes, "streamed_bytes": plan.streamed_bytes,
        "quantization": plan.quantization, "unquantized_read_bytes_per_forward": plan.unquantized_read_bytes,
        "kv_nvme_layers": len(plan.kv.nvme_layers) if plan.kv else 0, "kv_bytes_read": engine.kv_bytes_read,
        "kv_bytes_written": engine.kv_bytes_written, "kv_read_wait_s": engine.kv_wait_seconds,
        "host_to_device_bytes_per_forward": plan.host_to_device_bytes_per_forward,
        "unquantized_host_to_device_bytes_per_forward": plan.unquantized_host_to_device_bytes,
        "device_resident_bytes": plan.device.resident_bytes if plan.device else None,
        "bound_s_per_token": plan.bound_seconds(),
    }


def _report(f: dict, out) -> None:
    print(f"time to first token: {f['time_to_first_token_s']:.3f} s (ready {f['init_s']:.3f} s + first forward "
          f"{f['first_token_s']:.3f} s; every resident weight was in memory {f['load_s']:.3f} s after the start)",
          file=out)
    if f["s_per_token"] is None:
        print("seconds per token: - (one token only)", file=out)
        return
    print(f"seconds per token: {f['s_per_token']:.4f} ({f['tokens_per_s']:.2f} tokens/s over the batch of {f['batch']})",
          file=out)
    if f["device_resident_bytes"] is not None:
        bound = f["bound_s_per_token"]
        print(f"host->device: {f['host_to_device_bytes_per_forward'] / 1e9:.3f} GB per token; "
              + (f"{f['s_per_token'] / bound:.2f}x the tiers' bound of {bound:.4f} s per token (the slower link)"
                 if bound else "nothing crosses a link per token" if bound == 0
                 else "the tiers' bound is unknown (give --host-to-device-gbps)"), file=out)
    if not f["read_bytes_per_forward"]:
        print("read: nothing streamed (every weight is in memory)", file=out)
        return
    line = f"read: {f['read_gbps']:.2f} GB/s ({f['read_bytes_per_forward'] / 1e9:.3f} GB per token)"
    if f["disk_gbps"] and f["read_gbps"] > f["disk_gbps"]:  # the figure was low (a short probe, a busy disk)
        line += (f", faster than the disk's {f['disk_gbps']:.2f} GB/s ({f['disk_source']}), which understated it: "
                 f"give --disk-gbps (tensorio-bench run DIR --rw read measures it) for the plan's bound")
    elif f["disk_gbps"]:
        bound = f["disk_s_per_forward"]
        line += (f", {f['read_gbps'] / f['disk_gbps']:.0%} of the disk's {f['disk_gbps']:.2f} GB/s ({f['disk_source']}); "
                 f"{f['s_per_token'] / bound:.2f}x the disk's bound of {bound:.4f} s per token")
    print(line, file=out)
