"""`tensorio-bench`: validate a swap directory, measure one aio configuration, sweep a grid, run fio.

Exit status: 0 done, 1 failed (bad directory, I/O error, fio error), 2 bad usage, 130 interrupted.
Every subcommand prints its configuration first; benchmark files are removed on every exit. Errors
end in one line; ``--debug`` (or ``OFFLOAD_DEBUG=1``) shows the traceback, the underlying error's
included.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from ._units import format_bytes, format_ns, format_size, parse_size

from ._errors import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_USAGE, CliError

DEBUG_ENV = "OFFLOAD_DEBUG"
"""Set to 1 to see the traceback of an error: the variable of the ``python -m offload.*`` commands
(offload.cli_errors, not imported here: it would load the offload package into this tool)."""

DEFAULT_CONFIG_OUT = Path("configs/aio_tuned.json")

#: The extra that brings matplotlib, which the sweep's chart needs (the JSON and CSV need nothing more).
CHART_EXTRA = "tensorio-offload[bench]"
DEFAULT_OUT_DIR = Path("results/aio-sweep")


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `tensorio-bench` console command; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv or os.environ.get(DEBUG_ENV, "") not in ("", "0")
    argv = [arg for arg in argv if arg != "--debug"]  # accepted before or after the subcommand
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except CliError as exc:
        if debug:
            exc.__suppress_context__ = False  # the error it reports, with its traceback, comes first
            raise
        print(f"tensorio-bench {args.command}: error: {exc}", file=sys.stderr)
        return exc.status
    except KeyboardInterrupt:
        print(f"\ntensorio-bench {args.command}: interrupted; benchmark files removed", file=sys.stderr)
        return EXIT_INTERRUPTED


# ---- validate ------------------------------------------------------------------------------------

def _cmd_validate(args: argparse.Namespace) -> int:
    from .validate import validate_directory

    print(f"tensorio-bench validate {args.directory}" + (f" --size {format_size(args.size)}" if args.size else ""))
    v = validate_directory(args.directory, need_bytes=args.size or 0)
    print(v.format())
    return 0 if v.usable else EXIT_FAILED


# ---- run -------------------------------------------------------------------------------------------

def _cmd_run(args: argparse.Namespace) -> int:
    from .measure import MeasurementError, measure_point
    from .report import BUFFERED_NOTE, format_point, point_json
    from .scratch import scratch_dir
    from tensorio import TensorIOError

    from .workload_cli import run_workload_command, workload_or_usage

    say = _say(args)  # with --json, stdout holds the JSON alone
    config = _config_from_args(args)
    workload = workload_or_usage(args)
    if workload is not None:
        return run_workload_command(args, config, workload, say, _usable_directory, _check_backend)
    if args.fio:
        raise CliError("--fio goes with --workload training or inference (the sweep compares the sequential "
                       "passes with fio)", EXIT_USAGE)
    request_size = _request_size(args, [config.block_size])
    rws = ("write", "read") if args.rw == "both" else (args.rw,)
    say(f"tensorio-bench run {args.directory}: {args.rw} {format_size(args.size)} as requests of "
        f"{format_size(request_size)}, {args.repeats} repeats (median), after an untimed warm-up write")
    say(f"aio: {_json_line(config.to_dict())}")
    v = _usable_directory(args.directory, args.size)
    _check_backend(config, v)
    (buffers,) = _buffers(args.size)
    say(f"disk: {v.filesystem}, {'O_DIRECT' if v.direct and config.direct is not False else 'buffered'}; "
        f"buffers {buffers.lock_status}")
    try:
        with scratch_dir(v.directory) as scratch:
            point = measure_point(config, scratch / "run.dat", buffers, request_size=request_size,
                                  repeats=args.repeats, direct=v.direct, rws=rws)
    except (TensorIOError, MeasurementError) as exc:
        raise CliError(str(exc)) from None
    if args.json:
        print(_json_line({"tool": "tensorio-bench run", "directory": str(Path(v.directory).resolve()),
                          "filesystem": v.filesystem, "rw": args.rw, "size": args.size, "request_size": request_size,
                          "repeats": args.repeats, "buffers": buffers.lock_status, **point_json(point),
                          "note": None if point.direct else BUFFERED_NOTE}, indent=2))
        return 0
    print(f"backend: {point.backend}")
    print(format_point(point))
    if not point.direct:
        print(f"note: {BUFFERED_NOTE}")
    return 0


# ---- sweep -----------------------------------------------------------------------------------------

def _cmd_sweep(args: argparse.Namespace) -> int:
    from .configfile import check_config_out, check_merge_target
    from .journal import SweepJournal, load_partial
    from .report import (format_best, format_choice, format_noise, format_table, format_together, sweep_json,
                         write_csv, write_json)
    from .sweep import GRIDS, REFERENCE_MEASUREMENTS, choose_config, config_label, sweep_plan
    from .workload import INFERENCE_PIECE
    from .workload_cli import check_memory, describe, like_for_like, workload_or_usage

    grid_name = "quick" if args.quick else "full" if args.full else "default"
    grid = GRIDS[grid_name]
    if args.backend:
        grid = replace(grid, backends=(args.backend,))
    workload = workload_or_usage(args)
    if workload is not None and workload.kind == "inference" and INFERENCE_PIECE not in grid.block_sizes:
        grid = replace(grid, block_sizes=(*grid.block_sizes, INFERENCE_PIECE))  # the engine's pieces
    if workload is not None and workload.request_bytes % max(grid.block_sizes):
        raise CliError(f"--partition-size {format_size(workload.request_bytes)} is not a multiple of the largest "
                       f"block size {format_size(max(grid.block_sizes))}", EXIT_USAGE)
    size = args.size or grid.size
    request_size = _request_size(args, grid.block_sizes, size=size)
    direct = _direct_arg(args.direct)
    config_out = args.config_out or (None if args.merge_into else DEFAULT_CONFIG_OUT)

    # 1. Check every directory, where the answer goes and the memory before any I/O: a sweep that fails
    #    on its second disk, or refuses its output at the end, wastes the first.
    validations = [_usable_directory(d, size + (workload.disk_bytes() if workload else 0)) for d in args.directories]
    _check_devices(args.directories, args.same_device)
    for v in validations:
        if direct is True and not v.direct:
            raise CliError(f"--direct true but {v.directory} has no O_DIRECT ({v.filesystem}); use --direct auto")
    try:
        if config_out:
            check_config_out(config_out)
        if args.merge_into:
            check_merge_target(args.merge_into)
    except (OSError, ValueError) as exc:
        raise CliError(str(exc), EXIT_USAGE) from None
    backends_here = [b for b in grid.backends if b != "io_uring" or all(v.io_uring for v in validations)]
    if not backends_here:
        raise CliError(f"io_uring cannot run here ({_io_uring_reason()}); use --backend threads")
    configs = grid.configs(backends=backends_here, direct=direct)
    plan = sweep_plan(configs, references=REFERENCE_MEASUREMENTS)
    settings = {"grid": grid_name, **{k: list(v) for k, v in asdict(grid).items() if k != "size"},
                "backends": backends_here, "size": size, "request_size": request_size, "repeats": args.repeats,
                "direct": direct, "references": REFERENCE_MEASUREMENTS,
                "workload": workload.to_json() if workload else None}
    journal_path = args.out_dir / "sweep.json"
    try:
        done = load_partial(journal_path, settings, args.directories) if args.resume else None
    except ValueError as exc:
        raise CliError(str(exc), EXIT_USAGE) from None

    passes = len(plan) * (1 + 2 * args.repeats)
    at_once = ", all at once (a thread per directory, each step started together)" if len(validations) > 1 else ""
    print(f"tensorio-bench sweep ({grid_name} grid): {len(configs)} points x {len(validations)} disk(s){at_once}, "
          f"{args.repeats} repeats (median)")
    print(f"  reference    {config_label(plan[0].config)}, measured {REFERENCE_MEASUREMENTS} times among them "
          f"for the disk's noise")
    print(f"  block sizes  {', '.join(format_size(b) for b in grid.block_sizes)}")
    print(f"  queue depths {', '.join(map(str, grid.queue_depths))}; threads {', '.join(map(str, grid.thread_counts))}")
    print(f"  single_submit {_bools(grid.single_submit)}; overlap_events {_bools(grid.overlap_events)} (io_uring only)")
    print(f"  backends     {', '.join(backends_here)}" +
          ("" if backends_here == list(grid.backends) else f" (io_uring unavailable: {_io_uring_reason()})"))
    print(f"  size {format_size(size)} per pass in requests of {format_size(request_size)}; direct={direct}; "
          f"{passes} passes = {format_bytes(passes * size)} per disk")
    if workload is not None:
        print(f"  {describe(workload, plan[0].config)}; the choice goes by it")
    for v in validations:
        print(f"  disk {v.directory}: {v.filesystem}, {'O_DIRECT' if v.direct else 'buffered I/O (no O_DIRECT)'}, "
              f"{format_bytes(v.free_bytes)} free")
    outputs = [f"results to {args.out_dir}/"] + ([f"aio section to {config_out}"] if config_out else []) + \
              ([f"merged into {args.merge_into} (a backup first)"] if args.merge_into else [])
    print(f"  {', '.join(outputs)}")
    journal = SweepJournal(journal_path, settings, args.directories, done)
    if done:
        print(f"  resuming: {journal.measured} of {len(plan) * len(validations)} measurements kept in {journal_path}")

    # 2. Measure, saving as it goes.
    buffers = _buffers(size, len(validations))
    settings["buffers"] = buffers[0].lock_status
    started = time.monotonic()
    if workload is not None:
        check_memory(workload.buffer_bytes(plan[0].config) * len(validations) + 2 * size * len(validations),
                      "the workload's buffers beside the sweep's")
    disks = _measure(args, validations, plan, buffers, journal, request_size, workload)
    elapsed = time.monotonic() - started

    # 3. The choice: the lightest configuration within the noisiest disk's noise of the best round trip.
    cpu_noises = [d.noise.cpu for d in disks if d.noise.cpu is not None]
    choice = choose_config([d.points for d in disks], max(d.noise.relative for d in disks),
                           max(cpu_noises) if cpu_noises else None)

    # 4. Report: tables, noise and bests per disk, the choice, then the files and the answer.
    for d in disks:
        print(f"\n== {Path(d.validation.directory).resolve()} ({d.validation.filesystem}) ==")
        print(format_table(d.points, limit=args.top, choice=choice))
        if args.top and len(d.points) > args.top:
            print(f"... {len(d.points) - args.top} more rows in the CSV")
        print(format_noise(d))
        print(format_best(d))
    like = like_for_like(args, validations[0], choice.config, workload) if workload and not args.no_fio else None
    settings["elapsed_s"] = round(elapsed, 1)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    document = sweep_json(disks, settings, choice)
    if like is not None:
        document["like_for_like"] = like.to_json()
    write_json(journal_path, document)
    write_csv(args.out_dir / "sweep.csv", disks, choice)
    charts = _draw_charts(disks, args.out_dir, size, choice.config)
    if len(disks) > 1:
        print()
        print(format_together(disks, choice))
    print()
    print(format_choice(choice, len(disks), f"{workload.kind} figure" if workload else "round trip"))
    _write_answer(choice.config, config_out, args.merge_into)
    print(f"wrote {', '.join(map(str, [journal_path, args.out_dir / 'sweep.csv', *charts]))} ({elapsed:.0f} s)")
    if not charts:
        print(f"no chart: matplotlib is not installed; `pip install '{CHART_EXTRA}'` gives sweep.png")
    return 0


def _measure(args: argparse.Namespace, validations: list[Any], plan: list[Any], buffers: list[Any], journal: Any,
             request_size: int, workload: Any = None) -> list[Any]:
    """Sweep every directory (at once where there are several), recording each step in ``journal``
    and showing progress; on an interrupt or a failure, save what was measured and say how to go on."""
    from tensorio import TensorIOError

    from .measure import MeasurementError
    from .progress import Progress
    from .sweep import sweep_directory
    from .together import sweep_together

    total = len(plan) * len(validations)
    try:
        with Progress(total, enabled=not args.no_progress, done=journal.measured) as bar:
            def on_step(index: int, phase: str, step: Any, result: Any) -> None:
                if phase == "start":
                    bar.describe(f"{step.config.backend} bs={format_size(step.config.block_size)} "
                                 f"qd={step.config.queue_depth} t={step.config.thread_count}")
                elif phase == "done":
                    journal.record(index, step, result)
                    bar.step(f"W {result.write.gb_per_s:.2f} R {result.read.gb_per_s:.2f} GB/s")

            try:
                if len(validations) == 1:  # in this thread: Ctrl-C stops the point in flight at once
                    return [sweep_directory(validations[0], plan, buffers[0], request_size=request_size,
                                            repeats=args.repeats, with_fio=not args.no_fio, done=journal.done(0),
                                            on_step=lambda *event: on_step(0, *event), workload=workload)]
                return sweep_together(validations, plan, buffers, request_size=request_size, repeats=args.repeats,
                                      with_fio=not args.no_fio, done=[journal.done(i) for i in range(len(buffers))],
                                      on_step=on_step, on_stopping=lambda: print(
                                          "\ntensorio-bench sweep: stopping; waiting for the step in flight on each "
                                          "directory", file=sys.stderr), workload=workload)
            except (TensorIOError, MeasurementError) as exc:
                raise CliError(str(exc)) from None
    except (KeyboardInterrupt, CliError):
        if journal.measured:
            journal.save()
            print(f"tensorio-bench sweep: kept {journal.measured} of {total} measurements in {journal.path} (marked "
                  f"incomplete); run the same command with --resume to go on", file=sys.stderr)
        raise


def _write_answer(config: Any, config_out: Path | None, merge_target: Path | None) -> None:
    """Write the chosen ``config`` as an aio section alone and/or into the user's config."""
    from .configfile import merge_into, write_aio_config

    if config_out:
        write_aio_config(config_out, config)
        print(f"wrote {config_out}: {_json_line({'aio': config.to_dict()})}")
    if merge_target:
        try:
            backup = merge_into(merge_target, config)
        except (OSError, ValueError) as exc:
            raise CliError(f"--merge-into {merge_target}: {exc}") from None
        print(f"merged the aio section into {merge_target}, every other key kept (the original is in {backup})")


def _draw_charts(disks: list[Any], out_dir: Path, size: int, chosen: Any) -> list[Path]:
    """One PNG per disk (sweep.png, or sweep-diskN.png for several), titled with the directory's absolute
    path and file system, the chosen configuration marked; none when matplotlib is missing."""
    try:
        from .chart import plot_sweep
    except ModuleNotFoundError as exc:
        if (exc.name or "").partition(".")[0] != "matplotlib":
            raise
        return []  # matplotlib is an extra: the caller says how to get it
    charts = []
    for i, d in enumerate(disks, 1):
        chart = out_dir / ("sweep.png" if len(disks) == 1 else f"sweep-disk{i}.png")
        plot_sweep(d.points, chart, f"{Path(d.validation.directory).resolve()} ({d.validation.filesystem}"
                                    f"{'' if d.validation.direct else ', buffered'}), {format_size(size)} per pass",
                   chosen=chosen, fio_curve=d.fio_curve)
        charts.append(chart)
    return charts


# ---- fio -------------------------------------------------------------------------------------------

def _cmd_fio(args: argparse.Namespace) -> int:
    from .fio import FioError, FioNotFound, job_for_config, run_fio

    say = _say(args)
    config = _config_from_args(args)
    try:
        job = replace(job_for_config(config, directory=args.directory, rw=args.rw, size=args.size),
                      ioengine=args.ioengine, overwrite=args.rw == "write" and not args.fresh)
    except ValueError as exc:
        raise CliError(str(exc), EXIT_USAGE) from None
    say(f"tensorio-bench fio {args.directory}: {args.rw} {format_size(job.size)} with the settings of")
    say(f"aio: {_json_line(config.to_dict())}")
    try:
        result = run_fio(job)
    except (FioNotFound, FioError, OSError) as exc:
        raise CliError(str(exc)) from None
    if args.json:
        print(_json_line({"tool": "tensorio-bench fio", "directory": str(Path(args.directory).resolve()),
                          "aio": config.to_dict(), "ioengine": job.ioengine, "direct": job.direct,
                          "block_size": job.block_size, **result.to_json()}, indent=2))
        return 0
    print(" ".join(result.command))
    print(f"{result.fio_version}: {result.rw} {result.gb_per_s:.2f} GB/s  {result.iops:.0f} IOPS "
          f"({format_size(job.block_size)})  clat p50 {format_ns(result.clat_ns_p50)}, "
          f"p99 {format_ns(result.clat_ns_p99)} (per {format_size(job.block_size)} I/O)")
    if not job.direct:
        print("note: buffered I/O (direct=0): the page cache inflates these figures")
    return 0


# ---- shared helpers --------------------------------------------------------------------------------

def _usable_directory(directory: Path, size: int):
    """Validate ``directory`` for ``size`` bytes; a failed check becomes a CliError with the report."""
    from .validate import validate_directory

    v = validate_directory(directory, need_bytes=size)
    if not v.usable:
        raise CliError(f"{directory} cannot be used: " + "; ".join(c.detail for c in v.failures()))
    return v


def _check_devices(directories: list[Path], allow_shared: bool) -> None:
    """Refuse two directories on one device (they would share its bandwidth, measured at once) unless
    ``allow_shared``."""
    from .device import shared_devices

    if allow_shared:
        return
    for a, b, disk in shared_devices(directories):
        raise CliError(f"{a} and {b} are on the same device ({disk}): measured at once they share its bandwidth; "
                       f"give one directory per device, or --same-device to measure them together anyway",
                       EXIT_USAGE)


def _check_backend(config: Any, v: Any) -> None:
    if config.backend == "io_uring" and not v.io_uring:
        raise CliError(f"backend io_uring cannot run here ({_io_uring_reason()}); use --backend threads or auto")
    if config.direct is True and not v.direct:
        raise CliError(f"direct=true but {v.directory} has no O_DIRECT ({v.filesystem}); use --direct auto or false")


def _io_uring_reason() -> str:
    from tensorio import probe_io_uring

    return probe_io_uring()[1]


def _config_from_args(args: argparse.Namespace):
    """The aio config of ``--config FILE`` (or the defaults) with the flags given on top; a file
    without an aio section is refused rather than read as the defaults."""
    from tensorio import AioConfig

    from .configfile import read_aio_config

    try:
        values = read_aio_config(args.config).to_dict() if args.config else AioConfig().to_dict()
        for key in ("block_size", "queue_depth", "thread_count", "single_submit", "overlap_events", "backend"):
            if getattr(args, key) is not None:
                values[key] = getattr(args, key)
        if args.direct is not None:
            values["direct"] = _direct_arg(args.direct)
        return AioConfig.from_dict(values)
    except FileNotFoundError:
        raise CliError(f"--config {args.config}: no such file", EXIT_USAGE) from None
    except ValueError as exc:
        raise CliError(f"--config {exc}" if args.config and str(exc).startswith(str(args.config)) else str(exc),
                       EXIT_USAGE) from None


def _buffers(size: int, count: int = 1) -> list[Any]:
    """``count`` pairs of locked buffers of ``size`` bytes (a point writes one and reads back into the
    other; one pair per directory measured at once), after checking that the memory holds them all; a
    refusal (ours or the kernel's) is one line naming the size and what is available."""
    from .measure import Buffers
    from .memory import NotEnoughMemory, check_room, memory_room

    what = f"two buffers of {format_size(size)} (written, then read back into the second)"
    if count > 1:
        what = f"{count} pairs of buffers of {format_size(size)} (one pair per directory)"
    try:
        check_room(2 * size * count, what)
        return [Buffers(size) for _ in range(count)]
    except NotEnoughMemory as exc:
        raise CliError(str(exc)) from None
    except (MemoryError, OSError) as exc:  # a limit the check could not see (overcommit, a cgroup in a namespace)
        try:
            room = f"{format_bytes(memory_room().available)} available"
        except OSError:
            room = "available memory unknown"
        reason = getattr(exc, "strerror", None) or type(exc).__name__
        raise CliError(f"{what} could not be allocated ({reason}; {room}); use a smaller --size") from None


def _say(args: argparse.Namespace):
    """print, or print to stderr where ``--json`` keeps stdout for the JSON document."""
    stream = sys.stderr if getattr(args, "json", False) else sys.stdout
    return lambda text: print(text, file=stream)


def _request_size(args: argparse.Namespace, block_sizes: Any, *, size: int | None = None) -> int:
    """The request size: --request-size or 16M, capped at the test size; checked against the blocks."""
    from .measure import DEFAULT_REQUEST_BYTES

    size = size or args.size
    request = min(args.request_size or DEFAULT_REQUEST_BYTES, size)
    if size % request:
        raise CliError(f"--size {format_size(size)} is not a multiple of the request size {format_size(request)}",
                       EXIT_USAGE)
    if request % 4096:
        raise CliError(f"request size {request} is not a multiple of 4096 (O_DIRECT alignment)", EXIT_USAGE)
    if max(block_sizes) > request:
        raise CliError(f"block size {format_size(max(block_sizes))} exceeds the request size {format_size(request)}; "
                       f"raise --request-size (and --size) so each request holds whole blocks", EXIT_USAGE)
    return request


def _direct_arg(text: str) -> bool | str:
    return {"auto": "auto", "true": True, "false": False}[text]


def _bools(values: tuple[bool, ...]) -> str:
    return "/".join(str(v).lower() for v in values)


def _json_line(data: dict[str, Any], indent: int | None = None) -> str:
    import json

    return json.dumps(data, indent=indent)


def _size(text: str) -> int:
    try:
        value = parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: a size must be > 0")
    return value


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: must be >= 1")
    return value


def _add_aio_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("aio settings (default: AioConfig's defaults, or --config)")
    g.add_argument("--config", type=Path, metavar="FILE", help="JSON with an `aio` section (e.g. configs/aio_tuned.json)")
    g.add_argument("--block-size", "--bs", dest="block_size", type=_size, metavar="SIZE", help="bytes per piece, e.g. 1M")
    g.add_argument("--queue-depth", "--qd", dest="queue_depth", type=_positive, metavar="N", help="pieces in flight per worker")
    g.add_argument("--thread-count", "--threads", dest="thread_count", type=_positive, metavar="N",
                   help="workers a request is split over (DeepSpeed's intra_op_parallelism)")
    g.add_argument("--single-submit", action=argparse.BooleanOptionalAction, default=None,
                   help="one submission per piece (io_uring)")
    g.add_argument("--overlap-events", action=argparse.BooleanOptionalAction, default=None,
                   help="refill the queue as pieces complete (io_uring)")
    g.add_argument("--backend", choices=("auto", "io_uring", "threads"), default=None)
    g.add_argument("--direct", choices=("auto", "true", "false"), default=None,
                   help="O_DIRECT: auto uses it where the file system has it (the default)")


def _parser() -> argparse.ArgumentParser:
    from .compare import add_compare_parser
    from .workload_cli import RUN_RUNTIME_S, SWEEP_RUNTIME_S, add_workload_flags

    parser = argparse.ArgumentParser(
        prog="tensorio-bench",
        description="Tune tensorio's aio settings for a disk: check a directory, measure one configuration, "
                    "sweep a grid of them, and compare with fio.",
        epilog="Sizes take binary suffixes: 128K, 1M, 2G. See docs/tuning.md.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("validate", help="what works for swap files in a directory, and why not",
                       description="Check a directory for swap files: writable, file system, O_DIRECT, free space, "
                                   "io_uring, memlock limit, CUDA, fio. Exit status 1 when it cannot hold them.")
    p.add_argument("directory", type=Path, metavar="DIR")
    p.add_argument("--size", type=_size, metavar="SIZE", help="also fail when SIZE (plus 10%%) does not fit")
    p.set_defaults(func=_cmd_validate)

    p = sub.add_parser("run", help="measure one configuration (like one fio job)",
                       description="Write and/or read SIZE bytes with one aio configuration through tensorio; print "
                                   "GB/s, IOPS and per-request completion latency (p50, p99).")
    p.add_argument("directory", type=Path, metavar="DIR")
    p.add_argument("--rw", choices=("read", "write", "both"), default="both", help="direction(s) timed (default both)")
    p.add_argument("--size", type=_size, default=_size("256M"), metavar="SIZE", help="bytes per pass (default 256M)")
    p.add_argument("--request-size", type=_size, metavar="SIZE", help="bytes per request (default 16M)")
    p.add_argument("--repeats", type=_positive, default=3, metavar="N", help="timed passes; the median is reported")
    p.add_argument("--json", action="store_true",
                   help="print the result as one JSON document on stdout (the settings go to stderr)")
    p.add_argument("--fio", action="store_true",
                   help="with --workload: ours (2 MiB and 4 KiB pages) beside fio on the same workload, in turn")
    _add_aio_flags(p)
    add_workload_flags(p, runtime_s=RUN_RUNTIME_S)
    p.set_defaults(func=_cmd_run)

    p = sub.add_parser("sweep", help="measure a grid of configurations and pick the best",
                       description="Sweep block size x queue depth x threads x single_submit x overlap_events x "
                                   "backend on each directory (one per disk), reading and writing; save JSON, CSV "
                                   "and a chart, compare the best with fio, and write the chosen `aio` section.")
    p.add_argument("directories", type=Path, nargs="+", metavar="DIR",
                   help="one directory per device; several are swept at once")
    p.add_argument("--same-device", action="store_true",
                   help="accept several directories on one device (measured at once, they share it)")
    grid = p.add_mutually_exclusive_group()
    grid.add_argument("--quick", action="store_true", help="16 points at 128M: under a minute")
    grid.add_argument("--full", action="store_true", help="the whole cross product at 1G: hours")
    p.add_argument("--size", type=_size, metavar="SIZE", help="bytes per pass (default: the grid's, 128M/256M/1G)")
    p.add_argument("--request-size", type=_size, metavar="SIZE", help="bytes per request (default 16M)")
    p.add_argument("--repeats", type=_positive, default=3, metavar="N", help="passes per point; median reported")
    p.add_argument("--backend", choices=("io_uring", "threads"), help="sweep only this backend")
    p.add_argument("--direct", choices=("auto", "true", "false"), default="auto",
                   help="O_DIRECT (auto: where the file system has it)")
    p.add_argument("--out-dir", type=Path, default=DEFAULT_OUT_DIR, metavar="RESULTS",
                   help=f"where sweep.json, sweep.csv and sweep.png (with matplotlib) go (default {DEFAULT_OUT_DIR})")
    p.add_argument("--config-out", type=Path, metavar="FILE",
                   help=f"where the chosen `aio` section goes alone (default {DEFAULT_CONFIG_OUT}, unless "
                        f"--merge-into is given); a file with other sections is refused")
    p.add_argument("--merge-into", type=Path, metavar="FILE",
                   help="set the chosen settings in the aio section of this DeepSpeed or inference config, keeping "
                        "every other key (the original is copied to FILE.bak first)")
    p.add_argument("--resume", action="store_true",
                   help="go on with the interrupted sweep saved in RESULTS/sweep.json (same directories and options)")
    p.add_argument("--top", type=_positive, default=15, metavar="N", help="rows of the summary table (default 15)")
    p.add_argument("--no-fio", action="store_true", help="skip the comparison with fio")
    p.add_argument("--no-progress", action="store_true",
                   help="no progress (a bar on a terminal, else a line every tenth of the sweep)")
    add_workload_flags(p, runtime_s=SWEEP_RUNTIME_S)
    p.set_defaults(func=_cmd_sweep)

    p = sub.add_parser("fio", help="run the fio binary with the settings of a configuration",
                       description="Run fio with the job matching an aio configuration (numjobs = thread_count, "
                                   "iodepth = queue_depth, bs = block_size) and print its figures.")
    p.add_argument("directory", type=Path, metavar="DIR")
    p.add_argument("--rw", choices=("read", "write"), default="read")
    p.add_argument("--size", type=_size, default=_size("256M"), metavar="SIZE", help="bytes moved (default 256M)")
    p.add_argument("--ioengine", choices=("io_uring", "libaio", "psync"), default="io_uring")
    p.add_argument("--fresh", action="store_true",
                   help="write into a fresh file (allocating writes) instead of overwriting a laid-out one")
    p.add_argument("--json", action="store_true",
                   help="print fio's figures as one JSON document on stdout (the settings go to stderr)")
    _add_aio_flags(p)
    p.set_defaults(func=_cmd_fio)
    add_compare_parser(sub, _add_aio_flags)
    for p in (parser, *sub.choices.values()):  # main() reads it: listed here for --help
        p.add_argument("--debug", action="store_true",
                       help=f"show the traceback of an error instead of one line (or set {DEBUG_ENV}=1)")
    return parser


if __name__ == "__main__":
    sys.exit(main())
