"""Benchmark 2: one OffloadAdam step with all state on NVMe, against the in-memory step and the I/O bound.

    python -m benchmarks.optimizer_step --params 104857600 --dir /work/tmp
    python -m benchmarks.optimizer_step --params 104857600 --dir /work/tmp /dev/shm   # striped over two drives

The I/O bound is the state's bytes read at fio's read speed plus its bytes written at fio's write
speed, both measured here (before and after the offloaded steps, the faster run counting) on the
same directory with the same aio settings. Headline:
offloaded step / max(I/O bound, in-memory step) (target: at most 1.15).

With several directories (one per drive) the state is striped over them (`offload.storage.StripedSwapFile`)
and fio's speeds are the sums of each directory's, measured alone: the bound of drives that add up.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import statistics
import tempfile
import time

import torch

from bench.fio import job_for_config, run_fio
from offload import OffloadAdam
from tensorio import AioConfig


def _model(numel: int, tensors: int) -> list[torch.Tensor]:
    sizes = [numel // tensors] * tensors
    sizes[-1] += numel - sum(sizes)
    gen = torch.Generator().manual_seed(0)
    params = []
    for size in sizes:
        p = torch.randn(size, generator=gen).requires_grad_()
        p.grad = torch.randn(size, generator=gen) * 1e-3
        params.append(p)
    return params


def _time_steps(opt: OffloadAdam, warmup: int, steps: int) -> list[float]:
    for _ in range(warmup):
        opt.step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - start)
    return times


def main(argv: list[str] | None = None) -> dict[str, float]:
    """Run the benchmark; print the configuration, the figures and the headline ratio; return them."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", type=int, default=100 * 2**20, help="fp32 parameter elements")
    ap.add_argument("--tensors", type=int, default=12, help="parameters the elements are split into")
    ap.add_argument("--dir", nargs="+", default=None,
                    help="directory on the disk to measure (default: a temporary one); several: one per drive, "
                         "the state striped over them")
    ap.add_argument("--sub-group-size", type=int, default=1 << 22)
    ap.add_argument("--buffer-count", type=int, default=4)
    ap.add_argument("--queue-depth", type=int, default=32)
    ap.add_argument("--block-size", type=int, default=1 << 20)
    ap.add_argument("--thread-count", type=int, default=1)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--fio-size", type=int, default=1 << 30, help="bytes fio moves per direction")
    args = ap.parse_args(argv)
    aio = AioConfig(block_size=args.block_size, queue_depth=args.queue_depth, thread_count=args.thread_count)
    with contextlib.ExitStack() as stack:
        directories = [stack.enter_context(tempfile.TemporaryDirectory(dir=d, prefix="bench-optimizer-step-"))
                       for d in (args.dir or [None])]
        print(f"params={args.params} tensors={args.tensors} sub_group_size={args.sub_group_size} "
              f"buffer_count={args.buffer_count} aio={aio} torch_threads={torch.get_num_threads()} "
              f"dir={' '.join(directories)}")
        params = _model(args.params, args.tensors)

        # 1. In-memory step: the same kernel with all state in RAM.
        opt = OffloadAdam(params, lr=1e-4, nvme_offload_fraction=0.0, sub_group_size=args.sub_group_size)
        in_memory = statistics.median(_time_steps(opt, args.warmup, args.steps))
        opt.close()
        del opt
        gc.collect()

        # 2. The disk's speed at fio, before and after the offloaded steps; the faster of the two
        #    runs counts (the strictest bound on a shared, noisy machine).
        fio_size = min(args.fio_size, max(8 * args.params, args.block_size * args.thread_count))

        def fio(rw: str) -> float:  # several drives: the sum of each one's speed alone
            return sum(run_fio(job_for_config(aio, directory=d, rw=rw, size=fio_size)).bw_bytes for d in directories)
        read_bws, write_bws = [fio("read")], [fio("write")]

        # 3. Fully offloaded step, pipelined.
        opt = OffloadAdam(params, lr=1e-4, nvme_offload_fraction=1.0, nvme_offload_dir=directories if len(directories) > 1 else directories[0],
                          sub_group_size=args.sub_group_size, buffer_count=args.buffer_count, aio=aio)
        offloaded = statistics.median(_time_steps(opt, args.warmup, args.steps))
        state_bytes = sum(r.plan.state_bytes for r in opt.swapper.records.values())
        buffers = opt.host_state_bytes()["buffers"]
        opt.close()
        read_bws.append(fio("read"))
        write_bws.append(fio("write"))
    read_bw, write_bw = max(read_bws), max(write_bws)
    io_bound = state_bytes / read_bw + state_bytes / write_bw
    ratio = offloaded / max(io_bound, in_memory)
    print(f"state {state_bytes / 1e9:.3f} GB each way; swap buffers {buffers / 1e6:.0f} MB")
    print(f"fio: read {read_bw / 1e9:.2f} GB/s, write {write_bw / 1e9:.2f} GB/s -> I/O bound {io_bound:.3f} s")
    print(f"in-memory step {in_memory:.3f} s; offloaded step {offloaded:.3f} s "
          f"({state_bytes * 2 / offloaded / 1e9:.2f} GB/s of state moved)")
    print(f"offloaded / max(I/O bound, in-memory) = {ratio:.3f}  (target <= 1.15)")
    return {"in_memory_s": in_memory, "offloaded_s": offloaded, "io_bound_s": io_bound, "ratio": ratio}


if __name__ == "__main__":
    main()
