"""Byte sizes as people type them ("128K", "8 GiB", "20GB") and as short labels ("128K")."""

from __future__ import annotations

import re
from fractions import Fraction

# A letter alone or with "iB" is binary (K = KiB = 1024); with "B" alone it is decimal (KB = 1000),
# as disks and GB/s figures count.
_BINARY = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
_UNITS = {"": 1, "b": 1,
          **_BINARY, **{f"{p}ib": v for p, v in _BINARY.items()}, **{f"{p}b": 1000 ** (i + 1) for i, p in enumerate("kmgt")}}
_PATTERN = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-z]*)\s*$", re.IGNORECASE)


def parse_size(value: str | int) -> int:
    """Bytes in ``value``: an int, or a string of a number and an optional unit, case-insensitive.

    - ``"4096"``, ``"4096B"``: bytes.
    - ``"128K"``, ``"128KiB"``, ``"8 G"``, ``"8GiB"``: binary, K/M/G/T = 2**10, 2**20, 2**30, 2**40.
    - ``"20KB"``, ``"20MB"``, ``"20 GB"``, ``"1TB"``: decimal, 10**3 ... 10**12.
    - ``"1.5GiB"``: a fraction is allowed; the bytes are rounded down.

    Raises ValueError naming ``value`` when it is not such a size (negative, empty, an unknown unit, a bool).
    """
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 0:
            raise ValueError(f"{value!r} is not a size; a size is >= 0 bytes")
        return value
    match = _PATTERN.match(value) if isinstance(value, str) else None
    unit = _UNITS.get(match.group(2).lower()) if match else None
    if unit is None:
        raise ValueError(f"{value!r} is not a size; write bytes, or a number with a unit: 4096, 128K, 512MiB, "
                         f"8 GiB (binary), 20GB (decimal)")
    return int(Fraction(match.group(1)) * unit)


def format_size(nbytes: int) -> str:
    """The shortest exact binary label, which `parse_size` reads back: 131072 -> "128K", 1536 -> "1536"."""
    for suffix in "TGMK":
        unit = _BINARY[suffix.lower()]
        if nbytes >= unit and nbytes % unit == 0:
            return f"{nbytes // unit}{suffix}"
    return str(nbytes)
