"""The main job: check a directory's disk, move a 1 GiB tensor beside fio, and tune the aio settings.

    python -m bench.demo [--dir .] [--size 1G] [--out-dir results/demo]

1. Validate the directory (file system, O_DIRECT, io_uring, memlock, free space, fio).
2. Write then read one locked tensor with tensorio at the default aio settings and, right after,
   run fio with the same settings on the same directory; print both in GB/s and their ratio.
3. A quick sweep of the aio settings (`tensorio-bench sweep --quick`): the summary table, the best
   configurations against fio, and the chosen `aio` section, chart and data in ``--out-dir``.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import torch

import tensorio

from . import cli
from .fio import FioError, job_for_config, run_fio
from .measure import time_transfer
from .validate import validate_directory


def parser() -> argparse.ArgumentParser:
    """The demo's arguments; its name is ``TENSORIO_DEMO_PROG`` ("./run demo" from ./run), else
    "python -m bench.demo"."""
    parser = argparse.ArgumentParser(
        prog=os.environ.get("TENSORIO_DEMO_PROG", "python -m bench.demo"),
        description="tensorio demo: validate a disk, write and read a tensor beside fio, then a quick sweep of the aio "
                    "settings")
    parser.add_argument("--dir", default=".", help="directory on the disk to use (default: .)")
    parser.add_argument("--size", type=cli._size, default="1G", help="tensor size (default 1G)")
    parser.add_argument("--out-dir", default="results/demo", help="where the sweep's results go")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar during the sweep")
    parser.add_argument("--no-fio", action="store_true", help="skip every comparison with fio")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the demo; return its exit status."""
    args = parser().parse_args(argv)
    size = args.size

    print(f"== 1. validate {os.path.abspath(args.dir)}")
    validation = validate_directory(args.dir, need_bytes=size)
    print(validation.format())
    if not validation.usable:
        return 1

    config = tensorio.AioConfig()
    print(f"\n== 2. write and read a {size / 2**30:.2f} GiB tensor: {config}")
    tensor = tensorio.locked_tensor(size, torch.uint8)
    tensor.copy_(torch.randint(0, 256, (size,), dtype=torch.uint8))
    scratch = tempfile.mkdtemp(prefix="tio-demo-", dir=args.dir)
    path = os.path.join(scratch, "demo.bin")
    try:
        with tensorio.AioHandle.from_config(config) as handle:
            write = time_transfer(handle, tensor, path, write=True)
            back = tensorio.locked_tensor(size, torch.uint8)
            read = time_transfer(handle, back, path, write=False)
            if not torch.equal(back, tensor):
                print("FAIL: the tensor read back differs from the one written", file=sys.stderr)
                return 1
            backend = handle.backend_name
        fio = {}
        for rw in ("write", "read") if not args.no_fio else ():
            try:
                fio[rw] = run_fio(job_for_config(config, directory=scratch, rw=rw, size=size)).gb_per_s
            except FioError as exc:
                print(f"fio {rw}: not measured ({str(exc).splitlines()[0]})")
    finally:
        if os.path.exists(path):
            os.unlink(path)
        os.rmdir(scratch)
    print(f"\n{'':8}{'tensorio (' + backend + ')':>22}{'fio':>10}{'ratio':>8}")
    for rw, ours in (("write", write), ("read", read)):
        ref = fio.get(rw)
        print(f"{rw:<8}{ours:>17.2f} GB/s{(f'{ref:.2f}' if ref else '-'):>10}"
              f"{(f'{ours / ref:.2f}' if ref else '-'):>8}")
    print("(one run each, bytes verified; for medians of interleaved runs: python -m benchmarks.io_vs_fio)")

    print(f"\n== 3. quick sweep of the aio settings on {os.path.abspath(args.dir)}")
    return cli.main(["sweep", args.dir, "--quick", "--out-dir", args.out_dir,
                     "--config-out", os.path.join(args.out_dir, "aio_tuned.json"),
                     *(["--no-progress"] if args.no_progress else []), *(["--no-fio"] if args.no_fio else [])])


if __name__ == "__main__":
    sys.exit(main())
