"""`OffloadedKVCache`: a transformers `Cache` whose chosen layers keep their keys and values on NVMe.

The other layers keep transformers' own `DynamicLayer` in memory. A layer on NVMe (`NvmeKVLayer`)
owns one file under the cache's directory, laid out token-major ([tokens, batch, heads, head dim]
for the keys, then the same for the values, each region page-aligned), so that the first ``n``
tokens of a layer are one contiguous O_DIRECT read and each new token is appended at the end.

A ring of locked buffers (`KVRing`), each one layer's cache at the full length, is read ahead in
forward order (wrapping to the next step), like the weights' ring: while a layer computes, the next
NVMe layer's cache is read. A layer's update copies its new keys and values (and the few tokens not
yet written) after what was read, returns them to attention in its layout, and writes behind the
whole pages that are now complete (from a copy, so that the buffer is free as soon as attention is
done); the last partial page stays in memory (at most a page's worth of tokens per layer). Every read
and write goes through tensorio with O_DIRECT; the writes waiting at one time are bounded by
``write_behind_bytes``.

Memory: ``buffer_count`` buffers of one layer's cache, attention's copy of one layer's cache, the
tails and the writes in flight.
The disk holds the rest, so a cache larger than the host's memory works as long as one layer's fits.
"""

from __future__ import annotations

import math
import os
import shutil
import tempfile
import time
from collections import deque
from typing import Protocol

import torch
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicLayer

from offload.infer.config import KVQuantization
from offload.infer.kv.quant import KVCodec, QuantizedLayer
from tensorio import DIRECT_ALIGN, AioHandle, IOFuture, aligned_tensor, free_locked_tensor, locked_tensor

__all__ = ["CACHE_KEYWORD", "KVRing", "LayerStager", "MicroBatchedLayer", "NvmeKVLayer", "OffloadedKVCache"]


def _cache_keyword() -> str:
    """The keyword under which the installed transformers' ``generate`` takes a `Cache` without a
    warning: ``past_key_values`` up to 5.23, ``cache`` from 5.24 (which renamed it, taking the old name
    with a FutureWarning). 5.23 and older refuse ``cache``."""
    from transformers.generation import utils

    return "cache" if "cache" in getattr(utils, "ALL_CACHE_NAMES", ()) else "past_key_values"


CACHE_KEYWORD = _cache_keyword()
"""``model.generate(..., **{CACHE_KEYWORD: cache})`` hands a cache to any supported transformers."""


class LayerStager(Protocol):
    """Carries host layers' keys and values to a compute device with memory of its own
    (`offload.infer.kv.device.KVStager`, handed in by the engine)."""

    def stage(self, inner: CacheLayerMixin) -> CacheLayerMixin:
        """``inner`` wrapped so that its keys and values go to the device per update."""

    def close(self) -> None:
        """Wait for the copies and give every buffer back."""


class _StreamedLayer(CacheLayerMixin):
    """What the cache layers here share: read ahead by the ring (offload and prefetch do nothing),
    no maximum length, and no reordering, cropping or batch surgery (each refused naming ``_what``
    and ``_instead``)."""

    is_sliding = False
    is_croppable = False
    _what = ""
    _instead = ""

    def get_max_length(self) -> int:
        return -1

    def get_max_cache_shape(self) -> int:  # `get_max_length`'s name before transformers 5.13
        return -1

    def offload(self) -> None:
        """Nothing to do: the ring reads ahead by itself and writes behind."""

    def prefetch(self) -> None:
        """Nothing to do: the ring reads ahead by itself."""

    @classmethod
    def _refuse(cls, what: str) -> NotImplementedError:
        return NotImplementedError(f"{cls._what} {what}; {cls._instead}")

    @classmethod
    def beam_search_refusal(cls) -> NotImplementedError:
        """The error for beam search (or several returned sequences) over such a layer, raised by
        `reorder_cache` and, before any forward, by the engine's ``generate``."""
        return cls._refuse("does not reorder for beam search")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise self.beam_search_refusal()

    def crop(self, tokens_to_remove: int) -> None:
        raise self._refuse("cannot be cropped (assisted decoding)")

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise self._refuse("cannot be expanded over the batch")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise self._refuse("cannot select sequences of the batch")


class NvmeKVLayer(_StreamedLayer):
    """One decoder layer's keys and values in a file on NVMe; see the module's docstring."""

    _what = "kv_offload: a cache on NVMe"
    _instead = "use greedy decoding or sampling, or kv_offload.device \"cpu\""

    def __init__(self, ring: "KVRing", index: int, part: int = 0) -> None:
        super().__init__()
        self.ring, self.index = ring, index
        self.path = os.path.join(ring.directory, f"layer-{index:04d}-{part:04d}.kv")
        self.length = 0
        """Tokens held: ``flushed`` in the file (written or being written), the rest in ``tail_*``."""
        self.flushed = 0
        self.tail_keys: torch.Tensor | None = None
        self.tail_values: torch.Tensor | None = None
        self.writes: list[IOFuture] = []
        """The writes of this layer still in flight (each with its staging copy in the ring's queue)."""

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.ring.shape_from(key_states)
        self.device = key_states.device
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append ``key_states`` / ``value_states`` ([batch, heads, new, head dim]); return every
        token's keys and values ([batch, heads, tokens, head dim], copied out of the ring buffer).
        Raises ValueError when the cache would pass its length, TensorIOError for a failed read or write."""
        keys, values = self._append(key_states, value_states)
        # Attention's layout, contiguous: torch's CPU attention on the token-major views took 2.5x as long
        # as on a copy, and the copy costs what transformers' DynamicLayer pays anyway (it concatenates).
        # The buffer is then free at once, for the next read.
        out = (self.ring.codec.decode(keys[:self.length]).permute(1, 2, 0, 3).contiguous(),
               self.ring.codec.decode(values[:self.length]).permute(1, 2, 0, 3).contiguous())
        self.ring.release(self)
        return out

    def append(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs) -> None:
        """`update` without returning the tokens (the device path reads them with `held` before the
        next update). Raises as `update`."""
        self._append(key_states, value_states)
        self.ring.release(self)

    def held(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Every token's keys and values as [batch, heads, tokens, head dim] views (of the ring buffer,
        which stays held for the next `update` or `append`), waiting for the read; None when empty.
        Raises TensorIOError for a failed read."""
        if not self.length:
            return None
        keys, values = self._acquire()
        return (self.ring.codec.decode(keys[:self.length]).permute(1, 2, 0, 3),
                self.ring.codec.decode(values[:self.length]).permute(1, 2, 0, 3))

    def _acquire(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The ring buffer with every token held ([max_tokens, batch, heads, row]), held until released."""
        keys, values = self.ring.acquire(self)  # the first `flushed` tokens read
        if self.length > self.flushed:
            keys[self.flushed:self.length] = self.tail_keys
            values[self.flushed:self.length] = self.tail_values
        return keys, values

    def _append(self, key_states: torch.Tensor, value_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append the new tokens to the held ring buffer and write behind the whole pages; the buffer's views."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        ring = self.ring
        new = key_states.shape[-2]
        total = self.length + new
        if total > ring.max_tokens:
            raise ValueError(f"kv_offload: layer {self.index}'s cache holds {ring.max_tokens} tokens (the length it was "
                             f"made for), and {total} are asked for; make the cache for the full length (prompt plus "
                             f"max_new_tokens)")
        keys, values = self._acquire()
        keys[self.length:total] = ring.codec.encode(key_states.permute(2, 0, 1, 3))
        values[self.length:total] = ring.codec.encode(value_states.permute(2, 0, 1, 3))
        self.length = total
        # Write behind the whole pages now complete; keep the rest in memory.
        done = (total // ring.page_tokens) * ring.page_tokens
        if done > self.flushed:
            ring.write(self, keys, values, self.flushed, done)
            self.flushed = done
        self.tail_keys = keys[done:total].clone() if total > done else None
        self.tail_values = values[done:total].clone() if total > done else None
        return keys, values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.length

    def reset(self) -> None:
        self.ring.forget(self)
        self.length = self.flushed = 0
        self.tail_keys = self.tail_values = None


class KVRing:
    """The NVMe layers' files, read ahead into ``buffer_count`` locked buffers and written behind.

    The files go into a new directory under ``parent``, removed by `close`. Buffers are made at the first update, once
    the batch, heads, head dim and dtype are known (`shape_from`). With ``quantization`` the files and
    buffers hold each token's keys and values as `KVCodec` bytes (each head's row [bytes] instead of [head dim]).
    """

    def __init__(self, handle: AioHandle, parent: str, *, max_tokens: int, buffer_count: int = 2,
                 write_behind_bytes: int = 64 << 20, quantization: KVQuantization | None = None) -> None:
        if not os.path.isdir(parent):
            raise FileNotFoundError(f"kv_offload.nvme_path: {parent} is not a directory; the KV cache's files go there")
        self.handle = handle
        self.directory = tempfile.mkdtemp(prefix="offload-kv-", dir=parent)
        self.max_tokens = max_tokens
        self.buffer_count = buffer_count
        self.write_behind_bytes = write_behind_bytes
        self.quantization = quantization
        self.codec: KVCodec | None = None
        """How a row is stored (made by `shape_from`)."""
        self.layers: list[NvmeKVLayer] = []
        """The NVMe layers in forward order."""
        self.row_shape: tuple[int, ...] | None = None
        self.dtype: torch.dtype | None = None
        self.row_nbytes = 0
        self.page_tokens = 1
        self.region_nbytes = 0
        self.buffers: list[torch.Tensor] = []
        self._free: deque[int] = deque()
        self._inflight: deque[tuple[NvmeKVLayer, int, list[IOFuture]]] = deque()
        self._held: tuple[NvmeKVLayer, int] | None = None
        self._next = 0
        self._writes: deque[tuple[NvmeKVLayer, list[IOFuture], torch.Tensor]] = deque()
        self.bytes_read = 0
        self.bytes_written = 0
        self.wait_seconds = 0.0

    def add(self, layer: NvmeKVLayer) -> None:
        self.layers.append(layer)

    @property
    def buffer_nbytes(self) -> int:
        return 2 * self.region_nbytes

    def shape_from(self, key_states: torch.Tensor) -> None:
        """Fix the token row ([batch, heads, head dim]) and dtype from the first update; make the buffers."""
        batch, heads, _, head_dim = key_states.shape
        row = (batch, heads, head_dim)
        if self.row_shape is not None:
            if row != self.row_shape or key_states.dtype != self.dtype:
                raise ValueError(f"kv_offload: a layer's keys are {list(row)} {key_states.dtype} per token, another's "
                                 f"{list(self.row_shape)} {self.dtype}; the layers of one cache must agree")
            return
        self.row_shape, self.dtype = row, key_states.dtype
        self.codec = KVCodec(self.quantization, head_dim, key_states.dtype)
        self.row_nbytes = batch * heads * self.codec.nbytes
        self.page_tokens = DIRECT_ALIGN // math.gcd(self.row_nbytes, DIRECT_ALIGN)
        self.region_nbytes = -(-self.max_tokens * self.row_nbytes // DIRECT_ALIGN) * DIRECT_ALIGN
        self.buffers = [locked_tensor(self.buffer_nbytes, torch.uint8) for _ in range(self.buffer_count)]
        self._free = deque(range(self.buffer_count))

    def _views(self, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values regions of buffer ``slot``, as [max_tokens, batch, heads, row] (row: the
        head dimension, or the codec's bytes)."""
        buffer = self.buffers[slot]
        shape = (self.max_tokens, *self.row_shape[:2], self.codec.row_width)
        used = self.max_tokens * self.row_nbytes
        keys = buffer[:used].view(self.codec.stored_dtype).view(shape)
        values = buffer[self.region_nbytes:self.region_nbytes + used].view(self.codec.stored_dtype).view(shape)
        return keys, values

    # ---- reads ahead ------------------------------------------------------------------------------

    def acquire(self, layer: NvmeKVLayer) -> tuple[torch.Tensor, torch.Tensor]:
        """``layer``'s buffer with its first ``flushed`` tokens read (waiting for that read), held
        until `release` (``layer``'s own held buffer again when it is acquired twice)."""
        if self._held is not None and self._held[0] is layer:  # held ahead of its update (`NvmeKVLayer.held`)
            return self._views(self._held[1])
        if self._held is not None:  # an update that raised: its buffer is free again
            self._free.append(self._held[1])
            self._held = None
        if not self._inflight or self._inflight[0][0] is not layer:  # out of the expected order: restart at it
            self._drain()
            self._next = self.layers.index(layer)
        self._issue()
        held, slot, futures = self._inflight.popleft()
        start = time.perf_counter()
        self.bytes_read += _wait(futures)
        self.wait_seconds += time.perf_counter() - start
        self._held = (held, slot)
        return self._views(slot)

    def release(self, layer: NvmeKVLayer) -> None:
        """``layer`` is done with its buffer, which takes the next read at once."""
        if self._held is not None and self._held[0] is layer:
            self._free.append(self._held[1])
            self._held = None
            self._issue()

    def _issue(self) -> None:
        """Start reads into the free buffers, in forward order, wrapping around to the next step."""
        while self._free and self.layers and len(self._inflight) < self.buffer_count:
            layer = self.layers[self._next]
            if any(entry[0] is layer for entry in self._inflight) or (self._held and self._held[0] is layer):
                return
            self._wait_writes(layer)  # its pages must be on the disk before they are read back
            slot = self._free.popleft()
            futures = []
            if layer.flushed:
                nbytes = layer.flushed * self.row_nbytes
                region = self.region_nbytes
                buffer = self.buffers[slot]
                futures = [self.handle.read(buffer[:nbytes], layer.path, 0),
                           self.handle.read(buffer[region:region + nbytes], layer.path, region)]
            self._inflight.append((layer, slot, futures))
            self._next = (self._next + 1) % len(self.layers)

    def _drain(self) -> None:
        while self._inflight:
            _, slot, futures = self._inflight.popleft()
            try:
                _wait(futures)
            finally:
                self._free.append(slot)

    # ---- writes behind ----------------------------------------------------------------------------

    def write(self, layer: NvmeKVLayer, keys: torch.Tensor, values: torch.Tensor, start: int, end: int) -> None:
        """Write tokens [start, end) of ``layer`` (whole pages) from a copy; keep at most
        ``write_behind_bytes`` of copies waiting."""
        nbytes = (end - start) * self.row_nbytes
        staging = aligned_tensor(2 * nbytes, torch.uint8)
        staging[:nbytes].view(keys.dtype).view(keys[start:end].shape).copy_(keys[start:end])
        staging[nbytes:].view(values.dtype).view(values[start:end].shape).copy_(values[start:end])
        offset = start * self.row_nbytes
        futures = [self.handle.write(staging[:nbytes], layer.path, offset),
                   self.handle.write(staging[nbytes:], layer.path, self.region_nbytes + offset)]
        layer.writes.extend(futures)
        self._writes.append((layer, futures, staging))
        while sum(entry[2].numel() for entry in self._writes) > self.write_behind_bytes and len(self._writes) > 1:
            self._finish_write()

    def _finish_write(self) -> None:
        layer, futures, _ = self._writes.popleft()
        try:
            self.bytes_written += _wait(futures)
        finally:
            layer.writes = [f for f in layer.writes if f not in futures]

    def _wait_writes(self, layer: NvmeKVLayer) -> None:
        while layer.writes:
            self._finish_write()

    def forget(self, layer: NvmeKVLayer) -> None:
        """``layer`` starts again empty: nothing of it in flight, nothing read ahead for it."""
        self._drain()
        self._wait_writes(layer)
        if self._held is not None and self._held[0] is layer:
            self._free.append(self._held[1])
            self._held = None

    # ---- lifetime ---------------------------------------------------------------------------------

    def close(self) -> None:
        """Wait for every read and write, free the buffers and remove the files. Raises the first
        write's error once all are done."""
        error = None
        try:
            self._drain()
        except Exception as exc:  # noqa: BLE001 - raised below, after the cleanup
            error = exc
        while self._writes:
            try:
                self._finish_write()
            except Exception as exc:  # noqa: BLE001 - raised below
                error = error or exc
        for buffer in self.buffers:
            free_locked_tensor(buffer)
        self.buffers, self._free, self._held = [], deque(), None
        shutil.rmtree(self.directory, ignore_errors=True)
        if error is not None:
            raise error


def _wait(futures: list[IOFuture]) -> int:
    """Wait for every future; the bytes moved. Raises the first error after all are done."""
    nbytes, error = 0, None
    for future in futures:
        try:
            nbytes += future.result()
        except BaseException as exc:  # noqa: BLE001 - raised below, once all are done
            error = error or exc
    if error is not None:
        raise error
    return nbytes


class MicroBatchedLayer(_StreamedLayer):
    """One decoder layer's cache under the block schedule: one layer cache per micro-batch, the
    one updated chosen by the cache's ``micro_batch`` (set by `offload.infer.schedule` before each
    micro-batch runs through the layer)."""

    _what = "block schedule: a cache split into micro-batches"
    _instead = "use greedy decoding or sampling, or block_schedule.micro_batch_size equal to the batch"

    def __init__(self, cache: "OffloadedKVCache", parts: list[CacheLayerMixin]) -> None:  # noqa: D107
        self.cache, self.parts = cache, parts
        self.keys = self.values = None

    @property
    def is_initialized(self) -> bool:
        return all(part.is_initialized for part in self.parts)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.parts[self.cache.micro_batch].lazy_initialization(key_states, value_states)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.parts[self.cache.micro_batch].update(key_states, value_states, *args, **kwargs)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.parts[0].get_mask_sizes(query_length)

    def get_seq_length(self) -> int:
        return self.parts[0].get_seq_length()

    def reset(self) -> None:
        for part in self.parts:
            part.reset()


class OffloadedKVCache(Cache):
    """A transformers `Cache` for ``num_layers`` decoder layers: those in ``nvme_layers`` on NVMe
    (files in a new directory under ``parent``, removed by `close`), the others in memory
    (`DynamicLayer`). ``max_tokens`` is the longest sequence it will hold (prompt plus new tokens).
    With ``micro_batches`` > 1 every layer holds one cache per micro-batch (`MicroBatchedLayer`),
    read in the block schedule's order (layer by layer, the micro-batches of each in turn).

    Use it as ``model.generate(..., **{CACHE_KEYWORD: cache})`` (``past_key_values=`` on transformers
    5.23 and older, ``cache=`` from 5.24) and `close` it afterwards (or use it as a context
    manager). With ``stager`` (compute on a device of its own) every layer (each micro-batch's part) is a
    `StagedKVLayer`, copied to the device one layer ahead of its update (offload/infer/kv/device.py). With ``quantization`` every layer stores its keys and values as `KVCodec` bytes, those in
    memory as `QuantizedLayer`. Greedy decoding and sampling work; beam search and assisted decoding
    need reordering or cropping, which layers on NVMe or in micro-batches refuse (NotImplementedError
    naming kv_offload or block_schedule); layers in memory do them.
    """

    def __init__(self, num_layers: int, nvme_layers: set[int] | list[int] | tuple[int, ...], handle: AioHandle,
                 parent: str | os.PathLike, *, max_tokens: int, buffer_count: int = 2, micro_batches: int = 1,
                 quantization: KVQuantization | None = None, stager: LayerStager | None = None) -> None:
        self.stager = stager
        self.ring = KVRing(handle, os.fspath(parent), max_tokens=max_tokens, buffer_count=buffer_count,
                           quantization=quantization)
        self.micro_batches = micro_batches
        self.micro_batch = 0
        """The micro-batch running now (the block schedule sets it)."""
        on_nvme = set(nvme_layers)
        layers: list[CacheLayerMixin] = []
        for index in range(num_layers):
            parts: list[CacheLayerMixin] = []
            for part in range(micro_batches):
                if index in on_nvme:
                    layer = NvmeKVLayer(self.ring, index, part)
                    self.ring.add(layer)
                    parts.append(layer)
                else:
                    parts.append(DynamicLayer() if quantization is None else QuantizedLayer(self._codec_for))
            if stager is not None:  # each part in the order the forward updates them (block schedule: micro-batches in turn)
                parts = [stager.stage(part) for part in parts]
            layers.append(parts[0] if micro_batches == 1 else MicroBatchedLayer(self, parts))
        super().__init__(layers=layers)

    def _codec_for(self, key_states: torch.Tensor) -> KVCodec:
        """The codec of a layer in memory whose first keys are ``key_states`` [batch, heads, tokens, head dim]."""
        return KVCodec(self.ring.quantization, key_states.shape[-1], key_states.dtype)

    def close(self) -> None:
        """Wait for reads and writes in flight, free the rings (the stager's too) and remove the files."""
        try:
            if self.stager is not None:
                self.stager.close()
        finally:
            self.ring.close()

    def __enter__(self) -> "OffloadedKVCache":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
