"""One generation request read from JSON: the body of OpenAI's ``/v1/completions`` or
``/v1/chat/completions``, or a line of a prompts file. Checked field by field; every error is a
`RequestError` naming the field, as OpenAI's error body does (``param``).

Fields OpenAI has and this project does not implement are accepted at their default value only
(``n`` 1, no penalties, no log-probabilities, ...) and refused otherwise, naming the field; unknown
fields are refused, never dropped.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from offload.infer.sampling import RequestError, SamplingParams

__all__ = ["GenerationRequest", "KINDS", "parse_request"]

_SAMPLING = ("max_tokens", "temperature", "top_p", "top_k", "stop", "seed", "ignore_eos")

# OpenAI's fields with no effect here but at this value (several values: any of them).
_DEFAULT_ONLY: dict[str, tuple[Any, ...]] = {
    "n": (1, None), "best_of": (1, None), "echo": (False, None), "logprobs": (None, False),
    "top_logprobs": (None, 0), "presence_penalty": (0, 0.0, None), "frequency_penalty": (0, 0.0, None),
    "logit_bias": (None, {}), "suffix": (None, ""), "tools": (None, []), "tool_choice": (None, "none"),
    "response_format": (None, {"type": "text"}),
}

KINDS = {
    "completion": {"prompt", "model", "stream", "stream_options", *_SAMPLING, "n", "best_of", "echo", "logprobs",
                   "presence_penalty", "frequency_penalty", "logit_bias", "suffix", "user"},
    "chat": {"messages", "model", "stream", "stream_options", "max_completion_tokens", *_SAMPLING, "n", "logprobs",
             "top_logprobs", "presence_penalty", "frequency_penalty", "logit_bias", "tools", "tool_choice",
             "response_format", "user"},
    "line": {"id", "prompt", "messages", *_SAMPLING},
}
"""The fields each kind of request takes: the two endpoints' bodies and a prompts file's lines."""

_ROLES = ("system", "developer", "user", "assistant", "tool")


@dataclass(kw_only=True, slots=True)
class GenerationRequest:
    """A checked request: a prompt (text or token ids) or chat messages, and how to answer it."""

    sampling: SamplingParams
    prompt: str | list[int] | None = None
    messages: list[dict[str, str]] | None = None
    """Chat messages, each ``{"role": ..., "content": text}`` (content parts joined into one text)."""
    stream: bool = False
    include_usage: bool = False
    """``stream_options.include_usage``: a last chunk with the token counts."""
    model: str | None = None
    id: Any = None
    """A prompts file's line's own ``id``, written back with its answer."""


def parse_request(body: Any, kind: str) -> GenerationRequest:
    """Check ``body`` (parsed JSON) as a request of ``kind``: "completion" (``prompt``), "chat"
    (``messages``) or "line" (a prompts file's line: ``prompt`` or ``messages``, and an ``id``).
    Raises `RequestError` naming the field that is missing, unknown or not allowed."""
    if kind not in KINDS:
        raise ValueError(f"kind: {kind!r} is not one of {', '.join(KINDS)}")
    if not isinstance(body, Mapping):
        raise RequestError(f"the request must be a JSON object, got {type(body).__name__}")
    allowed = KINDS[kind]
    for key in body:
        if key not in allowed:
            raise RequestError(f"{key}: unknown field; the fields taken here are {', '.join(sorted(allowed))}", key)
    for key, values in _DEFAULT_ONLY.items():
        if key in body and not any(body[key] == v and isinstance(body[key], bool) == isinstance(v, bool)
                                   for v in values):
            raise RequestError(f"{key}: {body[key]!r} is not supported by this server; leave it out", key)

    sampling = {key: body[key] for key in _SAMPLING if key in body and body[key] is not None}
    if "max_completion_tokens" in body and body["max_completion_tokens"] is not None:
        if "max_tokens" in sampling and sampling["max_tokens"] != body["max_completion_tokens"]:
            raise RequestError("max_completion_tokens: differs from max_tokens; give one of the two",
                               "max_completion_tokens")
        sampling["max_tokens"] = body["max_completion_tokens"]
    request = GenerationRequest(sampling=SamplingParams(**sampling), id=body.get("id"))

    if kind == "chat" or (kind == "line" and "messages" in body):
        if kind == "line" and "prompt" in body:
            raise RequestError("prompt: give either prompt or messages, not both", "prompt")
        request.messages = _messages(body)
    else:
        request.prompt = _prompt(body)
    if kind != "line":
        request.model = _optional_str(body, "model")
        request.stream = _bool(body, "stream")
        options = body.get("stream_options")
        if options is not None:
            if not isinstance(options, Mapping) or set(options) - {"include_usage"}:
                raise RequestError(f"stream_options: expected {{\"include_usage\": true|false}}, got {options!r}",
                                   "stream_options")
            if not request.stream:
                raise RequestError("stream_options: only with stream true", "stream_options")
            request.include_usage = _bool(options, "include_usage", "stream_options.include_usage")
    return request


def _prompt(body: Mapping) -> str | list[int]:
    if "prompt" not in body:
        raise RequestError("prompt: missing; give the text to continue (or a list of token ids)", "prompt")
    prompt = body["prompt"]
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return list(prompt)
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        return _prompt({"prompt": prompt[0]})  # OpenAI's batch of one
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        raise RequestError(f"prompt: a list of {len(prompt)} prompts; send one prompt per request (requests sent "
                           f"together share each read of the weights)", "prompt")
    raise RequestError(f"prompt: expected a string or a non-empty list of token ids, got {prompt!r}", "prompt")


def _messages(body: Mapping) -> list[dict[str, str]]:
    messages = body.get("messages")
    if messages is None:
        raise RequestError("messages: missing; give a list of {\"role\": ..., \"content\": ...}", "messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError(f"messages: expected a non-empty list, got {messages!r}", "messages")
    checked = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, Mapping):
            raise RequestError(f"{where}: expected an object with role and content, got {message!r}", where)
        role = message.get("role")
        if role not in _ROLES:
            raise RequestError(f"{where}.role: {role!r} is not one of {', '.join(_ROLES)}", f"{where}.role")
        checked.append({**{k: v for k, v in message.items() if k not in ("role", "content")},
                        "role": role, "content": _content(message.get("content"), f"{where}.content")})
    return checked


def _content(content: Any, where: str) -> str:
    """A message's content as text: a string, or OpenAI's list of ``{"type": "text", "text": ...}`` parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, Mapping) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise RequestError(f"{where}: expected a string or a list of {{\"type\": \"text\", \"text\": ...}} parts "
                       f"(text only), got {content!r}", where)


def _optional_str(body: Mapping, key: str) -> str | None:
    value = body.get(key)
    if value is not None and not isinstance(value, str):
        raise RequestError(f"{key}: expected a string, got {value!r}", key)
    return value


def _bool(body: Mapping, key: str, name: str | None = None) -> bool:
    value = body.get(key, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise RequestError(f"{name or key}: expected true or false, got {value!r}", name or key)
    return value
