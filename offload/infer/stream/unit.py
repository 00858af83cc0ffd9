"""One record per unit of placement (`Unit`): a decoder layer, the output head, the embeddings, and
its parameters (`ParamRef`), with the state the streamer and the resident load move it through (the
states: offload/infer/stream/streamer.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Protocol

import torch
from torch import nn

from offload.infer.stream.device_layout import DeviceLayout
from offload.infer.weights.names import Conversion
from offload.storage.safetensors_reader import Window, windows_nbytes
from tensorio import IOFuture

__all__ = ["ParamRef", "Unit", "UnitLoad"]


class UnitLoad(Protocol):
    """The load that makes a unit resident in the background (`offload.infer.stream.resident_load.ResidentLoad`),
    as the streamer and the engine ask it about one unit."""

    def wait(self, unit: Unit) -> None:
        """Wait for ``unit``'s reads and bind its parameters there for good."""

    def claim(self, unit: Unit) -> bool:
        """Lend ``unit`` to the streamer for one forward, if the load has not taken it on; whether lent."""

    def unclaim(self, unit: Unit) -> None:
        """The streamer is done with ``unit``: the load may take it on."""

    def drop(self, unit: Unit) -> None:
        """Give ``unit`` up ("on disk", unbound) without waiting for the load to reach it."""


@dataclass(frozen=True, slots=True)
class ParamRef:
    """One parameter of a unit: every (module, attribute) that holds it (more than one when tied),
    the checkpoint tensor it is read from, and its meta placeholder; or, with ``conversion``, the
    checkpoint tensors it is assembled from (offload/infer/weights/names.py; ``tensor`` is then the
    model key the conversion makes for it)."""

    owners: tuple[tuple[nn.Module, str], ...]
    tensor: str
    placeholder: nn.Parameter
    conversion: Conversion | None = None

    @property
    def tensors(self) -> tuple[str, ...]:
        """The checkpoint tensors it reads."""
        return (self.tensor,) if self.conversion is None else self.conversion.tensors

    def value(self, views: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """Its values from the unit's tensors as read (``views``: checkpoint key -> tensor): a view, or a copy
        where transformers' conversion assembles it from several, or where it is stored in another dtype
        than the model keeps it in (a router kept in fp32 by the model, stored in bf16)."""
        value = views[self.tensor] if self.conversion is None else self.conversion.run(views)[self.tensor]
        return value if value.dtype == self.placeholder.dtype else value.to(self.placeholder.dtype)

    def bind(self, value: torch.Tensor) -> None:
        param = value if isinstance(value, nn.Parameter) else nn.Parameter(value, requires_grad=False)
        for module, attr in self.owners:
            module._parameters[attr] = param

    def unbind(self) -> None:
        for module, attr in self.owners:
            module._parameters[attr] = self.placeholder


@dataclass(eq=False, slots=True)
class Unit:
    """One unit of placement (a decoder layer, the output head, ...) and its state."""

    name: str
    module: nn.Module
    params: tuple[ParamRef, ...]
    windows: list[Window]
    """Its tensors' aligned windows, packed from buffer offset 0."""
    nbytes: int
    """Its weights' bytes in memory."""
    streamable: bool
    state: str = "on disk"
    """"resident", "loading" (becoming resident), "on disk", "in flight", "in use", or with a device
    tier "host" (kept in pinned host memory, ``host_buffer``) and "staged" (that copied to the device ring)."""
    slot: int | None = None
    """The ring buffer it is read into (in flight or in use)."""
    futures: list[IOFuture] = field(default_factory=list)
    users: int = 0
    hooks: list = field(default_factory=list)
    loading: UnitLoad | None = None
    """The load reading it into memory of its own (state "loading")."""
    load_hooks: list = field(default_factory=list)
    claimed: bool = False
    """Loading, but lent to the ring for a forward because its load had not taken it on yet (set
    and cleared by the load, under its lock)."""
    host_buffer: torch.Tensor | None = None
    """State "host": its windows in pinned host memory, copied to the device for each forward."""
    device_buffer: torch.Tensor | None = None
    """Resident on a device with memory of its own: the device buffer its parameters are views of."""
    _layout: DeviceLayout | None = field(default=None, repr=False)

    @property
    def read_nbytes(self) -> int:
        return sum(w.nbytes for w in self.windows)

    @property
    def buffer_nbytes(self) -> int:
        """Bytes of a buffer that holds it: its windows read (host), or its tensors aligned (device)."""
        return max(windows_nbytes(self.windows), self.device_layout.nbytes)

    @property
    def copy_nbytes(self) -> int:
        """Bytes one copy of it to a device moves: its tensors (`device_layout`), not its windows' page slack."""
        return sum(nbytes for _, _, nbytes in self.device_layout.copies)

    @property
    def device_layout(self) -> DeviceLayout:
        """Where its tensors go in a device buffer, each aligned (offload/infer/stream/device_layout.py)."""
        if self._layout is None or self._layout.windows is not self.windows:
            self._layout = DeviceLayout.of(self.windows)
        return self._layout

    def unbind(self) -> None:
        for ref in self.params:
            ref.unbind()
