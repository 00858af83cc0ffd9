"""The checksum's speed beside the disk's: GB/s of each candidate hash on a locked buffer, whether it lets
other Python threads run while it hashes, and fio's sequential read speed on the same machine.

The swap files' checksums (tensorio's ``checksum=``/``verify=``) are hashed in the I/O threads piece by
piece as the bytes land. `fresh_hash_speeds` measures the hash as it meets them there: each piece hashed
right after its O_DIRECT read (still in the CPU's cache), or right after its O_DIRECT write; the time it
takes to hash a step's bytes at those speeds is what checksums cost a step whose cores are busy
(`benchmarks.engine_step` prints that floor beside its on/off ratio).

    python -m benchmarks.checksum_speed --dir . --size 64M --repeats 5
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import threading
import time

import numpy
import torch
import xxhash

import tensorio
from tensorio import parse_size
from bench.fio import FioJob, FioNotFound, run_fio


def _candidates() -> dict[str, object]:
    hashes = {"xxh3_64": xxhash.xxh3_64_intdigest, "xxh3_128": xxhash.xxh3_128_intdigest}
    try:
        import google_crc32c  # optional: pip install google-crc32c
    except ImportError:
        print("google-crc32c is not installed (pip install google-crc32c): crc32c not measured")
    else:
        # It takes no memoryview (the buffer could change under it); a NumPy view of the same memory is no copy.
        hashes[f"crc32c ({google_crc32c.implementation})"] = lambda view: google_crc32c.value(
            numpy.frombuffer(view, dtype=numpy.uint8))
    return hashes


def _gb_per_s(fn, view: memoryview, repeats: int) -> float:
    fn(view)  # warm-up
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn(view)
        seconds.append(time.perf_counter() - start)
    return len(view) / statistics.median(seconds) / 1e9


def _other_thread_share(fn, view: memoryview, seconds: float = 0.5) -> float:
    """Python work done by this thread while another hashes in a loop, as a fraction of that work alone
    (about 1.0 when the hash releases the GIL and a core is free; well below when it holds the GIL)."""

    def count(until: float) -> int:
        n = 0
        while time.perf_counter() < until:
            n += 1
        return n

    alone = count(time.perf_counter() + seconds)
    stop = threading.Event()

    def hash_loop() -> None:
        while not stop.is_set():
            fn(view)

    worker = threading.Thread(target=hash_loop, daemon=True)
    worker.start()
    beside = count(time.perf_counter() + seconds)
    stop.set()
    worker.join()
    return beside / alone


def fresh_hash_speeds(directory: str, piece_bytes: int = 1 << 20, nbytes: int = 256 << 20,
                      repeats: int = 3) -> tuple[float, float]:
    """(GB/s hashing pieces fresh from an O_DIRECT read, GB/s hashing pieces right after their O_DIRECT
    write): ``nbytes`` through a file in ``directory`` in ``piece_bytes`` pieces, each hashed (xxh3_64, as
    tensorio) right after it moved, median of ``repeats`` passes; only the hash calls are timed."""
    buffer = tensorio.aligned_tensor(nbytes, torch.uint8).random_(0, 256)
    view = memoryview(buffer.numpy()).cast("B")
    fd, path = tempfile.mkstemp(dir=directory, prefix="hash-floor-")
    os.close(fd)
    fd = os.open(path, os.O_RDWR | getattr(os, "O_DIRECT", 0))
    speeds: dict[bool, list[float]] = {True: [], False: []}
    try:
        for _ in range(repeats):
            for write in (True, False):
                hashing = 0.0
                for first in range(0, nbytes, piece_bytes):
                    piece = view[first:first + piece_bytes]
                    (os.pwritev if write else os.preadv)(fd, [piece], first)
                    start = time.perf_counter()
                    tensorio.checksum(piece)
                    hashing += time.perf_counter() - start
                speeds[write].append(nbytes / hashing / 1e9)
    finally:
        os.close(fd)
        os.unlink(path)
    return statistics.median(speeds[False]), statistics.median(speeds[True])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default=".", help="directory on the disk for fio's read (default: .)")
    parser.add_argument("--size", default="64M", help="bytes hashed per call (default 64M)")
    parser.add_argument("--fio-size", default="1G", help="bytes fio reads (default 1G)")
    parser.add_argument("--repeats", type=int, default=5, help="hash calls timed; the median is reported")
    args = parser.parse_args(argv)
    size = parse_size(args.size)
    print(f"buffer {size} bytes, locked; {args.repeats} repeats (median); fio read of {args.fio_size} "
          f"in {os.path.abspath(args.dir)}, 1 MiB blocks, queue depth 32, O_DIRECT; {os.cpu_count()} CPUs")

    buffer = tensorio.locked_tensor(size, torch.uint8)
    buffer.copy_(torch.randint(0, 256, (size,), dtype=torch.uint8))
    view = memoryview(buffer.numpy()).cast("B")
    for name, fn in _candidates().items():
        print(f"{name:>24}: {_gb_per_s(fn, view, args.repeats):6.1f} GB/s, another thread's Python work beside "
              f"it: {_other_thread_share(fn, view):4.0%} of alone")
    fresh_read, fresh_write = fresh_hash_speeds(args.dir)
    print(f"{'xxh3_64, as tensorio':>24}: {fresh_read:6.1f} GB/s on 1 MiB pieces fresh from an O_DIRECT read, "
          f"{fresh_write:.1f} GB/s right after their O_DIRECT write (256 MiB, median of 3)")
    try:
        result = run_fio(FioJob(directory=args.dir, rw="read", size=parse_size(args.fio_size), block_size=1 << 20,
                                queue_depth=32))
        print(f"{'fio read':>24}: {result.gb_per_s:6.2f} GB/s")
    except FioNotFound as error:
        print(f"fio: {error}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
