"""`SwapConfig`: how offloaded optimizer state is swapped; the one place its settings are checked.

`OffloadAdam` builds it from its keyword arguments, the engine from ``zero_optimization.
offload_optimizer`` (`OffloadOptimizerConfig.swap_config`): the names, defaults and checks are these.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from tensorio import AioConfig

from offload.config.parse import boolean, integral


@dataclass(kw_only=True, slots=True)
class SwapConfig:
    """How offloaded optimizer state is swapped (DeepSpeed's ``offload_optimizer`` key names).

    Raises ValueError naming the key for a bad value.
    """

    buffer_count: int = 4
    """Locked buffers of one sub-group's state each. At least ``buffers_needed``."""

    pin_memory: bool = True
    """Lock (mlock/pin) the buffers; False uses plain page-aligned memory."""

    pipeline_read: bool | None = None
    """Read the next sub-group's state while the current one is updated. None (not chosen): on when
    ``buffer_count`` has room for it (2 or more)."""

    pipeline_write: bool | None = None
    """Write the previous sub-group's state while the current one is updated. None (not chosen): on
    when ``buffer_count`` has room for it beside reading ahead (3 or more)."""

    sub_group_size: int = 1 << 22
    """Most parameter elements updated by one kernel call, and so held by one buffer. At least 1024."""

    aio: AioConfig = field(default_factory=AioConfig)
    """tensorio settings of the swap file's I/O (an `AioConfig` or a dict of its keys)."""

    def __post_init__(self) -> None:
        self.pin_memory = boolean("pin_memory", self.pin_memory)
        self.buffer_count = integral("buffer_count", self.buffer_count, minimum=1)
        self.sub_group_size = integral("sub_group_size", self.sub_group_size, minimum=1024)
        if self.pipeline_read is None:
            self.pipeline_read = self.buffer_count >= 2
        if self.pipeline_write is None:
            self.pipeline_write = self.buffer_count >= 2 + int(self.pipeline_read)
        self.pipeline_read = boolean("pipeline_read", self.pipeline_read)
        self.pipeline_write = boolean("pipeline_write", self.pipeline_write)
        if isinstance(self.aio, Mapping):
            self.aio = AioConfig.from_dict(dict(self.aio))
        if not isinstance(self.aio, AioConfig):
            raise ValueError(f"aio: {self.aio!r} is not allowed; use an AioConfig or a dict of its keys")
        if self.buffer_count < self.buffers_needed:
            raise ValueError(f"buffer_count: {self.buffer_count} is too few; pipeline_read={self.pipeline_read} "
                             f"and pipeline_write={self.pipeline_write} need at least {self.buffers_needed}")

    @property
    def buffers_needed(self) -> int:
        """Buffers the pipeline needs: one being updated, one being read ahead, one being written."""
        return 1 + int(self.pipeline_read) + int(self.pipeline_write)

    @property
    def read_ahead(self) -> int:
        """Sub-groups that may be read ahead of the one being updated: every other buffer.

        A sub-group is written from the buffer it was updated in, so a write needs no buffer of
        its own; read-ahead only ever takes buffers that are free (see `StateSwapper.free_buffers`).
        """
        return self.buffer_count - 1 if self.pipeline_read else 0


def prefixed(key: str, build: Any, /, **values: Any) -> Any:
    """``build(**values)``, with ``key.`` before the key its ValueError names (for a JSON section)."""
    try:
        return build(**values)
    except ValueError as error:
        raise ValueError(f"{key}.{error}") from None
