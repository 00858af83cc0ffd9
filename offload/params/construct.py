"""Building a model partition by partition: the machinery of `offload.zero.Init`.

While a `PartitionedBuild` is active:

1. every parameter a module registers is *pending*: it stays in memory as built, so that its
   module's own initialisation (``reset_parameters``) runs on it unchanged;
2. once the pending and re-gathered parameters hold more than ``limit`` elements, the oldest are
   placed (`Placement.place`: partitioned, written to the swap file or kept in memory) and their
   ``.data`` becomes a zero-stride *placeholder* of the full shape (one element of memory), so that
   code reading shapes (``weight.shape``, ``tie_weights``) sees the real ones;
3. a dispatch mode watches every tensor operation: one that touches a placeholder (Hugging Face's
   ``_init_weights`` re-initialising a child's weight after the whole model is built, a
   ``GatheredParameters`` user) gathers that parameter back first and runs on the real values,
   which count as pending again and are written back when evicted;
4. ``GatheredParameters`` gathers from the partitions itself: a parameter still pending when it
   starts is placed first (`settle_for_gather`), since a pending parameter is whole on every rank
   and a change to it would reach that rank's partition only (with ``modifier_rank``, the modifier's
   values are broadcast and written back into every rank's partition; without, changes are dropped as
   for any placed parameter).

So host memory holds at most ``limit`` elements of parameters plus the one being built, and every
operation runs on the same values in the same order as without partitioning: the random number
generator is drawn from exactly as in a plain construction, and the weights come out identical.
"""

from __future__ import annotations

import collections
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_unflatten

from offload.params.placement import Placement
from offload.params.record import ParamRecord
from offload.params.store import ParamStore, find_record

__all__ = ["BUILT", "PartitionedBuild", "built_store", "discard_build", "settle_for_gather"]


class PartitionedBuild(TorchDispatchMode):
    """Places each parameter built inside the block (see the module docstring).

    ``dtype``: parameters are cast to it when registered (None: kept as built). Raises ValueError
    for a parameter that is not a floating-point CPU tensor, TensorIOError for the swap file.
    """

    def __init__(self, store: ParamStore, placement: Placement, *, limit: int, dtype: torch.dtype | None) -> None:
        super().__init__()
        self.store, self.placement, self.limit, self.dtype = store, placement, max(1, limit), dtype
        self._pending: collections.OrderedDict[int, nn.Parameter] = collections.OrderedDict()
        """Parameters in memory, oldest first: built and not placed yet (id -> parameter)."""
        self._gathered: collections.OrderedDict[int, ParamRecord] = collections.OrderedDict()
        """Placed parameters gathered back by an operation, oldest first (record index -> record)."""
        self._elements = 0
        self._by_storage: dict[int, ParamRecord] = {}
        """Placeholder storage -> its record, for the dispatch mode."""
        self._register = None

    # ---- entering and leaving -------------------------------------------------------------------------

    def __enter__(self) -> "PartitionedBuild":
        self._register = nn.Module.register_parameter
        build = self

        def register_parameter(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
            build._register(module, name, param)
            if param is not None:
                build._adopt(param)
        nn.Module.register_parameter = register_parameter
        _OPEN_BUILDS.append(self)
        return super().__enter__()

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        try:
            super().__exit__(exc_type, *exc)
        finally:
            nn.Module.register_parameter = self._register
            _OPEN_BUILDS.remove(self)
        if exc_type is None:
            self.flush()

    def flush(self) -> None:
        """Place every pending parameter and write back every gathered one (sync point)."""
        while self._pending or self._gathered:
            self._evict_oldest()
        self.placement.finish()

    # ---- what is in memory --------------------------------------------------------------------------------

    def _adopt(self, param: nn.Parameter) -> None:
        if id(param) in self._pending or self.store.record_of(param) is not None:
            return  # registered again (a tied weight): already tracked
        if self.dtype is not None and param.is_floating_point() and param.dtype != self.dtype:
            param.data = param.data.to(self.dtype)
        self._pending[id(param)] = param
        self._elements += param.numel()
        self._evict_while_over(keep=id(param))

    def _evict_while_over(self, keep: int | None = None) -> None:
        while self._elements > self.limit and len(self._pending) + len(self._gathered) > 1:
            if not self._evict_oldest(keep=keep):
                return

    def settle(self, param: nn.Parameter) -> None:
        """Before ``param`` is gathered from outside the dispatch mode (`offload.zero.GatheredParameters`):
        place it now if it is pending (whole on every rank, as built), so that it is gathered from the
        partitions and a change made inside the block reaches every rank's partition, or none; and let
        the writes in flight land first, as `_gather` does (sync point). Raises TensorIOError."""
        if id(param) in self._pending:
            self._place(id(param))
        rec = self.store.record_of(param)
        if rec is not None and rec.on_disk:
            self.placement.finish()  # never read (or overwrite) a partition whose first write is in flight

    def _evict_oldest(self, keep: int | None = None) -> bool:
        """Place the oldest pending parameter, else write back the oldest gathered one."""
        for key in self._pending:
            if key != keep:
                self._place(key)
                return True
        if self._gathered:
            _, rec = self._gathered.popitem(last=False)
            self._elements -= rec.numel
            self.store.write_back(rec)
            self.store.release(rec)
            return True
        return False

    def _place(self, key: int) -> None:
        param = self._pending.pop(key)
        self._elements -= param.numel()
        rec = self.placement.place(param, [f"param{len(self.store.records)}"], len(self.store.records))
        self.store.add(rec)
        if not rec.keep_full:
            self._by_storage[self.store.placeholder_of(rec).untyped_storage()._cdata] = rec
            rec.param.data = self.store.placeholder_of(rec)

    def _gather(self, rec: ParamRecord) -> torch.Tensor:
        if rec.on_disk:
            self.placement.finish()  # sync point: never read a partition whose first write is in flight
        full = self.store.gather(rec).view(rec.shape)
        if rec.index not in self._gathered:
            self._gathered[rec.index] = rec
            self._elements += rec.numel
            self._evict_while_over()
        return full

    # ---- the dispatch mode ----------------------------------------------------------------------------------

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        flat, spec = tree_flatten((args, kwargs or {}))
        replaced = False
        for i, value in enumerate(flat):
            if not isinstance(value, torch.Tensor) or value.numel() == 0 or any(value.stride()):
                continue  # a placeholder has all strides 0
            rec = self._by_storage.get(value.untyped_storage()._cdata)
            if rec is None:
                continue
            if tuple(value.shape) != tuple(rec.shape):
                raise RuntimeError(f"parameter {rec.name!r} was viewed while partitioned (shape "
                                   f"{tuple(value.shape)} of {tuple(rec.shape)}); wrap the code that reads or "
                                   f"changes it in offload.zero.GatheredParameters")
            flat[i] = self._gather(rec)
            replaced = True
        if replaced:
            args, kwargs = tree_unflatten(flat, spec)
        return func(*args, **(kwargs or {}))


BUILT: dict[int, ParamStore] = {}
"""Stores of models built under `Init`, until `initialize` adopts (or `discard_build` drops) them."""

_OPEN_BUILDS: list[PartitionedBuild] = []
"""The builds whose blocks are open, innermost last (`settle_for_gather`)."""


def settle_for_gather(param: nn.Parameter) -> None:
    """Inside an `offload.zero.Init` block, before `offload.zero.GatheredParameters` gathers ``param``: the
    open build holding it places it if still pending and waits for its writes in flight
    (`PartitionedBuild.settle`); nothing for a parameter no open build holds. Raises TensorIOError."""
    for build in _OPEN_BUILDS:
        build.settle(param)


def discard_build(store: ParamStore) -> None:
    """Forget a build and remove its swap file (a failed or abandoned `Init`)."""
    BUILT.pop(id(store), None)
    if store.swap is not None:
        store.swap.close()


def built_store(model: nn.Module) -> ParamStore | None:
    """The store `Init` placed ``model``'s parameters in, or None for a model built without it.

    Raises ValueError for a model whose parameters are partly from `Init` and partly not, or from two
    `Init` blocks."""
    stores = {}
    plain = []
    for name, p in model.named_parameters():
        found = find_record(p)
        if found is not None and id(found[0]) in BUILT:
            stores[id(found[0])] = found[0]
        else:
            plain.append(name)
    if not stores:
        return None
    if len(stores) > 1:
        raise ValueError("the model's parameters were built under more than one zero.Init block; build it under one")
    if plain:
        raise ValueError(f"parameters {plain[:5]} were made outside zero.Init, the rest under it; build the whole "
                         f"model under zero.Init, or none of it")
    return next(iter(stores.values()))
