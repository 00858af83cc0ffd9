"""What the planners share: a unit's sizes, the error a budget raises, and how they name units and bytes."""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["BudgetError", "UnitSize", "format_bytes", "spread_order", "unit_names"]


class BudgetError(ValueError):
    """The memory budget, the buffers or the machine cannot hold what the plan needs; names the figures."""


def format_bytes(nbytes: float, *, up: bool = False) -> str:
    """ "1.50 GiB", "12.3 MiB", "512 B": to the nearest shown digit, or rounded up with ``up`` (for
    what is needed: a budget of the figure shown is then enough)."""
    for unit, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(nbytes) >= size:
            scale = 100 if unit in ("GiB", "TiB") else 10
            value = math.ceil(nbytes / size * scale) / scale if up else nbytes / size
            return f"{value:.2f} {unit}" if scale == 100 else f"{value:.1f} {unit}"
    return f"{math.ceil(nbytes) if up else int(nbytes)} B"


@dataclass(frozen=True, slots=True)
class UnitSize:
    """One unit of placement (a decoder layer, the output head, the embeddings) as the plan sees it."""

    name: str
    """Module path, e.g. "model.layers.3"."""
    nbytes: int
    """Its weights' bytes in memory."""
    read_nbytes: int
    """Bytes one read of it moves from the disk (its aligned windows)."""
    buffer_nbytes: int
    """Buffer bytes its windows need."""
    streamable: bool
    """False for what must stay resident (embeddings, norms, tied weights)."""
    copy_nbytes: int | None = None
    """Bytes one copy of it to a device moves (its tensors, offload/infer/stream/device_layout.py); None:
    ``buffer_nbytes``."""

    @property
    def device_copy_nbytes(self) -> int:
        """Bytes a forward copies host->device for it where the device does not keep it."""
        return self.buffer_nbytes if self.copy_nbytes is None else self.copy_nbytes


def unit_names(units: Sequence[UnitSize]) -> str:
    """ "model.embed_tokens, model.norm, model.layers.{0,3,5} (3 of them)": repeated blocks folded."""
    groups: dict[str, list[str]] = {}
    order: list[str] = []
    for unit in units:
        match = re.fullmatch(r"(.*)\.(\d+)", unit.name)
        key, leaf = (match.group(1), match.group(2)) if match else (unit.name, "")
        if key not in groups:
            order.append(key)
        groups.setdefault(key, []).append(leaf)
    parts = []
    for key in order:
        leaves = groups[key]
        if leaves == [""]:
            parts.append(key)
        else:
            parts.append(f"{key}.{{{','.join(leaves)}}} ({len(leaves)})")
    return ", ".join(parts) if parts else "nothing"


def spread_order(count: int) -> list[int]:
    """0..count-1 ordered so that every prefix is spread evenly (bit-reversed order: 0, n/2, n/4, 3n/4, ...)."""
    bits = max(1, (count - 1).bit_length())
    return sorted(range(count), key=lambda i: int(format(i, f"0{bits}b")[::-1], 2))
