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
"""

from __future__ import annotations

import time
from collections import Counter, deque
from dataclasses import dataclass
from typing import Any

import torch
from torch.nn import functional as F

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
    (``guess``). Installs itself as each layer's experts forward; `close` removes it."""

    def __init__(self, handle: AioHandle, layers: list[ExpertLayer], *, slots: int, guess: bool = True) -> None:
        if not layers:
            raise ValueError("ExpertStore: no expert layers")
        self.handle = handle
        self.layers = layers
        self.guess = guess
        self.slot_count = max(1, slots)
        self.slot_nbytes = max(e.buffer_nbytes for layer in layers for e in layer.experts)
        self.expert_nbytes = max(e.nbytes for layer in layers for e in layer.experts)
        self.slots: list[torch.Tensor] = []
        self._free: deque[int] = deque()
        self._reads: dict[Key, _Read] = {}
        self._order: deque[Key] = deque()
        """Reads in flight, oldest first."""
        self.cache: dict[Key, tuple[torch.Tensor, ...]] = {}
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

    def set_capacity(self, nbytes: int | None) -> None:
        """Keep at most ``nbytes`` of experts in memory (None: every one read stays); the least used go first."""
        self.capacity = None if nbytes is None else max(0, int(nbytes))
        if self.capacity is not None:
            for key in sorted(self.cache, key=self.uses.__getitem__):
                if self.cache_bytes <= self.capacity:
                    break
                self._evict(key)

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
        cached = [e for e, key in zip(picked, keys) if key in self.cache]
        counts.hits += len(cached)
        missing = [e for e, key in zip(picked, keys) if key not in self.cache]
        for e in missing:  # every read the slots allow, before anything computes
            if (layer.position, e) not in self._reads and not self._start(layer, e, guessed=False):
                break
        if self.guess:
            self._guess_next(layer, hidden)
        out = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
        for e in cached + missing:
            slices = self.cache.get((layer.position, e)) or self._take(layer, e)
            tokens, position = torch.where(index == e)
            for ref, value in zip(layer.params, slices):
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
            out.index_add_(0, tokens, part.float())
        self._pinned = set()
        return out.to(hidden.dtype)

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

    def _take(self, layer: ExpertLayer, e: int) -> tuple[torch.Tensor, ...]:
        """Expert ``e``'s slices, from its read (started now if it was not: a slot is freed for it)."""
        key = (layer.position, e)
        if key not in self._reads:
            while not self._start(layer, e, guessed=False):
                self._settle_and_keep(self._order[0])  # the slots are all taken: the oldest read first
        if self._reads[key].guessed:
            self.counts.guessed_used += 1
        start = time.perf_counter()
        slices = self._settle(key)
        self.counts.wait_seconds += time.perf_counter() - start
        self._admit(key, slices)
        return slices

    def _settle_and_keep(self, key: Key) -> None:
        """Wait for ``key``'s read and keep its expert in the cache where the capacity and its uses allow."""
        self._admit(key, self._settle(key))

    def _settle(self, key: Key) -> tuple[torch.Tensor, ...]:
        """Wait for ``key``'s read, make its slices (their own memory) and free its slot. Raises the read's
        error (after every future of it is done)."""
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
            return _slices(layer, layer.experts[key[1]], self.slots[read.slot])
        finally:
            self._free.append(read.slot)

    def _guess_next(self, layer: ExpertLayer, hidden: torch.Tensor) -> None:
        """Read ahead, into free slots, the experts the next layers' routers pick for this layer's input: the
        next layer's first, then the one after it while slots are free (`GUESS_LAYERS`). Guessed reads for
        this layer or earlier ones that nobody took, once done, give their slots first (kept in the cache
        where their uses earn it)."""
        for key in [k for k in self._order if self._reads[k].guessed and k[0] <= layer.position
                    and k not in self._pinned and all(f.done() for f in self._reads[k].futures)]:
            self._settle_and_keep(key)
        for ahead in range(1, GUESS_LAYERS + 1):
            if layer.position + ahead >= len(self.layers) or not self._free:
                return
            following = self.layers[layer.position + ahead]
            weight = getattr(following.router, "weight", None)
            if weight is None or weight.device.type == "meta":
                return
            scores = F.linear(hidden.to(weight.dtype), weight)
            guessed = torch.topk(scores, following.top_k, dim=-1).indices.reshape(-1).tolist()
            for e in sorted(set(guessed), key=lambda e: -self.uses[(following.position, e)]):
                key = (following.position, e)
                if key not in self.cache and key not in self._reads and not self._start(following, e, guessed=True):
                    return

    # ---- the cache --------------------------------------------------------------------------------

    def _admit(self, key: Key, slices: tuple[torch.Tensor, ...]) -> None:
        """Keep ``slices`` where the capacity has room, or by evicting experts used less often than it."""
        if key in self.cache:
            return
        nbytes = self.layers[key[0]].experts[key[1]].nbytes
        if self.capacity is not None and self.cache_bytes + nbytes > self.capacity:
            uses = self.uses[key]
            victims = sorted((k for k in self.cache if k not in self._pinned and self.uses[k] < uses),
                             key=self.uses.__getitem__)
            room = self.capacity - self.cache_bytes
            chosen = []
            for victim in victims:
                if room >= nbytes:
                    break
                chosen.append(victim)
                room += self.layers[victim[0]].experts[victim[1]].nbytes
            if room < nbytes:
                return
            for victim in chosen:
                self._evict(victim)
        self.cache[key] = slices
        self.cache_bytes += nbytes

    def _evict(self, key: Key) -> None:
        del self.cache[key]
        self.cache_bytes -= self.layers[key[0]].experts[key[1]].nbytes

    # ---- lifetime ---------------------------------------------------------------------------------

    def reset(self) -> None:
        """No read left in flight (after an error, or before a change of plan); the cache stays."""
        while self._order:
            try:
                self._settle(self._order[0])
            except Exception:  # noqa: BLE001 - nobody needs that data; a needed read raises when taken
                pass
        self._pinned = set()

    def close(self) -> None:
        """Wait for reads in flight, free the slots and the cache, and give each layer its own forward back."""
        self.reset()
        for buffer in self.slots:
            try:
                free_locked_tensor(buffer)
            except ValueError:
                pass
        self.slots, self._free = [], deque()
        self.cache.clear()
        self.cache_bytes = 0
        for layer in self.layers:
            layer.module.__dict__.pop("forward", None)


def _slices(layer: ExpertLayer, expert: Expert, buffer: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The expert's slice of each fused parameter, in memory of their own (not views into ``buffer``)."""
    views = tensor_views(list(expert.windows), buffer)
    start, end = buffer.data_ptr(), buffer.data_ptr() + buffer.numel()
    out = []
    for ref, conversion in zip(layer.params, expert.conversions):
        value = conversion.run(views)[ref.tensor]
        if value.dtype != ref.placeholder.dtype:
            value = value.to(ref.placeholder.dtype)
        elif start <= value.data_ptr() < end:
            value = value.clone()
        out.append(value)
    return tuple(out)
