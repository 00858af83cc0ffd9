"""Page-cache figures of the inference benchmarks: a file's pages in the page cache (mincore, which
loads none) and the system's /proc/meminfo figures."""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import numpy as np

PAGE = 4096


def page_cache_bytes(paths) -> int:
    """Bytes of the files ``paths`` now in the page cache: mincore over a read-only shared mapping,
    which touches (and so loads) no page."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    total = 0
    for path in paths:
        size = os.path.getsize(path)
        if size == 0:
            continue
        fd = os.open(path, os.O_RDONLY)
        try:
            addr = libc.mmap(None, size, 1, 1, fd, 0)  # PROT_READ, MAP_SHARED
            if addr in (None, ctypes.c_void_p(-1).value):
                raise OSError(ctypes.get_errno(), f"mmap of {path} failed")
            try:
                vec = np.zeros((size + PAGE - 1) // PAGE, dtype=np.uint8)
                if libc.mincore(addr, size, vec.ctypes.data) != 0:
                    raise OSError(ctypes.get_errno(), f"mincore of {path} failed")
                total += int((vec & 1).sum()) * PAGE
            finally:
                libc.munmap(addr, size)
        finally:
            os.close(fd)
    return total


def meminfo(key: str) -> int:
    """A figure of /proc/meminfo ("Cached", "MemAvailable", ...) in bytes; 0 where it is missing."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return 0


def meminfo_cached() -> int:
    """The system's page cache ("Cached" in /proc/meminfo), in bytes."""
    return meminfo("Cached")


def _files(directory: Path) -> list[str]:
    return sorted(str(p) for p in directory.rglob("*") if p.is_file())
