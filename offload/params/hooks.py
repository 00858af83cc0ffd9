"""The forward hooks of `ParamStore.install`: the stack of forwards under way, external parameters
detected as a module's forward returns them, and a module's parameters gathered around its forward
(one all-gather for those not gathered yet across ranks: `ParamStore.gather_together`)."""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from offload.params.record import ParamRecord


class HookedStore(Protocol):
    """What the hooks use of the `ParamStore` that installs them."""

    forwards: list[nn.Module]
    _detected: dict[int, set[int]]

    def record_of(self, param: torch.Tensor) -> ParamRecord | None: ...
    def register_external(self, module: nn.Module, rec: ParamRecord) -> None: ...
    def gather_together(self, recs: list[ParamRecord]) -> None: ...
    def reused_soon(self, rec: ParamRecord) -> bool: ...
    def release(self, rec: ParamRecord) -> None: ...


class ForwardEntry:
    """Pushes a module onto the store's stack of forwards under way."""

    def __init__(self, store: "HookedStore") -> None:
        self.store = store

    def __call__(self, module: nn.Module, args: object) -> None:
        self.store.forwards.append(module)


class ForwardExit:
    """Detects external parameters as DeepSpeed does: a parameter that a module's forward returns (a
    module handing out its weight, as some embeddings do) is used by the forward that called it, so it
    is registered as an external parameter of that caller (`register_external`): kept gathered until
    the caller's forward ends, and gathered around it from then on. Uses in any other way are not
    visible to hooks: register those with `offload.zero.register_external_parameter`."""

    def __init__(self, store: "HookedStore") -> None:
        self.store = store

    def __call__(self, module: nn.Module, args: object, output: object) -> None:
        forwards = self.store.forwards
        if forwards and forwards[-1] is module:
            forwards.pop()
        if not forwards or isinstance(output, torch.Tensor) and not isinstance(output, nn.Parameter):
            return  # the outermost forward, or a plain tensor: nothing to look for
        caller = forwards[-1]
        for value in tree_flatten(output)[0]:
            rec = self.store.record_of(value) if isinstance(value, nn.Parameter) else None
            if rec is None or rec.keep_full:
                continue
            detected = self.store._detected.setdefault(id(caller), set())
            if rec.index in detected:
                continue
            detected.add(rec.index)
            # Still gathered (this hook runs before its owner's releases it); from here on the caller's
            # hooks hold it, as if its pre-forward hook had gathered it.
            rec.users += 1
            self.store.register_external(caller, rec)


class PreForward:
    """Gathers a module's parameters (one all-gather across ranks) before its forward."""

    def __init__(self, store: "HookedStore", recs: list[ParamRecord]) -> None:
        self.store, self.recs = store, recs

    def __call__(self, module: nn.Module, args: object) -> None:
        for rec in self.recs:
            rec.users += 1
        self.store.gather_together(self.recs)


class PostForward:
    """Releases a module's parameters after its forward, unless used again soon."""

    def __init__(self, store: "HookedStore", recs: list[ParamRecord]) -> None:
        self.store, self.recs = store, recs

    def __call__(self, module: nn.Module, args: object, output: object) -> None:
        for rec in self.recs:
            rec.users = max(0, rec.users - 1)
            if rec.users == 0 and not self.store.reused_soon(rec):
                self.store.release(rec)  # saved tokens gather it again in backward
