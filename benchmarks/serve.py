"""Benchmark: ``python -m offload.serve`` on a streamed Llama: one client, concurrent clients, a prompts file.

    python -m benchmarks.serve --dir /work/bench-serve          # the documented run (1.73 GB bf16, 576 MB budget)
    python -m benchmarks.serve --dir /work/bench-serve --offline-only   # (c) alone: no server
    python -m benchmarks.serve --dir /tmp/x --scale 0.025 --layers 2 --budget 200KiB --clients 2 \\
        --prompts 4 --new-tokens 3 --repeats 1                  # tiny, as tests/test_serve_bench.py runs it

1. Writes, once, a random-weight bf16 Llama (benchmarks/infer_stream.py's `write_checkpoint`: ``--scale``
   of the 28.6 GB model's hidden, intermediate and vocab sizes, ``--layers`` layers) and a word-level
   tokenizer over its vocabulary ("w3" ... "wN": every token shows text), so the server can run it.
2. Starts ``python -m offload.serve`` in a child process at ``--budget`` (``--max-in-cpu``; by default a
   third of the checkpoint, so that most decoder layers stream from NVMe every forward) and times (d)
   from the start to the first answered request (a 1-token completion sent at once: the server binds
   its port before the engine's build), beside the engine's build ("ready in") and that first forward.
3. (a) One client alone asks ``--new-tokens`` greedy tokens, streamed: seconds per token (between its
   first and last token; the median of ``--repeats`` requests), beside ``python -m offload.generate``'s
   seconds per token on the same checkpoint, budget and prompt (a child process each, median).
4. (b) ``--clients`` clients at once, each asking ``--new-tokens`` tokens of its own prompt: their tokens
   over the wall time from the first request sent to the last token, against one client alone by the
   same measure (median of ``--repeats`` rounds each). Target: >= 10x.
5. (c) Offline: ``--prompts`` prompts of lengths spread over ``--prompt-lengths`` from a file
   (``offload.generate --prompts-file``, ``--batch-size`` the prompt count) against ``offload.generate
   --batch-size N`` of one prompt of their mean length: tokens over the whole run's seconds (prefill
   included) each. Target: >= 0.8x.
6. Stops the server with SIGTERM (it must exit 0) and prints the table and the targets.

The figures are rough on a shared machine (other processes compete for the cores and the disk).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks._common import REPO, free_port, run_child
from benchmarks.infer_stream import Spec, write_checkpoint
from tensorio import parse_size


def write_tokenizer(directory: Path, vocab: int) -> None:
    """A word-level tokenizer over "<pad>", "<s>", "</s>", "w3" ... "w{vocab-1}" saved into ``directory`` (no download)."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = {"<pad>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, vocab)}}
    core = Tokenizer(models.WordLevel(words, unk_token="<pad>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    transformers.PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<pad>", pad_token="<pad>", bos_token="<s>",
                                         eos_token="</s>").save_pretrained(directory)


def prompt_ids(index: int, length: int, vocab: int) -> list[int]:
    """A deterministic prompt of ``length`` token ids (none special) for client or line ``index``."""
    return [3 + (index * 7919 + i * 104729) % (vocab - 3) for i in range(length)]


# ---- the server, and its clients ------------------------------------------------------------------------


class Server:
    """``python -m offload.serve`` in a child process; each line it prints kept with the time it came."""

    def __init__(self, checkpoint: Path, port: int, options: list[str]) -> None:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
        self.port, self.lines = port, []
        self.start = time.perf_counter()
        self.process = subprocess.Popen([sys.executable, "-m", "offload.serve", str(checkpoint), "--port", str(port),
                                         "--model-name", "bench", *options], stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT, text=True, env=env)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.process.stdout:
            self.lines.append((time.perf_counter(), line.rstrip("\n")))

    def line(self, prefix: str) -> tuple[float, str] | None:
        """The first printed line that starts with ``prefix``, and when it came."""
        return next(((t, text) for t, text in self.lines if text.startswith(prefix)), None)

    def stop(self) -> int:
        """SIGTERM; the exit status (the server must exit 0)."""
        self.process.send_signal(signal.SIGTERM)
        if self.process.poll() is not None:
            return self.process.returncode
        code = self.process.wait(timeout=120)
        self._reader.join(timeout=10)
        return code


def complete(port: int, prompt: list[int], tokens: int, *, timeout: float = 3600) -> dict[str, Any]:
    """One streamed greedy ``/v1/completions`` request: when it was sent, when each token's text came, usage."""
    body = json.dumps({"model": "bench", "prompt": prompt, "max_tokens": tokens, "temperature": 0, "stream": True,
                       "ignore_eos": True, "stream_options": {"include_usage": True}})
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    sent = time.perf_counter()
    try:
        connection.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        response = connection.getresponse()
        if response.status != 200:
            raise RuntimeError(f"the server answered {response.status}: {response.read()[:500]!r}")
        times, usage = [], None
        for raw in response:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"the server's stream failed: {chunk['error']}")
            if chunk.get("usage"):
                usage = chunk["usage"]
            if any(choice.get("text") for choice in chunk.get("choices", ())):
                times.append(time.perf_counter())
    finally:
        connection.close()
    return {"sent": sent, "times": times, "usage": usage}


def first_answer(server: Server, prompt: list[int], deadline: float) -> float:
    """Send a 1-token request as soon as ``server``'s port takes connections; when its answer came. Raises
    RuntimeError with the server's output where it exits first."""
    while True:
        try:
            complete(server.port, prompt, 1)
            return time.perf_counter()
        except (ConnectionRefusedError, ConnectionResetError, http.client.RemoteDisconnected):
            if server.process.poll() is not None:
                server._reader.join(timeout=10)
                raise RuntimeError(f"offload.serve exited with status {server.process.returncode} before answering:\n"
                                   + "\n".join(text for _, text in server.lines[-20:])) from None
            if time.perf_counter() > deadline:
                raise
            time.sleep(0.05)


def one_token_run(checkpoint: Path, prompt: list[int], options: list[str]) -> float:
    """Seconds from starting ``python -m offload.generate`` for one token of ``prompt`` to its exit: the same
    imports, engine build and first forward as the server's first answer, without the server."""
    began = time.perf_counter()
    run_child("offload.generate", [str(checkpoint), "--prompt-ids", ",".join(map(str, prompt)), "--max-new-tokens", "1",
                                   "--json", *options])
    return time.perf_counter() - began


def s_per_token(result: dict[str, Any]) -> float | None:
    """Seconds between a streamed answer's first and last token, per token."""
    times = result["times"]
    return (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else None


def together(port: int, prompts: list[list[int]], tokens: int) -> dict[str, Any]:
    """Every prompt sent at once from its own thread: tokens, wall seconds (first sent to last token), tokens/s."""
    results: list[dict[str, Any] | BaseException] = [None] * len(prompts)
    gate = threading.Barrier(len(prompts))

    def client(i: int) -> None:
        gate.wait()
        try:
            results[i] = complete(port, prompts[i], tokens)
        except BaseException as error:  # noqa: BLE001 - raised below, in the caller's thread
            results[i] = error

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(prompts))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for result in results:
        if isinstance(result, BaseException):
            raise result
    generated = sum(r["usage"]["completion_tokens"] for r in results)
    seconds = max(r["times"][-1] for r in results) - min(r["sent"] for r in results)
    return {"tokens": generated, "seconds": seconds, "tokens_per_s": generated / seconds}


# ---- the offline comparison -------------------------------------------------------------------------------


def offline(checkpoint: Path, options: list[str], args: argparse.Namespace, vocab: int, work: Path) -> dict[str, Any]:
    """(c): a file of ``args.prompts`` prompts of mixed lengths against ``--batch-size`` of one prompt."""
    low, high = (int(x) for x in args.prompt_lengths.split("-"))
    lengths = [low + (high - low) * i // max(args.prompts - 1, 1) for i in range(args.prompts)]
    lines = [{"id": i, "prompt": prompt_ids(i, n, vocab), "max_tokens": args.new_tokens, "ignore_eos": True}
             for i, n in enumerate(lengths)]
    prompts, answers = work / "prompts.jsonl", work / "answers.jsonl"
    prompts.write_text("".join(json.dumps(line) + "\n" for line in lines))
    files, repeated, details = [], [], []
    mean = round(statistics.mean(lengths))
    for _ in range(args.repeats):
        answers.unlink(missing_ok=True)
        figures = run_child("offload.generate", [str(checkpoint), "--prompts-file", str(prompts), "--output",
                                                 str(answers), "--batch-size", str(args.prompts), "--json", *options])
        files.append(figures["tokens"] / figures["seconds"])
        detail = {"file": {key: figures.get(key) for key in ("seconds", "steps", "largest_batch", "positions", "padding",
                                                             "read_bytes")}}
        figures = run_child("offload.generate", [str(checkpoint), "--prompt-ids", ",".join(map(str, prompt_ids(0, mean, vocab))),
                                                 "--batch-size", str(args.prompts), "--max-new-tokens", str(args.new_tokens),
                                                 "--json", *options])
        seconds = figures["first_token_s"] + (figures["s_per_token"] or 0.0) * (len(figures["tokens"]) - 1)
        repeated.append(args.prompts * len(figures["tokens"]) / seconds)
        detail["repeated"] = {"seconds": seconds, "read_bytes": figures.get("read_bytes"),
                              "first_token_s": figures["first_token_s"], "s_per_token": figures["s_per_token"]}
        details.append(detail)
        print(f"(c) round: file {detail['file']}; repeated {detail['repeated']}", flush=True)
    file_rate, repeated_rate = statistics.median(files), statistics.median(repeated)
    return {"lengths": f"{min(lengths)}-{max(lengths)} (mean {mean})", "file_tokens_per_s": file_rate,
            "repeated_tokens_per_s": repeated_rate, "ratio": file_rate / repeated_rate, "rounds": details}


# ---- the run ------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the benchmark (see the module docstring); print the table and the targets; return every figure."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", required=True, help="directory of the checkpoint (written once, reused)")
    ap.add_argument("--scale", type=float, default=0.4, help="of the 28.6 GB Llama's hidden, intermediate and vocab sizes")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--shards", type=int, default=8)
    ap.add_argument("--budget", help="--max-in-cpu for every run (default: a third of the checkpoint's bytes)")
    ap.add_argument("--clients", type=int, default=16, help="concurrent clients in (b)")
    ap.add_argument("--new-tokens", type=int, default=16, help="tokens each request asks for")
    ap.add_argument("--prompt-tokens", type=int, default=16, help="the prompt's length in (a) and (b)")
    ap.add_argument("--prompts", type=int, default=64, help="prompts in (c)'s file, and the repeated prompt's batch")
    ap.add_argument("--prompt-lengths", default="4-32", help="(c)'s prompt lengths, spread evenly: LOW-HIGH tokens")
    ap.add_argument("--repeats", type=int, default=3, help="runs of each measure (the median is reported)")
    ap.add_argument("--disk-gbps", type=float, default=2.0,
                    help="passed to every run (the plan's bound only), so that none spends time probing the disk")
    ap.add_argument("--offline-only", action="store_true", help="measure (c) alone (no server: (a), (b), (d) skipped)")
    ap.add_argument("--online-only", action="store_true", help="measure (a), (b) and (d) alone ((c) skipped)")
    ap.add_argument("--out", help="write every figure to this JSON file")
    args = ap.parse_args(argv)
    if args.offline_only and args.online_only:
        ap.error("--offline-only and --online-only leave nothing to measure: give one of them")

    spec = Spec.scaled(args.scale, args.layers, args.shards)
    checkpoint = write_checkpoint(Path(args.dir), spec)
    if not (checkpoint / "tokenizer.json").is_file():
        write_tokenizer(checkpoint, spec.vocab)
    size = sum(f.stat().st_size for f in checkpoint.glob("*.safetensors"))
    budget = parse_size(args.budget) if args.budget else size // 3
    options = ["--max-in-cpu", f"{budget}B", "--disk-gbps", str(args.disk_gbps)]
    print(f"checkpoint: {checkpoint} ({size / 1e9:.2f} GB bf16 Llama: hidden {spec.hidden}, {spec.layers} layers, vocab "
          f"{spec.vocab}); budget {budget / 1e9:.3f} GB; {args.clients} clients x {args.new_tokens} tokens, prompts of "
          f"{args.prompt_tokens}; offline {args.prompts} prompts of {args.prompt_lengths} tokens; {args.repeats} repeats",
          flush=True)
    figures: dict[str, Any] = {"checkpoint_bytes": size, "budget": budget, "args": vars(args)}
    if args.offline_only:
        with tempfile.TemporaryDirectory(dir=args.dir) as work:
            off = figures["offline"] = offline(checkpoint, options, args, spec.vocab, Path(work))
        print(f"(c) {args.prompts} prompts of {off['lengths']} tokens from a file: {off['file_tokens_per_s']:.2f} "
              f"tokens/s; --batch-size {args.prompts} of one prompt {off['repeated_tokens_per_s']:.2f}: "
              f"{off['ratio']:.2f}x (target >= 0.8x)")
        if args.out:
            Path(args.out).write_text(json.dumps(figures, indent=1))
        return figures

    # (d) the server's start to its first answer, alternated with offload.generate's whole run for one token
    # (the same imports, build and first forward: the floor); the last server then stays up for (a) and (b).
    first_prompt = prompt_ids(0, args.prompt_tokens, spec.vocab)
    starts, floors = [], []
    for round_ in range(args.repeats):
        floors.append(one_token_run(checkpoint, first_prompt, options))
        server = Server(checkpoint, free_port(), [*options, "--max-batch", str(max(args.clients, 1))])
        try:
            answered = first_answer(server, first_prompt, deadline=time.perf_counter() + 3600)
        except BaseException:
            server.stop()
            raise
        ready = server.line("ready in ")
        starts.append({"to_first_answer_s": answered - server.start,
                       "engine_build_s": float(ready[1].split()[2]) if ready else None,
                       "ready_line_to_answer_s": answered - ready[0] if ready else None})
        if round_ < args.repeats - 1:
            server.stop()
    to_answer = statistics.median(s["to_first_answer_s"] for s in starts)
    figures["start"] = {**min(starts, key=lambda s: abs(s["to_first_answer_s"] - to_answer)), "to_first_answer_s": to_answer,
                        "runs": starts, "generate_one_token_s": statistics.median(floors), "generate_runs": floors,
                        "ratio": to_answer / statistics.median(floors)}
    port = server.port
    print(f"(d) start to first answer {to_answer:.2f} s; offload.generate of one token, start to exit "
          f"{figures['start']['generate_one_token_s']:.2f} s", flush=True)
    try:
        # (a) one client alone, against offload.generate.
        alone = [complete(port, prompt_ids(1, args.prompt_tokens, spec.vocab), args.new_tokens) for _ in range(args.repeats)]
        generate = [run_child("offload.generate", [str(checkpoint), "--prompt-ids",
                                                   ",".join(map(str, prompt_ids(1, args.prompt_tokens, spec.vocab))),
                                                   "--max-new-tokens", str(args.new_tokens), "--json", *options])
                    for _ in range(args.repeats)]
        served = statistics.median(s_per_token(r) for r in alone)
        generated = statistics.median(g["s_per_token"] for g in generate)
        lone_rate = statistics.median(r["usage"]["completion_tokens"] / (r["times"][-1] - r["sent"]) for r in alone)
        figures["one"] = {"served_s_per_token": served, "generate_s_per_token": generated, "ratio": served / generated,
                          "served_tokens_per_s": lone_rate, "generate_first_token_s": statistics.median(
                              g["first_token_s"] for g in generate), "read_bytes_per_forward": generate[0]["read_bytes_per_forward"]}
        print(f"(a) one client {served:.3f} s/token, offload.generate {generated:.3f}", flush=True)

        # (b) concurrent clients.
        rounds = [together(port, [prompt_ids(10 + i, args.prompt_tokens, spec.vocab) for i in range(args.clients)],
                           args.new_tokens) for _ in range(args.repeats)]
        rate = statistics.median(r["tokens_per_s"] for r in rounds)
        figures["concurrent"] = {"tokens_per_s": rate, "ratio": rate / lone_rate, "rounds": rounds}
        print(f"(b) {args.clients} clients {rate:.2f} tokens/s", flush=True)
    finally:
        figures["server_exit"] = server.stop()
        figures["server_output"] = [text for _, text in server.lines][-20:]

    # (c) offline.
    if not args.online_only:
        with tempfile.TemporaryDirectory(dir=args.dir) as work:
            figures["offline"] = offline(checkpoint, options, args, spec.vocab, Path(work))
    report(figures, args)
    if args.out:
        Path(args.out).write_text(json.dumps(figures, indent=1))
    return figures


def report(f: dict[str, Any], args: argparse.Namespace) -> None:
    """Print the table and the targets."""
    one, many, off, start = f["one"], f["concurrent"], f.get("offline"), f["start"]
    rows = [("(a) one client, s/token", f"{one['served_s_per_token']:.3f}",
             f"offload.generate {one['generate_s_per_token']:.3f}", f"{one['ratio']:.2f}x", "<= 1.1x"),
            (f"(b) {args.clients} clients, tokens/s", f"{many['tokens_per_s']:.2f}",
             f"one client {one['served_tokens_per_s']:.2f}", f"{many['ratio']:.1f}x", ">= 10x")]
    if off is not None:
        rows.append((f"(c) {args.prompts} prompts from a file, tokens/s", f"{off['file_tokens_per_s']:.2f}",
                     f"--batch-size {args.prompts} {off['repeated_tokens_per_s']:.2f}", f"{off['ratio']:.2f}x", ">= 0.8x"))
    rows += [("(d) start to first answer, s", f"{start['to_first_answer_s']:.2f}",
             f"offload.generate of one token, start to exit {start['generate_one_token_s']:.2f}",
             f"{start['ratio']:.2f}x", "<= 1.1x (the same imports, build and forward)")]
    print("| measure | served | beside | ratio | target |\n|---|---|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    lengths = f" (c): prompt lengths {off['lengths']}." if off is not None else ""
    print(f"(d): of which {start['ready_line_to_answer_s']:.2f} s from the server's 'ready' line to the answer (the first "
          f"forward, {one['generate_first_token_s']:.2f} s in offload.generate); the rest is Python's imports and the "
          f"build.{lengths} Server exit status on SIGTERM: {f['server_exit']}.")


if __name__ == "__main__":
    main()
