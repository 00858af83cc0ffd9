"""Mixture-of-experts layers split into units of one expert each.

transformers 5 holds a layer's experts as one module (``MixtralExperts``, ``Qwen3MoeExperts``,
``DeepseekV3Experts``, ...) whose parameters are 3-D, one slice per expert (``gate_up_proj`` [E, 2I, H],
``down_proj`` [E, H, I]), and whose forward takes ``(hidden_states, top_k_index, top_k_weights)`` from the
block's router. Checkpoints on disk keep one tensor per expert (``experts.3.w1.weight``), fused by
transformers' conversion as they load (offload/infer/weights/names.py). Here each expert becomes its own
unit: its tensors' windows in the checkpoint, and the conversion that makes its slice of every fused
parameter from them alone (the same operations on a list of one expert). The layer's other weights
(attention, norms, shared experts) stay in the layer's unit; the router goes to a unit of its own that
stays in memory, so that the next layer's choice can be guessed before that layer is read.

A layer whose experts are stored fused in the checkpoint (no per-expert tensors) is left whole.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from offload.infer.stream.unit import ParamRef, Unit
from offload.infer.weights.names import Conversion
from offload.storage.safetensors_reader import SafetensorsCheckpoint, Window, windows_nbytes

__all__ = ["Expert", "ExpertLayer", "split_experts"]


@dataclass(frozen=True, slots=True)
class Expert:
    """One expert of one layer: the checkpoint tensors it is read from and how its slices are made."""

    index: int
    windows: tuple[Window, ...]
    conversions: tuple[Conversion, ...]
    """One per fused parameter of the layer's experts module (in `ExpertLayer.params` order), over this
    expert's tensors only: it makes that parameter's slice of shape [1, ...]."""
    nbytes: int
    """Its slices' bytes in memory (the compute dtype)."""

    @property
    def read_nbytes(self) -> int:
        """Bytes one read of it moves from the disk (its aligned windows)."""
        return sum(w.nbytes for w in self.windows)

    @property
    def buffer_nbytes(self) -> int:
        """Bytes of a buffer its windows are read into."""
        return windows_nbytes(self.windows)


@dataclass(eq=False, slots=True)
class ExpertLayer:
    """A decoder layer's experts module, its router and its experts."""

    position: int
    """Its place among the model's expert layers (0, 1, ...), in forward order."""
    name: str
    """The experts module's path, e.g. "model.layers.3.mlp.experts"."""
    module: nn.Module
    params: tuple[ParamRef, ...]
    """Its fused parameters (``gate_up_proj``, ``down_proj``, biases), meta placeholders between forwards."""
    experts: tuple[Expert, ...]
    router: nn.Module | None
    """The block's router (its weight [E, hidden]), kept in memory; None where none was found."""
    top_k: int
    """Experts each token picks (the config's ``num_experts_per_tok``)."""

    @property
    def count(self) -> int:
        return len(self.experts)


def split_experts(units: list[Unit], module: nn.Module, checkpoint: SafetensorsCheckpoint) -> tuple[list[Unit], list[ExpertLayer]]:
    """``units`` with the experts of every mixture-of-experts layer taken out (and the routers in units of
    their own, kept in memory), and those layers' `ExpertLayer` records in forward order. ``units``
    unchanged and no layers where the model has none, or its checkpoint stores them fused."""
    top_k = _top_k(module)
    out: list[Unit] = []
    layers: list[ExpertLayer] = []
    for unit in units:
        experts_module = _experts_module(unit, top_k)
        if experts_module is None:
            out.append(unit)
            continue
        path, owner = experts_module
        fused = tuple(ref for ref in unit.params if ref.owners[0][0] is owner)
        count = owner.num_experts
        experts = tuple(_expert(e, fused, count, checkpoint) for e in range(count))
        router_path, router = _router(module, path, count)
        routed = tuple(ref for ref in unit.params if router is not None and ref.owners[0][0] is router)
        rest = tuple(ref for ref in unit.params if ref not in fused and ref not in routed)
        if routed:
            out.append(_unit(router_path, router, routed, checkpoint, streamable=False))
        out.append(_unit(unit.name, unit.module, rest, checkpoint, streamable=unit.streamable))
        layers.append(ExpertLayer(len(layers), path, owner, fused, experts, router, top_k))
    return out, layers


def _top_k(module: nn.Module) -> int:
    config = getattr(module, "config", None)
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    return int(getattr(config, "num_experts_per_tok", 0) or getattr(config, "moe_topk", 0) or 1)


def _experts_module(unit: Unit, top_k: int) -> tuple[str, nn.Module] | None:
    """(path, module) of the experts module inside ``unit`` whose fused parameters are all assembled from one
    checkpoint tensor per expert and source pattern; None where there is none."""
    owners = {id(ref.owners[0][0]): ref.owners[0][0] for ref in unit.params}
    for path, child in unit.module.named_modules():
        count = getattr(child, "num_experts", None)
        if id(child) not in owners or not isinstance(count, int) or count <= 1 or top_k >= count:
            continue
        refs = [ref for ref in unit.params if ref.owners[0][0] is child]
        if all(len(ref.owners) == 1 and ref.placeholder.dim() >= 2 and ref.placeholder.shape[0] == count
               and ref.conversion is not None and all(len(keys) == count for keys in ref.conversion.sources.values())
               for ref in refs):
            return f"{unit.name}.{path}" if path else unit.name, child
    return None


def _expert(index: int, fused: tuple[ParamRef, ...], count: int, checkpoint: SafetensorsCheckpoint) -> Expert:
    conversions = tuple(Conversion(ref.conversion.converter, ref.conversion.layer,
                                   {pattern: (keys[index],) for pattern, keys in ref.conversion.sources.items()})
                        for ref in fused)
    tensors = [key for conversion in conversions for key in conversion.tensors]
    nbytes = sum(ref.placeholder.numel() // count * ref.placeholder.element_size() for ref in fused)
    return Expert(index, tuple(checkpoint.windows(tensors)), conversions, nbytes)


def _router(model: nn.Module, experts_path: str, count: int) -> tuple[str, nn.Module | None]:
    """The sibling of the experts module whose weight scores the experts ([count, hidden])."""
    block_path = experts_path.rpartition(".")[0]
    block = model.get_submodule(block_path)
    for name, child in block.named_children():
        weight = getattr(child, "weight", None)
        if isinstance(weight, nn.Parameter) and weight.dim() == 2 and weight.shape[0] == count:
            return f"{block_path}.{name}", child
    return "", None


def _unit(name: str, module: nn.Module, refs: tuple[ParamRef, ...], checkpoint: SafetensorsCheckpoint, *,
          streamable: bool) -> Unit:
    nbytes = sum(ref.placeholder.numel() * ref.placeholder.element_size() for ref in refs)
    tensors = [key for ref in refs for key in ref.tensors]
    return Unit(name, module, refs, checkpoint.windows(tensors), nbytes, streamable)
