"""How fast a whole safetensors file is checked against its checksum record (`verify_file`: a generation cache
when a run reuses it, a checkpoint's files under ``python -m offload.checkpoint verify``), against fio
reading as many bytes from the same directory: the floor, since every byte must be read.

    python -m benchmarks.file_verify --dir /work/tmp --size 2G --rounds 3

Writes one file of ``--size`` bytes (bf16 tensors of 32 MiB, random) with its checksums, then per round:
its pages dropped from the page cache, `verify_file` timed; fio's sequential O_DIRECT read of as many bytes
(`benchmarks.disk_floor.disk_rates`, tensorio's own read where fio is missing, said so). Medians of the
rounds, and their ratio (target: the check at fio's read speed, 1.0x or less of its time).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.disk_floor import disk_rates
from offload.infer.weights.convert import drop_page_cache
from offload.storage.file_checksums import verify_file
from offload.storage.safetensors_writer import atomic_safetensors
from tensorio import AioConfig, parse_size

TENSOR_BYTES = 32 << 20


def main(argv: list[str] | None = None) -> dict[str, float]:
    """Run the benchmark; print and return the medians."""
    ap = argparse.ArgumentParser(prog="python -m benchmarks.file_verify", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", required=True, help="a directory on the disk to measure")
    ap.add_argument("--size", default="2G", help="bytes of the file (rounded to whole 32 MiB tensors)")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    count = max(1, parse_size(args.size) // TENSOR_BYTES)
    shape = (TENSOR_BYTES // 2 // 4096, 4096)
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="bench-verify-") as directory:
        path = Path(directory, "model.safetensors")
        generator = torch.Generator().manual_seed(0)
        with atomic_safetensors(path, {f"t{i}": (torch.bfloat16, shape) for i in range(count)}, checksums=True) as out:
            for i in range(count):
                out.write(f"t{i}", torch.randn(shape, generator=generator).to(torch.bfloat16))
        record, nbytes = out.checksums, path.stat().st_size
        checks, reads = [], []
        for _ in range(args.rounds):
            drop_page_cache(path)
            start = time.perf_counter()
            verify_file(str(path), record)
            checks.append(time.perf_counter() - start)
            rates = disk_rates(AioConfig(), directory, nbytes // (1 << 20) * (1 << 20))
            reads.append(nbytes / rates.read_bps)
    check, read = statistics.median(checks), statistics.median(reads)
    print(f"file of {nbytes / 1e9:.2f} GB ({count} tensors): verify_file {check:.3f} s ({nbytes / check / 1e9:.2f} "
          f"GB/s; rounds {', '.join(f'{t:.3f}' for t in checks)}); {rates.source} reading as many bytes {read:.3f} s "
          f"({nbytes / read / 1e9:.2f} GB/s); verify / read {check / read:.2f}x")
    return {"verify_s": check, "read_s": read, "ratio": check / read, "bytes": float(nbytes)}


if __name__ == "__main__":
    main()
