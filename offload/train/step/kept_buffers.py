"""The read buffers a training step keeps for its updates, so that a partition is not read twice.

A gather of an on-disk partition reads it into a budgeted buffer, dropped when the parameter is
released. A step whose updates use the partition's values keeps that buffer instead (the store asks
`KeptBuffers.keeps`, as its `BufferKeeper`):

- updates during backward (`for_update`): every on-disk trainable partition's buffer is kept from its
  backward gather until its gradient is final and the update takes it (`take`);
- the step in the next forward (`next`): the buffers backward read of the partitions that forward
  updates first are kept past the end of backward (`offload.train.step.deferred`).

An update owns a buffer from `take` on, and gives its elements back to the budget with `give_back`.
"""

from __future__ import annotations

import torch

from offload.params.record import ParamRecord
from offload.params.store import ParamStore


class KeptBuffers:
    """The store's `BufferKeeper` for a training engine (see the module docstring)."""

    def __init__(self, store: ParamStore) -> None:
        self._store = store
        self.for_update = False
        """This backward's updates run as gradients arrive: on-disk trainable partitions' buffers are kept."""
        self.next: set[int] = set()
        """Record indices whose buffer is kept past the end of backward, for the next forward's first updates
        (any release other than the end of a backward drops them)."""
        store.keeper = self

    def keeps(self, rec: ParamRecord) -> bool:
        """Whether ``rec``'s buffer stays when its parameter is released."""
        return (self.for_update and rec.on_disk and rec.param.requires_grad) or rec.index in self.next

    def reset(self, *, end_of_backward: bool) -> None:
        """The store releases everything: ``for_update`` ends; ``next`` survives the end of a backward only."""
        self.for_update = False
        if not end_of_backward:
            self.next = set()

    def begin_backward(self, *, for_update: bool) -> None:
        """A backward pass starts; with ``for_update`` its updates run as gradients arrive (see `take`)."""
        self.for_update = for_update

    def take(self, rec: ParamRecord, *, observe: bool = True) -> torch.Tensor:
        """The page-aligned buffer holding an on-disk partition's values, for its update: the one kept
        from this backward's gather, else one read now (sync point). The caller owns it from here and
        gives its elements back to the budget with `give_back`. ``observe``: count it as a gather in
        the recorded order (not for a step run in the forward, whose gathers count themselves)."""
        store = self._store
        if rec.full is not None:
            store.release(rec)  # the gradient is final: no backward node reads the parameter any more
        if rec.buffer is None or rec.read is not None:
            # Not gathered in this backward (a bias, an embedding): part of the recorded order, so
            # that from the next step on it is read ahead like any gather.
            if observe:
                store.prefetcher.observe(rec.index)
            store.arrive(rec)
        buffer, rec.buffer = rec.buffer, None
        return buffer

    def give_back(self, rec: ParamRecord) -> None:
        """A buffer from `take` is no longer used: its elements leave the budget."""
        self._store.budget.held -= rec.partition_numel
