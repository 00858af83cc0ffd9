"""``python -m offload.generate CHECKPOINT --prompts-file prompts.jsonl --output answers.jsonl``: every
prompt of a file answered, in batches that share each read of the weights.

Each line of the prompts file is a JSON object: ``prompt`` (text, or token ids) or ``messages`` (chat
messages, through the tokenizer's chat template), and optionally ``id`` (written back with the answer)
and the sampling options of `offload.infer.sampling.SamplingParams` (``max_tokens``, ``temperature``,
``top_p``, ``top_k``, ``stop``, ``seed``, ``ignore_eos``); the command's options are the defaults. The
prompts run through one `Batcher`, shortest first (sequences of similar length join together, so the
batch carries little padding), at most ``--batch-size`` at once, a finished one's place taken by the
next at once; the prompts that join in one step are prefilled in forwards by length, whose padding is
at most `MAX_PADDING` of their real tokens (a compute-bound prefill computes no more than that for
nothing; each further forward reads the streamed weights once more). The output has one JSON object
per line of input that had one, in the input's order, written as soon as the answers before it are:
``{"line", "id", "text", "token_ids", "finish_reason", "usage"}``, or ``{"line", "error"}`` for a line
that is not a valid request (the others are answered). With ``resume`` an existing output is continued:
the lines it has a record for are skipped.
"""

from __future__ import annotations

import dataclasses
import json
import os
import queue
import time
from dataclasses import dataclass
from typing import Any, TextIO

from tqdm import tqdm

from offload.infer.batch import Batcher, Update
from offload.infer.prompt import context_length, fit_context, prompt_ids, vocab_size
from offload.infer.request import parse_request
from offload.infer.sampling import RequestError, SamplingParams

__all__ = ["MAX_PADDING", "PromptLine", "answer_prompts_file", "read_prompts"]

MAX_PADDING = 0.25
"""A step's prefill padding at most this fraction of its prompts' tokens (`Batcher`'s ``max_padding``): 64
prompts of 4 to 32 tokens take 4 forwards of 1,326 positions, not one of 2,048 (the real ones: 1,124)."""


@dataclass(frozen=True, slots=True)
class PromptLine:
    """One valid line of a prompts file: its number (from 1), its ``id``, its prompt's token ids and
    its sampling options (``max_tokens`` resolved against the context)."""

    number: int
    id: Any
    prompt: list[int]
    params: SamplingParams


def read_prompts(path: str | os.PathLike, tokenizer: Any, *, defaults: dict[str, Any], context: int | None,
                 vocab: int | None, skip: frozenset[int] = frozenset()) -> tuple[list[PromptLine], dict[int, str]]:
    """The prompts of the file at ``path``: (the valid lines, {line number: what is wrong} for the others).
    ``defaults`` are sampling options a line's own override (a line's ``seed`` defaults to ``defaults["seed"]``
    plus its line number); blank lines and the numbers in ``skip`` are left out. Raises OSError naming the
    file where it cannot be read."""
    lines, errors = [], {}
    with open(path, encoding="utf-8") as f:
        for number, text in enumerate(f, start=1):
            if not text.strip() or number in skip:
                continue
            try:
                body = json.loads(text)
            except ValueError as error:
                errors[number] = f"line {number}: not valid JSON ({error})"
                continue
            if not isinstance(body, dict):
                errors[number] = f"line {number}: expected a JSON object, got {type(body).__name__}"
                continue
            seeded = {**defaults, "seed": defaults["seed"] + number} if defaults.get("seed") is not None else defaults
            try:
                request = parse_request({**seeded, **body}, "line")
                ids = prompt_ids(request, tokenizer, vocab)
                params = dataclasses.replace(request.sampling,
                                             max_tokens=fit_context(len(ids), request.sampling.max_tokens, context))
            except RequestError as error:
                errors[number] = f"line {number}: {error}"
                continue
            lines.append(PromptLine(number, request.id, ids, params))
    return lines, errors


def answer_prompts_file(engine: Any, tokenizer: Any, prompts: str | os.PathLike, output: str | os.PathLike, *,
                        max_batch: int, defaults: dict[str, Any], resume: bool = False,
                        out: TextIO | None = None) -> dict[str, Any]:
    """Answer every prompt of the file ``prompts`` with ``engine`` into the file ``output`` (see the module
    docstring); ``defaults`` as `read_prompts` takes them; a progress bar on ``out``. Returns the figures:
    ``prompts`` (lines with a record this time), ``answered``, ``errors`` (lines refused or failed),
    ``skipped`` (by ``resume``), ``tokens``, ``seconds``, ``tokens_per_s``, ``read_bytes`` and the batcher's
    ``steps`` (forwards), ``largest_batch``, ``positions`` (computed by the forwards) and ``padding`` (of them).

    Raises FileExistsError where ``output`` exists and ``resume`` is False, OSError naming a file that
    cannot be read or written, ValueError for engine settings a `Batcher` cannot honour."""
    done = _answered(output) if resume else frozenset()
    if not resume and os.path.exists(output):
        raise FileExistsError(f"--output {output}: exists already; remove it, or pass --resume to answer only the "
                              f"lines it does not answer yet")
    lines, errors = read_prompts(prompts, tokenizer, defaults=defaults, context=context_length(engine.module.config),
                                 vocab=vocab_size(engine.module.config), skip=done)
    order = sorted([*(line.number for line in lines), *errors])
    finished: dict[int, dict[str, Any]] = {n: {"line": n, "error": message} for n, message in errors.items()}
    updates: queue.Queue[tuple[PromptLine, Update]] = queue.Queue()
    answers: dict[int, tuple[list[str], list[int]]] = {line.number: ([], []) for line in lines}
    read_start, start, tokens, failed = engine.io_bytes(), time.perf_counter(), 0, 0
    with open(output, "a" if resume else "w", encoding="utf-8") as sink, \
            Batcher(engine, tokenizer, max_batch=max_batch, max_queue=max(len(lines), 1),
                    max_padding=MAX_PADDING, start=False) as batcher, \
            tqdm(total=len(lines), file=out, unit="prompt", desc="answering", dynamic_ncols=True) as bar:
        for line in sorted(lines, key=lambda line: len(line.prompt)):  # shortest first: little padding
            batcher.submit(line.prompt, line.params, lambda update, line=line: updates.put((line, update)))
        batcher.start()
        written = _write_ready(sink, order, finished, 0)
        while answers:  # 1. each update as it comes; 2. a finished answer written once those before it are
            line, update = updates.get()
            text, ids = answers[line.number]
            text.append(update.text)
            if update.token is not None:
                ids.append(update.token)
            if not update.last:
                continue
            del answers[line.number]
            finished[line.number] = _record(line, update, "".join(text), ids, tokenizer)
            failed += update.error is not None
            tokens += len(ids)
            bar.update(1)
            bar.set_postfix_str(f"{tokens / max(time.perf_counter() - start, 1e-9):.1f} tokens/s")
            written = _write_ready(sink, order, finished, written)
        stats = batcher.stats()
    seconds = time.perf_counter() - start
    for message in errors.values():
        print(message, file=out)
    return {"prompts": len(order), "answered": len(lines) - failed, "errors": len(errors) + failed, "skipped": len(done),
            "tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds if seconds else None,
            "read_bytes": engine.io_bytes() - read_start, "steps": stats["steps"],
            "largest_batch": stats["largest_batch"], "positions": stats["positions"], "padding": stats["padding"]}


def _record(line: PromptLine, update: Update, text: str, ids: list[int], tokenizer: Any) -> dict[str, Any]:
    """The output's object for ``line``, from its text, its token ids and its last update."""
    if update.error is not None:
        return {"line": line.number, "id": line.id, "error": update.error}
    return {"line": line.number, "id": line.id, "text": text if tokenizer is not None else None, "token_ids": ids,
            "finish_reason": update.finish_reason, "usage": update.usage}


def _write_ready(sink: TextIO, order: list[int], finished: dict[int, dict[str, Any]], written: int) -> int:
    """Write the finished records that follow the ``written`` first of ``order``; return how many are written."""
    while written < len(order) and order[written] in finished:
        sink.write(json.dumps(finished.pop(order[written])) + "\n")
        written += 1
    sink.flush()
    return written


def _answered(output: str | os.PathLike) -> frozenset[int]:
    """The line numbers an existing output has a record for (an answer or an error); a last line cut short (the
    command was stopped while writing it) is removed from the file. Raises ValueError for a line that is not JSON."""
    if not os.path.exists(output):
        return frozenset()
    with open(output, "rb") as f:
        data = f.read()
    keep = data[:data.rfind(b"\n") + 1]
    if len(keep) != len(data):
        with open(output, "r+b") as f:
            f.truncate(len(keep))
    numbers = set()
    for number, raw in enumerate(keep.splitlines(), start=1):
        try:
            record = json.loads(raw)
        except ValueError:
            raise ValueError(f"--output {output}: line {number} is not JSON, so it cannot be resumed; remove it") from None
        if isinstance(record, dict) and isinstance(record.get("line"), int):
            numbers.add(record["line"])
    return frozenset(numbers)
