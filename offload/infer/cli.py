"""``python -m offload.generate``: generate from a checkpoint larger than memory, streaming its weights.

    python -m offload.generate CHECKPOINT --prompt "Once upon a time" --max-new-tokens 32 --max-in-cpu 8GiB
    python -m offload.generate CHECKPOINT --prompt-ids 1,450,4996 --batch-size 16 --config ds.json
    python -m offload.generate CHECKPOINT --prompt "Once upon a time" --max-memory 0=6GiB,cpu=16GiB
    python -m offload.generate CHECKPOINT --prompts-file prompts.jsonl --output answers.jsonl --batch-size 32
    python -m offload.generate CHECKPOINT --chat --max-in-cpu 8GiB     # a conversation: a user turn a line

Prints the plan, then the tokens as they come (the first sequence's; text where the checkpoint
directory has a tokenizer), then time to first token, seconds per token, the read speed during
decoding and that speed against the disk's (measured with a short O_DIRECT read of the checkpoint,
or --disk-gbps). With --prompts-file, every prompt of a JSON-lines file is answered into --output
(offload/infer/prompts_file.py): batched, each answer in the input's order. With --chat and no prompt,
user turns are read from stdin, a line each, and answered in the chat template with the conversation
so far (offload/infer/chat.py) until the end of input, Ctrl-C, an empty line or /exit.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

import torch

from offload.cli_errors import add_debug_flag
from offload.infer.engine import init_inference
from offload.infer.options import add_engine_options, check_engine_options, engine_overrides, parse_max_memory
from offload.infer.prompt import TOKENIZER_FILES, find_tokenizer

__all__ = ["main", "parse_max_memory"]  # parse_max_memory lives in offload/infer/options.py


class _Printer:
    """A transformers streamer (``put``/``end``) that prints the first sequence's new tokens as they
    come and records when each arrived. With a tokenizer it prints text, otherwise token ids."""

    def __init__(self, tokenizer: Any, out) -> None:
        self.tokenizer, self.out = tokenizer, out
        self.times: list[float] = []
        self.tokens: list[int] = []
        self._printed = ""
        self._prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if not self._prompt_seen:  # generate() hands the prompt over first
            self._prompt_seen = True
            return
        self.times.append(time.perf_counter())
        self.tokens.append(int(value.reshape(value.shape[0], -1)[0, -1]) if value.dim() else int(value))
        if self.tokenizer is None:
            self.out.write(f"{self.tokens[-1]} ")
        else:
            text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
            self.out.write(text[len(self._printed):])
            self._printed = text
        self.out.flush()

    def end(self) -> None:
        self.out.write("\n")
        self.out.flush()


def main(argv: list[str] | None = None, out=None) -> dict[str, Any]:
    """Run the command; print as it goes; return the figures (also printed as JSON with --json)."""
    out = out or sys.stdout
    ap = argparse.ArgumentParser(prog="python -m offload.generate", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint", help="directory with config.json and the safetensors file(s)")
    prompt = ap.add_mutually_exclusive_group()
    prompt.add_argument("--prompt", help="prompt text (needs a tokenizer in the checkpoint directory)")
    prompt.add_argument("--prompt-ids", help="prompt token ids, comma-separated (no tokenizer needed)")
    prompt.add_argument("--prompts-file", help="a JSON-lines file of prompts, each answered into --output (one "
                                               "object per line: prompt or messages, and sampling options)")
    ap.add_argument("--output", help="with --prompts-file: the JSON-lines file of answers, in the prompts' order")
    ap.add_argument("--resume", action="store_true",
                    help="with --prompts-file: continue an existing --output, skipping the lines it has")
    ap.add_argument("--max-new-tokens", type=int, default=32,
                    help="tokens to generate (with --prompts-file: a line's max_tokens by default)")
    ap.add_argument("--batch-size", type=int,
                    help="the prompt repeated this many times (default 1); with --prompts-file: prompts running "
                         "together at most (default 16)")
    add_engine_options(ap)
    ap.add_argument("--do-sample", action="store_true", help="sample instead of greedy decoding")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--top-k", type=int, default=50)
    ap.add_argument("--top-p", type=float, default=1.0,
                    help="with --do-sample: sample from the fewest tokens whose probabilities reach it (1.0: all)")
    ap.add_argument("--repetition-penalty", type=float, default=1.0,
                    help="divide the scores of tokens already in the sequence by it (1.0: off)")
    ap.add_argument("--stop", action="append", default=[],
                    help="end the answer at this text (repeatable; needs the checkpoint's tokenizer)")
    ap.add_argument("--chat", action="store_true",
                    help="--prompt is a user message: apply the checkpoint's chat template to it; without --prompt, "
                         "a conversation: user turns read from stdin, a line each, until an empty line, /exit or EOF")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true",
                    help="print the figures as one JSON line on stdout, everything else on stderr")
    add_debug_flag(ap)  # read by offload.cli_errors.run_command (python -m offload.generate)
    args = ap.parse_args(argv)
    if args.batch_size is None:
        args.batch_size = 16 if args.prompts_file is not None else 1
    if args.batch_size < 1 or args.max_new_tokens < 1:
        ap.error("--batch-size and --max-new-tokens must be at least 1")
    if (args.output is not None or args.resume) and args.prompts_file is None:
        ap.error("--output and --resume go with --prompts-file")
    check_engine_options(ap, args)
    if args.prompts_file is not None:
        return _answer_file(ap, args, out)

    if not 0 < args.top_p <= 1 or args.repetition_penalty <= 0:
        ap.error("--top-p must be in (0, 1] and --repetition-penalty above 0")
    if args.chat and args.prompt_ids is not None:
        ap.error("--chat goes with --prompt (the user message the template wraps), or alone for a conversation")
    if args.prompt is None and args.prompt_ids is None:
        if not args.chat:
            ap.error("give a prompt: --prompt TEXT, --prompt-ids IDS or --prompts-file FILE (or --chat alone for a "
                     "conversation read from stdin)")
        return _converse(ap, args, out)
    tokenizer = None
    if args.prompt is not None or args.stop:
        option = "--prompt" if args.prompt is not None else "--stop"
        tokenizer = _tokenizer(ap, args.checkpoint, option, "use --prompt-ids instead")
        if tokenizer is None:
            ap.error(f"{option} needs a tokenizer in {args.checkpoint} (none of {', '.join(TOKENIZER_FILES)})"
                     f"{'; use --prompt-ids instead' if option == '--prompt' else ''}")
    if args.prompt is not None:
        ids = _prompt_ids(ap, tokenizer, args.prompt, args.chat, args.checkpoint)
    else:
        try:
            ids = torch.tensor([[int(t) for t in args.prompt_ids.split(",") if t.strip()]])
        except ValueError:
            ap.error(f"--prompt-ids: {args.prompt_ids!r} is not a comma-separated list of integers")
    _check_prompt_ids(ap, ids, args.checkpoint)
    ids = ids.repeat(args.batch_size, 1)
    if args.json:  # stdout carries the JSON line alone (| jq); the plan and the tokens go to stderr
        out, json_out = sys.stderr, out
    else:
        json_out = out

    overrides = engine_overrides(args)
    with init_inference(args.checkpoint, args.config, **overrides) as engine:
        plan = engine.reserve(args.batch_size, ids.shape[1] + args.max_new_tokens)
        print(plan.describe(), file=out)
        print(f"ready in {engine.init_seconds:.2f} s; the resident weights load in the background, each "
              f"forward waiting only for the layers it reaches", file=out)
        print(f"generating {args.max_new_tokens} tokens for batch {args.batch_size} (the first sequence shown):", file=out)
        printer = _Printer(tokenizer, out)
        torch.manual_seed(args.seed)
        start = time.perf_counter()
        read_start = engine.io_bytes()
        engine.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.max_new_tokens, streamer=printer,
                        pad_token_id=_pad_id(engine), **_sampling(args, tokenizer, ids.shape[1]))
        end = time.perf_counter()
        read_end = engine.io_bytes()
        figures = _figures(engine, printer, start, end, read_start, read_end, args.batch_size)
    _report(figures, out)
    if args.json:
        print(json.dumps(figures), file=json_out)
    return figures


def _sampling(args: argparse.Namespace, tokenizer: Any, prompt: int) -> dict[str, Any]:
    """``generate``'s sampling keywords for the options given, a prompt of ``prompt`` tokens."""
    sampling = {"do_sample": True, "temperature": args.temperature, "top_k": args.top_k, "top_p": args.top_p} \
        if args.do_sample else {"do_sample": False}
    if args.repetition_penalty != 1.0:
        sampling["repetition_penalty"] = args.repetition_penalty
    if args.stop:
        sampling["stopping_criteria"] = _stop_texts(tokenizer, args.stop, prompt)
    return sampling


def _pad_id(engine: Any) -> int:
    pad = engine.module.generation_config.pad_token_id
    if pad is None:
        pad = engine.module.generation_config.eos_token_id
    return pad if isinstance(pad, int) else (pad[0] if pad else 0)


def _converse(ap: argparse.ArgumentParser, args: argparse.Namespace, out) -> dict[str, Any]:
    """``--chat`` without a prompt: a conversation read from stdin (offload/infer/chat.py), each answer printed as
    it comes; the figures are the conversation (``messages``) and its ``turns``."""
    from offload.infer.chat import converse
    from offload.infer.prompt import context_length

    if args.batch_size != 1:
        ap.error("--batch-size goes with --prompt or --prompts-file, not a conversation (--chat alone)")
    tokenizer = _tokenizer(ap, args.checkpoint, "--chat", "fix it to hold a conversation")
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        ap.error(f"--chat: a conversation needs a tokenizer with a chat template in {args.checkpoint} "
                 f"(tokenizer_config.json's chat_template); give --prompt TEXT (without --chat) instead")
    if args.json:  # stdout carries the JSON line alone; the plan, the prompts and the answers go to stderr
        out, json_out = sys.stderr, out
    else:
        json_out = out
    with init_inference(args.checkpoint, args.config, **engine_overrides(args)) as engine:
        print(engine.plan.describe(), file=out)
        print("a conversation: a line is a user turn; an empty line, /exit or Ctrl-D ends it", file=out, flush=True)
        context = context_length(engine.module.config)
        torch.manual_seed(args.seed)

        def answer(messages: list[dict[str, str]]) -> str:
            ids = _template_ids(tokenizer, messages)
            if context is not None and ids.shape[1] + args.max_new_tokens > context:
                raise ValueError(f"--chat: the conversation's {ids.shape[1]} tokens + --max-new-tokens "
                                 f"{args.max_new_tokens} exceed the model's context of {context} tokens; start a new "
                                 f"conversation, or lower --max-new-tokens")
            printer = _Printer(tokenizer, out)
            engine.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.max_new_tokens,
                            streamer=printer, pad_token_id=_pad_id(engine), **_sampling(args, tokenizer, ids.shape[1]))
            text = tokenizer.decode(printer.tokens, skip_special_tokens=True)
            cut = min((text.index(stop) for stop in args.stop if stop in text), default=len(text))
            return text[:cut]

        messages = converse(answer, sys.stdin, out)
    figures = {"messages": messages, "turns": sum(m["role"] == "user" for m in messages)}
    if args.json:
        print(json.dumps(figures), file=json_out)
    return figures


def _stop_texts(tokenizer: Any, stops: list[str], prompt: int) -> Any:
    """A transformers stopping criterion that ends a sequence once its answer's text (decoded from the tokens
    after the ``prompt`` first ones) holds one of ``stops``: the answer ends with the token that completed it.
    (transformers' own ``stop_strings`` needs a vocabulary it can read token by token, which word-level and
    some other tokenizers do not give.)"""
    import transformers

    class StopTexts(transformers.StoppingCriteria):
        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs: Any) -> torch.Tensor:
            texts = tokenizer.batch_decode(input_ids[:, prompt:].cpu(), skip_special_tokens=True)
            return torch.tensor([any(stop in text for stop in stops) for text in texts], device=input_ids.device)

    return transformers.StoppingCriteriaList([StopTexts()])


def _prompt_ids(ap: argparse.ArgumentParser, tokenizer: Any, prompt: str, chat: bool, checkpoint: str) -> torch.Tensor:
    """``prompt`` as token ids [1, n]: tokenized, or with ``chat`` a user message in the checkpoint's chat template
    (with the assistant's turn opened). One line (``ap.error``) for a tokenizer without a template."""
    if not chat:
        return tokenizer(prompt, return_tensors="pt").input_ids
    if not getattr(tokenizer, "chat_template", None):
        ap.error(f"--chat: the tokenizer in {checkpoint} has no chat template (tokenizer_config.json's chat_template); "
                 f"leave --chat out to send the prompt as it is")
    return _template_ids(tokenizer, [{"role": "user", "content": prompt}])


def _template_ids(tokenizer: Any, messages: list[dict[str, str]]) -> torch.Tensor:
    """``messages`` through the tokenizer's chat template, the assistant's turn opened: token ids [1, n]."""
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt")
    return ids["input_ids"] if not isinstance(ids, torch.Tensor) else ids


def _tokenizer(ap: argparse.ArgumentParser, checkpoint: str, option: str, instead: str) -> Any:
    """The checkpoint directory's tokenizer, None where it has none; one line (``ap.error``) where it cannot be
    loaded, saying what to do ``instead``."""
    try:
        return find_tokenizer(checkpoint)
    except (OSError, ValueError) as exc:
        ap.error(f"{option}: the tokenizer in {checkpoint} cannot be loaded ({exc}); {instead}")


def _answer_file(ap: argparse.ArgumentParser, args: argparse.Namespace, out) -> dict[str, Any]:
    """``--prompts-file``: every prompt answered into ``--output`` (offload/infer/prompts_file.py); the figures."""
    from offload.infer.batch import check_settings
    from offload.infer.config import InferenceConfig
    from offload.infer.prompts_file import answer_prompts_file

    if args.output is None:
        ap.error("--prompts-file needs --output FILE, where the answers go (one JSON object per line)")
    if not os.path.isfile(args.prompts_file):
        ap.error(f"--prompts-file: {args.prompts_file} is not a file")
    tokenizer = _tokenizer(ap, args.checkpoint, "--prompts-file", "fix it, or remove it and give token ids as prompts")
    defaults = {"max_tokens": args.max_new_tokens, "temperature": args.temperature if args.do_sample else 0.0,
                "top_k": args.top_k if args.do_sample else 0, "seed": args.seed}
    if args.json:  # stdout carries the JSON line alone (| jq); the plan and the progress go to stderr
        out, json_out = sys.stderr, out
    else:
        json_out = out
    overrides = engine_overrides(args)
    check_settings(InferenceConfig.from_dict(args.config, **overrides))  # before the engine's build
    with init_inference(args.checkpoint, args.config, **overrides) as engine:
        print(engine.plan.describe(), file=out)
        figures = answer_prompts_file(engine, tokenizer, args.prompts_file, args.output, max_batch=args.batch_size,
                                      defaults=defaults, resume=args.resume, out=out)
    rate = f"{figures['tokens_per_s']:.2f} tokens/s" if figures["tokens_per_s"] else "-"
    print(f"answered {figures['answered']} of {figures['prompts']} prompts into {args.output} ({figures['errors']} "
          f"refused or failed, {figures['skipped']} skipped as recorded before): {figures['tokens']} tokens in "
          f"{figures['seconds']:.2f} s, {rate}; {figures['steps']} forwards, at most {figures['largest_batch']} "
          f"sequences at once", file=out)
    if args.json:
        print(json.dumps(figures), file=json_out)
    return figures


def _check_prompt_ids(ap: argparse.ArgumentParser, ids: torch.Tensor, checkpoint: str) -> None:
    """Refuse (one line, through ``ap.error``) prompt ids outside the model's vocabulary, which the
    embedding would fail on deep inside generate()."""
    path = os.path.join(checkpoint, "config.json")
    try:
        with open(path, encoding="utf-8") as f:
            vocab = json.load(f).get("vocab_size")
    except (OSError, ValueError):
        return  # init_inference names what is wrong with the checkpoint
    if ids.numel() == 0:
        ap.error("--prompt-ids: no ids given; pass at least one, such as --prompt-ids 1")
    bad = [int(t) for t in ids.flatten() if t < 0 or (isinstance(vocab, int) and t >= vocab)]
    if bad:
        ap.error(f"--prompt-ids: {bad[0]} is outside the model's vocabulary (vocab_size {vocab} in {path}); "
                 f"use ids from 0 to {vocab - 1 if isinstance(vocab, int) else '...'}")


def _figures(engine, printer: _Printer, start: float, end: float, read_start: int, read_end: int, batch: int) -> dict:
    times = printer.times
    first = times[0] - start if times else end - start
    decode_s = (times[-1] - times[0]) if len(times) > 1 else 0.0
    steps = max(len(times) - 1, 0)
    plan = engine.plan
    per_forward = plan.read_bytes_per_forward
    return {
        "tokens": printer.tokens, "batch": batch, "init_s": engine.init_seconds, "first_token_s": first,
        "load_s": engine.wait_loaded(),
        "time_to_first_token_s": engine.init_seconds + first,
        "s_per_token": decode_s / steps if steps else None,
        "tokens_per_s": batch * steps / decode_s if decode_s else None,
        "read_bytes": read_end - read_start, "read_bytes_per_forward": per_forward,
        "read_gbps": per_forward * steps / decode_s / 1e9 if decode_s and per_forward else 0.0,
        "disk_gbps": plan.disk_bps / 1e9 if plan.disk_bps else None, "disk_source": plan.disk_source,
        "disk_s_per_forward": plan.disk_seconds_per_forward, "read_wait_s": engine.read_wait_seconds,
        "resident_bytes": plan.resident_bytes, "streamed_bytes": plan.streamed_bytes,
        "quantization": plan.quantization, "unquantized_read_bytes_per_forward": plan.unquantized_read_bytes,
        "kv_nvme_layers": len(plan.kv.nvme_layers) if plan.kv else 0, "kv_bytes_read": engine.kv_bytes_read,
        "kv_bytes_written": engine.kv_bytes_written, "kv_read_wait_s": engine.kv_wait_seconds,
        "host_to_device_bytes_per_forward": plan.host_to_device_bytes_per_forward,
        "unquantized_host_to_device_bytes_per_forward": plan.unquantized_host_to_device_bytes,
        "device_resident_bytes": plan.device.resident_bytes if plan.device else None,
        "bound_s_per_token": plan.bound_seconds(),
    }


def _report(f: dict, out) -> None:
    print(f"time to first token: {f['time_to_first_token_s']:.3f} s (ready {f['init_s']:.3f} s + first forward "
          f"{f['first_token_s']:.3f} s; every resident weight was in memory {f['load_s']:.3f} s after the start)",
          file=out)
    if f["s_per_token"] is None:
        print("seconds per token: - (one token only)", file=out)
        return
    print(f"seconds per token: {f['s_per_token']:.4f} ({f['tokens_per_s']:.2f} tokens/s over the batch of {f['batch']})",
          file=out)
    if f["device_resident_bytes"] is not None:
        bound = f["bound_s_per_token"]
        print(f"host->device: {f['host_to_device_bytes_per_forward'] / 1e9:.3f} GB per token; "
              + (f"{f['s_per_token'] / bound:.2f}x the tiers' bound of {bound:.4f} s per token (the slower link)"
                 if bound else "nothing crosses a link per token" if bound == 0
                 else "the tiers' bound is unknown (give --host-to-device-gbps)"), file=out)
    if not f["read_bytes_per_forward"]:
        print("read: nothing streamed (every weight is in memory)", file=out)
        return
    line = f"read: {f['read_gbps']:.2f} GB/s ({f['read_bytes_per_forward'] / 1e9:.3f} GB per token)"
    if f["disk_gbps"] and f["read_gbps"] > f["disk_gbps"]:  # the figure was low (a short probe, a busy disk)
        line += (f", faster than the disk's {f['disk_gbps']:.2f} GB/s ({f['disk_source']}), which understated it: "
                 f"give --disk-gbps (tensorio-bench run DIR --rw read measures it) for the plan's bound")
    elif f["disk_gbps"]:
        bound = f["disk_s_per_forward"]
        line += (f", {f['read_gbps'] / f['disk_gbps']:.0%} of the disk's {f['disk_gbps']:.2f} GB/s ({f['disk_source']}); "
                 f"{f['s_per_token'] / bound:.2f}x the disk's bound of {bound:.4f} s per token")
    print(line, file=out)
