"""The JSON bodies of OpenAI's API, as its clients read them: completions and chat completions (whole,
and as the chunks of a stream), the models list, and errors. Plain dicts; no web framework here."""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

__all__ = ["Reply", "error_body", "models_body", "sse"]


def error_body(message: str, param: str | None = None, kind: str = "invalid_request_error",
               code: str | None = None) -> dict[str, Any]:
    """OpenAI's error body: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def models_body(name: str, created: int) -> dict[str, Any]:
    """``GET /v1/models``: the one model this server runs."""
    return {"object": "list", "data": [{"id": name, "object": "model", "created": created, "owned_by": "offload"}]}


def sse(payload: dict[str, Any] | str) -> str:
    """One server-sent event: ``data: <json>`` (or the text as it is, as ``[DONE]``) and a blank line."""
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


class Reply:
    """The bodies of one request's reply: ``chat`` (chat.completion) or not (text_completion), under
    one id and creation time, for ``model``."""

    def __init__(self, model: str, chat: bool) -> None:
        self.model, self.chat = model, chat
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())

    def whole(self, text: str, finish_reason: str, usage: dict[str, int]) -> dict[str, Any]:
        """The reply without streaming."""
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish_reason, "logprobs": None}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        return self._body("chat.completion" if self.chat else "text_completion", [choice], usage=usage)

    def chunk(self, text: str | None, finish_reason: str | None = None, *, role: bool = False) -> dict[str, Any]:
        """A chunk of a stream: ``text`` added (None: no content, as the chat stream's last chunk), and
        ``finish_reason`` on the last one; ``role``: the chat stream's first chunk, the assistant's role."""
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish_reason, "logprobs": None}
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant"} if role else {}
            if text is not None:
                delta["content"] = text
            choice["delta"] = delta
        else:
            choice["text"] = text or ""
        return self._body("chat.completion.chunk" if self.chat else "text_completion", [choice])

    def usage_chunk(self, usage: dict[str, int]) -> dict[str, Any]:
        """The stream's last chunk with ``stream_options.include_usage``: no choices, the token counts."""
        return self._body("chat.completion.chunk" if self.chat else "text_completion", [], usage=usage)

    def _body(self, kind: str, choices: list[dict[str, Any]], **more: Any) -> dict[str, Any]:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices,
                **more}
