"""The HTTP side of the server: OpenAI's ``POST /v1/chat/completions``, ``POST /v1/completions`` and
``GET /v1/models`` as a FastAPI app, each request checked (`offload.infer.request`), turned into
token ids (`offload.infer.prompt`) and handed to the `Batcher`, which runs it with the others.

Bad input gets HTTP 400 with OpenAI's error body naming the field (as does a request whose KV cache
cannot fit the budget even alone: ``max_tokens``); a full queue 429 with ``Retry-After``; a server
shutting down 503; a failed forward 500. ``stream: true`` answers as server-sent events; a client
that goes away mid-stream has its request cancelled (its sequence leaves the batch at the next step).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException

from offload.infer.prompt import fit_context, prompt_ids
from offload.infer.request import parse_request
from offload.infer.sampling import RequestError
from offload.infer.batch import Batcher, QueueFull, Ticket, Update
from offload.serve.openai_format import Reply, error_body, models_body, sse

__all__ = ["COMPLETION_DEFAULT_MAX_TOKENS", "create_app"]

COMPLETION_DEFAULT_MAX_TOKENS = 16
"""``/v1/completions`` without ``max_tokens`` answers this many tokens at most (OpenAI's default); a chat
answer without it may run to the end of the model's context."""


def create_app(batcher: Batcher, *, name: str, context: int | None, vocab_size: int | None) -> FastAPI:
    """The app serving ``batcher``'s engine as the model ``name``; prompts are tokenized by
    ``batcher.tokenizer``, checked against ``context`` tokens and ``vocab_size`` (None: not known)."""
    app = FastAPI(title="offload.serve", docs_url=None, redoc_url=None)
    created = int(time.time())

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, error: HTTPException) -> JSONResponse:  # 404, 405 in OpenAI's form
        return JSONResponse(error_body(str(error.detail), kind="invalid_request_error"), status_code=error.status_code)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return models_body(name, created)

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", **batcher.stats()}

    async def generate(request: Request, kind: str) -> Any:
        try:
            body = json.loads(await request.body())
        except ValueError as error:  # json's JSONDecodeError and UnicodeDecodeError
            return _error(400, f"the request body is not valid JSON: {error}")
        try:
            asked = parse_request(body, kind)
            if asked.model is not None and asked.model != name:
                raise RequestError(f"model: {asked.model!r} is not served here; this server runs {name!r} "
                                   f"(GET /v1/models)", "model")
            ids = prompt_ids(asked, batcher.tokenizer, vocab_size)
            wanted = asked.sampling.max_tokens
            if wanted is None and kind == "completion":
                wanted = COMPLETION_DEFAULT_MAX_TOKENS if context is None else min(
                    COMPLETION_DEFAULT_MAX_TOKENS, max(context - len(ids), 1))
            params = dataclasses.replace(asked.sampling, max_tokens=fit_context(len(ids), wanted, context))
        except RequestError as error:
            return _error(400, str(error), error.param)
        loop, updates = asyncio.get_running_loop(), asyncio.Queue()
        try:
            ticket = batcher.submit(ids, params, lambda update: loop.call_soon_threadsafe(updates.put_nowait, update))
        except QueueFull as error:
            return _error(429, str(error), kind="rate_limit_error", headers={"Retry-After": str(error.retry_after)})
        except RuntimeError as error:  # closed: shutting down
            return _error(503, str(error), kind="server_error")
        reply = Reply(name, chat=kind == "chat")
        if asked.stream:
            return StreamingResponse(_stream(reply, updates, ticket, asked.include_usage), media_type="text/event-stream")
        return await _whole(reply, updates, ticket)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        return await generate(request, "completion")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Any:
        return await generate(request, "chat")

    return app


async def _whole(reply: Reply, updates: asyncio.Queue, ticket: Ticket) -> JSONResponse:
    """Wait for every update of the request; the reply as one body."""
    text = []
    try:
        while True:
            update: Update = await updates.get()
            if update.error is not None:  # refused (its field named), or a step failed
                return (_error(400, update.error, update.param) if update.param
                        else _error(500, update.error, kind="server_error"))
            text.append(update.text)
            if update.last:
                return JSONResponse(reply.whole("".join(text), update.finish_reason, update.usage))
    finally:
        ticket.cancel()  # a no-op once finished; frees the sequence when this task is cancelled


async def _stream(reply: Reply, updates: asyncio.Queue, ticket: Ticket, include_usage: bool) -> AsyncIterator[str]:
    """The reply as server-sent events: a chunk per step that showed text, the finish reason, usage where
    asked, ``[DONE]``. Leaving early (the client went away) cancels the request."""
    try:
        if reply.chat:
            yield sse(reply.chunk("", role=True))
        while True:
            update: Update = await updates.get()
            if update.error is not None:
                yield sse(error_body(update.error, update.param) if update.param
                          else error_body(update.error, kind="server_error"))
                break
            if update.text:
                yield sse(reply.chunk(update.text))
            if update.last:
                yield sse(reply.chunk(None if reply.chat else "", update.finish_reason))
                if include_usage:
                    yield sse(reply.usage_chunk(update.usage))
                break
        yield sse("[DONE]")
    finally:
        ticket.cancel()


def _error(status: int, message: str, param: str | None = None, *, kind: str = "invalid_request_error",
           headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, param, kind), status_code=status, headers=headers)
