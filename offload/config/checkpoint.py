"""`CheckpointConfig`: how ``engine.save_checkpoint`` saves when its caller does not say (the ``checkpoint``
section at the top of the JSON config; not a DeepSpeed key)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from offload.config.parse import boolean

__all__ = ["CheckpointConfig"]


@dataclass(kw_only=True, slots=True)
class CheckpointConfig:
    """The ``checkpoint`` section: ``{"async_save": true}`` makes every ``save_checkpoint`` that does not pass
    ``async_save=`` itself asynchronous, so that the trainers' integrations (OffloadTrainer's ``save_steps``,
    Lightning's and Accelerate's saves) do not stall the step (docs/engine.md, "Asynchronous save")."""

    _KEY: ClassVar[str] = "checkpoint"

    async_save: bool = False
    """Save in the background: ``save_checkpoint`` returns once the snapshot of the step is fixed."""

    def __post_init__(self) -> None:
        self.async_save = boolean(f"{self._KEY}.async_save", self.async_save)
