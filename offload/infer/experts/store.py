"""Experts read by the router's choice: only the experts some token of the batch picks are read, the most
used stay in memory, and the next layer's are guessed and read ahead.

Each expert layer's module (offload/infer/experts/split.py) computes through `ExpertStore.forward`: the
router has run (it is cheap and stays in memory), so ``top_k_index`` says which experts the batch needs.
Those in the cache compute at once while the others are read, each into a locked slot of the store's,
converted to its slices (transformers' operations over that expert's tensors), computed, and kept in the
cache if the budget has room or it has been used more often than the least used kept expert (counts kept
as generation runs). Before this layer waits for anything, the next layer's router is applied to this
layer's input (as the mixtral-offloading work does, arXiv 2312.17238) and the experts it picks are read
ahead into free slots: a wrong guess costs those bytes, never a token, and its read stays usable until
its slot is needed (the next token may pick it).

Each picked expert is computed by the experts module's own forward (transformers' implementation, the
configured one) with its parameters bound to that expert's slices and every token routed to it, then
the outputs are summed per token in fp32 (as transformers' grouped implementation sums over top_k).

Where compute has memory of its own (a GPU), a `DeviceExperts` (offload/infer/experts/device.py) is the
tier above the cache: an expert read is packed into a pinned buffer (what the cache then keeps), the most
used experts are kept on the device by the same counts, and every other picked expert is copied there
to compute (the next layer's guessed ones staged ahead where the cache holds them).
"""

from __future__ import annotations

import time
from collections import Counter, deque
from dataclasses import dataclass
from typing import Any

import torch
from torch.nn import functional as F

from offload.infer.experts.device import DeviceExperts
from offload.infer.experts.split import Expert, ExpertLayer
from offload.storage.safetensors_reader import read_windows, tensor_views
from tensorio import AioHandle, IOFuture, free_locked_tensor, locked_tensor

__all__ = ["ExpertStore"]

Key = tuple[int, int]
"""(layer position, expert index)."""

GUESS_LAYERS = 2
"""Layers ahead whose experts are guessed and read ahead (while slots are free): the next one, whose router
applied to this layer's input guesses best, then the one after it."""


@dataclass(eq=False, slots=True)
class _Read:
    slot: int
    futures: list[IOFuture]
    guessed: bool


@dataclass(slots=True)
class ExpertCounts:
    """What the store has done since it was made (or `ExpertCounts.clear`)."""

    calls: int = 0
    """Expert-layer forwards."""
    picked: int = 0
    """Distinct experts those forwards computed with, summed."""
    hits: int = 0
    """Of those, found in the cache."""
    reads: int = 0
    """Experts read from the disk (guesses included)."""
    bytes_read: int = 0
    guessed: int = 0
    """Reads started on a guess of the next layer's router."""
    guessed_used: int = 0
    """Of those, used by the forward they were read for, or a later one."""
    wait_seconds: float = 0.0
    """Time forwards waited for expert reads."""

    def clear(self) -> None:
        """Start counting from zero."""
        for name in ("calls", "picked", "hits", "reads", "bytes_read", "guessed", "guessed_used"):
            setattr(self, name, 0)
        self.wait_seconds = 0.0


class ExpertStore:
    """The experts of ``layers``, read through ``slots`` locked buffers by the router's choice, kept in a
    cache of at most ``capacity`` bytes (`set_capacity`; None: no limit), with the next layer's guessed
    (``guess``); with ``device`` (compute on a device of its own) the most used kept there too. Installs
    itself as each layer's experts forward; `close` removes it."""

    def __init__(self, handle: AioHandle, layers: list[ExpertLayer], *, slots: int, guess: bool = True,
                 device: DeviceExperts | None = None) -> None:
        if not layers:
            raise ValueError("ExpertStore: no expert layers")
        self.handle = handle
        self.layers = layers
        self.device = device
        """The device tier, where compute has memory of its own; None computes on the host."""
        self.guess = guess
        self.slot_count = max(1, slots)
        self.slot_nbytes = max(e.buffer_nbytes for layer in layers for e in layer.experts)
        self.expert_nbytes = max(e.nbytes for layer in layers for e in layer.experts)
        self.slots: list[torch.Tensor] = []
        self._free: deque[int] = deque()
        self._reads: dict[Key, _Read] = {}
        self._order: deque[Key] = deque()
        """Reads in flight, oldest first."""
        self.cache: dict[Key, Any] = {}
        """Experts kept in host memory: their slices, or with a device tier their pinned packed buffer."""
        self.cache_bytes = 0
        self.capacity: int | None = 0
        self.uses: Counter[Key] = Counter()
        self.counts = ExpertCounts()
        self._pinned: set[Key] = set()
        for layer in layers:
            layer.module.forward = self._forward_of(layer)

    # ---- sizes ------------------------------------------------------------------------------------

    @property
    def total_nbytes(self) -> int:
        """Every expert's bytes in memory."""
        return sum(e.nbytes for layer in self.layers for e in layer.experts)

    @property
    def buffers_nbytes(self) -> int:
        """The read slots' bytes."""
        return self.slot_count * self.slot_nbytes

    def set_capacity(self, nbytes: int | None, device_nbytes: int | None = None) -> None:
        """Keep at most ``nbytes`` of experts in host memory (None: every one read stays) and, with a device
        tier, ``device_nbytes`` on the device; the least used go first (off the device: into host memory
        where their uses earn it)."""
        self.capacity = None if nbytes is None else max(0, int(nbytes))
        if self.capacity is not None:
            for key in sorted(self.cache, key=self.uses.__getitem__):
                if self.cache_bytes <= self.capacity:
                    break
                self._evict(key)
        if self.device is not None:
            self.device.capacity = max(0, int(device_nbytes or 0))
            for key in sorted(self.device.kept, key=self.uses.__getitem__):
                if self.device.kept_bytes <= self.device.capacity:
                    break
                self._demote(key)

    # ---- the forward ------------------------------------------------------------------------------

    def _forward_of(self, layer: ExpertLayer):
        compute = type(layer.module).forward.__get__(layer.module)

        def forward(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                    *args: Any, **kwargs: Any) -> torch.Tensor:
            return self.forward(layer, compute, hidden_states, top_k_index, top_k_weights, *args, **kwargs)

        return forward

    def forward(self, layer: ExpertLayer, compute, hidden: torch.Tensor, index: torch.Tensor, weights: torch.Tensor,
                *args: Any, **kwargs: Any) -> torch.Tensor:
        """``layer``'s experts on ``hidden`` [tokens, hidden] as routed by ``index`` / ``weights`` [tokens, k]:
        each picked expert read (or found in the cache) and computed by ``compute`` (the module's own forward)."""
        picked = sorted(e for e in set(index.reshape(-1).tolist()) if 0 <= e < layer.count)
        keys = [(layer.position, e) for e in picked]
        self._pinned = set(keys)
        self.uses.update(keys)
        counts = self.counts
        counts.calls += 1
        counts.picked += len(keys)
        tier = self.device
        on_device = [e for e, key in zip(picked, keys) if tier is not None and key in tier.kept]
        cached = [e for e, key in zip(picked, keys) if key in self.cache and e not in on_device]
        counts.hits += len(on_device) + len(cached)
        missing = [e for e, key in zip(picked, keys) if key not in self.cache and e not in on_device]
        for e in missing:  # every read the slots allow, before anything computes
            if (layer.position, e) not in self._reads and not self._start(layer, e, guessed=False):
                break
        if tier is not None:  # those held on the host into free copy slots now: the copies overlap compute
            for key in [(layer.position, e) for e in cached]:
                if tier.victims(key, self.uses, self._pinned) is None and not tier.prefetch(key, self.cache[key]):
                    break
        if self.guess:
            self._guess_next(layer, hidden)
        out = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
        for e in on_device + cached + missing:
            key = (layer.position, e)
            if tier is not None:
                values = self._device_values(layer, e)
            else:
                values = self.cache[key] if key in self.cache else self._take(layer, e)
            tokens, position = torch.where(index == e)
            for ref, value in zip(layer.params, values):
                ref.bind(value)
            module, count = layer.module, layer.module.num_experts
            module.num_experts = 1
            try:
                part = compute(hidden[tokens], torch.zeros_like(position)[:, None], weights[tokens, position][:, None],
                               *args, **kwargs)
            finally:
                module.num_experts = count
                for ref in layer.params:
                    ref.unbind()
            if tier is not None:
                tier.release(key)
            out.index_add_(0, tokens, part.float())
        self._pinned = set()
        return out.to(hidden.dtype)

    def _device_values(self, layer: ExpertLayer, e: int) -> tuple[torch.Tensor, ...]:
        """Expert ``e``'s values on the device: kept there, or copied there now from the cache or its read,
        and kept there in place of less used ones where its uses earn it (those go back to the cache where
        theirs do). An expert kept on the device leaves the cache."""
        key, tier = (layer.position, e), self.device
        if key in tier.kept:
            return tier.values(key)
        read = key not in self.cache
        host = self._take(layer, e, keep=False) if read else self.cache[key]
        victims = tier.victims(key, self.uses, self._pinned)
        if victims is None:
            values = tier.stage(key, host)
            if read:
                self._keep(key, host)
            return values
        for victim in victims:
            self._demote(victim)
        try:
            values = tier.admit(key, host)
        finally:
            if read:
                tier.give(host)
        if not read:
            self._evict(key)
        return values

    def _demote(self, key: Key) -> None:
        """Take kept ``key`` off the device: into the cache where its uses earn it, else dropped."""
        if key not in self.cache and self._room(key) is not None:
            self._keep(key, self.device.demote(key))
        else:
            self.device.drop(key)

    def keep(self, position: int, expert: int) -> bool:
        """Read expert ``expert`` of the layer at ``position`` now, outside a forward, and keep it where the
        capacity has room (or it is used more than a kept one); whether it is kept."""
        key = (position, expert)
        if key not in self.cache:
            self._take(self.layers[position], expert)  # kept there where the capacity or its uses allow
        return key in self.cache

    # ---- reads ------------------------------------------------------------------------------------

    def _allocate(self) -> None:
        self.slots = [locked_tensor(self.slot_nbytes, torch.uint8) for _ in range(self.slot_count)]
        self._free = deque(range(self.slot_count))

    def _start(self, layer: ExpertLayer, e: int, *, guessed: bool) -> bool:
        """Start reading expert ``e`` into a free slot (a guess only where one is free; a needed read takes
        the oldest guessed read's slot); whether started."""
        if not self.slots:
            self._allocate()
        if not self._free and not guessed:
            self._reclaim()
        if not self._free:
            return False
        slot = self._free.popleft()
        try:
            futures = read_windows(self.handle, list(layer.experts[e].windows), self.slots[slot])
        except BaseException:
            self._free.append(slot)
            raise
        key = (layer.position, e)
        self._reads[key] = _Read(slot, futures, guessed)
        self._order.append(key)
        self.counts.reads += 1
        self.counts.guessed += guessed
        return True

    def _reclaim(self) -> None:
        """Free the slot of the oldest guessed read in flight: its expert is kept in the cache where the
        budget and its uses allow, else dropped."""
        for key in list(self._order):
            read = self._reads[key]
            if read.guessed and key not in self._pinned:
                self._settle_and_keep(key)
                return

    def _take(self, layer: ExpertLayer, e: int, *, keep: bool = True) -> Any:
        """Expert ``e``'s slices (with a device tier: its pinned packed buffer), from its read (started now if
        it was not: a slot is freed for it); kept in the cache where its capacity and uses allow (``keep``)."""
        key = (layer.position, e)
        if key not in self._reads:
            while not self._start(layer, e, guessed=False):
                self._settle_and_keep(self._order[0])  # the slots are all taken: the oldest read first
        if self._reads[key].guessed:
            self.counts.guessed_used += 1
        start = time.perf_counter()
        held = self._settle(key)
        self.counts.wait_seconds += time.perf_counter() - start
        if keep:
            self._keep(key, held)
        return held

    def _settle_and_keep(self, key: Key) -> None:
        """Wait for ``key``'s read and keep its expert in the cache where the capacity and its uses allow."""
        self._keep(key, self._settle(key))

    def _settle(self, key: Key) -> Any:
        """Wait for ``key``'s read, make its slices (their own memory; with a device tier packed into a pinned
        buffer) and free its slot. Raises the read's error (after every future of it is done)."""
        read = self._reads.pop(key)
        self._order.remove(key)
        error, moved = None, 0
        for future in read.futures:
            try:
                moved += future.result()
            except BaseException as exc:  # noqa: BLE001 - raised below, once all are done
                error = error or exc
        self.counts.bytes_read += moved
        try:
            if error is not None:
                raise error
            layer = self.layers[key[0]]
            if self.device is None:
                return _slices(layer, layer.experts[key[1]], self.slots[read.slot])
            return self.device.pack(key[0], _slices(layer, layer.experts[key[1]], self.slots[read.slot], own=False))
        finally:
            self._free.append(read.slot)

    def _guess_next(self, layer: ExpertLayer, hidden: torch.Tensor) -> None:
        """Read ahead, into free slots, the experts the next layers' routers pick for this layer's input: the
        next layer's first, then the one after it while slots are free (`GUESS_LAYERS`). Guessed reads for
        this layer or earlier ones that nobody took, once done, give their slots first (kept in the cache
        where their uses earn it). With a device tier, the guessed experts the cache holds are copied to free
        copy slots (staged ahead), and those kept on the device need nothing."""
        for key in [k for k in self._order if self._reads[k].guessed and k[0] <= layer.position
                    and k not in self._pinned and all(f.done() for f in self._reads[k].futures)]:
            self._settle_and_keep(key)
        tier = self.device
        for ahead in range(1, GUESS_LAYERS + 1):
            if layer.position + ahead >= len(self.layers) or (not self._free and tier is None):
                return
            following = self.layers[layer.position + ahead]
            weight = getattr(following.router, "weight", None)
            if weight is None or weight.device.type == "meta":
                return
            scores = F.linear(hidden.to(weight.dtype), weight)
            guessed = torch.topk(scores, following.top_k, dim=-1).indices.reshape(-1).tolist()
            for e in sorted(set(guessed), key=lambda e: -self.uses[(following.position, e)]):
                key = (following.position, e)
                if tier is not None and key in tier.kept:
                    continue
                if tier is not None and key in self.cache:
                    tier.prefetch(key, self.cache[key], guessed=True)
                elif key not in self.cache and key not in self._reads and not self._start(following, e, guessed=True):
                    if tier is None:
                        return

    # ---- the cache --------------------------------------------------------------------------------

    def _keep(self, key: Key, held: Any) -> None:
        """Keep ``held`` (``key``'s slices, or pinned buffer) where the capacity has room, or by evicting experts
        used less often than it; else let it go."""
        victims = None if key in self.cache else self._room(key)
        if victims is None:
            if self.device is not None:
                self.device.give(held)
            return
        for victim in victims:
            self._evict(victim)
        self.cache[key] = held
        self.cache_bytes += self._nbytes(key)

    def _room(self, key: Key) -> list[Key] | None:
        """The kept experts to evict for ``key``, least used first, each used less often than it and not
        computing now ([] where there is room); None where it is not kept."""
        nbytes = self._nbytes(key)
        if self.capacity is None or self.cache_bytes + nbytes <= self.capacity:
            return []
        uses = self.uses[key]
        room, chosen = self.capacity - self.cache_bytes, []
        for victim in sorted((k for k in self.cache if k not in self._pinned and self.uses[k] < uses),
                             key=self.uses.__getitem__):
            if room >= nbytes:
                break
            chosen.append(victim)
            room += self._nbytes(victim)
        return chosen if room >= nbytes else None

    def _evict(self, key: Key) -> None:
        held = self.cache.pop(key)
        self.cache_bytes -= self._nbytes(key)
        if self.device is not None:
            self.device.give(held)

    def _nbytes(self, key: Key) -> int:
        """``key``'s bytes in the cache (with a device tier: its pinned packed buffer's)."""
        return self.device.nbytes(key) if self.device is not None else self.layers[key[0]].experts[key[1]].nbytes

    # ---- lifetime ---------------------------------------------------------------------------------

    def reset(self) -> None:
        """No read left in flight (after an error, or before a change of plan); the cache stays."""
        while self._order:
            try:
                self._settle(self._order[0])
            except Exception:  # noqa: BLE001 - nobody needs that data; a needed read raises when taken
                pass
        self._pinned = set()
        if self.device is not None:
            self.device.reset()

    def close(self) -> None:
        """Wait for reads in flight, free the slots and the cache, and give each layer its own forward back."""
        self.reset()
        for buffer in self.slots:
            try:
                free_locked_tensor(buffer)
            except ValueError:
                pass
        self.slots, self._free = [], deque()
        if self.device is not None:
            for held in self.cache.values():
                self.device.give(held)
        self.cache.clear()
        self.cache_bytes = 0
        if self.device is not None:
            self.device.close()
        for layer in self.layers:
            layer.module.__dict__.pop("forward", None)


def _slices(layer: ExpertLayer, expert: Expert, buffer: torch.Tensor, *, own: bool = True) -> tuple[torch.Tensor, ...]:
    """The expert's slice of each fused parameter, in memory of their own (not views into ``buffer``; with
    ``own`` False views where the conversion makes none, for a caller that copies them at once)."""
    views = tensor_views(list(expert.windows), buffer)
    start, end = buffer.data_ptr(), buffer.data_ptr() + buffer.numel()
    out = []
    for ref, conversion in zip(layer.params, expert.conversions):
        value = conversion.run(views)[ref.tensor]
        if value.dtype != ref.placeholder.dtype:
            value = value.to(ref.placeholder.dtype)
        elif own and start <= value.data_ptr() < end:
            value = value.clone()
        out.append(value)
    return tuple(out)
