"""Byte sizes as reports print them; parsed by tensorio's `parse_size` ("128K", "1M", "2G", "20GB")."""

from __future__ import annotations

from tensorio import format_size, parse_size  # the one parser of sizes; re-exported for bench

__all__ = ["format_bytes", "format_ns", "format_size", "parse_size"]


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
