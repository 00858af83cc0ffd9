"""How many OpenMP threads the optimizer's worker thread runs its kernels on.

The update thread runs beside the training loop, whose own kernels already use every core through
torch's OpenMP team. Given a team as large, the update's fused Adam kernel (memory-bound) starts a
second team, so the two loops' threads preempt each other and each team's threads spin at their
barriers waiting for a preempted partner. The worker therefore asks for half the loop's threads.
"""

from __future__ import annotations

import ctypes
import os

import torch

_RUNTIMES = ("libgomp.so.1", "libiomp5.so", "libomp.so")  # torch's OpenMP runtime, as its builds ship it


def update_thread_count() -> int:
    """OpenMP threads for the optimizer's worker: half of torch's intra-op threads, at least one."""
    return max(1, torch.get_num_threads() // 2)


def limit_this_thread(count: int) -> bool:
    """Let OpenMP regions started from the calling thread use ``count`` threads (OpenMP keeps the
    setting per thread: other threads, the training loop's included, keep theirs). Returns False
    when no OpenMP runtime is loaded (torch built without OpenMP: nothing to limit)."""
    # torch sets a thread's count once, before its first kernel, from the process-wide setting
    # (torch.set_num_threads): let it do so now, or it would undo the limit at that first kernel.
    torch.get_num_threads()
    for name in _RUNTIMES:
        try:
            runtime = ctypes.CDLL(name, mode=os.RTLD_NOLOAD)
        except OSError:
            continue
        runtime.omp_set_num_threads(ctypes.c_int(count))
        return True
    return False
