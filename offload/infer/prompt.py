"""A request's prompt as token ids (text through the tokenizer, chat messages through the checkpoint's
chat template), checked against the model's vocabulary and context length."""

from __future__ import annotations

import os
from typing import Any

import transformers

from offload.infer.request import GenerationRequest
from offload.infer.sampling import RequestError

__all__ = ["TOKENIZER_FILES", "context_length", "find_tokenizer", "fit_context", "prompt_ids", "vocab_size"]

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
"""A directory with one of these has a tokenizer."""


def find_tokenizer(directory: str) -> Any:
    """transformers' tokenizer saved in ``directory``, None where it has none (no `TOKENIZER_FILES`).
    Raises OSError or ValueError (transformers') when one is there and cannot be loaded."""
    if not any(os.path.isfile(os.path.join(directory, name)) for name in TOKENIZER_FILES):
        return None
    return transformers.AutoTokenizer.from_pretrained(directory)


def _text_config(config: Any) -> Any:
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def vocab_size(config: Any) -> int | None:
    """The model's vocabulary size from its (transformers) config; None where it names none."""
    value = getattr(_text_config(config), "vocab_size", None)
    return value if isinstance(value, int) and value > 0 else None


def context_length(config: Any) -> int | None:
    """The longest sequence (prompt and answer) the model was built for, from its config
    (``max_position_embeddings``, GPT-2's ``n_positions``, ...); None where it names none."""
    text = _text_config(config)
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length", "n_ctx"):
        value = getattr(text, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def prompt_ids(request: GenerationRequest, tokenizer: Any, vocab_size: int | None = None) -> list[int]:
    """The token ids of ``request``'s prompt: its messages through ``tokenizer.apply_chat_template``
    (with the assistant's turn opened), its text through ``tokenizer``, or its ids as given. Raises
    `RequestError` naming the field: no tokenizer or no chat template, an id outside the vocabulary,
    a prompt of no tokens."""
    if request.messages is not None:
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            raise RequestError("messages: this checkpoint's tokenizer has no chat template; send the text to "
                               "/v1/completions (a prompts file's line: \"prompt\") instead", "messages")
        try:
            ids = tokenizer.apply_chat_template(request.messages, add_generation_prompt=True, tokenize=True,
                                                return_dict=False)
        except Exception as error:  # jinja's TemplateError, the template's raise_exception(...), a bad role order
            raise RequestError(f"messages: the chat template refused them: {error}", "messages") from error
        ids, field = list(ids), "messages"
    elif isinstance(request.prompt, str):
        if tokenizer is None:
            raise RequestError("prompt: text needs a tokenizer in the checkpoint's directory; send token ids", "prompt")
        ids, field = list(tokenizer(request.prompt).input_ids), "prompt"
    else:
        ids, field = list(request.prompt or ()), "prompt"
    if not ids:
        raise RequestError(f"{field}: it makes no tokens; give at least one", field)
    if vocab_size is not None:
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise RequestError(f"{field}: token id {bad[0]} is outside the model's vocabulary of {vocab_size} "
                               f"(ids 0 to {vocab_size - 1})", field)
    return ids


def fit_context(prompt_tokens: int, max_tokens: int | None, context: int | None, *, default: int = 16) -> int:
    """``max_tokens`` checked against the context: returns it, or where it is None what the context
    leaves after the prompt (``default`` where the context is unknown). Raises `RequestError` naming
    both lengths when the prompt fills the context, or the prompt and ``max_tokens`` exceed it."""
    if context is None:
        return max_tokens if max_tokens is not None else default
    if prompt_tokens >= context:
        raise RequestError(f"prompt: {prompt_tokens} tokens, and the model's context is {context} tokens; shorten the "
                           f"prompt to at most {context - 1} tokens to leave room for an answer", "prompt")
    if max_tokens is None:
        return context - prompt_tokens
    if prompt_tokens + max_tokens > context:
        raise RequestError(f"max_tokens: the prompt's {prompt_tokens} tokens + max_tokens {max_tokens} = "
                           f"{prompt_tokens + max_tokens} exceed the model's context of {context} tokens; ask for at "
                           f"most {context - prompt_tokens}", "max_tokens")
    return max_tokens
