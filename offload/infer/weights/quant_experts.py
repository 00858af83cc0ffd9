"""A mixture-of-experts layer's experts quantized expert by expert, as the dense layers' linear weights are.

transformers 5 holds a layer's experts as one module whose projections are 3-D parameters, one slice per
expert (``gate_up_proj`` or ``up_proj``, and ``down_proj``: [E, out, in], or [E, in, out] where the class
says ``is_transposed``; biases ``<name>_bias`` [E, out]). `QuantExperts` stands in for it in a quantized
model: a child per expert ("0", "1", ...), each projection of it a `QuantLinear` (the same spec, group size
and kernels as the dense layers') where the kernel takes its shape, else an ``nn.Linear`` in the compute
dtype (as a dense linear layer the kernel does not take), named without the ``_proj`` (``experts.3.down``):
transformers' conversions take ``experts.*.down_proj.weight`` for checkpoints' per-expert tensors and would
fuse them. Each expert is then tensors of its own in the quantized cache, laid out together from a page
boundary (`expert_layout`, written by offload/infer/weights/qcache.py), so that reading one expert by the
router's choice (offload/infer/experts/) is one aligned read of its quantized bytes.

Its forward computes each picked expert on the tokens routed to it (projection, the class's own gating
``_apply_gate`` or activation, projection, times the routing weight, rounded to the activations' dtype as
transformers' eager loop rounds it) and sums them per token in fp32. Called with ``num_experts`` 1 it
computes with its first child only: the expert store binds each read expert's tensors there.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import torch
from torch import nn

from offload.device import CPU_KERNELS, PackedKernels
from offload.infer.config import WeightQuantization
from offload.infer.weights.quantize import QuantLinear, quantizable_shape, quantize_weight, quantized_layout

__all__ = ["QuantExperts", "expert_layout", "expert_tensors", "experts_targets", "projections", "swap_experts"]

PROJECTIONS = ("gate_up_proj", "up_proj", "down_proj")
"""The projections of transformers' experts modules (``use_experts_implementation``), in compute order."""


def projections(module: nn.Module) -> list[tuple[str, int, int, bool]]:
    """(name, out features, in features, has a bias) of each projection of the experts module ``module``, in
    compute order; [] where it is not one `QuantExperts` can stand in for (not a transformers experts class,
    other parameters, a norm after each expert, experts spread over ranks)."""
    count = getattr(module, "num_experts", None)
    if (not isinstance(count, int) or count <= 1 or not hasattr(module, "is_transposed")
            or getattr(module, "has_post_expert_norm", False) or getattr(module, "_is_expert_parallel", False)):
        return []
    params = dict(module.named_parameters(recurse=False))
    found = []
    for name in PROJECTIONS:
        weight = params.pop(name, None)
        if weight is None:
            continue
        bias = params.pop(f"{name}_bias", None)
        if weight.dim() != 3 or weight.shape[0] != count:
            return []
        out_features, in_features = weight.shape[1:] if not module.is_transposed else weight.shape[:0:-1]
        found.append((name, int(out_features), int(in_features), bias is not None))
    if params or [n for n, *_ in found] not in (["gate_up_proj", "down_proj"], ["up_proj", "down_proj"]):
        return []
    return found


def experts_targets(module: nn.Module, blocks: str | None, spec: WeightQuantization) -> dict[str, nn.Module]:
    """The experts modules inside the decoder layers (``blocks``) that `QuantExperts` stands in for under
    ``spec`` (path -> module): those with at least one projection the kernel takes."""
    if blocks is None:
        return {}
    found = {}
    for name, child in module.get_submodule(blocks).named_modules():
        if any(quantizable_shape(out, inp, spec) for _, out, inp, _ in projections(child)):
            found[f"{blocks}.{name}"] = child
    return found


class QuantExperts(nn.Module):
    """The experts of ``source`` (a transformers experts module), a child per expert whose projections are
    `QuantLinear` on ``kernels`` where ``spec`` takes their shape, else ``nn.Linear`` in ``dtype`` (all on
    the meta device until the engine binds them). See the module docstring."""

    def __init__(self, source: nn.Module, spec: WeightQuantization, dtype: torch.dtype,
                 kernels: PackedKernels = CPU_KERNELS) -> None:
        super().__init__()
        found = projections(source)
        if not found:
            raise ValueError(f"QuantExperts: {type(source).__name__} is not an experts module of transformers' "
                             f"experts implementation with projections {PROJECTIONS}")
        self.num_experts = source.num_experts
        self.names = tuple(name for name, *_ in found)
        self.has_gate = self.names[0] == "gate_up_proj"
        self._gate = type(source)._apply_gate.__get__(source) if self.has_gate else None
        self.act_fn = source.act_fn
        for e in range(self.num_experts):
            expert = nn.Module()
            for name, out_features, in_features, bias in found:
                if quantizable_shape(out_features, in_features, spec):
                    linear = QuantLinear(in_features, out_features, spec, dtype, bias=bias, kernels=kernels)
                else:
                    linear = nn.Linear(in_features, out_features, bias=bias, device="meta", dtype=dtype)
                    linear.requires_grad_(False)
                expert.add_module(_child(name), linear)
            self.add_module(str(e), expert)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        """Each expert ``top_k_index`` [tokens, k] picks (below ``num_experts``) on its tokens of
        ``hidden_states`` [tokens, hidden], weighted by ``top_k_weights`` [tokens, k], summed in fp32."""
        out = torch.zeros(hidden_states.shape, dtype=torch.float32, device=hidden_states.device)
        for e in sorted(set(top_k_index.reshape(-1).tolist())):
            if not 0 <= e < self.num_experts:
                continue
            tokens, position = torch.where(top_k_index == e)
            part = self.expert(e, hidden_states[tokens]) * top_k_weights[tokens, position, None]
            out.index_add_(0, tokens, part.to(hidden_states.dtype).float())
        return out.to(hidden_states.dtype)

    def expert(self, index: int, x: torch.Tensor) -> torch.Tensor:
        """Expert ``index`` on ``x`` [rows, hidden]."""
        expert = self.get_submodule(str(index))
        first, down = (getattr(expert, _child(name)) for name in self.names)
        h = first(x)
        h = self._gate(h) if self.has_gate else self.act_fn(h)
        return down(h)

    def extra_repr(self) -> str:
        return f"num_experts={self.num_experts}, {', '.join(self.names)}"


def _child(projection: str) -> str:
    """The attribute of a `QuantExperts` child that holds ``projection`` ("down_proj": "down")."""
    return projection.removesuffix("_proj")


def swap_experts(module: nn.Module, paths: list[str], spec: WeightQuantization, dtype: torch.dtype,
                 kernels: PackedKernels = CPU_KERNELS) -> None:
    """Replace the experts modules ``paths`` of ``module`` (`experts_targets`) by meta-device `QuantExperts`."""
    for path in paths:
        parent, _, attr = path.rpartition(".")
        setattr(module.get_submodule(parent), attr, QuantExperts(module.get_submodule(path), spec, dtype, kernels))


def expert_layout(path: str, source: nn.Module, spec: WeightQuantization, dtype: torch.dtype,
                  kernels: PackedKernels = CPU_KERNELS) -> list[dict[str, tuple[torch.dtype, tuple[int, ...]]]]:
    """Per expert, the tensors (name -> (dtype, shape)) `QuantExperts` of the experts module ``source`` at
    ``path`` reads, in order: ``<path>.<e>.<projection without _proj>.qweight`` and its scales where quantized, else
    ``.weight``; then ``.bias`` where it has one."""
    out = []
    for e in range(source.num_experts):
        tensors: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
        for name, out_features, in_features, bias in projections(source):
            prefix = f"{path}.{e}.{_child(name)}"
            if quantizable_shape(out_features, in_features, spec):
                for attr, place in quantized_layout(out_features, in_features, spec, dtype, kernels).items():
                    tensors[f"{prefix}.{attr}"] = place
            else:
                tensors[f"{prefix}.weight"] = (dtype, (out_features, in_features))
            if bias:
                tensors[f"{prefix}.bias"] = (dtype, (out_features,))
        out.append(tensors)
    return out


def expert_tensors(path: str, source: nn.Module, values: Mapping[str, torch.Tensor], spec: WeightQuantization,
                   dtype: torch.dtype, kernels: PackedKernels = CPU_KERNELS) -> Iterator[tuple[str, torch.Tensor]]:
    """The (name, tensor) pairs of `expert_layout`, in its order, from the experts module's parameters as
    transformers makes them (``values``: attribute -> [E, ...] tensor); one expert quantized at a time."""
    transposed = bool(source.is_transposed)
    for e in range(source.num_experts):
        for name, out_features, in_features, bias in projections(source):
            prefix = f"{path}.{e}.{_child(name)}"
            weight = values[name][e]
            weight = weight.T if transposed else weight  # [out, in], as a linear layer's
            if quantizable_shape(out_features, in_features, spec):
                for attr, tensor in quantize_weight(weight, spec, dtype, kernels).items():
                    yield f"{prefix}.{attr}", tensor
            else:
                yield f"{prefix}.weight", weight.to(dtype).contiguous()
            if bias:
                yield f"{prefix}.bias", values[f"{name}_bias"][e].to(dtype)
