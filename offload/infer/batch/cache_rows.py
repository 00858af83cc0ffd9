"""The running batch's KV cache as rows that come and go: a transformers `DynamicCache` (keys and values
``[batch, heads, tokens, head_dim]`` per layer) and its attention mask ``[batch, tokens]`` (1: a real
token, 0: padding), changed between decode steps.

Rows join as all-padding rows (`add_rows`) before the step that prefills them, or as the rows of a
cache of their own, prefilled by a forward of its own (`append_rows`); finished rows leave
(`keep_rows`); `right_align` then moves each row's real tokens to the right end, so that the cache is
as long as its longest row and no longer. Moving a token's keys is allowed because their positions
were applied when they were computed (rotary embeddings) or live in the hidden states (learned
positions); the next steps give each row its position ids explicitly.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

__all__ = ["add_rows", "append_rows", "check_full_attention", "keep_rows", "right_align"]


def check_full_attention(cache: DynamicCache) -> None:
    """Refuse a cache whose layers are not plain full-attention `DynamicLayer`s (sliding windows,
    indexed or static layers keep positions of their own, which moving rows and tokens would break).
    Raises ValueError naming the layer's type."""
    for i, layer in enumerate(cache.layers):
        if type(layer) is not DynamicLayer:
            raise ValueError(f"the model's KV cache layer {i} is a {type(layer).__name__}; batches that sequences join and "
                             f"leave (offload.serve, offload.generate --prompts-file) need full-attention DynamicLayer "
                             f"caches; use python -m offload.generate --prompt (--batch-size) for this model")


def add_rows(cache: DynamicCache, mask: torch.Tensor, count: int) -> torch.Tensor:
    """Append ``count`` rows of padding to every layer of ``cache`` (its layers hold at least one row);
    return the mask with ``count`` rows of zeros appended. A quantized layer (one with a ``codec``:
    `offload.infer.kv.quant.QuantizedLayer`) gets zeros encoded: zero bytes would decode to NaN (a scale
    of 0), which the attention mask cannot hide."""
    for layer in cache.layers:
        codec = getattr(layer, "codec", None)
        for name in ("keys", "values"):
            tensor = getattr(layer, name)
            if codec is None or codec.spec is None:
                padding = tensor.new_zeros((count, *tensor.shape[1:]))
            else:
                padding = codec.encode(torch.zeros((count, *tensor.shape[1:-1], codec.head_dim), dtype=codec.dtype,
                                                   device=tensor.device))
            setattr(layer, name, torch.cat([tensor, padding]))
    return torch.cat([mask, mask.new_zeros((count, mask.shape[1]))])


def append_rows(cache: DynamicCache, mask: torch.Tensor, other: DynamicCache, other_mask: torch.Tensor) -> torch.Tensor:
    """Append the rows of ``other`` (a cache of the same model, its mask ``other_mask``) below those of
    ``cache``, the shorter of the two left-padded to the longer (padding keys and values, encoded
    zeros where a layer is quantized, as `add_rows`); return the mask of every row."""
    length = max(mask.shape[1], other_mask.shape[1])
    for layer, extra in zip(cache.layers, other.layers, strict=True):
        for name in ("keys", "values"):
            setattr(layer, name, torch.cat([_left_pad(layer, getattr(layer, name), length),
                                            _left_pad(extra, getattr(extra, name), length)]))
    return torch.cat([_left_pad_mask(mask, length), _left_pad_mask(other_mask, length)])


def _left_pad_mask(mask: torch.Tensor, length: int) -> torch.Tensor:
    """``mask`` with columns of zeros (padding) on the left up to ``length``."""
    return torch.cat([mask.new_zeros((mask.shape[0], length - mask.shape[1])), mask], dim=1)


def _left_pad(layer: DynamicLayer, tensor: torch.Tensor, length: int) -> torch.Tensor:
    """``tensor`` (a layer's keys or values, [batch, heads, tokens, width]) with padding tokens on the left
    up to ``length`` tokens; encoded zeros where ``layer`` is quantized."""
    count = length - tensor.shape[2]
    if not count:
        return tensor
    codec = getattr(layer, "codec", None)
    if codec is None or codec.spec is None:
        padding = tensor.new_zeros((*tensor.shape[:2], count, tensor.shape[3]))
    else:
        padding = codec.encode(torch.zeros((*tensor.shape[:2], count, codec.head_dim), dtype=codec.dtype,
                                           device=tensor.device))
    return torch.cat([padding, tensor], dim=2)


def keep_rows(cache: DynamicCache, mask: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """Keep only ``rows`` (indices, in the order given) of ``cache``; return their mask."""
    index = torch.tensor(rows, dtype=torch.long)
    cache.batch_select_indices(index.to(cache.layers[0].keys.device))
    return mask[index]


def right_align(cache: DynamicCache, mask: torch.Tensor) -> torch.Tensor:
    """Move every row's real tokens (in order) to the right end and cut the columns no row uses; return
    the new mask. A copy of the cache: call it when rows joined or left, not every step."""
    length = int(mask.sum(dim=1).max()) if mask.numel() else 0
    if length == mask.shape[1] and bool(mask.all()):
        return mask
    # A stable sort of the mask puts each row's padding first and keeps its real tokens in order.
    order = torch.argsort(mask, dim=1, stable=True)[:, mask.shape[1] - length:]
    for layer in cache.layers:
        for name in ("keys", "values"):
            tensor = getattr(layer, name)
            batch, heads, _, width = tensor.shape
            index = order.to(tensor.device)[:, None, :, None].expand(batch, heads, length, width)
            setattr(layer, name, tensor.gather(2, index))
    return mask.gather(1, order)
