"""Weight-only int8 / int4 quantization of the decoder layers' linear layers, on torch's packed kernels.

A quantized linear layer (`QuantLinear`) holds its weight as the kernel of the compute device takes
it (``Device.packed_kernels``, offload/device/_packed.py), so a layer streamed into a ring buffer (or
copied to a device's ring) computes straight from the bytes read, with nothing unpacked or
dequantized on the way:

- int8: ``qweight`` int8 [out, in] and ``scales`` [out] (one per output channel) for
  ``torch._weight_int8pack_mm``; asymmetric ranges add ``offsets`` [out], applied as
  ``offsets * x.sum(-1)`` after the product (w = scale * q + offset).
- int4: ``qweight`` in the device's packed layout (on the CPU uint8 [out, in / 2] as
  ``torch._convert_weight_to_int4pack_for_cpu`` packs it) and ``scales_and_zeros``
  [in / group, out, 2] (w = (q - 8) * scale + zero; symmetric ranges have zero 0).

Scales and zeros are in the compute dtype (the kernels take them in the activations' dtype), and the
integers are chosen against the scales as stored, so the rounding of the scales costs no accuracy
twice. Linear layers whose shapes the kernels do not take stay in the compute dtype: int8, in
features not a multiple of 16 (torch 2.13's ``_weight_int8pack_mm`` reads out of bounds there as soon
as the input has more than one row: a segmentation fault); int4, out features not a multiple of 16
or in features not a multiple of the group.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from offload.device import CPU_KERNELS, PackedKernels
from offload.infer.config import WeightQuantization

__all__ = ["QuantLinear", "block_linears", "quantizable", "quantizable_shape", "quantization_targets", "quantize_weight",
           "quantized_layout", "swap_linears"]


def quantizable(linear: nn.Module, spec: WeightQuantization) -> bool:
    """Whether ``linear`` (an ``nn.Linear``) has a shape the kernel of ``spec`` takes."""
    if type(linear) is not nn.Linear:
        return False
    return quantizable_shape(*linear.weight.shape, spec)


def quantizable_shape(out_features: int, in_features: int, spec: WeightQuantization) -> bool:
    """Whether the kernel of ``spec`` takes a weight of ``out_features`` x ``in_features`` (a linear layer's, or
    one expert's projection: offload/infer/weights/quant_experts.py)."""
    if spec.num_bits == 8:  # torch 2.13's int8 kernel crashes on other widths beyond one row of input
        return in_features % 16 == 0
    return out_features % 16 == 0 and in_features % spec.group_size == 0


def quantized_layout(out_features: int, in_features: int, spec: WeightQuantization, dtype: torch.dtype,
                     kernels: PackedKernels = CPU_KERNELS) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """The tensors (attribute -> (dtype, shape)) a quantized weight of that shape is stored as, for
    the device whose ``kernels`` compute with it (int4's packing is the device's)."""
    if spec.num_bits == 8:
        layout = {"qweight": (torch.int8, (out_features, in_features)), "scales": (dtype, (out_features,))}
        if not spec.symmetric:
            layout["offsets"] = (dtype, (out_features,))
        return layout
    return {"qweight": kernels.int4_weight(out_features, in_features),
            "scales_and_zeros": (dtype, (in_features // spec.group_size, out_features, 2))}


def quantize_weight(weight: torch.Tensor, spec: WeightQuantization, dtype: torch.dtype,
                    kernels: PackedKernels = CPU_KERNELS) -> dict[str, torch.Tensor]:
    """``weight`` [out, in] as the tensors of `quantized_layout` (computed in fp32, scales stored in
    ``dtype``), int4 packed for ``kernels``' device. Returns host tensors.

    Works through the rows in chunks of about 4 MiB of fp32, so that the temporaries are reused
    rather than fresh memory the size of the weight (slow to fault in on a virtual machine)."""
    out_features, in_features = weight.shape
    layout = quantized_layout(out_features, in_features, spec, dtype, kernels)
    result = {name: torch.empty(shape, dtype=tensor_dtype) for name, (tensor_dtype, shape) in layout.items()}
    rows = max(64, (1 << 20) // in_features // 64 * 64)  # a multiple of 64: the int4 packing is row-block local
    for first in range(0, out_features, rows):
        chunk = slice(first, min(first + rows, out_features))
        w = weight[chunk].to(torch.float32, copy=True)  # worked on in place
        if spec.num_bits == 8:
            _int8_rows(w, spec, dtype, result, chunk)
        else:
            _int4_rows(w, spec, dtype, result, chunk, kernels)
    return result


def _int8_rows(w: torch.Tensor, spec: WeightQuantization, dtype: torch.dtype, out: dict, rows: slice) -> None:
    tiny = torch.finfo(torch.float32).tiny
    if spec.symmetric:
        scales = (w.abs().amax(dim=1) / 127).clamp_(min=tiny).to(dtype)
        out["qweight"][rows] = w.div_(scales.float()[:, None]).round_().clamp_(-128, 127)
    else:
        low, high = w.amin(dim=1), w.amax(dim=1)
        scales = ((high - low) / 255).clamp_(min=tiny).to(dtype)
        offsets = (low + 128 * scales.float()).to(dtype)  # w = scale * q + offset, q in [-128, 127]
        out["qweight"][rows] = w.sub_(offsets.float()[:, None]).div_(scales.float()[:, None]).round_().clamp_(-128, 127)
        out["offsets"][rows] = offsets
    out["scales"][rows] = scales


def _int4_rows(w: torch.Tensor, spec: WeightQuantization, dtype: torch.dtype, out: dict, rows: slice,
               kernels: PackedKernels) -> None:
    tiny = torch.finfo(torch.float32).tiny
    count, in_features = w.shape
    groups = w.view(count, in_features // spec.group_size, spec.group_size)
    if spec.symmetric:
        scales = (groups.abs().amax(dim=-1) / 7).clamp_(min=tiny).to(dtype)
        zeros = torch.zeros_like(scales)
    else:
        low, high = groups.amin(dim=-1), groups.amax(dim=-1)
        scales = ((high - low) / 15).clamp_(min=tiny).to(dtype)
        zeros = (low + 8 * scales.float()).to(dtype)  # w = (q - 8) * scale + zero, q in [0, 15]
    q = groups.sub_(zeros.float()[..., None]).div_(scales.float()[..., None]).add_(8).round_().clamp_(0, 15)
    packed = kernels.pack_int4(q.view(count, in_features).to(torch.int32))
    first = rows.start * packed.shape[0] // count  # the packing's first dimension: rows (the CPU's) or tiles of rows
    out["qweight"][first:first + packed.shape[0]] = packed
    out["scales_and_zeros"][:, rows] = torch.stack([scales, zeros], dim=-1).transpose(0, 1)


class QuantLinear(nn.Module):
    """A linear layer on int8 or int4 packed weights (see the module docstring), multiplied by
    ``kernels`` (the compute device's). Its tensors are parameters (without gradients) so that the
    engine places, loads and streams them as any other."""

    def __init__(self, in_features: int, out_features: int, spec: WeightQuantization, dtype: torch.dtype,
                 bias: bool, device: torch.device | str = "meta", kernels: PackedKernels = CPU_KERNELS) -> None:
        super().__init__()
        self.in_features, self.out_features, self.spec, self.kernels = in_features, out_features, spec, kernels
        for name, (tensor_dtype, shape) in quantized_layout(out_features, in_features, spec, dtype, kernels).items():
            setattr(self, name, nn.Parameter(torch.empty(shape, dtype=tensor_dtype, device=device), requires_grad=False))
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype, device=device), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        if self.spec.num_bits == 8:
            y = self.kernels.int8_mm(flat, self.qweight, self.scales)
            if not self.spec.symmetric:
                y = y + flat.sum(dim=-1, keepdim=True, dtype=torch.float32).to(y.dtype) * self.offsets
        else:
            y = self.kernels.int4_mm(flat, self.qweight, self.spec.group_size, self.scales_and_zeros)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.spec.name}, {self.kernels.name} kernels"


def swap_linears(module: nn.Module, names: list[str], spec: WeightQuantization, dtype: torch.dtype,
                 kernels: PackedKernels = CPU_KERNELS) -> None:
    """Replace the ``nn.Linear`` submodules ``names`` of ``module`` by meta-device `QuantLinear`s on ``kernels``."""
    for name in names:
        parent, _, attr = name.rpartition(".")
        linear = module.get_submodule(name)
        out_features, in_features = linear.weight.shape
        setattr(module.get_submodule(parent), attr,
                QuantLinear(in_features, out_features, spec, dtype, bias=linear.bias is not None, kernels=kernels))


def block_linears(module: nn.Module, blocks: str | None, spec: WeightQuantization) -> Iterator[str]:
    """The paths of the linear layers inside the decoder layers (``blocks``) that ``spec`` can quantize."""
    if blocks is None:
        return
    for name, child in module.get_submodule(blocks).named_modules():
        if name and quantizable(child, spec):
            yield f"{blocks}.{name}"


def quantization_targets(module: nn.Module, blocks: str | None, spec: WeightQuantization, kernels: PackedKernels,
                         dtype: torch.dtype, device_name: str) -> dict[str, nn.Linear]:
    """The decoder layers' linear layers ``spec`` packs (path -> module). Raises ValueError naming
    ``weight_quantization`` where the device's kernels cannot run it, or where no layer takes it."""
    refusal = kernels.unsupported(spec.num_bits, dtype)
    if refusal is not None:
        raise ValueError(f"weight_quantization: {spec.name} cannot compute on the {device_name} device: {refusal}")
    targets = {path: module.get_submodule(path) for path in block_linears(module, blocks, spec)}
    if not targets:
        raise ValueError(f"weight_quantization: {type(module).__name__} has no nn.Linear in its decoder layers "
                         f"that the int{spec.num_bits} kernel takes (int8: in features a multiple of 16; int4: out "
                         f"features a multiple of 16, in features of {spec.group_size}); leave weight_quantization out")
    return targets
