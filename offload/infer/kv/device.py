"""The KV cache on the host (memory or NVMe) while compute runs on a device with memory of its own.

Where the device budget (``max_memory[0]``) cannot hold the cache, or ``kv_offload.device`` asks for
"cpu" / "nvme", `OffloadedKVCache` keeps its layers where it does on the CPU path (transformers'
layers in host memory, `NvmeKVLayer` files read ahead and written behind) and wraps each in a
`StagedKVLayer`. The `KVStager` carries them to the device through the seam (offload/device), one
layer ahead of compute:

- while layer i computes, layer i+1's cache so far (its tokens before this forward) is copied into a
  pinned staging buffer and from there, on the side stream ``kv-copies``, into a free device buffer
  (`DeviceRing` ``kv``); the copy waits on the device for the compute that last read that buffer.
  The last layer's update does the same for the first layer of the next forward.
- at layer i+1's attention (its update) the compute stream waits for that copy's event; the new
  tokens' keys and values are written after the copied ones on the device, copied from there to the
  free pinned buffer (``to_host`` after the compute that made them; the host reads them once the
  copy's event is done) and appended to the host layer (written behind to NVMe as on the CPU).
  Attention reads every token from the device buffer.

A device buffer holds one layer's cache token-major ([tokens, keys/values, batch, heads, head dim]),
so the tokens before a forward are one contiguous copy and attention gets strided
[batch, heads, tokens, head dim] views. Device memory: two buffers of one layer's cache (the layer
computing and the next, being copied); host memory besides the cache: two pinned buffers of the same
size (the one the running copy reads, and the one that takes the new tokens, then the next copy).
"""

from __future__ import annotations

from collections import deque

import torch
from transformers.cache_utils import CacheLayerMixin

from offload.device import Device
from offload.infer.kv.cache import NvmeKVLayer, _StreamedLayer
from offload.infer.kv.quant import QuantizedLayer
from offload.infer.stream.device_layout import whole
from offload.infer.stream.device_ring import DeviceRing

__all__ = ["KVStager", "StagedKVLayer"]


class KVStager:
    """The device and pinned host buffers that carry host-resident layers' caches to the device one layer
    ahead of compute and their new tokens back (see the module docstring); ``slot_nbytes``: one layer's
    keys and values at the full length, in the compute dtype. The layers register in forward order
    (`add`).

    Raises DeviceMemoryError (nothing held then) when the two device buffers exceed the budget.
    """

    def __init__(self, device: Device, slot_nbytes: int) -> None:
        self.device = device
        self.slot_nbytes = slot_nbytes
        self.ring = DeviceRing(device, 2, slot_nbytes, name="kv")
        self._pinned = [device.pinned_empty(slot_nbytes) for _ in range(2)]
        self._free_pinned: deque[torch.Tensor] = deque(self._pinned)
        self.layers: list[StagedKVLayer] = []
        """Every layer (and micro-batch part) in the order the forward updates them."""
        self._staged: dict[StagedKVLayer, tuple[torch.Tensor, int]] = {}
        """Layers whose copy to the device is issued: the pinned buffer it reads, the tokens it copies."""
        self._held: StagedKVLayer | None = None
        """The layer updated last: its attention reads its device buffer."""
        self._token: tuple[tuple[int, int, int], torch.dtype] | None = None
        """(batch, heads, head dim) and dtype of a token's keys, from the first update."""
        self.bytes_to_host = 0
        """Bytes of new keys and values copied device -> host so far."""

    @property
    def bytes_to_device(self) -> int:
        """Bytes of cache copied host -> device so far."""
        return self.ring.bytes_copied

    def add(self, layer: "StagedKVLayer") -> None:
        """Register ``layer`` as the next one the forward updates."""
        self.layers.append(layer)

    def stage(self, inner: CacheLayerMixin) -> "StagedKVLayer":
        """``inner`` (a host layer of the cache) staged to the device, registered as the next one the
        forward updates: how `OffloadedKVCache` composes this stager in."""
        return StagedKVLayer(self, inner)

    # ---- geometry ---------------------------------------------------------------------------------

    @property
    def _token_nbytes(self) -> int:
        (batch, heads, head_dim), dtype = self._token
        return 2 * batch * heads * head_dim * dtype.itemsize

    def _tokens(self, buffer: torch.Tensor) -> torch.Tensor:
        """A device or pinned buffer as [tokens, 2 (keys, values), batch, heads, head dim]."""
        row, dtype = self._token
        capacity = self.slot_nbytes // self._token_nbytes
        return buffer[:capacity * self._token_nbytes].view(dtype).view(capacity, 2, *row)

    def _fit(self, key_states: torch.Tensor, total: int) -> None:
        batch, heads, _, head_dim = key_states.shape
        if self._token is None:
            self._token = ((batch, heads, head_dim), key_states.dtype)
        if self._token != ((batch, heads, head_dim), key_states.dtype):
            raise ValueError(f"kv_offload: a layer's keys are {[batch, heads, head_dim]} {key_states.dtype} per token, "
                             f"another's {list(self._token[0])} {self._token[1]}; the layers of one cache must agree")
        if total * self._token_nbytes > self.slot_nbytes:
            raise ValueError(f"kv_offload: {total} tokens of {list(key_states.shape)} {key_states.dtype} keys and values "
                             f"take {total * self._token_nbytes} bytes, more than the {self.slot_nbytes} of the device's "
                             f"KV buffer (one layer's cache at the length the cache was made for)")

    # ---- one update -------------------------------------------------------------------------------

    def update(self, layer: "StagedKVLayer", key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append the new ``key_states`` / ``value_states`` (on the device) to ``layer``, on the device and
        on the host; start the next layer's copy; return every token's keys and values on the device.
        Raises ValueError beyond the buffers, and what the host layer raises."""
        old, new = layer.inner.get_seq_length(), key_states.shape[-2]
        total = old + new
        self._fit(key_states, total)
        self.release()
        raw = self._stage(layer, old)
        self._held = layer
        tokens = self._tokens(raw)
        tokens[old:total, 0].copy_(key_states.permute(2, 0, 1, 3))
        tokens[old:total, 1].copy_(value_states.permute(2, 0, 1, 3))
        new_keys, new_values = self._to_host(raw, old, total)
        layer.append(new_keys, new_values, *args, **kwargs)
        self._prefetch(self.layers[(self.layers.index(layer) + 1) % len(self.layers)])
        return tokens[:total, 0].permute(1, 2, 0, 3), tokens[:total, 1].permute(1, 2, 0, 3)

    def _stage(self, layer: "StagedKVLayer", old: int) -> torch.Tensor:
        """``layer``'s device buffer with its ``old`` tokens, compute ordered after their copy (issued
        now where it was not ahead)."""
        for other, (_, count) in list(self._staged.items()):
            if other is not layer or count != old:  # copied ahead of a layer that did not come next, or since changed
                self._discard(other)
        if layer not in self._staged:
            self._prefetch(layer)
        staging, count = self._staged[layer]
        return self.ring.stage(layer, staging, whole(count * self._token_nbytes))

    def _to_host(self, raw: torch.Tensor, old: int, total: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Tokens [old, total) of device buffer ``raw`` copied into the free pinned buffer, ready to read, as
        keys and values [batch, heads, new, head dim] (valid until the next copy ahead is staged)."""
        device, stream, size = self.device, self.ring.stream, self._token_nbytes
        host = self._free_pinned[0][:(total - old) * size]
        device.check_writable(host)
        stream.wait_event(device.compute_stream.record())  # the copy runs after the compute that wrote them
        device.to_host(host, raw[old * size:total * size], stream=stream).synchronize()
        device.check_ready(host)
        self.bytes_to_host += host.numel()
        row, dtype = self._token
        tokens = host.view(dtype).view(total - old, 2, *row)
        return tokens[:, 0].permute(1, 2, 0, 3), tokens[:, 1].permute(1, 2, 0, 3)

    def _prefetch(self, layer: "StagedKVLayer") -> None:
        """Copy ``layer``'s tokens so far into a pinned buffer and start their copy to a free device
        buffer on the side stream (nothing where it is issued already or no buffer is free)."""
        if layer in self._staged or not self.ring.free_count:
            return
        held = layer.host_tokens()
        count = 0 if held is None else held[0].shape[-2]
        staging = self._free_pinned.popleft()
        try:
            if count:
                self.device.check_writable(staging)
                tokens = self._tokens(staging)
                tokens[:count, 0].copy_(held[0].permute(2, 0, 1, 3))
                tokens[:count, 1].copy_(held[1].permute(2, 0, 1, 3))
            self.ring.prefetch(layer, staging, whole(count * self._token_nbytes))
        except BaseException:
            self._free_pinned.appendleft(staging)
            raise
        self._staged[layer] = (staging, count)

    # ---- giving buffers back ----------------------------------------------------------------------

    def release(self) -> None:
        """The layer updated last has had its attention issued: its buffers take the next copy."""
        if self._held is not None:
            self.ring.release(self._held)  # the copy has read its pinned buffer on return
            self._free_pinned.append(self._staged.pop(self._held)[0])
            self._held = None

    def _discard(self, layer: "StagedKVLayer") -> None:
        self.ring.discard(layer)
        self._free_pinned.append(self._staged.pop(layer)[0])

    def forget(self, layer: "StagedKVLayer") -> None:
        """``layer`` starts again empty: nothing of it held or copied ahead."""
        if self._held is layer:
            self.release()
        elif layer in self._staged:
            self._discard(layer)

    def close(self) -> None:
        """Wait for the copies and give every buffer back."""
        self._held = None
        self._staged.clear()
        self.ring.close()
        for buffer in self._pinned:
            self.device.free_pinned(buffer)
        self._pinned, self._free_pinned = [], deque()


class StagedKVLayer(_StreamedLayer):
    """A host layer of the cache (``inner``) whose keys and values go to the compute device per update
    (see the module docstring)."""

    _what = "kv_offload: a cache kept on the host while compute runs on a device"
    _instead = "use greedy decoding or sampling, or a device budget (max_memory[0]) that holds the cache"

    def __init__(self, stager: KVStager, inner: CacheLayerMixin) -> None:
        super().__init__()
        self.stager, self.inner = stager, inner
        stager.add(self)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append the new ``key_states`` / ``value_states`` (on the device) to the host layer; return every
        token's keys and values on the device. Raises as the host layer, ValueError beyond the buffers."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        return self.stager.update(self, key_states, value_states, *args, **kwargs)

    def append(self, keys: torch.Tensor, values: torch.Tensor, *args, **kwargs) -> None:
        """Append new ``keys`` / ``values`` (host memory) to the host layer."""
        if isinstance(self.inner, (NvmeKVLayer, QuantizedLayer)):
            self.inner.append(keys, values, *args, **kwargs)  # without decoding every token again
        else:
            self.inner.update(keys, values, *args, **kwargs)

    def host_tokens(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Every token's keys and values held on the host ([batch, heads, tokens, head dim]); None when empty."""
        if isinstance(self.inner, (NvmeKVLayer, QuantizedLayer)):
            return self.inner.held()
        return (self.inner.keys, self.inner.values) if self.inner.get_seq_length() else None

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.inner.get_mask_sizes(query_length)

    def get_seq_length(self) -> int:
        return self.inner.get_seq_length()

    def reset(self) -> None:
        self.stager.forget(self)
        self.inner.reset()
