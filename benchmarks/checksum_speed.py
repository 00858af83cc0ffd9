"""The checksum's speed beside the disk's: GB/s of each candidate hash on a locked buffer, whether it lets
other Python threads run while it hashes, and fio's sequential read speed on the same machine.

The swap files' checksums (tensorio's ``checksum=``/``verify=``) are hashed in the I/O threads piece by
piece as the bytes land. `fresh_hash_speeds` measures the hash as it meets them there: each piece hashed
right after its O_DIRECT read (where it may still be in the CPU's cache), or after its O_DIRECT write;
`transfer_on_off` what checksums cost tensorio's own reads and writes where the disk is the bound.

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


def transfer_on_off(directory: str, nbytes: int = 512 << 20, repeats: int = 3) -> dict[str, float]:
    """tensorio writing then reading ``nbytes`` (1 MiB pieces, queue depth 32, O_DIRECT) without and with
    checksums, interleaved, ``repeats`` times: the median seconds of each (``write_off``, ``write_on``,
    ``read_off``, ``read_on``) and the process's CPU seconds per pass (``cpu_off``, ``cpu_on``); the read
    with checksums is checked against the write's, so a wrong hash fails the run."""
    data = tensorio.aligned_tensor(nbytes, torch.uint8).random_(0, 256)
    back = tensorio.aligned_tensor(nbytes, torch.uint8)
    fd, path = tempfile.mkstemp(dir=directory, prefix="hash-on-off-")
    os.close(fd)
    times: dict[str, list[float]] = {}
    try:
        with tensorio.AioHandle(block_size=1 << 20, queue_depth=32) as handle:
            handle.write(data, path, 0).result()  # the file's blocks allocated before anything is timed
            for _ in range(repeats):
                for on in (False, True):
                    suffix = "on" if on else "off"
                    cpu = time.process_time()
                    start = time.perf_counter()
                    written = handle.write(data, path, 0, checksum=nbytes if on else None)
                    written.result()
                    middle = time.perf_counter()
                    handle.read(back, path, 0, verify=written.checksums).result()
                    end = time.perf_counter()
                    for key, value in ((f"write_{suffix}", middle - start), (f"read_{suffix}", end - middle),
                                       (f"cpu_{suffix}", time.process_time() - cpu)):
                        times.setdefault(key, []).append(value)
    finally:
        os.unlink(path)
    return {key: statistics.median(values) for key, values in times.items()}


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
    moved = transfer_on_off(args.dir)
    print(f"{'tensorio, 512 MiB':>24}: written {moved['write_off']:.3f} s without checksums, {moved['write_on']:.3f} s "
          f"with ({moved['write_on'] / moved['write_off']:.2f}x); read {moved['read_off']:.3f} s / {moved['read_on']:.3f} s "
          f"verified ({moved['read_on'] / moved['read_off']:.2f}x); CPU {moved['cpu_off']:.2f} / {moved['cpu_on']:.2f} s "
          f"(median of 3, interleaved)")
    try:
        result = run_fio(FioJob(directory=args.dir, rw="read", size=parse_size(args.fio_size), block_size=1 << 20,
                                queue_depth=32))
        print(f"{'fio read':>24}: {result.gb_per_s:6.2f} GB/s")
    except FioNotFound as error:
        print(f"fio: {error}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
