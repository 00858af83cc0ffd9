"""One record per parameter (`ParamRecord`), and the two protocols through which training plugs into
the store (`PendingUpdates`, `BufferKeeper`): what the store and its device side share, below both."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from tensorio import IOFuture

from offload.storage.slotted import SlotPair


@dataclass(slots=True, eq=False)
class ParamRecord:
    """Everything about one (possibly tied) parameter."""

    index: int
    names: list[str]
    param: nn.Parameter
    shape: torch.Size
    numel: int
    partition: nn.Parameter
    """This rank's flat partition, ``partition_numel`` elements; an empty placeholder while on disk."""
    partition_numel: int
    keep_full: bool
    """Never released: persistent (small) parameters, and at world size 1 those in memory (the
    partition is then a view of the parameter itself)."""
    slots: SlotPair | None = None
    """The partition's two slots in the parameter swap file (NVMe records only): reads take the newest,
    a training step writes the other and commits or rolls back (`offload.storage.slotted`)."""
    buffer: torch.Tensor | None = None
    """The page-aligned buffer a read fills, counted in the swap budget until dropped."""
    read: IOFuture | None = None
    full: torch.Tensor | None = None
    """The gathered flat parameter (``numel`` elements) while in use."""
    users: int = 0
    """Modules whose forward is using the gathered parameter now."""
    saved: int = 0
    """Tokens saved for backward and not yet unpacked."""
    accumulator: object = None
    """The parameter's AccumulateGrad node, made at the full shape and held so that autograd keeps it (it
    checks each gradient against that shape); None: not trainable. The gradient hooks are on the parameter."""

    @property
    def name(self) -> str:
        return self.names[0]

    @property
    def on_disk(self) -> bool:
        return self.slots is not None


class BufferKeeper(Protocol):
    """Which on-disk partitions' buffers stay in memory when their parameter is released (`ParamStore.keeper`)."""

    def keeps(self, rec: ParamRecord) -> bool:
        """Whether ``rec``'s buffer stays when its parameter is released."""

    def reset(self, *, end_of_backward: bool) -> None:
        """The store releases everything (`ParamStore.release_all`): at the end of a backward, or for good."""


class PendingUpdates(Protocol):
    """A training step whose updates run during the passes (`ParamStore.updates`; the engine's
    ``DeferredStep``): what the store asks it before reading or gathering a partition."""

    def values(self, rec: ParamRecord) -> torch.Tensor | None:
        """Wait for ``rec``'s pending update (sync point); its updated values when the step holds them
        (None: gather as usual). Raises the update's error."""

    def holds(self, rec: ParamRecord) -> bool:
        """Whether the step holds ``rec``'s values (the store must not read it)."""

    def overwrites(self, rec: ParamRecord) -> bool:
        """Whether ``rec``'s pending update writes every element without reading it (no read needed)."""

    def settled(self, rec: ParamRecord) -> bool:
        """Whether ``rec``'s values are final for this pass without waiting (no update pending, or it has
        run): what a copy ahead may read."""


class FaultSink(Protocol):
    """Where a pass's failure goes instead of raising, with several ranks (`ParamStore.faults`; the engine's
    ``StepAgreement``)."""

    def absorb(self, error: BaseException, where: str) -> bool:
        """Keep ``error`` (raised ``where``) for the ranks' agreement and return True, so the caller goes on
        with stand-in data; False: the caller raises it."""
