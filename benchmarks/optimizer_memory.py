"""Where Benchmark 1's peak RSS falls: one configuration of benchmarks/optimizer_colossal.py, traced.

    python -m benchmarks.optimizer_memory --fraction 1.0 --dir /work/tmp

A thread samples the RSS (psutil) every millisecond while GPT-2 small trains (one warm-up step, then
``--steps`` steps); each step is cut into forward, backward and step+zero_grad phases. Printed per
phase: the highest RSS seen and, at the phase's start, glibc's heap (``mallinfo2``: bytes the heap
holds from the system, bytes in use, bytes mmapped outside it). Then where the peak fell and, for
OffloadAdam, the seconds the training thread was blocked on swap I/O. Peak RSS is not live memory:
the heap keeps freed chunks, and how much depends on the order of allocations (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import ctypes
import os

from benchmarks._common import RssSampler
from benchmarks.optimizer_colossal import add_run_arguments, build_run


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                     "fsmblks", "uordblks", "fordblks", "keepcost")]


def _heap() -> dict[str, int]:
    """glibc's heap now: 'heap' (held from the system), 'in_use', 'mmapped'; empty without mallinfo2."""
    libc = ctypes.CDLL(None)
    if not hasattr(libc, "mallinfo2"):
        return {}
    libc.mallinfo2.restype = _MallInfo2
    info = libc.mallinfo2()
    return {"heap": info.arena, "in_use": info.uordblks, "mmapped": info.hblkhd}


def main(argv: list[str] | None = None) -> dict[str, object]:
    """Trace one configuration; print the phases, the peak and where the optimizer state lives; return
    {'peak_phase', 'peak_rss', 'io_wait', 'state_in_ram', 'swap_file_bytes'}."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--optimizer", choices=["torch", "offload"], default="offload")
    ap.add_argument("--fraction", type=float, default=1.0)
    add_run_arguments(ap)
    args = ap.parse_args(argv)

    from offload import OffloadAdam

    print(f"GPT-2 {args.model_config} {args.optimizer} fraction={args.fraction} batch={args.batch} seq={args.seq} "
          f"steps={args.steps} (+1 warm-up) sub_group_size={args.sub_group_size} buffer_count={args.buffer_count} "
          f"MALLOC_MMAP_THRESHOLD_={os.environ.get('MALLOC_MMAP_THRESHOLD_')}")
    with RssSampler(interval=0.001) as sampler:
        sampler.mark("model", **_heap())
        model, opt, tokens = build_run(args)
        for step in range(args.steps + 1):
            sampler.mark(f"{step}.forward", **_heap())
            loss = model(input_ids=tokens, labels=tokens).loss
            sampler.mark(f"{step}.backward", **_heap())
            loss.backward()
            sampler.mark(f"{step}.step", **_heap())
            opt.step()
            opt.zero_grad()
        sampler.mark("end")
        if isinstance(opt, OffloadAdam):
            io_wait, state_in_ram = opt.io_wait_seconds(), opt.host_state_bytes()["resident"]
            swap_file_bytes = os.path.getsize(opt.swap_path) if opt.swap_path else 0
            opt.close()
        else:
            io_wait, swap_file_bytes = 0.0, 0
            state_in_ram = sum(t.numel() * t.element_size() for state in opt.state.values()
                               for t in state.values() if t.dim())  # not the 0-d step counts
    rows = sampler.phases()
    print(f"{'phase':12s} {'seconds':>8s} {'peak RSS':>9s} {'heap':>7s} {'in use':>7s} {'mmapped':>8s}  (MB; heap "
          "figures at the phase's start)")
    for row in rows:
        heap = "".join(f" {row[k] / 1e6:7.0f}" if k in row else "       -" for k in ("heap", "in_use", "mmapped"))
        print(f"{row['phase']:12s} {row['seconds']:8.3f} {row['peak_rss'] / 1e6:9.0f}{heap}")
    top = max(rows, key=lambda r: r["peak_rss"])
    print(f"peak RSS {top['peak_rss'] / 1e6:.0f} MB in phase {top['phase']}; io wait {io_wait:.3f} s "
          "(all steps, warm-up included)")
    print(f"optimizer state: {state_in_ram / 1e6:.1f} MB in RAM, swap file {swap_file_bytes / 1e6:.1f} MB")
    return {"peak_phase": top["phase"], "peak_rss": top["peak_rss"], "io_wait": io_wait,
            "state_in_ram": state_in_ram, "swap_file_bytes": swap_file_bytes}


if __name__ == "__main__":
    main()
