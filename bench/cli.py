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

EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 1, 2, 130

DEBUG_ENV = "OFFLOAD_DEBUG"
"""Set to 1 to see the traceback of an error: the variable of the ``python -m offload.*`` commands
(offload.cli_errors, not imported here: it would load the offload package into this tool)."""

DEFAULT_CONFIG_OUT = Path("configs/aio_tuned.json")

#: The extra that brings matplotlib, which the sweep's chart needs (the JSON and CSV need nothing more).
CHART_EXTRA = "tensorio-offload[bench]"
DEFAULT_OUT_DIR = Path("results/aio-sweep")


class CliError(Exception):
    """A failure to report in one line and exit with ``status``, without a traceback."""

    def __init__(self, message: str, status: int = EXIT_FAILED) -> None:
        super().__init__(message)
        self.status = status


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
    from .measure import Buffers, MeasurementError, measure_point
    from .report import BUFFERED_NOTE, format_point
    from .scratch import scratch_dir
    from tensorio import TensorIOError

    config = _config_from_args(args)
    request_size = _request_size(args, [config.block_size])
    rws = ("write", "read") if args.rw == "both" else (args.rw,)
    print(f"tensorio-bench run {args.directory}: {args.rw} {format_size(args.size)} as requests of "
          f"{format_size(request_size)}, {args.repeats} repeats (median), after an untimed warm-up write")
    print(f"aio: {_json_line(config.to_dict())}")
    v = _usable_directory(args.directory, args.size)
    _check_backend(config, v)
    buffers = Buffers(args.size)
    print(f"disk: {v.filesystem}, {'O_DIRECT' if v.direct and config.direct is not False else 'buffered'}; "
          f"buffers {buffers.lock_status}")
    try:
        with scratch_dir(v.directory) as scratch:
            point = measure_point(config, scratch / "run.dat", buffers, request_size=request_size,
                                  repeats=args.repeats, direct=v.direct, rws=rws)
    except (TensorIOError, MeasurementError) as exc:
        raise CliError(str(exc)) from None
    print(f"backend: {point.backend}")
    print(format_point(point))
    if not point.direct:
        print(f"note: {BUFFERED_NOTE}")
    return 0


# ---- sweep -----------------------------------------------------------------------------------------

def _cmd_sweep(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from tensorio import AioConfig, TensorIOError

    from .measure import Buffers, MeasurementError
    from .report import format_best, format_table, sweep_json, write_aio_config, write_csv, write_json
    from .sweep import GRIDS, chosen_config, config_label, sweep_directory

    grid_name = "quick" if args.quick else "full" if args.full else "default"
    grid = GRIDS[grid_name]
    if args.backend:
        grid = replace(grid, backends=(args.backend,))
    size = args.size or grid.size
    request_size = _request_size(args, grid.block_sizes, size=size)
    direct = _direct_arg(args.direct)

    # 1. Check every directory before any I/O: a sweep that fails on its second disk wastes the first.
    validations = [_usable_directory(d, size) for d in args.directories]
    for v in validations:
        if direct is True and not v.direct:
            raise CliError(f"--direct true but {v.directory} has no O_DIRECT ({v.filesystem}); use --direct auto")
    backends_here = [b for b in grid.backends if b != "io_uring" or all(v.io_uring for v in validations)]
    if not backends_here:
        raise CliError(f"io_uring cannot run here ({_io_uring_reason()}); use --backend threads")
    configs = grid.configs(backends=backends_here, direct=direct)
    passes = len(configs) * (1 + 2 * args.repeats)
    print(f"tensorio-bench sweep ({grid_name} grid): {len(configs)} points x {len(validations)} disk(s), "
          f"{args.repeats} repeats (median)")
    print(f"  block sizes  {', '.join(format_size(b) for b in grid.block_sizes)}")
    print(f"  queue depths {', '.join(map(str, grid.queue_depths))}; threads {', '.join(map(str, grid.thread_counts))}")
    print(f"  single_submit {_bools(grid.single_submit)}; overlap_events {_bools(grid.overlap_events)} (io_uring only)")
    print(f"  backends     {', '.join(backends_here)}" +
          ("" if backends_here == list(grid.backends) else f" (io_uring unavailable: {_io_uring_reason()})"))
    print(f"  size {format_size(size)} per pass in requests of {format_size(request_size)}; direct={direct}; "
          f"{passes} passes = {format_bytes(passes * size)} per disk")
    for v in validations:
        print(f"  disk {v.directory}: {v.filesystem}, {'O_DIRECT' if v.direct else 'buffered I/O (no O_DIRECT)'}, "
              f"{format_bytes(v.free_bytes)} free")
    print(f"  results to {args.out_dir}/, aio section to {args.config_out}")

    buffers = Buffers(size)
    disks = []
    started = time.monotonic()
    with tqdm(total=len(configs) * len(validations), file=sys.stderr, unit="pt", dynamic_ncols=True,
              disable=args.no_progress) as bar:
        for index, v in enumerate(validations, 1):
            def on_point(phase: str, config: AioConfig, result: Any, index: int = index) -> None:
                if phase == "start":
                    bar.set_description_str(f"disk {index}/{len(validations)} {config_label(config)}")
                else:
                    bar.set_postfix_str(f"W {result.write.gb_per_s:.2f} R {result.read.gb_per_s:.2f} GB/s")
                    bar.update(1)

            try:
                disks.append(sweep_directory(v, configs, buffers, request_size=request_size, repeats=args.repeats,
                                             with_fio=not args.no_fio, on_point=on_point))
            except (TensorIOError, MeasurementError) as exc:
                raise CliError(f"{v.directory}: {exc}") from None
    elapsed = time.monotonic() - started

    # 2. Report: tables and bests per disk, then the files.
    for d in disks:
        print(f"\n== {Path(d.validation.directory).resolve()} ({d.validation.filesystem}) ==")
        print(format_table(d.points, limit=args.top))
        if args.top and len(d.points) > args.top:
            print(f"... {len(d.points) - args.top} more rows in the CSV")
        print(format_best(d))
    chosen = chosen_config([d.points for d in disks])
    settings = {"grid": grid_name, **{k: list(v) for k, v in asdict(grid).items() if k != "size"},
                "backends": backends_here, "size": size, "request_size": request_size, "repeats": args.repeats,
                "direct": direct, "elapsed_s": round(elapsed, 1), "buffers": buffers.lock_status}
    args.out_dir.mkdir(parents=True, exist_ok=True)
    write_json(args.out_dir / "sweep.json", sweep_json(disks, settings, chosen))
    write_csv(args.out_dir / "sweep.csv", disks)
    charts = _draw_charts(disks, args.out_dir, size, chosen)
    write_aio_config(args.config_out, chosen)
    print(f"\nchosen (best round trip{' over all disks' if len(disks) > 1 else ''}): {config_label(chosen)}")
    print(f"wrote {args.config_out}: {_json_line({'aio': chosen.to_dict()})}")
    print(f"wrote {', '.join(map(str, [args.out_dir / 'sweep.json', args.out_dir / 'sweep.csv', *charts]))} "
          f"({elapsed:.0f} s)")
    if not charts:
        print(f"no chart: matplotlib is not installed; `pip install '{CHART_EXTRA}'` gives sweep.png")
    return 0


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

    config = _config_from_args(args)
    try:
        job = replace(job_for_config(config, directory=args.directory, rw=args.rw, size=args.size),
                      ioengine=args.ioengine, overwrite=args.rw == "write" and not args.fresh)
    except ValueError as exc:
        raise CliError(str(exc), EXIT_USAGE) from None
    print(f"tensorio-bench fio {args.directory}: {args.rw} {format_size(job.size)} with the settings of")
    print(f"aio: {_json_line(config.to_dict())}")
    try:
        result = run_fio(job)
    except (FioNotFound, FioError, OSError) as exc:
        raise CliError(str(exc)) from None
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


def _check_backend(config: Any, v: Any) -> None:
    if config.backend == "io_uring" and not v.io_uring:
        raise CliError(f"backend io_uring cannot run here ({_io_uring_reason()}); use --backend threads or auto")
    if config.direct is True and not v.direct:
        raise CliError(f"direct=true but {v.directory} has no O_DIRECT ({v.filesystem}); use --direct auto or false")


def _io_uring_reason() -> str:
    from tensorio import probe_io_uring

    return probe_io_uring()[1]


def _config_from_args(args: argparse.Namespace):
    """The aio config of ``--config FILE`` (or the defaults) with the flags given on top."""
    from tensorio import AioConfig

    try:
        values = AioConfig.from_file(args.config).to_dict() if args.config else AioConfig().to_dict()
        for key in ("block_size", "queue_depth", "thread_count", "single_submit", "overlap_events", "backend"):
            if getattr(args, key) is not None:
                values[key] = getattr(args, key)
        if args.direct is not None:
            values["direct"] = _direct_arg(args.direct)
        return AioConfig.from_dict(values)
    except FileNotFoundError:
        raise CliError(f"--config {args.config}: no such file", EXIT_USAGE) from None
    except ValueError as exc:
        raise CliError(str(exc), EXIT_USAGE) from None


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


def _json_line(data: dict[str, Any]) -> str:
    import json

    return json.dumps(data)


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
    _add_aio_flags(p)
    p.set_defaults(func=_cmd_run)

    p = sub.add_parser("sweep", help="measure a grid of configurations and pick the best",
                       description="Sweep block size x queue depth x threads x single_submit x overlap_events x "
                                   "backend on each directory (one per disk), reading and writing; save JSON, CSV "
                                   "and a chart, compare the best with fio, and write the chosen `aio` section.")
    p.add_argument("directories", type=Path, nargs="+", metavar="DIR", help="one directory per disk")
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
    p.add_argument("--config-out", type=Path, default=DEFAULT_CONFIG_OUT, metavar="FILE",
                   help=f"where the chosen `aio` section goes (default {DEFAULT_CONFIG_OUT})")
    p.add_argument("--top", type=_positive, default=15, metavar="N", help="rows of the summary table (default 15)")
    p.add_argument("--no-fio", action="store_true", help="skip the comparison with fio")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
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
    _add_aio_flags(p)
    p.set_defaults(func=_cmd_fio)
    for p in (parser, *sub.choices.values()):  # main() reads it: listed here for --help
        p.add_argument("--debug", action="store_true",
                       help=f"show the traceback of an error instead of one line (or set {DEBUG_ENV}=1)")
    return parser


if __name__ == "__main__":
    sys.exit(main())
