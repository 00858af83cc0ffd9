"""All-gathers issued ahead: the coalesced all-gather of the module expected next, started as the one
before it is gathered and waited for when the module needs it (`ParamStore.gather_together`).

The order of a pass's coalesced gathers is recorded in the first step (`GroupOrder`), as `Prefetcher`
records the reads; from the second step on, right after each gather the next group's partitions are
taken (its NVMe reads waited for, its pending update run) and its all-gather issued without waiting
(host memory: ``async_op``, gloo's thread runs it; on a GPU, on the side stream "param-gather" of
`DeviceGathers`, beside the compute queued before it, which waits for it only when the module takes it).
One is in flight at most. Every
rank records the same order (the same graph) and decides from it alone, so every rank issues the same
collectives in the same order. A gather whose group is not the one in flight gathers at once; the
one in flight stays until its group comes or the pass ends (`abandon`: waited for, dropped).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from offload.params.record import ParamRecord


class GroupOrder:
    """The order of a pass's coalesced gathers (each a tuple of record indices), recorded in the first
    step, as `Prefetcher` records single records: what `ParamStore.gather_together` issues ahead. Every rank
    records the same order (the same graph), so every rank issues the same all-gathers ahead."""

    def __init__(self) -> None:
        self.trace: list[tuple[int, ...]] = []
        self.recording = True
        self.cursor = 0

    def observe(self, key: tuple[int, ...]) -> None:
        """Note that the group ``key`` is being gathered: record it, or move the cursor past it (a group
        not in the order leaves the cursor where it is)."""
        if self.recording:
            self.trace.append(key)
        elif self.cursor < len(self.trace) and self.trace[self.cursor] == key:
            self.cursor += 1
        elif key in self.trace[self.cursor:]:
            self.cursor = self.trace.index(key, self.cursor) + 1

    def upcoming(self) -> tuple[int, ...] | None:
        """The group expected next, or None (recording, or at the end of the order)."""
        return None if self.recording or self.cursor >= len(self.trace) else self.trace[self.cursor]

    def end_step(self) -> None:
        """The first step's order is final; every later pass replays it from the start."""
        if self.trace:
            self.recording = False
        self.cursor = 0


@dataclass(slots=True, eq=False)
class _Ahead:
    key: tuple[int, ...]
    members: list[tuple[ParamRecord, torch.Tensor]]
    finish: Callable[[], list[torch.Tensor]]
    """Waits for the all-gather (sync point) and unpacks: each member's full flat tensor."""
    abandon: Callable[[], None]


class GatherAhead:
    """The order of the coalesced gathers and the one all-gather in flight ahead of its module."""

    def __init__(self) -> None:
        self.order = GroupOrder()
        self._pending: _Ahead | None = None
        self.busy = False
        """While the store takes the next group's partitions: a gather inside that (a pending update's
        refresh) issues nothing ahead."""
        self.issued = 0
        """All-gathers issued ahead so far."""
        self.used = 0
        """Of those, the ones their module then took (the others were dropped at the end of a pass)."""

    def wanted(self) -> tuple[int, ...] | None:
        """The group to issue ahead now, or None (one is in flight, none is expected, or busy)."""
        return None if self._pending is not None or self.busy else self.order.upcoming()

    def hold(self, key: tuple[int, ...], members: list[tuple[ParamRecord, torch.Tensor]],
             finish: Callable[[], list[torch.Tensor]], abandon: Callable[[], None]) -> None:
        """Keep the all-gather just issued for group ``key`` until `take` or `abandon`."""
        self._pending = _Ahead(key, members, finish, abandon)
        self.issued += 1

    def take(self, key: tuple[int, ...]) -> tuple[list[tuple[ParamRecord, torch.Tensor]], list[torch.Tensor]] | None:
        """The members and full tensors of the all-gather in flight for group ``key`` (waits: sync point), or None."""
        pending = self._pending
        if pending is None or pending.key != key:
            return None
        self._pending = None
        self.used += 1
        return pending.members, pending.finish()

    def abandon(self) -> None:
        """End of a pass (or an error): wait for the all-gather in flight and drop it."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.abandon()
