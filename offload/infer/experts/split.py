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

With quantized weights the experts module is a `QuantExperts` (offload/infer/weights/quant_experts.py): a
child per expert whose tensors the quantized cache stores together. Each expert is then the windows of its
own tensors, taken as they are read (quantized, no conversion) in its first child's place: `QuantExperts`
computes with that child alone when told it has one expert, as transformers' module computes with the
slices of one.

A layer whose experts are stored fused in the checkpoint (no per-expert tensors) is left whole.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from offload.infer.stream.unit import ParamRef, Unit
from offload.infer.weights.names import Conversion
from offload.infer.weights.quant_experts import QuantExperts
from offload.storage.safetensors_reader import SafetensorsCheckpoint, Window, windows_nbytes

__all__ = ["Expert", "ExpertLayer", "Taken", "split_experts"]


@dataclass(frozen=True, slots=True)
class Taken:
    """One checkpoint tensor taken as it is read for another parameter: a quantized expert's tensor ``key``
    bound in its `QuantExperts`' first child's place (``target``, that parameter's key)."""

    key: str
    target: str

    @property
    def tensors(self) -> tuple[str, ...]:
        """The checkpoint key it reads."""
        return (self.key,)

    def run(self, tensors, model=None) -> dict[str, torch.Tensor]:
        """{``target``: the tensor of ``key`` in ``tensors``} (as read: a view)."""
        return {self.target: tensors[self.key]}


@dataclass(frozen=True, slots=True)
class Expert:
    """One expert of one layer: the checkpoint tensors it is read from and how its slices are made."""

    index: int
    windows: tuple[Window, ...]
    conversions: tuple[Conversion | Taken, ...]
    """One per parameter of `ExpertLayer.params` (in its order), over this expert's tensors only: it makes
    that fused parameter's slice of shape [1, ...], or takes this expert's quantized tensor for it."""
    nbytes: int
    """Its slices' bytes in memory (the compute dtype; quantized: its packed tensors)."""

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
    """What one expert's values are bound to for a forward with ``num_experts`` 1, meta placeholders between
    forwards: its fused parameters (``gate_up_proj``, ``down_proj``, biases), or a `QuantExperts`' first
    child's."""
    experts: tuple[Expert, ...]
    router: nn.Module | None
    """The block's router (its weight [E, hidden]), kept in memory; None where none was found."""
    top_k: int
    """Experts each token picks (the config's ``num_experts_per_tok``)."""

    @property
    def count(self) -> int:
        return len(self.experts)

    @property
    def slice_shapes(self) -> tuple[tuple[torch.Size, torch.dtype], ...]:
        """(shape, dtype) of one expert's value for each of ``params``: its slice [1, ...] of a fused parameter,
        or a `QuantExperts`' first child's parameter whole."""
        whole = isinstance(self.module, QuantExperts)
        return tuple((ref.placeholder.shape if whole else torch.Size((1, *ref.placeholder.shape[1:])),
                      ref.placeholder.dtype) for ref in self.params)


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
        count = owner.num_experts
        if isinstance(owner, QuantExperts):
            fused, params, experts = _quantized(unit, owner, checkpoint)
        else:
            fused = params = tuple(ref for ref in unit.params if ref.owners[0][0] is owner)
            experts = tuple(_expert(e, fused, count, checkpoint) for e in range(count))
        router_path, router = _router(module, path, count)
        routed = tuple(ref for ref in unit.params if router is not None and ref.owners[0][0] is router)
        taken = {id(ref) for ref in fused + routed}
        rest = tuple(ref for ref in unit.params if id(ref) not in taken)
        if routed:
            out.append(_unit(router_path, router, routed, checkpoint, streamable=False))
        out.append(_unit(unit.name, unit.module, rest, checkpoint, streamable=unit.streamable))
        layers.append(ExpertLayer(len(layers), path, owner, params, experts, router, top_k))
    return out, layers


def _top_k(module: nn.Module) -> int:
    config = getattr(module, "config", None)
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    return int(getattr(config, "num_experts_per_tok", 0) or getattr(config, "moe_topk", 0) or 1)


def _experts_module(unit: Unit, top_k: int) -> tuple[str, nn.Module] | None:
    """(path, module) of the experts module inside ``unit`` whose fused parameters are all assembled from one
    checkpoint tensor per expert and source pattern, or of its `QuantExperts`; None where there is none."""
    owners = {id(ref.owners[0][0]): ref.owners[0][0] for ref in unit.params}
    for path, child in unit.module.named_modules():
        count = getattr(child, "num_experts", None)
        if not isinstance(count, int) or count <= 1 or top_k >= count:
            continue
        if isinstance(child, QuantExperts):  # its experts' tensors are its children's, one set per expert
            if any(id(m) in owners for m in child.modules()):
                return f"{unit.name}.{path}" if path else unit.name, child
            continue
        if id(child) not in owners:
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


def _quantized(unit: Unit, owner: QuantExperts, checkpoint: SafetensorsCheckpoint
               ) -> tuple[tuple[ParamRef, ...], tuple[ParamRef, ...], tuple[Expert, ...]]:
    """(every parameter of ``owner``'s experts, its first child's, one `Expert` per child) for a `QuantExperts`:
    expert ``e``'s tensors are taken for the first child's parameters of the same place."""
    place = {}  # id(owning module) -> (expert, the module's path inside its expert)
    for e in range(owner.num_experts):
        for name, module in owner.get_submodule(str(e)).named_modules():
            place[id(module)] = (e, name)
    per_expert: list[dict[tuple[str, str], ParamRef]] = [{} for _ in range(owner.num_experts)]
    for ref in unit.params:
        where = place.get(id(ref.owners[0][0]))
        if where is not None:
            per_expert[where[0]][(where[1], ref.owners[0][1])] = ref
    first = per_expert[0]
    if any(set(refs) != set(first) for refs in per_expert):
        raise ValueError(f"{unit.name}: the experts of its QuantExperts do not all have the same parameters")
    experts = []
    for e, refs in enumerate(per_expert):
        mine = [refs[key] for key in first]
        nbytes = sum(ref.placeholder.numel() * ref.placeholder.element_size() for ref in mine)
        experts.append(Expert(e, tuple(checkpoint.windows([ref.tensor for ref in mine])),
                              tuple(Taken(ref.tensor, first[key].tensor) for ref, key in zip(mine, first)), nbytes))
    every = tuple(ref for refs in per_expert for ref in refs.values())
    return every, tuple(first.values()), tuple(experts)


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
