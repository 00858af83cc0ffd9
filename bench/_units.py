"""Byte sizes as people type them ("128K", "1M", "2G") and as reports print them."""

from __future__ import annotations

import re

_SUFFIX = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
_PATTERN = re.compile(r"^\s*(\d+)\s*([KMGT]?)(?:I?B)?\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """Bytes in ``text``: an integer with an optional binary suffix K, M, G or T ("KiB"/"KB" too).

    Raises ValueError naming the text when it is not such a size.
    """
    match = _PATTERN.match(text)
    if not match:
        raise ValueError(f"{text!r} is not a size; write bytes or use a suffix, e.g. 4096, 128K, 1M, 2G")
    return int(match.group(1)) * _SUFFIX[match.group(2).upper()]


def format_size(nbytes: int) -> str:
    """Short binary size: 131072 -> "128K", 1048576 -> "1M", 1536 -> "1536"."""
    for suffix in ("T", "G", "M", "K"):
        unit = _SUFFIX[suffix]
        if nbytes >= unit and nbytes % unit == 0:
            return f"{nbytes // unit}{suffix}"
    return str(nbytes)


def format_bytes(nbytes: float) -> str:
    """Human-readable amount with one decimal: "1.5 GiB", "512.0 MiB"."""
    for suffix, unit in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(nbytes) >= unit:
            return f"{nbytes / unit:.1f} {suffix}"
    return f"{int(nbytes)} B"


def format_ns(ns: float) -> str:
    """A latency in the unit that suits it: "850 us", "12.3 ms", "1.20 s"."""
    if ns >= 1e9:
        return f"{ns / 1e9:.2f} s"
    if ns >= 1e6:
        return f"{ns / 1e6:.1f} ms"
    return f"{ns / 1e3:.0f} us"
