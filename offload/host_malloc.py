"""glibc's mmap threshold fixed at 1 MiB, so that large host tensors freed go back to the system at once.

glibc serves an allocation above its mmap threshold (128 KiB at start) by its own mapping, unmapped when
freed; but each such free raises the threshold to the freed size, up to 32 MiB. After the first forward,
tensors of 128 KiB to 32 MiB (a chunk's hidden states, its attention's pieces) come from the heap, where
freed memory stays in the process and sizes that do not fit the holes left take more: during a chunked
prefill of 32K tokens the RSS grew 1.2x the tensors' peak (1,141 against 936 MiB at the 2.7 GB Llama's
shape), 1.0x with the threshold fixed (941 MiB), at the same speed (docs/benchmarks.md, "Long prompts").

The threshold is the process's: set once, by the first engine, and kept. A user who set
``MALLOC_MMAP_THRESHOLD_`` in the environment keeps theirs (glibc reads it at start; so do we, and leave
it). On a C library other than glibc nothing is done.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import threading

__all__ = ["MMAP_THRESHOLD", "ENV_SETTING", "fix_mmap_threshold"]

MMAP_THRESHOLD = 1 << 20
"""Bytes from which glibc maps each allocation on its own (and unmaps it when freed)."""
ENV_SETTING = "MALLOC_MMAP_THRESHOLD_"
"""glibc's environment setting for the same; where the user set it, it is theirs."""
_M_MMAP_THRESHOLD = -3  # mallopt's parameter number (malloc.h)

_lock = threading.Lock()
_outcome: str | None = None


def fix_mmap_threshold() -> str:
    """Fix glibc's mmap threshold at `MMAP_THRESHOLD` for this process, once; later calls repeat the
    first's outcome. Returns what was done, in words: "fixed at 1 MiB", or why it was left (the user's
    ``MALLOC_MMAP_THRESHOLD_``, no glibc, mallopt refusing)."""
    global _outcome
    with _lock:
        if _outcome is None:
            _outcome = _fix()
        return _outcome


def _fix() -> str:
    if os.environ.get(ENV_SETTING):
        return f"left at the user's {ENV_SETTING}={os.environ[ENV_SETTING]}"
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        return f"left as it is: no mallopt in the C library ({name})"
    try:
        libc.gnu_get_libc_version
    except AttributeError:
        return f"left as it is: the C library ({name}) is not glibc"
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    if mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) != 1:
        return "left as it is: mallopt refused M_MMAP_THRESHOLD"
    return f"fixed at {MMAP_THRESHOLD >> 20} MiB"
