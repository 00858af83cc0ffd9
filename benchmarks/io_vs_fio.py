"""tensorio against fio on the same directory: GB/s of each backend and the ratio to fio.

Each round writes then reads a locked tensor with every backend and, interleaved with it, runs fio
with the same block size, queue depth and O_DIRECT on the same directory. Writes overwrite a file
laid out beforehand (swap files are rewritten in place; fio gets ``--overwrite=1``), and fio runs on
the very file tensorio just wrote and read. The medians of the rounds are reported, with the CPU
time (user + system) per block-sized I/O of each: the whole process's for tensorio (getrusage around
the transfer), fio's own usr_cpu + sys_cpu for fio.

    python -m benchmarks.io_vs_fio --dir . --size 1G --block-sizes 1M,128K --queue-depth 32 --rounds 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

import torch

import tensorio
from tensorio import parse_size
from bench.fio import FioJob, FioNotFound, fio_path, run_fio
from bench.measure import timed_transfer

BACKENDS = ("io_uring", "threads")


def available_backends() -> list[str]:
    """The backends that can run here (io_uring only where the probe passes)."""
    return [b for b in BACKENDS if b != "io_uring" or tensorio.probe_io_uring()[0]]


def io_parser(doc: str, *, block_sizes: str, rounds: int) -> argparse.ArgumentParser:
    """The options of the I/O benchmarks (this one and `benchmarks.io_phases`): --dir, --size,
    --block-sizes, --queue-depth, --rounds, --json; ``doc``'s first line describes them."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--dir", default=".", help="directory on the disk to measure (default: .)")
    parser.add_argument("--size", default="1G", help="bytes per transfer (default 1G)")
    parser.add_argument("--block-sizes", default=block_sizes, help=f"comma-separated (default {block_sizes})")
    parser.add_argument("--queue-depth", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=rounds, help="repetitions; medians are reported")
    parser.add_argument("--json", help="also write the medians to this JSON file")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = io_parser(__doc__, block_sizes="1M,128K", rounds=5)
    parser.add_argument("--thread-count", type=int, default=1)
    args = parser.parse_args(argv)

    size = parse_size(args.size)
    block_sizes = [parse_size(b) for b in args.block_sizes.split(",")]
    backends = available_backends()
    fio = fio_path()
    print(f"directory {os.path.abspath(args.dir)} ({tensorio.filesystem_type(args.dir)}), size {size} bytes, "
          f"queue depth {args.queue_depth}, threads {args.thread_count}, O_DIRECT, {args.rounds} rounds")
    print(f"backends: {', '.join(backends)}; fio: {fio or 'not installed (apt-get install fio)'}")

    samples: dict[tuple[str, int, str], list[float]] = {}
    cpu: dict[tuple[str, int, str], list[float]] = {}  # CPU microseconds per block-sized I/O
    tensor = tensorio.locked_tensor(size, torch.uint8)
    tensor.copy_(torch.randint(0, 256, (size,), dtype=torch.uint8))
    handles = {(b, bs): tensorio.AioHandle(block_size=bs, queue_depth=args.queue_depth,
                                           thread_count=args.thread_count, backend=b, direct=True)
               for b in backends for bs in block_sizes}
    scratch = tempfile.mkdtemp(prefix="tio-bench-", dir=args.dir)
    path = os.path.join(scratch, "data.bin")
    try:
        handles[(backends[0], block_sizes[0])].write(tensor, path).result()  # lay the file out, untimed
        for round_no in range(args.rounds):
            for bs in block_sizes:
                for rw in ("write", "read"):
                    for backend in backends:
                        gbps, seconds = timed_transfer(handles[(backend, bs)], tensor, path, write=rw == "write")
                        samples.setdefault((backend, bs, rw), []).append(gbps)
                        cpu.setdefault((backend, bs, rw), []).append(seconds * 1e6 / -(-size // bs))
                    if fio:
                        job = FioJob(directory=scratch, rw=rw, size=size, block_size=bs,
                                     queue_depth=args.queue_depth, numjobs=args.thread_count,
                                     overwrite=True)
                        result = run_fio(job, filename=path)  # the very file we just moved
                        samples.setdefault(("fio", bs, rw), []).append(result.gb_per_s)
                        if result.cpu_us_per_io is not None:
                            cpu.setdefault(("fio", bs, rw), []).append(result.cpu_us_per_io)
            print(f"round {round_no + 1}/{args.rounds} done", file=sys.stderr)
    except FioNotFound:
        fio = None
    finally:
        for handle in handles.values():
            handle.close()
        if os.path.exists(path):
            os.unlink(path)
        os.rmdir(scratch)

    medians = {key: statistics.median(values) for key, values in samples.items()}
    cpu_medians = {key: statistics.median(values) for key, values in cpu.items()}
    print(f"\n{'block':>8} {'op':>6} {'engine':>9} {'GB/s':>7} {'x fio':>6} {'CPU us/IO':>10} {'x fio':>6}")
    for bs in block_sizes:
        for rw in ("write", "read"):
            ref = medians.get(("fio", bs, rw))
            for engine in (*backends, "fio"):
                if (engine, bs, rw) not in medians:
                    continue
                value = medians[(engine, bs, rw)]
                ratio = f"{value / ref:6.2f}" if ref else "     -"
                us, fio_us = cpu_medians.get((engine, bs, rw)), cpu_medians.get(("fio", bs, rw))
                cpu_text = f"{us:10.2f}" if us is not None else f"{'-':>10}"
                cpu_ratio = f"{us / fio_us:6.2f}" if us is not None and fio_us else "     -"
                print(f"{bs >> 10:>7}K {rw:>6} {engine:>9} {value:7.2f} {ratio} {cpu_text} {cpu_ratio}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump([{"engine": e, "block_size": bs, "rw": rw, "gb_per_s": v, "samples": samples[(e, bs, rw)],
                        "cpu_us_per_io": cpu_medians.get((e, bs, rw)), "cpu_samples": cpu.get((e, bs, rw), [])}
                       for (e, bs, rw), v in medians.items()], f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
