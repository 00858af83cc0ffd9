"""`Snapshot`: one step's partitions and optimizer state, fixed for a save that runs while training goes on
(``save_checkpoint(..., async_save=True)``, docs/engine.md "Asynchronous save").

What the snapshot holds, and why no copy of the state on NVMe is made:

- State on NVMe (parameter partitions in the parameter swap file, offloaded optimizer sub-groups in the
  optimizer's) is **pinned**, not copied: every swap-file extent has two slots (A/B,
  `offload.storage.slotted`), a step writes the uncommitted one, so the committed slot keeps step N's
  values through step N+1. A `SlotPin` holds each extent's committed slot until the save has read it:
  step N+1 never waits; a write that would land in a slot still pinned (step N+2's update or a gradient
  kept in the spare slot, when the save is more than a step behind) waits for the save to read it first.
- State in memory (partitions kept in RAM, the optimizer's resident sub-groups, ``client_state``'s
  tensors, the counters and schedule) is changed in place by the next step, so it is **copied** here,
  on the caller's thread: with everything on NVMe that is the few persistent small parameters; with
  ``offload_optimizer: cpu`` it is that state's size (`copied_bytes`).

The save's buffers: two partitions and two optimizer sub-groups at a time, as the synchronous save.
"""

from __future__ import annotations

import collections
import copy
import errno
from typing import Any, Callable, Iterator

import torch

from tensorio import TensorIOError, aligned_tensor

from offload.params import ParamRecord, ParamStore
from offload.storage.slotted import SlotPair, SlotPin

__all__ = ["Snapshot"]

_KEYS = ("exp_avg", "exp_avg_sq", "master_param")


class Snapshot:
    """This rank's state as committed now, readable from another thread while training goes on.

    ``records``: the store's records to save (frozen ones may be left out). The optimizer must be
    `OffloadAdam` (its sub-groups and swap file are read directly, bypassing its buffers, which the next
    step uses). Take it between steps, after the update path settled. `close` lets every slot still
    pinned go (the save ended or failed); reading a pinned slot releases it.

    Raises ValueError naming the optimizer's type when it is not `OffloadAdam`; RuntimeError when a
    step's write is not committed yet.
    """

    def __init__(self, store: ParamStore, optimizer: Any, records: list[ParamRecord]) -> None:
        state = getattr(optimizer, "_state", None)
        swapper = getattr(optimizer, "_swapper", None)
        if state is None or swapper is None or not hasattr(state, "plans"):
            raise ValueError(f"save_checkpoint(async_save=True) reads OffloadAdam's state from its swap file; "
                             f"this engine's optimizer is {type(optimizer).__name__}: save with async_save=False")
        self.store, self.records = store, records
        self._state, self._swapper = state, swapper
        # 1. What changes in place in memory: copied now.
        self._copies = {id(rec): rec.partition.detach().clone() for rec in records if not rec.on_disk}
        self._resident = {plan.index: [region.clone() for region in state.resident[plan.index]]
                          for plan in state.plans if not plan.offloaded}
        self._with_state = {rec.index for rec in state.params if rec.step is not None}
        self.optimizer_rest = copy.deepcopy({"steps": {rec.index: float(rec.step) for rec in state.params
                                                       if rec.step is not None},
                                             "param_groups": state._packed_groups()})
        """What `OffloadAdam.save_state` returns beside the streamed state (step counts, param groups)."""
        self.copied_bytes = sum(t.numel() * t.element_size() for t in self._copies.values()) + \
            sum(r.numel() * 4 for regions in self._resident.values() for r in regions)
        """Bytes of in-memory state copied (held until the save ends)."""
        # 2. What lives on NVMe: its committed slots pinned until read.
        self._param_pairs = [rec.slots for rec in records if rec.on_disk]
        self._state_pairs = [rec.slots for rec in swapper.records.values()]
        self._param_pin = SlotPin(self._param_pairs)
        try:
            self._state_pin = SlotPin(self._state_pairs)
        except BaseException:
            self._param_pin.release_all(self._param_pairs)
            raise

    @property
    def wait_seconds(self) -> float:
        """Seconds training has waited for this snapshot's slots to be read (its writes held back)."""
        return self._param_pin.wait_seconds + self._state_pin.wait_seconds

    def partitions(self) -> Iterator[tuple[ParamRecord, torch.Tensor]]:
        """(record, its partition at the snapshot) in order; the next on-disk one's read started before this
        one is given out; two in memory at most. Each pinned slot is let go once read. Raises TensorIOError."""
        pending: collections.deque = collections.deque()
        for rec in self.records:
            pending.append((rec, self._start_partition(rec)))
            if len(pending) > 1:
                yield self._partition_arrived(*pending.popleft())
        while pending:
            yield self._partition_arrived(*pending.popleft())

    def _start_partition(self, rec: ParamRecord) -> tuple[torch.Tensor, Any]:
        if not rec.on_disk:
            return self._copies[id(rec)], None
        slot = self._param_pin.slot(rec.slots)
        return self.store.swap.read_new(rec.partition_numel, rec.partition.dtype, rec.slots.slot_offset(slot),
                                        what=f"{self.store.describe(rec)}, slot {'AB'[slot]}")

    def _partition_arrived(self, rec: ParamRecord, started: tuple[torch.Tensor, Any]) -> tuple[ParamRecord, torch.Tensor]:
        values, future = started
        if future is not None:
            try:
                future.result()  # sync point
            finally:
                self._param_pin.release(rec.slots)
        return rec, values

    def stream_optimizer(self, write: Callable[[str, int, torch.Tensor], None]) -> dict[str, Any]:
        """``write(name, first element, values)`` for every run of optimizer state, as `OffloadAdam.save_state`
        streams it, from the snapshot; the next offloaded sub-group read while this one is written. Returns
        `optimizer_rest`. Raises TensorIOError (short reads, checksums) and ``write``'s errors."""
        plans = self._state.plans
        pending: collections.deque = collections.deque()
        for plan in plans:
            pending.append((plan, self._start_state(plan)))
            if len(pending) > 1:
                self._write_state(*pending.popleft(), write)
        while pending:
            self._write_state(*pending.popleft(), write)
        return self.optimizer_rest

    def _start_state(self, plan: Any) -> tuple[list[torch.Tensor], Any]:
        """Start reading sub-group ``plan``'s pinned state into a buffer of its own (or give its copy)."""
        if not plan.offloaded:
            return self._resident[plan.index], None
        pair: SlotPair = self._swapper.records[plan.index].slots
        buffer = aligned_tensor(plan.state_bytes // 4, torch.float32)
        regions = list(buffer.split(plan.region))
        if not pair.filled:  # never written: zeros, as the swapper reads them
            buffer.zero_()
            self._state_pin.release(pair)
            return regions, None
        slot = self._state_pin.slot(pair)
        future = self._swapper._file.read(buffer, pair.slot_offset(slot), chunk=plan.region * 4,
                                          what=f"optimizer state of sub-group {plan.index}, slot {'AB'[slot]}")
        return regions, (future, pair, plan)

    def _write_state(self, plan: Any, started: tuple[list[torch.Tensor], Any],
                     write: Callable[[str, int, torch.Tensor], None]) -> None:
        regions, reading = started
        if reading is not None:
            future, pair, plan = reading
            try:
                moved = future.result()  # sync point
            finally:
                self._state_pin.release(pair)
            if moved != plan.state_bytes:
                raise TensorIOError(errno.EIO, f"short read of sub-group {plan.index}'s state for a checkpoint: "
                                    f"{moved} of {plan.state_bytes} bytes", path=self._swapper.path,
                                    offset=pair.offset, length=plan.state_bytes)
        for member in plan.members:
            if member.param not in self._with_state:
                continue
            for key, region in zip(_KEYS, regions):
                write(f"{member.param}.{key}", member.start, region[member.offset:member.offset + member.numel])

    def close(self) -> None:
        """Let every slot still pinned go and drop the copies (the save ended, or failed). Never raises."""
        self._param_pin.release_all(self._param_pairs)
        self._state_pin.release_all(self._state_pairs)
        self._copies, self._resident = {}, {}
