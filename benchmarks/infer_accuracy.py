"""Benchmark: held-out perplexity of a small causal LM in bf16, int8 and int4, through `init_inference`.

    python -m benchmarks.infer_accuracy --dir /tmp/acc --out infer_accuracy.json     # ~20 M parameters
    python -m benchmarks.infer_accuracy --dir /tmp/x --hidden 64 --layers 2 --steps 60 --eval-windows 4   # tiny

No pretrained weights reach this machine, so a byte-level Llama is trained here on real text the
machine ships: the Python standard library's source (``.py`` files under ``sysconfig``'s stdlib,
site-packages and the test suite left out), split by file: every file whose path hashes to 0 mod 20
is held out. The model (hidden 512, 6 layers, 20.7 M parameters by default) is trained for
``--steps`` steps of ``--batch`` x 256 bytes (AdamW, bf16 autocast), saved as a bf16 safetensors checkpoint,
and then evaluated on held-out windows through `init_inference` with the decoder layers streamed
(``max_in_cpu`` just above what must stay): unquantized, int8 (per channel) and int4 (groups of 64
and 128, asymmetric). Reports the perplexity of each, its change against unquantized, and the mean
KL divergence of the next-token distributions against unquantized; checks the targets (int8 within
+0.5%, int4 within +4%).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import sysconfig
import time
from pathlib import Path

import torch

__all__ = ["corpus", "evaluate", "save", "train"]

VARIANTS = {"bf16": None, "int8": {"num_bits": 8}, "int4-g64": {"num_bits": 4, "group_size": 64},
            "int4-g128": {"num_bits": 4, "group_size": 128}}


def corpus(limit: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(training bytes, held-out bytes) of the standard library's source, as uint8 tensors; split by
    file (a file whose relative path's SHA-1 is 0 mod 20 is held out), in sorted path order. ``limit``:
    stop once that many bytes are read (for quick runs)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    train, held, total = [], [], 0
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel.startswith(("site-packages/", "test/", "dist-packages/")) or "/tests/" in rel:
            continue
        try:
            data = path.read_bytes()
        except OSError:
            continue
        (held if int(hashlib.sha1(rel.encode()).hexdigest(), 16) % 20 == 0 else train).append(data)
        total += len(data)
        if limit is not None and total >= limit:
            break
    if not held or not train:
        raise RuntimeError(f"{root}: too little Python source to split into training and held-out text")
    as_tensor = lambda parts: torch.frombuffer(bytearray(b"\n".join(parts)), dtype=torch.uint8)  # noqa: E731
    return as_tensor(train), as_tensor(held)


def build(hidden: int, layers: int, seq: int):
    """A byte-level Llama (vocab 256) of that size, fp32, untied head."""
    import transformers

    config = transformers.LlamaConfig(
        hidden_size=hidden, intermediate_size=hidden * 3, num_hidden_layers=layers,
        num_attention_heads=max(1, hidden // 64), num_key_value_heads=max(1, hidden // 64), vocab_size=256,
        max_position_embeddings=seq, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    return transformers.AutoModelForCausalLM.from_config(config)


def train(data: torch.Tensor, *, hidden: int, layers: int, steps: int, seq: int = 256, batch: int = 16,
          lr: float = 2e-3, seed: int = 0, log_every: int = 0):
    """Train a byte-level Llama on ``data`` (uint8) for ``steps`` steps of ``batch`` x ``seq`` bytes at
    random offsets (AdamW, warm-up then cosine decay, bf16 autocast); returns the model (fp32, eval)."""
    torch.manual_seed(seed)
    model = build(hidden, layers, seq)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1, betas=(0.9, 0.95))
    warmup = max(1, steps // 20)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min((s + 1) / warmup, 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps))))
    generator = torch.Generator().manual_seed(seed)
    start = time.perf_counter()
    for step in range(steps):
        offsets = torch.randint(0, data.numel() - seq, (batch,), generator=generator)
        ids = torch.stack([data[o: o + seq] for o in offsets.tolist()]).long()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(ids, labels=ids, use_cache=False).loss  # transformers shifts the labels
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        if log_every and (step % log_every == 0 or step == steps - 1):
            print(f"step {step}: loss {loss.item():.3f} ({time.perf_counter() - start:.0f} s)", flush=True)
    return model.eval()


def save(model, directory: Path) -> Path:
    """The model as a bf16 safetensors checkpoint in ``directory``."""
    model.to(torch.bfloat16).save_pretrained(directory)
    model.float()
    return directory


def windows(held: torch.Tensor, count: int, seq: int) -> torch.Tensor:
    """``count`` evenly spaced windows of ``seq`` held-out bytes, as token ids [count, seq]."""
    step = (held.numel() - seq) // max(1, count)
    return torch.stack([held[i * step: i * step + seq] for i in range(count)]).long()


def evaluate(checkpoint: Path, ids: torch.Tensor, variant: dict | None, cache: Path, *, batch: int = 4,
             reference: list[torch.Tensor] | None = None) -> dict:
    """Held-out perplexity of ``checkpoint`` through `init_inference` (decoder layers streamed) with
    ``variant`` (a ``weight_quantization`` section, None: unquantized), and the mean KL divergence
    of its next-token distributions from ``reference`` (log-probabilities per batch) where given.
    Returns {"perplexity", "nll", "kl", "log_probs"}."""
    from offload.infer import init_inference

    import transformers

    text = transformers.AutoConfig.from_pretrained(checkpoint)
    # Room for what must stay (the embeddings, the norms) and the KV cache only: every decoder layer streams.
    kv = 2 * text.num_hidden_layers * batch * ids.shape[1] * text.hidden_size * 2
    must = text.vocab_size * text.hidden_size * 2 + (2 * text.num_hidden_layers + 1) * text.hidden_size * 2
    config = {"weight_quantization": variant} if variant else {}
    total_nll, total_kl, count, log_probs = 0.0, 0.0, 0, []
    with init_inference(checkpoint, config, max_in_cpu=f"{kv + must + 4096}B", nvme_path=str(cache),
                        disk_gbps=1.0) as engine:
        for i in range(0, ids.shape[0], batch):
            chunk = ids[i: i + batch]
            logits = engine(chunk, use_cache=False).logits[:, :-1].float()
            lp = torch.log_softmax(logits, dim=-1)
            total_nll -= lp.gather(-1, chunk[:, 1:, None]).sum().item()
            count += chunk[:, 1:].numel()
            if reference is not None:
                ref = reference[len(log_probs)]
                total_kl += (ref.exp() * (ref - lp)).sum().item()
            log_probs.append(lp)
        streamed = len(engine.plan.streamed)
    nll = total_nll / count
    return {"perplexity": math.exp(nll), "nll": nll, "kl": total_kl / count if reference is not None else 0.0,
            "log_probs": log_probs, "streamed_units": streamed}


def main(argv: list[str] | None = None) -> dict:
    """Train (once: reused from --dir), evaluate every variant, print the table and the targets."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", required=True, help="working directory: the trained checkpoint and the quantized caches")
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8, help="sequences per training step")
    ap.add_argument("--threads", type=int, help="torch threads (default torch's; 1 on a loaded machine)")
    ap.add_argument("--eval-windows", type=int, default=128, help="held-out windows of --seq bytes")
    ap.add_argument("--out", help="write the figures to this JSON file")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    directory = Path(args.dir).resolve()
    checkpoint = directory / "checkpoint"
    marker = directory / "trained.json"
    spec = {"hidden": args.hidden, "layers": args.layers, "steps": args.steps, "seq": args.seq, "batch": args.batch}
    data, held = corpus()
    print(f"corpus: {data.numel() / 1e6:.1f} MB of training source, {held.numel() / 1e6:.1f} MB held out "
          f"({sysconfig.get_paths()['stdlib']})")
    if not (marker.is_file() and json.loads(marker.read_text()).get("spec") == spec):
        start = time.perf_counter()
        model = train(data, hidden=args.hidden, layers=args.layers, steps=args.steps, seq=args.seq,
                      batch=args.batch, log_every=max(1, args.steps // 12))
        seconds = time.perf_counter() - start
        directory.mkdir(parents=True, exist_ok=True)
        save(model, checkpoint)
        marker.write_text(json.dumps({"spec": spec, "train_s": seconds,
                                      "parameters": sum(p.numel() for p in model.parameters())}))
    trained = json.loads(marker.read_text())
    print(f"model: {trained['parameters'] / 1e6:.1f} M parameters, {args.steps} steps of {args.batch} x {args.seq} bytes "
          f"in {trained['train_s']:.0f} s")
    ids = windows(held, args.eval_windows, args.seq)
    results, reference = {}, None
    for name, variant in VARIANTS.items():
        r = evaluate(checkpoint, ids, variant, directory, reference=reference)
        if reference is None:
            reference = r["log_probs"]
        results[name] = {k: v for k, v in r.items() if k != "log_probs"}
    base = results["bf16"]["perplexity"]
    print(f"held-out: {ids.shape[0]} windows of {args.seq} bytes ({ids[:, 1:].numel()} predicted), decoder layers streamed")
    print("| weights | perplexity | vs bf16 | KL vs bf16 (nats/token) |")
    print("|---|---|---|---|")
    for name, r in results.items():
        r["delta"] = r["perplexity"] / base - 1
        print(f"| {name} | {r['perplexity']:.4f} | {r['delta']:+.2%} | {r['kl']:.5f} |")
    targets = [f"int8: {results['int8']['delta']:+.2%} (target <= +0.5%): "
               f"{'met' if results['int8']['delta'] <= 0.005 else 'NOT met'}"]
    for name in ("int4-g64", "int4-g128"):
        targets.append(f"{name}: {results[name]['delta']:+.2%} (target <= +4%): "
                       f"{'met' if results[name]['delta'] <= 0.04 else 'NOT met'}")
    print("targets:\n  " + "\n  ".join(targets))
    figures = {"spec": spec, "trained": trained, "results": results, "targets": targets}
    if args.out:
        Path(args.out).write_text(json.dumps(figures, indent=1))
    return figures


if __name__ == "__main__":
    main()
