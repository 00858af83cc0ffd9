"""The KV cache on the host (memory or NVMe) while compute runs on a device with memory of its own.

Where the device budget (``max_memory[0]``) cannot hold the cache, or ``kv_offload.device`` asks for
"cpu" / "nvme", `OffloadedKVCache` keeps its layers where it does on the CPU path (transformers'
layers in host memory, `NvmeKVLayer` files read ahead and written behind) and wraps each in a
`StagedKVLayer`. Its update, through the device seam (offload/device):

1. copies the new token's keys and values from compute into a device buffer and from there to a
   pinned host buffer (``to_host`` on the copy stream, after the compute that made them; the host
   reads them once the copy's event is done);
2. appends them to the host layer (which writes whole pages behind to NVMe, as on the CPU);
3. copies every token's keys and values into a pinned staging buffer and from there into the
   device ring's buffer (`DeviceRing`, one buffer of one layer's cache at the full length),
   ordering compute after the copy; attention reads the device copy.

The device buffer is given back at the next layer's update (compute is ordered before the next copy
into it; the staging buffer is refilled once its copy is done). Device memory: the ring buffer and
the new tokens' buffer, one layer's cache each (counted against the budget by the plan).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import CacheLayerMixin

from offload.device import Device
from offload.infer.device_ring import DeviceRing
from offload.infer.kvcache import _StreamedLayer

__all__ = ["KVStager", "StagedKVLayer"]


class KVStager:
    """The device buffers and pinned host buffers that carry host-resident layers' caches to the
    device and their new tokens back (see the module docstring); ``slot_nbytes``: one layer's keys and
    values at the full length, in the compute dtype.

    Raises DeviceMemoryError (nothing held then) when the two device buffers exceed the budget.
    """

    def __init__(self, device: Device, slot_nbytes: int) -> None:
        self.device = device
        self.slot_nbytes = slot_nbytes
        self.ring = DeviceRing(device, 1, slot_nbytes)
        self._pinned: list[torch.Tensor] = []
        try:
            self.new_tokens = device.empty(slot_nbytes, torch.uint8, name="kv-new-tokens")
        except BaseException:
            self.ring.close()
            raise
        self.new_host = device.pinned_empty(slot_nbytes)
        self.staging = device.pinned_empty(slot_nbytes)
        self._held: StagedKVLayer | None = None
        self.bytes_to_host = 0
        """Bytes of new keys and values copied device -> host so far."""

    @property
    def bytes_to_device(self) -> int:
        """Bytes of cache copied host -> device so far."""
        return self.ring.bytes_copied

    def _fit(self, keys: torch.Tensor, what: str) -> int:
        nbytes = keys.numel() * keys.element_size()
        if 2 * nbytes > self.slot_nbytes:
            raise ValueError(f"kv_offload: {what} {list(keys.shape)} {keys.dtype} keys and values take "
                             f"{2 * nbytes} bytes, more than the {self.slot_nbytes} of the device's KV buffer (one "
                             f"layer's cache at the length the cache was made for)")
        return nbytes

    def to_host(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The new ``keys`` / ``values`` (on the compute device) copied into pinned host memory, ready
        to read (views valid until the next call)."""
        nbytes = self._fit(keys, "the new tokens'")
        device, stream = self.device, self.ring.stream
        self.new_tokens[:nbytes].view(keys.dtype).view(keys.shape).copy_(keys)
        self.new_tokens[nbytes:2 * nbytes].view(values.dtype).view(values.shape).copy_(values)
        stream.wait_event(device.compute_stream.record())  # the copy runs after the compute that wrote them
        host = self.new_host[:2 * nbytes]
        device.check_writable(host)
        device.to_host(host, self.new_tokens[:2 * nbytes], stream=stream).synchronize()
        device.check_ready(host)
        self.bytes_to_host += 2 * nbytes
        return (host[:nbytes].view(keys.dtype).view(keys.shape),
                host[nbytes:].view(values.dtype).view(values.shape))

    def to_device(self, layer: "StagedKVLayer", keys: torch.Tensor, values: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        """Every token's ``keys`` / ``values`` (host memory) copied into the device ring's buffer, with
        compute ordered after the copy; the previous layer's buffer is given back first."""
        nbytes = self._fit(keys, "the cache's")
        self.release()
        staging = self.staging[:2 * nbytes]
        self.ring.check_refill(staging)
        staging[:nbytes].view(keys.dtype).view(keys.shape).copy_(keys)
        staging[nbytes:].view(values.dtype).view(values.shape).copy_(values)
        buffer = self.ring.stage(layer, self.staging, 2 * nbytes)
        self._held = layer
        return (buffer[:nbytes].view(keys.dtype).view(keys.shape),
                buffer[nbytes:2 * nbytes].view(values.dtype).view(values.shape))

    def release(self) -> None:
        """The layer staged last has had its attention issued: its buffers take the next layer."""
        if self._held is not None:
            self.ring.release(self._held)
            self._held = None

    def close(self) -> None:
        """Wait for the copies and give every buffer back."""
        self._held = None
        self.ring.close()
        self.device.free(self.new_tokens)
        for buffer in (self.new_host, self.staging):
            self.device.free_pinned(buffer)


class StagedKVLayer(_StreamedLayer):
    """A host layer of the cache (``inner``) whose keys and values go to the compute device per update
    (see the module docstring)."""

    _what = "kv_offload: a cache kept on the host while compute runs on a device"
    _instead = "use greedy decoding or sampling, or a device budget (max_memory[0]) that holds the cache"

    def __init__(self, stager: KVStager, inner: CacheLayerMixin) -> None:
        super().__init__()
        self.stager, self.inner = stager, inner

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append the new ``key_states`` / ``value_states`` (on the device) to the host layer; return every
        token's keys and values on the device. Raises as the host layer, ValueError beyond the buffers."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        keys, values = self.inner.update(*self.stager.to_host(key_states, value_states), *args, **kwargs)
        return self.stager.to_device(self, keys, values)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.inner.get_mask_sizes(query_length)

    def get_seq_length(self) -> int:
        return self.inner.get_seq_length()

    def reset(self) -> None:
        self.stager.release()
        self.inner.reset()
