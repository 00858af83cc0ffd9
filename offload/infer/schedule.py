"""The block schedule: a batch goes through each decoder layer as several micro-batches, one after
the other, while the layer's weights are bound once (FlexGen's zig-zag order over a block of
micro-batches). The layer is read from the disk once for the whole batch, and the activations and
the KV cache's read-ahead ring are those of one micro-batch, so the batch is not limited by what one
forward holds.

`BlockSchedule.running` wraps each decoder layer's ``forward`` for the call that needs micro-batches
(its hooks, which bind and release the streamed weights, run once around all the micro-batches), and
unwraps it after: with one micro-batch nothing is wrapped, so a layer costs what transformers' does
(the wrapper's frame was 1.6% of a decode step of a 44-layer model computing on the CPU). The
micro-batches share the transformers cache, an `OffloadedKVCache` made with as many micro-batches,
whose ``micro_batch`` it sets before each.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from offload.infer.kv.cache import OffloadedKVCache
from offload.infer.largest import largest_where

__all__ = ["BlockSchedule", "micro_batch_size"]


def micro_batch_size(batch: int, activation_bytes: Callable[[int], int], limit: int, requested: int | None) -> int:
    """The micro-batch size for ``batch`` sequences: ``requested`` (None: the largest size whose
    ``activation_bytes(size)`` is within ``limit``), lowered to a divisor of ``batch`` so that the
    micro-batches are equal. At least 1. (The activations grow with the size: found by halving.)"""
    largest = min(batch, requested) if requested else batch
    if requested is None and activation_bytes(largest) > limit:
        largest = largest_where(lambda size: activation_bytes(size) <= limit, 1, largest)  # 1: the least; largest: over
    return next(size for size in range(largest, 0, -1) if batch % size == 0)


class BlockSchedule:
    """Runs the decoder layers ``layers`` of a model in micro-batches while `running` is open."""

    def __init__(self, layers: nn.ModuleList) -> None:
        self.layers = layers

    @contextlib.contextmanager
    def running(self, micro_batches: int) -> Iterator[None]:
        """Within: each layer runs as ``micro_batches`` micro-batches (1: as it is, nothing wrapped)."""
        if micro_batches == 1:
            yield
            return
        before = [layer.__dict__.get("forward") for layer in self.layers]  # an instance's own forward, if any
        for layer in self.layers:
            layer.forward = self._wrap(layer.forward, micro_batches)
        try:
            yield
        finally:
            for layer, forward in zip(self.layers, before):
                if forward is None:
                    del layer.forward
                else:
                    layer.forward = forward

    @staticmethod
    def _wrap(forward: Callable[..., Any], parts: int) -> Callable[..., Any]:
        def scheduled(hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            cache = kwargs.get("cache", kwargs.get("past_key_values"))
            if not isinstance(cache, OffloadedKVCache) or cache.micro_batches != parts:
                raise ValueError(f"block schedule: {parts} micro-batches need the engine's OffloadedKVCache made with "
                                 f"as many (engine.generate makes it); got {type(cache).__name__}")
            batch = hidden_states.shape[0]
            size = batch // parts
            outputs = []
            try:
                for part in range(parts):
                    cache.micro_batch = part
                    lo, hi = part * size, (part + 1) * size
                    outputs.append(forward(_slice(hidden_states, lo, hi, batch),
                                           *(_slice(a, lo, hi, batch) for a in args),
                                           **{k: _slice(v, lo, hi, batch) for k, v in kwargs.items()}))
            finally:
                cache.micro_batch = 0  # a failed micro-batch leaves the cache addressing the first, as after a pass
            if isinstance(outputs[0], tuple):
                return tuple(torch.cat(group) if isinstance(group[0], torch.Tensor) else group[0]
                             for group in zip(*outputs))
            return torch.cat(outputs)

        return scheduled


def _slice(value: Any, lo: int, hi: int, batch: int) -> Any:
    """Rows [lo, hi) of a batch-major tensor (two dimensions or more, the first the batch), in a tuple
    or list too; anything else (1-D positions, broadcast masks, the cache, flags) as it is."""
    if isinstance(value, torch.Tensor):
        return value[lo:hi] if value.dim() >= 2 and value.shape[0] == batch else value
    if isinstance(value, (tuple, list)):
        return type(value)(_slice(v, lo, hi, batch) for v in value)
    return value
