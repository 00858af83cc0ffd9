"""The KV cache's keys and values as 8- or 4-bit integers (``kv_offload.quantization``).

`KVCodec` turns keys or values [..., head dim] into bytes [..., `KVCodec.nbytes`] and back: each head
dimension in groups of ``group_size`` values, each group with its own fp32 scale (and, asymmetric,
its minimum), the integers in front, two 4-bit values to a byte. One token's row of one head is thus
self-contained, so a cache of such rows grows by appending, is read back in part, and is reordered
or cropped along the batch and token dimensions like the unquantized one. The rounding itself is
torch's per-token affine quantization (``quantized_decomposed.quantize_per_token`` /
``dequantize_per_token``, each group one "token" there); only the choice of the ranges and the
packing of two 4-bit values into a byte are ours.

`QuantizedLayer` is transformers' `DynamicLayer` holding such bytes: a cache layer in memory. The
NVMe layers of `offload.infer.kv.cache` store the same bytes in their files.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.ao.quantization.fx._decomposed  # noqa: F401 - registers torch.ops.quantized_decomposed
from transformers.cache_utils import DynamicLayer

from offload.infer.activations import head_dim, largest_of_layers
from offload.infer.config import KVQuantization

__all__ = ["KVCodec", "QuantizedLayer", "kv_cache_bytes"]

_META = 4  # bytes of one scale or minimum (fp32)


class KVCodec:
    """Encode keys or values of head dimension ``head_dim`` into bytes and decode them into ``dtype``;
    ``spec`` None: no quantization (the tensors pass through). Raises ValueError naming
    ``kv_offload.quantization.group_size`` when the group does not divide the head dimension."""

    def __init__(self, spec: KVQuantization | None, head_dim: int, dtype: torch.dtype) -> None:
        self.spec, self.head_dim, self.dtype = spec, head_dim, dtype
        if spec is None:
            self.nbytes = head_dim * torch.empty((), dtype=dtype).element_size()
            return
        self.group_size = spec.group_size or min(64, head_dim)
        if head_dim % self.group_size or (spec.num_bits == 4 and head_dim % 2):
            raise ValueError(f"kv_offload.quantization.group_size: {self.group_size} does not divide the model's head "
                             f"dimension {head_dim}; use a group size that does (or leave it out)")
        self.groups = head_dim // self.group_size
        self.data_nbytes = head_dim * spec.num_bits // 8
        self.meta_count = 1 if spec.symmetric else 2
        self.nbytes = self.data_nbytes + self.groups * self.meta_count * _META
        """Bytes of one head's keys (or values) for one token."""
        self.levels = (1 << spec.num_bits) - 1

    @property
    def stored_dtype(self) -> torch.dtype:
        """The dtype of what `encode` returns: uint8 when quantized, else ``dtype``."""
        return self.dtype if self.spec is None else torch.uint8

    @property
    def row_width(self) -> int:
        """The last dimension of what `encode` returns: bytes when quantized, else the head dimension."""
        return self.head_dim if self.spec is None else self.nbytes

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` [..., head dim] as [..., `row_width`] of `stored_dtype` (``x`` itself when not quantized)."""
        if self.spec is None:
            return x
        spec, lead = self.spec, x.shape[:-1]
        groups = x.reshape(-1, self.group_size).float()
        if spec.symmetric:  # q = x / scale + levels/2, in [0, levels]; symmetric around the middle level
            half = self.levels // 2
            scale = (groups.abs().amax(dim=-1, keepdim=True) / half).clamp_(min=torch.finfo(torch.float32).tiny)
            zero = torch.full_like(scale, half + 1)
            meta = scale
        else:  # q = (x - low) / scale, in [0, levels]
            low, high = groups.amin(dim=-1, keepdim=True), groups.amax(dim=-1, keepdim=True)
            scale = ((high - low) / self.levels).clamp_(min=torch.finfo(torch.float32).tiny)
            zero = -low / scale
            meta = torch.cat([scale, low], dim=-1)
        q = torch.ops.quantized_decomposed.quantize_per_token(groups, scale, zero, 0, self.levels, torch.uint8)
        q = q.view(-1, self.head_dim)
        if spec.num_bits == 4:
            q = q[:, 0::2] | (q[:, 1::2] << 4)
        meta = meta.view(-1, self.groups * self.meta_count).view(torch.uint8)
        return torch.cat([q, meta], dim=-1).view(*lead, self.nbytes)

    def decode(self, data: torch.Tensor) -> torch.Tensor:
        """What `encode` returned (or any slice of it along the leading dimensions) as [..., head dim] in ``dtype``."""
        if self.spec is None:
            return data
        spec, lead = self.spec, data.shape[:-1]
        rows = data.reshape(-1, self.nbytes)
        q = rows[:, :self.data_nbytes]
        if spec.num_bits == 4:
            q = torch.stack([q & 15, q >> 4], dim=-1)
        q = q.reshape(-1, self.group_size)
        meta = rows[:, self.data_nbytes:].contiguous().view(torch.float32).view(-1, self.meta_count)
        scale = meta[:, :1]
        zero = torch.full_like(scale, self.levels // 2 + 1) if spec.symmetric else -meta[:, 1:] / scale
        x = torch.ops.quantized_decomposed.dequantize_per_token(q, scale, zero, 0, self.levels, torch.uint8, self.dtype)
        return x.view(*lead, self.head_dim)


def kv_cache_bytes(text_config, quantization: KVQuantization | None, dtype: torch.dtype, batch: int, tokens: int) -> int:
    """Bytes of the KV cache (keys and values, every layer) of ``batch`` sequences of ``tokens`` tokens of a
    model of ``text_config``, stored by ``quantization`` (None: in ``dtype``). Raises ValueError naming its
    group size where that does not divide the head dimension."""
    kv_heads = largest_of_layers(text_config, "num_key_value_heads") or largest_of_layers(text_config,
                                                                                        "num_attention_heads")
    row = KVCodec(quantization, head_dim(text_config), dtype).nbytes
    return 2 * text_config.num_hidden_layers * batch * tokens * kv_heads * row


class QuantizedLayer(DynamicLayer):
    """transformers' `DynamicLayer` storing its keys and values through ``codec`` ([batch, heads,
    tokens, bytes] uint8): each update appends the new tokens quantized and returns every token
    dequantized. Reordering (beam search), cropping and batch selection work as in `DynamicLayer`.
    ``codec_for`` makes the codec from the first keys (their head dimension and dtype)."""

    def __init__(self, codec_for: Callable[[torch.Tensor], KVCodec]) -> None:
        super().__init__()
        self._codec_for = codec_for
        self.codec: KVCodec | None = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.codec = self._codec_for(key_states)
        self.device = key_states.device
        batch, heads = key_states.shape[:2]
        self.keys = key_states.new_empty((batch, heads, 0, self.codec.row_width), dtype=self.codec.stored_dtype)
        self.values = value_states.new_empty((batch, heads, 0, self.codec.row_width), dtype=self.codec.stored_dtype)
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append ``key_states`` / ``value_states`` ([batch, heads, new, head dim]) quantized; return
        every token's, dequantized."""
        self.append(key_states, value_states)
        return self.codec.decode(self.keys), self.codec.decode(self.values)

    def append(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs) -> None:
        """`update` without decoding every token (the device path reads them with `held`)."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.keys = torch.cat([self.keys, self.codec.encode(key_states)], dim=-2)
        self.values = torch.cat([self.values, self.codec.encode(value_states)], dim=-2)

    def held(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Every token's keys and values, dequantized ([batch, heads, tokens, head dim]); None when empty."""
        if not self.get_seq_length():
            return None
        return self.codec.decode(self.keys), self.codec.decode(self.values)
