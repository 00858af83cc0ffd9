"""One forward's activations as transformers allocates them (the estimate the plan reserves beside the
weights and the KV cache), and the chunk a long prompt is prefilled in so that they fit."""

from __future__ import annotations

import logging
from typing import Any, Callable

from torch import nn
from torch.utils.hooks import RemovableHandle

import torch

from offload.infer.plan.units import format_bytes

__all__ = ["AUTO_ACTIVATION_TOKENS", "AUTO_PROCESS_MARGIN_BYTES", "RELEASE_PROMPT_TOKENS", "activation_bytes", "before_decode",
           "head_dim", "largest_of_layers", "prefill_chunk"]

AUTO_ACTIVATION_TOKENS = 2048
"""The prompt "auto" keeps activation room for beside its budget: one sequence of this many tokens (or the
model's context, where shorter). Longer prompts are prefilled in chunks within that room."""

AUTO_PROCESS_MARGIN_BYTES = 64 << 20
"""The rest of "auto"'s margin for generation, beside the activations it reserves by estimate: allocator
slack, generate's small tensors, thread stacks (the 512 MiB of `offload.device.AUTO_MARGIN_BYTES`, which
covers activations nobody estimated, would alone fill a small container)."""

log = logging.getLogger("offload.infer")

_SMALLEST_CHUNK = 16
"""Tokens of the smallest prefill chunk: below it a prompt is prefilled whole."""


def largest_of_layers(text: Any, name: str) -> Any:
    """``text.name`` (None where absent); for a setting the config keeps per layer (Gemma 4's ``head_dim``,
    which the config refuses to give as one value), the largest of the layers': what an upper estimate needs."""
    values = [getattr(layer, name, None) for layer in getattr(text, "per_layer_config", None) or ()]
    values = [value for value in values if value is not None]
    return max(values) if values else getattr(text, name, None)


def head_dim(text: Any) -> int:
    """The attention heads' width (the largest of the layers' where they differ)."""
    return largest_of_layers(text, "head_dim") or text.hidden_size // text.num_attention_heads


def activation_bytes(text: Any, attention: str | None, dtype: torch.dtype, batch: int, tokens: int, *,
                     logits: int | None = None, context: int | None = None) -> int:
    """An upper estimate of one forward's activations over ``tokens`` tokens of a model whose text config is
    ``text``, computing in ``dtype`` with attention implementation ``attention``: a decoder layer's hidden
    states and MLP intermediates in ``dtype``; the attention scores of every head (their product, fp32
    softmax and cast back) only where the implementation materialises them ("eager"), else (SDPA, flash
    attention: computed in tiles, never all at once) the mask where transformers materialises it (a padded
    batch, a chunk of a prompt: booleans, and SDPA's copy in ``dtype``); with grouped-query attention, the
    keys and values repeated to every head over the whole context where transformers repeats them (eager
    always, SDPA with a mask or heads wider than 256: its fused GQA takes neither); and fp32 logits for
    ``logits`` positions of each sequence (None: every position, as a forward returns them; ``generate``
    keeps the last one's). No copy of the output head's weight: the engine hands the head a row-major input
    (`offload.infer.build.contiguous_head_input`). ``context``: the tokens attended to (the cache's and
    these; default ``tokens``), for a chunk of a prompt. Checked against the peak of live tensors in
    tests/test_infer_activations.py and `benchmarks.infer_long_prompt`."""
    hidden, heads = text.hidden_size, largest_of_layers(text, "num_attention_heads")
    kv_heads = largest_of_layers(text, "num_key_value_heads") or heads
    width = head_dim(text)
    inner = largest_of_layers(text, "intermediate_size") or getattr(text, "n_inner", None) or 4 * hidden
    itemsize = torch.empty((), dtype=dtype).element_size()
    context = tokens if context is None else max(context, tokens)
    # per token: every head's scores (in the compute dtype, their fp32 softmax and its cast back); or, with
    # SDPA, the mask's row where transformers materialises it: as booleans and as SDPA converts them to the
    # compute dtype (a padded batch, a chunk attending to more tokens than its own; one sequence attending
    # to itself alone goes by SDPA's is_causal, and one decoding a token attends to every position: no mask)
    masked = batch > 1 or 1 < tokens < context
    eager = attention in (None, "eager")
    scores = heads * context * (4 + 3 * itemsize) if eager else (context * (1 + itemsize) if masked else 0)
    repeats = kv_heads < heads and (eager or (attention == "sdpa" and (masked or width > 256)))
    repeated = 2 * context * heads * width * itemsize if repeats else 0
    positions = tokens if logits is None else min(logits, tokens)
    return batch * (tokens * ((6 * hidden + 3 * inner) * itemsize + scores) + repeated
                    + 4 * positions * text.vocab_size)


def prefill_chunk(estimate: Callable[..., int], prompt: int, limit: int) -> int | None:
    """The chunk a prompt of ``prompt`` tokens is prefilled in (transformers' ``prefill_chunk_size``), or None
    when one sequence's prefill fits ``limit`` bytes of activations whole: the largest halving of the prompt
    whose activations (``estimate(batch, tokens, logits=, context=)``, a chunk attending to the prompt) fit,
    at least 16 tokens. Each chunk is a forward, so streamed layers are read once per chunk: chunks are as
    large as the limit allows."""
    if prompt <= _SMALLEST_CHUNK or estimate(1, prompt, logits=1, context=prompt) <= limit:
        return None
    chunk = prompt
    while chunk > _SMALLEST_CHUNK and estimate(1, chunk, logits=1, context=prompt) > limit:
        chunk = -(-chunk // 2)
    log.info("offload.infer: prefilling the %d-token prompt in chunks of %d tokens (one sequence's activations "
             "would exceed %s: block_schedule.max_activation_bytes, or the room \"auto\" kept; each chunk reads "
             "the streamed layers once)",
             prompt, chunk, format_bytes(limit))
    return chunk


RELEASE_PROMPT_TOKENS = 64
"""Prompts from this many tokens on have their prefill's activation reserve freed for the decode
(`before_decode`); a shorter one reserves about as much as a few decode steps, and re-placing weights for it
at every generate call would move units to the device and off again for little."""


def before_decode(module: nn.Module, prompt: int, release: Callable[[], Any]) -> RemovableHandle | None:
    """For a prompt of ``prompt`` tokens (at least `RELEASE_PROMPT_TOKENS`): call ``release`` once, just
    before ``module``'s first forward over one token per sequence, ``generate``'s first decode step once the
    prefill (whole or in chunks) is done; the plan is then re-made for one token's activations, so that the
    prefill's reserve holds weights during the decode. The handle removes the hook (at the end of the
    generate call); None for a shorter prompt."""
    if prompt < RELEASE_PROMPT_TOKENS:
        return None
    done = False

    def hook(_: nn.Module, args: tuple, kwargs: dict) -> None:
        nonlocal done
        ids = args[0] if args else kwargs.get("input_ids")
        ids = ids if ids is not None else kwargs.get("inputs_embeds")
        if not done and ids is not None and ids.shape[1] == 1:
            done = True
            release()

    return module.register_forward_pre_hook(hook, with_kwargs=True)
