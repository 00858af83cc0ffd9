"""The command-line side of the engine's workload: its flags, the `Workload` they make, and `run
--workload`. Errors are ValueError (bad flags) or what the I/O raises; `bench.cli` reports them."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from ._errors import EXIT_USAGE, CliError
from ._units import format_size, parse_size

__all__ = ["add_workload_flags", "check_memory", "describe", "like_for_like", "run_workload", "run_workload_command",
           "workload_from_args", "workload_or_usage"]

#: Default counted seconds and ramp, per use: a sweep drives the workload at every point.
RUN_RUNTIME_S, SWEEP_RUNTIME_S = 4.0, 1.5


def add_workload_flags(p: argparse.ArgumentParser, *, runtime_s: float) -> None:
    """--workload and its shape: partition or window size, ranks, files, runtime, ramp, buffers."""
    g = p.add_argument_group("the engine's workload (docs/tuning.md, 'The engine's own traffic')")
    g.add_argument("--workload", choices=("sequential", "training", "inference"), default=None,
                   help="sequential: write then read one file (the default); training: read one A/B slot while "
                        "writing the other, partition-sized, over several swap files; inference: layer windows "
                        "read in the engine's pieces. Default: sequential, or from --workload-config")
    g.add_argument("--workload-config", type=Path, metavar="FILE",
                   help="your DeepSpeed (training) or inference config: the workload and partition size follow it")
    g.add_argument("--partition-size", type=parse_size, metavar="SIZE",
                   help="bytes per request: a training partition (default sub_group_size x 12 from the config, "
                        "else 48M) or an inference layer window (64M)")
    g.add_argument("--ranks", type=int, default=1, metavar="N", help="training ranks driving the disk at once")
    g.add_argument("--swap-files", type=int, default=4, metavar="N", help="swap files per rank (training)")
    g.add_argument("--file-size", type=parse_size, metavar="SIZE",
                   help="inference: the checkpoint file's bytes (default 8 windows); may exceed RAM, the "
                        "buffers are the windows in flight alone")
    g.add_argument("--runtime", type=float, default=runtime_s, metavar="S",
                   help=f"seconds counted per measurement, after the ramp (default {runtime_s:g})")
    g.add_argument("--ramp", type=float, default=0.5, metavar="S", help="seconds run before counting (default 0.5)")
    g.add_argument("--no-huge-pages", action="store_true",
                   help="buffers in 4 KiB pages, not locked (as fio's), instead of the engine's 2 MiB pages")


def workload_from_args(args: argparse.Namespace) -> Any:
    """The `bench.workload.Workload` the flags ask for, or None for the sequential passes. Raises
    ValueError naming the flag or the config file that is wrong."""
    from .workload import workload_for

    user_config = None
    kind = args.workload
    if args.workload_config is not None:
        try:
            user_config = json.loads(Path(args.workload_config).read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise ValueError(f"--workload-config {args.workload_config}: no such file") from None
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"--workload-config {args.workload_config}: not a JSON config ({exc})") from None
        if not isinstance(user_config, dict):
            raise ValueError(f"--workload-config {args.workload_config}: not a JSON object")
        kind = kind or ("training" if "optimizer" in user_config or "train_micro_batch_size_per_gpu" in user_config
                        else "inference")
    if kind in (None, "sequential"):
        return None
    if args.ranks < 1 or args.swap_files < 2:
        raise ValueError(f"--ranks {args.ranks} must be >= 1 and --swap-files {args.swap_files} >= 2")
    try:
        return workload_for(kind, user_config=user_config, request_bytes=args.partition_size,
                            file_bytes=args.file_size or 0, files=args.swap_files, ranks=args.ranks,
                            runtime_s=args.runtime, ramp_s=args.ramp, huge_pages=not args.no_huge_pages)
    except ValueError as exc:
        raise ValueError(str(exc).replace("Workload.request_bytes", "--partition-size")
                         .replace("Workload.file_bytes", "--file-size")) from None


def describe(workload: Any, config: Any) -> str:
    """One line saying what the workload drives."""
    size = format_size(workload.request_bytes)
    pages = "2 MiB pages, locked (the engine's)" if workload.huge_pages else "4 KiB pages, not locked (fio's)"
    if workload.kind == "training":
        shape = (f"{workload.ranks} rank(s) x {workload.files} swap files of one {size} partition; each step reads "
                 f"one partition into slot A while writing slot B's")
    else:
        shape = (f"{size} layer windows in {format_size(config.block_size)} pieces, {workload.in_flight(config)} in "
                 f"flight, over a {format_size(workload.file_size())} checkpoint file")
    return (f"workload {workload.kind}: {shape}; {workload.ramp_s:g} s ramp, then {workload.runtime_s:g} s "
            f"counted in {workload.slices} slices; buffers {format_size(workload.buffer_bytes(config))} in {pages}")


def run_workload(args: argparse.Namespace, config: Any, workload: Any, directory: Any, say: Any) -> dict[str, Any]:
    """`run --workload`: the workload alone, or with ``--fio`` ours (both buffer kinds) beside fio. Prints
    the figures (with ``--json`` returns them only); raises TensorIOError / MeasurementError from the I/O."""
    from .likeforlike import side_by_side
    from .report import format_workload
    from .scratch import scratch_dir
    from .workload import measure_workload

    say(describe(workload, config))
    disks = directory.disks
    with scratch_dir(directory.directory) as scratch:
        if args.fio:
            result = side_by_side(config, scratch, workload, repeats=args.repeats, disks=disks)
            if not args.json:
                print(result.format())
            return result.to_json()
        runs = [measure_workload(config, scratch, workload, disks=disks) for _ in range(args.repeats)]
    if not args.json:
        for r in runs:
            print(f"{r.backend}: {format_workload(r)}")
            if r.disk:
                print(f"  {r.disk.describe()}")
    return {"workload": workload.to_json(), "runs": [r.to_json() for r in runs]}


def run_workload_command(args: argparse.Namespace, config: Any, workload: Any, say: Any, usable: Any,
                         check_backend: Any) -> int:
    """`run --workload`: check the directory (``usable``), backend and memory, run it, print or ``--json``.
    Raises CliError for a bad setting or a failed I/O."""
    from tensorio import TensorIOError

    from .measure import MeasurementError

    if workload.request_bytes % config.block_size:
        raise CliError(f"--partition-size {format_size(workload.request_bytes)} is not a multiple of the block size "
                       f"{format_size(config.block_size)}", EXIT_USAGE)
    say(f"tensorio-bench run {args.directory}: the {workload.kind} workload, {args.repeats} runs"
        + (" of each side beside fio" if args.fio else ""))
    say(f"aio: {json.dumps(config.to_dict())}")
    v = usable(args.directory, workload.disk_bytes())
    check_backend(config, v)
    check_memory(workload.buffer_bytes(config) * (2 if args.fio else 1), "the workload's buffers")
    try:
        record = run_workload(args, config, workload, v, say)
    except (TensorIOError, MeasurementError) as exc:
        raise CliError(str(exc)) from None
    if args.json:
        print(json.dumps({"tool": "tensorio-bench run", "directory": str(Path(v.directory).resolve()),
                          "filesystem": v.filesystem, "devices": v.devices, "aio": config.to_dict(), **record},
                         indent=2))
    return 0


def workload_or_usage(args: argparse.Namespace) -> Any:
    """`workload_from_args`, a bad flag a usage error (exit 2)."""
    try:
        return workload_from_args(args)
    except ValueError as exc:
        raise CliError(str(exc), EXIT_USAGE) from None


def check_memory(nbytes: int, what: str) -> None:
    """Refuse, in one line, buffers of ``nbytes`` the memory cannot hold (`bench.memory.check_room`)."""
    from .memory import NotEnoughMemory, check_room

    try:
        check_room(nbytes, what)
    except NotEnoughMemory as exc:
        raise CliError(str(exc)) from None


def like_for_like(args: argparse.Namespace, v: Any, config: Any, workload: Any) -> Any:
    """The chosen configuration on the workload, ours (both buffer kinds) beside fio, printed."""
    from tensorio import TensorIOError

    from .likeforlike import side_by_side
    from .measure import MeasurementError
    from .scratch import scratch_dir

    try:
        with scratch_dir(v.directory) as scratch:
            like = side_by_side(config, scratch, workload, repeats=args.repeats, disks=v.disks)
    except (TensorIOError, MeasurementError) as exc:
        raise CliError(str(exc)) from None
    print()
    print(f"the chosen configuration on {v.directory}, " + like.format())
    return like
