"""Continuous batching over the engine's forward: every request that is running takes one step per
forward, and a forward streams each layer that is not resident from NVMe once for the whole batch,
so requests that run together share each read of the weights.

A request that arrives while others run joins at the next step: that forward takes the newcomers'
whole prompts (their prefill) beside one token of each running sequence, all left-padded to the
longest prompt, so a join costs no extra read of the weights. With ``max_padding`` (the prompts
file's batches) the step's rows are split by length instead into the fewest forwards whose padding
stays within that fraction of their real tokens (length_groups.py): each further forward prefills
its prompts into a cache of its own, appended to the batch's (`append_rows`), a read of the streamed
weights more for less padding computed, which is what a compute-bound prefill (the CPU) wants.

A request that finishes (its ``max_tokens``, a stop string, the end-of-sequence token) or is
cancelled leaves the batch before the next step, and its rows of the KV cache go with it
(cache_rows.py).

The KV cache is a transformers `DynamicCache` in memory (on the device where compute has memory of
its own), in the compute dtype, or with ``kv_offload.quantization`` (``--kv-quantize``) its layers
`QuantizedLayer`s holding int8 / int4 bytes, as ``offload.generate`` keeps them. The batch grows
while the budget holds its cache beside the weights that must stay resident (checked before a
request joins, for the longest the cache can become) and ``max_batch`` allows; requests beyond wait in a queue of at most ``max_queue``, then `QueueFull`.
Every step calls the engine (``engine(ids, ...)``), which re-plans for the batch's cache as it grows
and shrinks (`InferenceEngine.reserve`): resident layers give way to the cache and come back after.
"""

from __future__ import annotations

import inspect
import itertools
import logging
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from transformers import DynamicCache

from offload.infer.answer import Answer
from offload.infer.kv.cache import CACHE_KEYWORD
from offload.infer.kv.quant import KVCodec, QuantizedLayer
from offload.infer.plan.host import BudgetError, format_bytes
from offload.infer.sampling import SamplingParams
from offload.infer.batch.cache_rows import add_rows, append_rows, check_full_attention, keep_rows, right_align
from offload.infer.batch.length_groups import length_groups

__all__ = ["Batcher", "QueueFull", "Ticket", "Update", "check_settings", "eos_token_ids"]

log = logging.getLogger("offload.infer.batch")


@dataclass(frozen=True, slots=True)
class Update:
    """What a request's ``sink`` receives after each step it took part in: the text it made showable
    and its token; the last one has ``finish_reason`` ("stop" or "length") and ``usage`` (OpenAI's
    token counts), or ``error`` when the request failed: ``param`` names the request's field to change
    where the request itself was refused (its cache cannot fit: "max_tokens"), None for a failed step."""

    text: str = ""
    token: int | None = None
    finish_reason: str | None = None
    usage: dict[str, int] | None = None
    error: str | None = None
    param: str | None = None

    @property
    def last(self) -> bool:
        """The request's last update: finished or failed."""
        return self.finish_reason is not None or self.error is not None


class QueueFull(RuntimeError):
    """More requests wait than the queue holds; ``retry_after`` is a suggested wait in seconds."""

    def __init__(self, message: str, retry_after: int = 1) -> None:
        super().__init__(message)
        self.retry_after = retry_after


@dataclass(eq=False, slots=True)
class _Sequence:
    """One request in the batcher: its prompt, its answer so far, where its updates go."""

    id: int
    prompt: list[int]
    answer: Answer
    sink: Callable[[Update], None]
    cancelled: bool = False
    position: int = 0
    """The position id of the token fed next: the sequence's tokens in the cache (its prompt's, while waiting)."""
    last: int = 0
    """The token generated last, fed at the next step."""


@dataclass(frozen=True, slots=True)
class Ticket:
    """A submitted request: `cancel` takes it out of the queue, or out of the batch at the next step."""

    id: int
    _batcher: "Batcher" = field(repr=False)
    _sequence: _Sequence = field(repr=False)

    def cancel(self) -> None:
        """Stop generating for this request (idempotent); its sink gets nothing more."""
        self._batcher._cancel(self._sequence)


def eos_token_ids(engine: Any, tokenizer: Any = None) -> tuple[int, ...]:
    """The end-of-sequence ids of the model's generation config (one or a list), else the tokenizer's."""
    eos = engine.module.generation_config.eos_token_id
    if eos is None and tokenizer is not None:
        eos = tokenizer.eos_token_id
    return tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (int(eos),))


def check_settings(settings: Any, *, separate_memory: bool = False) -> None:
    """Refuse the engine settings (an `InferenceConfig`) a `Batcher` cannot honour: it keeps each sequence's
    KV cache where compute runs (in memory, or on the device where compute has memory of its own:
    ``separate_memory``; quantized or not), and runs the batch through each layer at once. Raises
    ValueError naming the option, in one line."""
    kv = settings.kv_offload
    refused = ("--kv-offload nvme (kv_offload.device)" if kv.device == "nvme"
               else "--kv-offload cpu (kv_offload.device) with compute on a device" if kv.device == "cpu" and separate_memory
               else "--micro-batch-size (block_schedule.micro_batch_size)" if settings.block_schedule.micro_batch_size
               else None)
    if refused:
        raise ValueError(f"{refused} is not supported by batches that sequences join and leave (offload.serve, "
                         f"offload.generate --prompts-file): they keep the KV cache where compute runs and run the "
                         f"batch through each layer at once; leave the option out (--kv-quantize int8/int4 shrinks "
                         f"the cache there instead), or use python -m offload.generate --prompt --batch-size N, "
                         f"which takes it")


class Batcher:
    """Runs requests on ``engine`` (an `InferenceEngine`) in one batch that they join and leave between
    decode steps, on a thread of its own (see the module docstring). ``tokenizer`` turns answers into
    text (None: token ids only). ``max_batch``: sequences in the batch at most; ``max_queue``: requests
    waiting at most. ``max_padding``: None, every step one forward (a join costs no extra read); a
    fraction, a step's rows split by length into forwards whose padding is at most that fraction of
    their real tokens (`length_groups`). ``start`` False: nothing runs before `start` (requests
    submitted before it run together from the first step). Use as a context manager or call `close`;
    the engine stays the caller's.

    Raises ValueError for settings it cannot honour (`check_settings`), a model whose cache cannot take
    sequences joining and leaving (sliding-window attention), ``max_batch`` / ``max_queue`` below 1, or
    ``max_padding`` below 0.
    """

    def __init__(self, engine: Any, tokenizer: Any = None, *, max_batch: int = 32, max_queue: int = 256,
                 max_padding: float | None = None, start: bool = True) -> None:
        for name, value in (("max_batch", max_batch), ("max_queue", max_queue)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: expected an integer of at least 1, got {value!r}")
        if max_padding is not None and (isinstance(max_padding, bool) or not isinstance(max_padding, (int, float))
                                        or not max_padding >= 0):
            raise ValueError(f"max_padding: expected None or a fraction of at least 0, got {max_padding!r}")
        check_settings(engine.settings, separate_memory=engine.compute.separate_memory)
        check_full_attention(DynamicCache(config=engine.module.config))
        self.engine, self.tokenizer = engine, tokenizer
        self.max_batch, self.max_queue, self.max_padding = max_batch, max_queue, max_padding
        self.eos = eos_token_ids(engine, tokenizer)
        self._keep_logits = "logits_to_keep" in inspect.signature(engine.module.forward).parameters
        self._cond = threading.Condition()
        self._waiting: deque[_Sequence] = deque()
        self._rows: list[_Sequence] = []
        self._cache: DynamicCache | None = None
        self._mask = torch.zeros((0, 0), dtype=torch.long)
        self._ids = itertools.count(1)
        self._closing = False
        self._stats = {"steps": 0, "tokens": 0, "finished": 0, "largest_batch": 0, "joined_running": 0,
                       "positions": 0, "padding": 0}
        self._thread = threading.Thread(target=self._run, name="offload-infer-batcher", daemon=True)
        if start:
            self.start()

    # ---- the public surface -----------------------------------------------------------------------

    def submit(self, prompt: list[int], params: SamplingParams, sink: Callable[[Update], None]) -> Ticket:
        """Queue ``prompt`` (token ids) to be answered with ``params`` (``max_tokens`` resolved, as
        `offload.infer.prompt.fit_context` does). ``sink`` gets an `Update` after every step, on the
        batcher's thread: it must return quickly and not raise (an exception cancels the request).
        Raises `QueueFull` when ``max_queue`` requests wait already, RuntimeError once closed."""
        sequence = _Sequence(next(self._ids), list(prompt), Answer(len(prompt), params, self.tokenizer, self.eos),
                             sink, position=len(prompt))
        with self._cond:
            if self._closing:
                raise RuntimeError("the batcher is closed (shutting down); no new requests")
            if len(self._waiting) >= self.max_queue:
                raise QueueFull(f"{len(self._waiting)} requests are waiting already, the queue's limit "
                                f"(--max-queue {self.max_queue}); retry later")
            self._waiting.append(sequence)
            self._cond.notify()
        return Ticket(sequence.id, self, sequence)

    def start(self) -> None:
        """Begin stepping (once; the constructor does it unless ``start`` was False)."""
        if not self._thread.is_alive():
            self._thread.start()

    def stats(self) -> dict[str, int]:
        """Counts so far: ``steps`` (forwards: each streams the non-resident layers once), ``tokens``
        generated, ``finished`` requests, ``largest_batch`` seen, ``joined_running`` (requests that joined
        a batch already running), ``positions`` the forwards computed and the ``padding`` among them, and
        now ``running`` and ``waiting``."""
        with self._cond:
            return {**self._stats, "running": len(self._rows), "waiting": len(self._waiting)}

    def close(self) -> None:
        """Stop: requests still waiting or running get an `Update` with ``error``; waits for the step in
        flight. Idempotent. The engine is not closed."""
        with self._cond:
            self._closing = True
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join()
        for sequence in [*self._waiting, *self._rows]:
            self._send(sequence, Update(error="the batcher was closed (shutting down) before the answer was complete"))
        self._waiting.clear()
        self._rows.clear()
        self._cache = None

    def __enter__(self) -> "Batcher":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- the loop ---------------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._closing and not self._waiting and not self._rows:
                    self._cond.wait()
                if self._closing:
                    return
                self._drop_cancelled()
                candidates = self._candidates()
            joining = None
            try:
                joining = self._admit(candidates)
                if self._rows or joining:
                    self._step(joining)
            except Exception as error:  # a read, the budget: the batch fails, the batcher goes on
                failed = list({s.id: s for s in [*self._rows, *(candidates if joining is None else joining)]}.values())
                log.exception("offload.infer.batch: a step failed; its %d requests get the error", len(failed))
                for sequence in failed:
                    self._send(sequence, Update(error=f"generation failed: {type(error).__name__}: {error}"))
                with self._cond:
                    self._rows, self._cache = [], None
                    self._mask = torch.zeros((0, 0), dtype=torch.long)

    def _drop_cancelled(self) -> None:
        """Under the lock: cancelled requests leave the queue, and the batch with their cache rows."""
        self._waiting = deque(s for s in self._waiting if not s.cancelled)
        kept = [i for i, s in enumerate(self._rows) if not s.cancelled]
        if len(kept) != len(self._rows):
            self._leave(kept)

    def _candidates(self) -> list[_Sequence]:
        """Under the lock: the requests at the head of the queue that ``max_batch`` lets join now."""
        room = self.max_batch - len(self._rows)
        return [self._waiting.popleft() for _ in range(min(room, len(self._waiting)))]

    def _admit(self, candidates: list[_Sequence]) -> list[_Sequence]:
        """The longest head of ``candidates`` whose prefill's activations stay within
        ``block_schedule.max_activation_bytes`` (at least one joins) and whose cache fits beside the running
        batch's; the others go back to the head of the queue. A request that cannot fit even alone fails
        with the figures."""
        limit = self.engine.settings.block_schedule.max_activation_bytes
        most = len(candidates)
        while most > 1 and self.engine.activation_bytes(
                len(self._rows) + most, max(len(s.prompt) for s in candidates[:most]), logits=1) > limit:
            most -= 1
        for count in range(most, 0, -1):
            refusal = self._kv_refusal(self._rows + candidates[:count], candidates[:count])
            if refusal is None:
                break
            if count == 1 and not self._rows:
                self._send(candidates[0], Update(error=refusal, param="max_tokens"))
                return self._admit(candidates[1:])
        else:
            count = 0
        with self._cond:
            self._waiting.extendleft(reversed(candidates[count:]))
        return candidates[:count]

    def _kv_refusal(self, batch: list[_Sequence], joining: list[_Sequence]) -> str | None:
        """None when the KV cache of ``batch`` fits in memory at the longest it can grow to (every
        answer at its ``max_tokens``, and the join step's padding); else why not, with the figures."""
        longest = max(s.position + s.answer.params.max_tokens - len(s.answer.tokens) for s in batch)
        padded = self._mask.shape[1] + max(len(s.prompt) for s in joining)
        tokens = max(longest, padded)
        plan = self.engine.plan
        if plan.device is not None:  # the device tier decides where the cache goes: ask the engine
            try:
                plan = self.engine.reserve(len(batch), tokens)
            except BudgetError as error:
                return str(error)
            if not plan.kv.staged_nbytes:
                return None
            return (f"the KV cache of batch {len(batch)} x {tokens} tokens does not fit in the device's budget "
                    f"({plan.device.setting}); lower max_tokens, or raise the device's budget")
        need = self.engine.kv_bytes(len(batch), tokens)
        room = plan.budget - sum(u.nbytes for u in plan.units if not u.streamable) if plan.budget > 0 else None
        if room is None or need <= room:
            return None
        return (f"the KV cache of batch {len(batch)} x {tokens} tokens ({format_bytes(need)}) does not fit in the "
                f"memory budget's {format_bytes(max(room, 0))} left beside the weights that must stay resident; lower "
                f"max_tokens, or raise --max-in-cpu")

    def _step(self, joining: list[_Sequence]) -> None:
        """One step: a token for every running sequence, the prompts of ``joining`` (one forward, or with
        ``max_padding`` a forward per length group); then pick each sequence's next token, tell its sink,
        and let finished sequences leave."""
        rows = len(self._rows)
        groups = self._length_groups(joining)
        # 1. The running rows and the first group: one forward on the batch's cache, newcomers in rows of padding.
        if self._cache is None:  # none exists before the first step of a batch
            self._cache = self._new_cache()
            self._mask = torch.zeros((len(groups[0]), 0), dtype=torch.long)
        elif groups[0]:
            self._mask = add_rows(self._cache, self._mask, len(groups[0]))
        ids, real, positions = self._inputs(groups[0])
        mask = torch.cat([self._mask, real], dim=1)
        logits = [self._forward(ids, mask, positions, self._cache)]
        self._mask = mask
        # 2. Each further group: its prefill in a cache of its own, whose rows then join the batch's.
        for group in groups[1:]:
            ids, real, positions = self._inputs(group, running=False)
            cache = self._new_cache()
            logits.append(self._forward(ids, real, positions, cache))
            self._mask = append_rows(self._cache, self._mask, cache, real)
        logits = torch.cat(logits)
        joining = [sequence for group in groups for sequence in group]
        with self._cond:
            self._rows.extend(joining)
            self._stats["largest_batch"] = max(self._stats["largest_batch"], len(self._rows))
            if rows and joining:
                self._stats["joined_running"] += len(joining)
        # 4. Each sequence's next token, its text, whether it is over.
        kept, produced, finished = [], 0, 0
        for row, sequence in enumerate(self._rows):
            if sequence.cancelled:
                continue
            produced += 1
            token = sequence.answer.pick(logits[row])
            if row < rows:
                sequence.position += 1
            sequence.last = token
            shown = sequence.answer.add(token)
            answer = sequence.answer
            self._send(sequence, Update(text=shown, token=token, finish_reason=answer.finish_reason,
                                        usage=answer.usage() if answer.done else None))
            finished += answer.done
            if not answer.done and not sequence.cancelled:
                kept.append(row)
        with self._cond:
            self._stats["tokens"] += produced
            self._stats["finished"] += finished
            if joining or len(kept) != len(self._rows):
                self._leave(kept)

    def _length_groups(self, joining: list[_Sequence]) -> list[list[_Sequence]]:
        """The newcomers of each forward of a step: without ``max_padding`` all in the one forward; with it,
        shortest first, split by `length_groups` (the running rows, one token each, go with the first)."""
        if self.max_padding is None or not joining:
            return [joining]
        rows, joining = len(self._rows), sorted(joining, key=lambda s: len(s.prompt))
        ranges = length_groups([1] * rows + [len(s.prompt) for s in joining], self.max_padding)
        groups = [[joining[i - rows] for i in part if i >= rows] for part in ranges]
        return groups  # the first may hold no newcomer: the running rows' forward alone

    def _inputs(self, joining: list[_Sequence], *, running: bool = True
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A forward's ids, real-token mask and position ids: one token per running row (unless not
        ``running``), then each of ``joining``'s prompts, left-padded to the longest."""
        before = self._rows if running else []
        width = max([len(s.prompt) for s in joining] + [1])
        ids = torch.zeros((len(before) + len(joining), width), dtype=torch.long)
        real = torch.zeros_like(ids)
        positions = torch.zeros_like(ids)
        for row, sequence in enumerate(before):
            ids[row, -1], real[row, -1], positions[row, -1] = sequence.last, 1, sequence.position
        for row, sequence in enumerate(joining, start=len(before)):
            length = len(sequence.prompt)
            ids[row, width - length:] = torch.tensor(sequence.prompt)
            real[row, width - length:] = 1
            positions[row, width - length:] = torch.arange(length)
        return ids, real, positions

    def _forward(self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, cache: DynamicCache
                 ) -> torch.Tensor:
        """The engine's forward (every layer not resident read once for all rows); each row's last logits,
        on the host. ``mask`` covers the cache's tokens and ``ids``."""
        extra = {"logits_to_keep": 1} if self._keep_logits else {}
        out = self.engine(ids, attention_mask=mask, position_ids=positions, use_cache=True,
                          **{CACHE_KEYWORD: cache}, **extra)
        real = int(mask[:, -ids.shape[1]:].sum())
        with self._cond:
            self._stats["steps"] += 1
            self._stats["positions"] += ids.numel()
            self._stats["padding"] += ids.numel() - real
        return out.logits[:, -1, :].float().cpu()  # one copy to the host per forward, not one wait per row

    def _new_cache(self) -> DynamicCache:
        """An empty cache for a new batch: transformers' `DynamicCache`, its layers `QuantizedLayer`s where
        ``kv_offload.quantization`` asks (the bytes ``offload.generate`` stores, so the same answers)."""
        cache = DynamicCache(config=self.engine.module.config)
        spec = self.engine.settings.kv_offload.quantization
        if spec is not None:
            cache.layers = [QuantizedLayer(lambda keys: KVCodec(spec, keys.shape[-1], keys.dtype)) for _ in cache.layers]
        return cache

    def _leave(self, kept: list[int]) -> None:
        """Keep only the rows ``kept`` of the batch and its cache, the cache right-aligned again."""
        self._rows = [self._rows[i] for i in kept]
        if not self._rows:
            self._cache, self._mask = None, torch.zeros((0, 0), dtype=torch.long)
            return
        if len(kept) != self._mask.shape[0]:
            self._mask = keep_rows(self._cache, self._mask, kept)
        self._mask = right_align(self._cache, self._mask)

    def _send(self, sequence: _Sequence, update: Update) -> None:
        try:
            sequence.sink(update)
        except Exception:  # the client is gone: its sequence leaves at the next step
            log.warning("offload.infer.batch: request %d's sink raised; cancelling it", sequence.id, exc_info=True)
            sequence.cancelled = True

    def _cancel(self, sequence: _Sequence) -> None:
        with self._cond:
            sequence.cancelled = True
            self._cond.notify()
