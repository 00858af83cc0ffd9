"""Where a small request's CPU time goes: microseconds per block-sized piece, per phase, beside fio.

One whole-tensor write and read per round through tensorio's io_uring backend (O_DIRECT, a locked
tensor), with the worker's phases timed on its own thread's CPU clock by `tensorio.phase_timer`:
prepare (the caller's call), fill (submission entries), submit (the kernel issues the I/O), reap
(completions), wait (the rest of the worker's loop); then fio's CPU per I/O (its usr_cpu + sys_cpu)
on the same file with the same settings. The timers add a few clock reads per batch: the process
total here is slightly above `benchmarks.io_vs_fio`'s.

    python -m benchmarks.io_phases --dir . --size 1G --block-sizes 16K,128K --queue-depth 32 --rounds 3
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
from collections import defaultdict

import torch

import tensorio
from bench._units import parse_size
from bench.fio import FioJob, fio_path, run_fio
from bench.measure import process_cpu_seconds
from benchmarks.io_vs_fio import io_parser
from tensorio import PHASES


def measure(timer: tensorio.PhaseTimer, tensor, path, *, write: bool, pieces: int) -> dict[str, float]:
    """One transfer; CPU microseconds per piece of each phase, of the worker and of the process."""
    process_start = process_cpu_seconds()
    ns = timer.transfer(tensor, path, write=write)
    row = {phase: ns[phase] / 1e3 / pieces for phase in PHASES}
    row["worker"] = ns["worker"] / 1e3 / pieces
    row["process"] = (process_cpu_seconds() - process_start) * 1e6 / pieces
    return row


def main(argv: list[str] | None = None) -> int:
    args = io_parser(__doc__, block_sizes="16K,128K", rounds=3).parse_args(argv)
    if not tensorio.probe_io_uring()[0]:
        print(f"io_uring unavailable: {tensorio.probe_io_uring()[1]}")
        return 0
    size = parse_size(args.size)
    block_sizes = [parse_size(b) for b in args.block_sizes.split(",")]
    fio = fio_path()
    print(f"directory {os.path.abspath(args.dir)}, size {size} bytes, queue depth {args.queue_depth}, "
          f"io_uring, O_DIRECT, {args.rounds} rounds; fio: {fio or 'not installed'}")

    tensor = tensorio.locked_tensor(size, torch.uint8)
    tensor.copy_(torch.randint(0, 256, (size,), dtype=torch.uint8))
    scratch = tempfile.mkdtemp(prefix="tio-phases-", dir=args.dir)
    path = os.path.join(scratch, "data.bin")
    rows: dict[tuple[int, str], list[dict[str, float]]] = defaultdict(list)
    try:
        for bs in block_sizes:
            with tensorio.AioHandle(block_size=bs, queue_depth=args.queue_depth, backend="io_uring",
                                    direct=True) as handle, tensorio.phase_timer(handle) as timer:
                handle.write(tensor, path).result()  # lay the file out, untimed
                for _ in range(args.rounds):
                    for rw in ("write", "read"):
                        row = measure(timer, tensor, path, write=rw == "write", pieces=-(-size // bs))
                        if fio:
                            job = FioJob(directory=scratch, rw=rw, size=size, block_size=bs,
                                         queue_depth=args.queue_depth, overwrite=True)
                            row["fio"] = run_fio(job, filename=path).cpu_us_per_io or float("nan")
                        rows[(bs, rw)].append(row)
            print(f"block size {bs} done", file=sys.stderr)
    finally:
        if os.path.exists(path):
            os.unlink(path)
        os.rmdir(scratch)

    columns = (*PHASES, "worker", "process", "fio")
    print(f"\nCPU microseconds per block-sized I/O (medians of {args.rounds})")
    print(f"{'block':>7} {'op':>6}" + "".join(f"{c:>9}" for c in columns) + f"{'x fio':>7}")
    medians = {}
    for (bs, rw), samples in rows.items():
        med = {c: statistics.median(s[c] for s in samples) for c in columns if c in samples[0]}
        medians[f"{bs}/{rw}"] = med
        ratio = med["process"] / med["fio"] if med.get("fio") else float("nan")
        print(f"{bs >> 10:>6}K {rw:>6}" + "".join(f"{med.get(c, float('nan')):9.2f}" for c in columns)
              + f"{ratio:7.2f}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(medians, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
