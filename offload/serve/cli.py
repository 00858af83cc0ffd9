"""``python -m offload.serve``: an OpenAI-compatible server for a checkpoint larger than memory.

    python -m offload.serve CHECKPOINT --max-in-cpu 8GiB
    python -m offload.serve CHECKPOINT --port 8001 --max-memory 0=6GiB,cpu=16GiB --quantize int8

Takes the engine's options of ``python -m offload.generate`` (budgets, quantization, the KV cache's
place, the device; see docs/inference.md), binds HOST:PORT first (a port in use fails at once, not after
the engine's build), builds the engine, prints the plan and ``serving MODEL on http://HOST:PORT``, and
answers POST /v1/chat/completions, POST /v1/completions and GET /v1/models until SIGTERM or Ctrl-C:
then it stops accepting, lets the requests running finish, frees the engine and exits 0. docs/serving.md.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import sys
import threading
from collections.abc import Iterator
from typing import Any

from offload.cli_errors import add_debug_flag
from offload.infer.batch import Batcher, check_settings
from offload.infer.config import InferenceConfig
from offload.infer.options import add_engine_options, check_engine_options, engine_overrides
from offload.infer.prompt import TOKENIZER_FILES, context_length, find_tokenizer, vocab_size

__all__ = ["INSTALL_HINT", "main"]

INSTALL_HINT = ("python -m offload.serve needs FastAPI and uvicorn, which are not installed: "
                "pip install 'tensorio-offload[serve]' (or: pip install fastapi uvicorn)")
"""The one line printed where FastAPI or uvicorn is missing."""


def main(argv: list[str] | None = None, out=None) -> int:
    """Run the server until a signal stops it; return 0. Raises ValueError / OSError (one line through
    `offload.cli_errors.run_command`) for a bad option, a checkpoint that cannot be served or a port in use."""
    out = out or sys.stdout
    ap = argparse.ArgumentParser(prog="python -m offload.serve", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint", help="directory with config.json, the safetensors file(s) and a tokenizer")
    ap.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    ap.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000; 0: any free one)")
    ap.add_argument("--model-name", help="the model's name in the API (default: the checkpoint directory's name)")
    ap.add_argument("--tokenizer", help="directory of the tokenizer (default: the checkpoint directory)")
    ap.add_argument("--max-batch", type=int, default=32,
                    help="sequences running together at most (default 32; fewer where the budget cannot hold their "
                         "KV cache); the others wait")
    ap.add_argument("--max-queue", type=int, default=256,
                    help="requests waiting at most (default 256); beyond it the server answers 429 with Retry-After")
    add_engine_options(ap)
    add_debug_flag(ap)  # read by offload.cli_errors.run_command (python -m offload.serve)
    args = ap.parse_args(argv)
    check_engine_options(ap, args)
    if args.max_batch < 1 or args.max_queue < 1:
        ap.error("--max-batch and --max-queue must be at least 1")
    try:
        import uvicorn

        from offload.serve.app import create_app  # FastAPI's
    except ModuleNotFoundError as missing:
        if missing.name not in ("fastapi", "starlette", "uvicorn"):
            raise
        raise SystemExit(INSTALL_HINT) from None
    from offload.infer.engine import init_inference

    overrides = engine_overrides(args)
    check_settings(InferenceConfig.from_dict(args.config, **overrides))  # before the engine's minutes of build
    tokenizer = _tokenizer(args.tokenizer or args.checkpoint)
    name = args.model_name or os.path.basename(os.path.normpath(args.checkpoint))
    listener = _bind(args.host, args.port)
    with listener, init_inference(args.checkpoint, args.config, **overrides) as engine:
        print(engine.plan.describe(), file=out)
        host, port = listener.getsockname()[:2]
        with Batcher(engine, tokenizer, max_batch=args.max_batch, max_queue=args.max_queue) as batcher:
            app = create_app(batcher, name=name, context=context_length(engine.module.config),
                             vocab_size=vocab_size(engine.module.config))
            print(f"ready in {engine.init_seconds:.2f} s; serving {name} on http://{_url_host(host)}:{port} "
                  f"(POST /v1/chat/completions, POST /v1/completions, GET /v1/models); Ctrl-C stops", file=out,
                  flush=True)
            server = uvicorn.Server(uvicorn.Config(app, timeout_graceful_shutdown=30))
            with _signals_noted():
                server.run(sockets=[listener])
    print("stopped", file=out, flush=True)
    return 0


@contextlib.contextmanager
def _signals_noted() -> Iterator[None]:
    """SIGINT and SIGTERM only noted while uvicorn runs: it handles them itself (stops accepting, lets the
    requests running finish), then raises them again under the handlers it found, here these, so that
    the command goes on to free the engine and exit 0 rather than die of the signal."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _tokenizer(directory: str) -> Any:
    """The tokenizer the server needs (prompts are text, answers are text). Raises ValueError naming the
    directory when there is none, or it cannot be loaded."""
    try:
        tokenizer = find_tokenizer(directory)
    except (OSError, ValueError) as error:
        raise ValueError(f"--tokenizer: the tokenizer in {directory} cannot be loaded ({error})") from error
    if tokenizer is None:
        raise ValueError(f"--tokenizer: {directory} has no tokenizer (none of {', '.join(TOKENIZER_FILES)}); the server "
                         f"reads and writes text: save the model's tokenizer there or pass --tokenizer DIR")
    return tokenizer


def _bind(host: str, port: int) -> socket.socket:
    """A listening socket on ``host``:``port``, bound before the engine's build so that a port in use fails
    first. Raises OSError naming the address."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((host, port))
        listener.listen(128)
    except OSError as error:
        listener.close()
        raise OSError(error.errno, f"--host {host} --port {port}: cannot listen there ({error.strerror}); pick "
                                   f"another port (0: any free one)") from None
    listener.set_inheritable(True)
    return listener


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host
