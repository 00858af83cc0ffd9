"""Freed memory given back where several ranks share a node: glibc's mmap threshold fixed per rank.

glibc's malloc serves a block of 128 KiB or more with its own mapping at first, but once such a block is
freed it raises that threshold (up to 32 MiB) so that later blocks of that size come from the heap, and
memory freed there stays in the process. Alone on a node that is a speed-up. With several ranks on a node,
whose memory figures are each rank's share of the node's (`offload.device.host_memory`), it is memory
outside every share: in `benchmarks.node_memory` two and four ranks of GPT-2 medium in one memory cgroup of
1.2x one rank's peak were OOM-killed in their first step, each rank holding 2.6 GiB of which 0.5 GiB was
live; with the threshold fixed at 128 KiB (``MALLOC_MMAP_THRESHOLD_=131072``) no rank reached the limit
(docs/benchmarks.md, "A node of several ranks in one memory budget").

So at `initialize` and at `offload.zero.Init`, a rank with others on its node (``LOCAL_WORLD_SIZE`` > 1)
fixes glibc's threshold at 128 KiB (``mallopt(M_MMAP_THRESHOLD)``, which also stops it rising) and gives
back what its heap holds free (``malloc_trim(0)``), unless the user chose (``MALLOC_MMAP_THRESHOLD_`` set)
or the C library is not glibc. A rank alone on its node keeps glibc's default.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from typing import Mapping

__all__ = ["MMAP_THRESHOLD", "share_freed_memory"]

MMAP_THRESHOLD = 128 << 10
"""The threshold fixed for a rank that shares its node: glibc's starting value."""

_M_MMAP_THRESHOLD = -3  # glibc's malloc.h
_fixed = False


def share_freed_memory(local_ranks: int, environ: Mapping[str, str] = os.environ) -> str | None:
    """With ``local_ranks`` > 1 and ``MALLOC_MMAP_THRESHOLD_`` not set in ``environ``: fix glibc's mmap
    threshold at `MMAP_THRESHOLD` and trim the heap (see the module docstring); a line saying so (for the
    log). None where nothing was done: one rank on the node, the user's setting, no glibc, or done before
    in this process."""
    global _fixed
    if local_ranks <= 1 or "MALLOC_MMAP_THRESHOLD_" in environ or _fixed:
        return None
    libc = _glibc()
    if libc is None or not libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD):
        return None
    libc.malloc_trim(0)
    _fixed = True
    return (f"{local_ranks} ranks share this node: glibc's mmap threshold fixed at {MMAP_THRESHOLD >> 10} KiB, so "
            f"that freed blocks go back to the node (set MALLOC_MMAP_THRESHOLD_ to choose another)")


def _glibc() -> ctypes.CDLL | None:
    """This process's C library where it is glibc (it has ``mallopt`` and ``malloc_trim``), else None."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None
    if not hasattr(libc, "gnu_get_libc_version"):  # glibc's own: musl has mallopt but no such threshold
        return None
    libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    libc.malloc_trim.argtypes = [ctypes.c_size_t]
    return libc
