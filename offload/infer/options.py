"""The engine's command-line options, shared by ``python -m offload.generate`` and ``python -m offload.serve``:
the budgets, the ring, dtype and quantization, the KV cache's place, the device, a DeepSpeed-style config.
`add_engine_options` declares them, `check_engine_options` refuses bad combinations through the parser
(one line), `engine_overrides` turns them into `init_inference`'s keyword overrides."""

from __future__ import annotations

import argparse
import os
from typing import Any

from offload.device import DEVICE_CHOICES
from offload.infer.config import InferenceConfig

__all__ = ["add_engine_options", "check_engine_options", "engine_overrides", "parse_max_memory"]


def parse_max_memory(text: str) -> dict[str, str]:
    """``--max-memory 0=6GiB,cpu=16GiB`` as the mapping Accelerate's ``max_memory`` is; the keys and
    sizes are checked by `InferenceConfig` (which names the key). Raises ValueError for a part without "="."""
    pairs = [part.strip() for part in text.split(",") if part.strip()]
    bad = [part for part in pairs if "=" not in part]
    if bad or not pairs:
        raise ValueError(f"--max-memory: {bad[0] if bad else text!r} is not KEY=SIZE; write e.g. 0=6GiB,cpu=16GiB")
    return {key.strip(): size.strip() for key, size in (part.split("=", 1) for part in pairs)}


def add_engine_options(ap: argparse.ArgumentParser) -> None:
    """Declare the engine's options on ``ap`` (everything `engine_overrides` reads)."""
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
    ap.add_argument("--experts", choices=("routed", "whole"),
                    help="a mixture of experts whose layers are streamed: routed (default) reads only the experts the "
                         "router picks, the most used kept in memory; whole streams every expert with its layer")
    ap.add_argument("--config", help="DeepSpeed-style JSON config (command-line options override it)")
    ap.add_argument("--disk-gbps", type=float, help="the disk's read speed in GB/s (default: measure it)")


def check_engine_options(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse, through ``ap.error`` (one line, exit status 2), what the options cannot mean together."""
    if args.quantize_group_size is not None and args.quantize != "int4":
        ap.error(f"--quantize-group-size {args.quantize_group_size} needs --quantize int4 (int8 weights get one scale "
                 f"per output channel)")
    if args.max_memory is not None:
        try:
            parse_max_memory(args.max_memory)
        except ValueError as exc:
            ap.error(str(exc))
    if args.nvme_path is not None and not os.path.isdir(args.nvme_path):
        ap.error(f"--nvme-path: {args.nvme_path} is not an existing directory; create it or pass one that exists")


def engine_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """`init_inference`'s keyword overrides for the options given (``args.config`` is its config). The
    budget is "auto" unless the config or ``--max-memory`` gives one. Raises ValueError naming the key
    of a bad value in the config."""
    values: dict[str, Any] = {}
    if args.max_memory is not None:
        values["max_memory"] = parse_max_memory(args.max_memory)
    if args.max_in_cpu is not None:
        values["max_in_cpu"] = int(args.max_in_cpu) if args.max_in_cpu.isdigit() else args.max_in_cpu
    for key in ("buffer_count", "dtype", "disk_gbps", "nvme_path", "compute_device", "host_to_device_gbps",
                "experts"):
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
    if InferenceConfig.from_dict(args.config, **values).max_in_cpu is None:
        values["max_in_cpu"] = "auto"  # the host's available memory less a margin; the plan says how much
    return values
