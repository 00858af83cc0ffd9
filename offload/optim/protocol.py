"""What the training engine's fast paths use of their optimizer (`OffloadAdam` implements it).

The engine hands partitions over as their gradients are final and lets the optimizer's thread update
them; it commits and rolls back its parameters with the optimizer's state. Everything it calls is
here, so that the engine depends on this surface and not on how `OffloadAdam` is built.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol

import torch


class StepOptimizer(Protocol):
    """The optimizer surface of the engine's fast paths (see `OffloadAdam` for each method's contract)."""

    param_groups: list[dict[str, Any]]

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Finish the step: every update handed over has run; commit (now, or once its writes land)."""

    def start_step(self, grad_scale: float = 1.0, *, in_order: bool = False) -> None:
        """Begin a step whose gradients are handed over, each multiplied by ``grad_scale``."""

    def grad_ready(self, param: torch.Tensor, on_updated: Callable[[torch.Tensor], Any] | None = None, *,
                   grad: torch.Tensor | None = None) -> None:
        """``param``'s gradient is final: update it on the optimizer's thread."""

    def read_ahead(self, nbytes: int) -> None:
        """Between steps: read the state the next step's first updates need."""

    def wait_for_updates(self, done: Callable[[], bool]) -> None:
        """Back-pressure: wait until ``done()`` or every update handed over has run."""

    def synchronize(self) -> None:
        """Sync point: the updates and the last step's writes have landed and committed."""

    def raise_if_failed(self) -> None:
        """Raise the optimizer thread's error, if any, after giving the step up."""

    def abandon_step(self) -> None:
        """Forget the uncommitted step (the caller's part of it failed)."""

    def add_step_hooks(self, on_commit: Callable[[], None] | None = None,
                       on_abort: Callable[[], None] | None = None) -> None:
        """Run ``on_commit`` / ``on_abort`` as each step commits or is given up."""

    def update_groups(self) -> list[list[int]]:
        """Parameter indices updated together (sharing a sub-group)."""

    def overwrites(self, param: torch.Tensor) -> bool:
        """Whether ``param``'s next update writes it whole without reading it."""
