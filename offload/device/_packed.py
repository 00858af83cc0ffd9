"""Packed-int kernels: the int8 / int4 weight-only matrix products a device runs, and the layout its
int4 weights are stored in (docs/device.md, "Packed-int kernels").

Quantized weights (offload/infer/weights/quantize.py) are stored, streamed and copied to the device in the
layout its kernel takes, so that the products run on the bytes as they arrive. int8 weights are
int8 [out, in] with one scale per output channel everywhere (``torch._weight_int8pack_mm``, which
has CPU and CUDA kernels). int4 layouts differ: the CPU's kernel (``_weight_int4pack_mm_for_cpu``)
takes uint8 [out, in / 2] in ``_convert_weight_to_int4pack_for_cpu``'s packing; the CUDA kernel
(`CudaPackedKernels`, in offload/device/_cuda.py) takes tinygemm's tiles. Both mean
w = (q - 8) * scale + zero with ``scales_and_zeros`` [in / group, out, 2], so only the weight's
packing depends on the device.
"""

from __future__ import annotations

import hashlib

import torch

__all__ = ["CPU_KERNELS", "PackedKernels", "SimulatedPackedKernels", "tinygemm_refusal"]

_TINYGEMM_DTYPE = torch.bfloat16
"""The one activation dtype the CUDA int4 kernel (tinygemm) takes."""


def _int4_test_matrix() -> torch.Tensor:
    """A fixed 64 x 64 matrix of 4-bit values (int32) whose packing fingerprints a layout."""
    return (torch.arange(64 * 64, dtype=torch.int32).reshape(64, 64) * 7) % 16


class PackedKernels:
    """The CPU's packed-int kernels (the base: other devices override what differs).

    ``int4_layout`` names the int4 packing (it tags the quantized cache: a device whose packing
    differs gets a cache file of its own, written in its layout, so nothing is repacked per token).
    """

    name = "cpu"
    int4_layout = "cpu"

    def unsupported(self, num_bits: int, dtype: torch.dtype) -> str | None:
        """Why this device cannot run ``num_bits``-bit weights with activations in ``dtype``, or None
        when it can (the CPU runs int8 and int4 in float32, float16 and bfloat16)."""
        return None

    def int4_weight(self, out_features: int, in_features: int) -> tuple[torch.dtype, tuple[int, ...]]:
        """(dtype, shape) of a packed int4 weight of ``out_features`` x ``in_features`` values."""
        return torch.uint8, (out_features, in_features // 2)

    def pack_int4(self, q: torch.Tensor) -> torch.Tensor:
        """Host int32 [rows, in] of values 0..15 packed as `int4_weight` lays them out (on the host).
        Blocks of 64 rows pack independently (a caller may pack a matrix 64 rows at a time)."""
        return torch._convert_weight_to_int4pack_for_cpu(q, 1)

    def int4_fingerprint(self) -> str:
        """A hash of the int4 packing of a fixed matrix here: a layout may change between torch
        versions and CPUs, so the quantized cache records it and is rewritten where it differs."""
        packed = self.pack_int4(_int4_test_matrix())
        return f"torch {torch.__version__}, int4 pack {hashlib.sha256(packed.numpy().tobytes()).hexdigest()[:16]}"

    def int8_mm(self, x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        """``x`` [rows, in] times the int8 weight [out, in] scaled per output channel: [rows, out]."""
        return torch._weight_int8pack_mm(x, qweight, scales)

    def int4_mm(self, x: torch.Tensor, qweight: torch.Tensor, group_size: int,
                scales_and_zeros: torch.Tensor) -> torch.Tensor:
        """``x`` [rows, in] times the packed int4 weight, (q - 8) * scale + zero per group: [rows, out]."""
        return torch._weight_int4pack_mm_for_cpu(x, qweight, group_size, scales_and_zeros)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(int4 layout {self.int4_layout!r})"


def tinygemm_refusal(num_bits: int, dtype: torch.dtype, where: str) -> str | None:
    """CUDA's int4 rule (tinygemm computes in bfloat16 only), worded for the ``where`` device."""
    if num_bits == 4 and dtype != _TINYGEMM_DTYPE:
        return (f"int4 runs there on torch's tinygemm kernel (_weight_int4pack_mm), which takes bfloat16 activations "
                f"only, and the compute dtype is {str(dtype).removeprefix('torch.')}{where}; set dtype \"bfloat16\" "
                f"(or bf16.enabled), or use num_bits 8")
    return None


class SimulatedPackedKernels(PackedKernels):
    """The simulated GPU's kernels: the CPU's (it computes on the CPU, in the CPU's layout), with the
    GPU's rule on what it takes, so that a setting a GPU would refuse fails in tests too."""

    name = "simulated"

    def unsupported(self, num_bits: int, dtype: torch.dtype) -> str | None:
        return tinygemm_refusal(num_bits, dtype, " (the simulated device keeps the GPU's rule)")


CPU_KERNELS = PackedKernels()
"""The CPU's kernels (stateless: one for every CPU device)."""
