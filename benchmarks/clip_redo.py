"""How often would a speculative update be redone? The gradient norm against gradient_clipping, step by step,
on a real-text fine-tune.

    python -m benchmarks.clip_redo
    python -m benchmarks.clip_redo --clip 1.0 --warmup-steps 3000 --finetune-steps 500

A speculative design (DeepSpeed SuperOffload's "speculation then validation") updates each partition
during backward as if the global norm were under the clip threshold, and redoes the step when it turns
out above it (or not finite). This counts those steps, with plain PyTorch (``clip_grad_norm_`` returns
the norm before clipping), on text that ships with Python, so that nothing is downloaded:

1. warm-up: a small GPT-2 (byte-level: every byte a token) trained from scratch on the sources of the
   standard library's top-level modules, at least ``--min-warmup-steps`` and then until the mean
   gradient norm of the last ``--window`` steps falls under the threshold (or ``--warmup-steps``);
2. fine-tune: the same model continues, at a lower learning rate, on other text (the sources of the
   ``email``, ``json``, ``http`` and ``xml`` packages, held out of the warm-up).

Printed: the steps of each phase whose norm was above the threshold, and the norms' quartiles.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sysconfig
import time

FINETUNE_PACKAGES = ("email", "json", "http", "xml")


def corpus(packages: tuple[str, ...] | None) -> bytes:
    """The standard library's Python sources as one byte string: its top-level modules (``None``), or the
    given packages' files, in sorted order."""
    lib = sysconfig.get_paths()["stdlib"]
    paths = []
    if packages is None:
        paths = [os.path.join(lib, name) for name in sorted(os.listdir(lib)) if name.endswith(".py")]
    else:
        for package in packages:
            for root, dirs, files in os.walk(os.path.join(lib, package)):
                dirs.sort()
                paths += [os.path.join(root, name) for name in sorted(files) if name.endswith(".py")]
    text = b""
    for path in paths:
        with open(path, "rb") as f:
            text += f.read() + b"\n"
    return text


def main(argv: list[str] | None = None) -> dict:
    import torch
    import transformers

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clip", type=float, default=1.0, help="gradient_clipping (the HF Trainer's and DeepSpeed's default)")
    ap.add_argument("--model-config", type=json.loads,
                    default={"n_layer": 4, "n_embd": 256, "n_head": 8, "n_positions": 256})
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--warmup-lr", type=float, default=1e-3)
    ap.add_argument("--finetune-lr", type=float, default=1e-4)
    ap.add_argument("--warmup-steps", type=int, default=3000, help="at most; ends earlier once the norm is under --clip")
    ap.add_argument("--min-warmup-steps", type=int, default=1000, help="at least, so that the model has learnt something")
    ap.add_argument("--window", type=int, default=50, help="steps averaged for the warm-up's end")
    ap.add_argument("--finetune-steps", type=int, default=500)
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=256, bos_token_id=0, eos_token_id=0, resid_pdrop=0.0,
                                     embd_pdrop=0.0, attn_pdrop=0.0, **args.model_config)
    model = transformers.GPT2LMHeadModel(config)
    gen = torch.Generator().manual_seed(1)

    def batches(text: bytes):
        data = torch.frombuffer(bytearray(text), dtype=torch.uint8).long()
        while True:
            starts = torch.randint(0, len(data) - args.seq, (args.batch,), generator=gen)
            yield torch.stack([data[s:s + args.seq] for s in starts.tolist()])

    def phase(name: str, text: bytes, lr: float, steps: int, until_under: bool, at_least: int = 0) -> dict:
        opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01, fused=True)
        norms, losses, start = [], [], time.perf_counter()
        for step, batch in zip(range(steps), batches(text)):
            loss = model(batch, labels=batch).loss
            loss.backward()
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)))
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
            if (until_under and len(norms) >= max(args.window, at_least)
                    and statistics.mean(norms[-args.window:]) < args.clip):
                break
        above = sum(1 for norm in norms if not norm <= args.clip)  # inf / nan count as above
        quartiles = statistics.quantiles(norms, n=4) if len(norms) > 1 else norms * 3
        result = {"steps": len(norms), "above": above, "norm_quartiles": quartiles, "first_loss": losses[0],
                  "last_loss": statistics.mean(losses[-args.window:]), "seconds": time.perf_counter() - start}
        print(f"{name}: {len(norms)} steps, norm above {args.clip} in {above} ({100 * above / len(norms):.1f}%); norm "
              f"quartiles {' '.join(f'{q:.3f}' for q in quartiles)}; loss {losses[0]:.2f} -> {result['last_loss']:.2f} "
              f"({result['seconds']:.0f} s)", flush=True)
        return result

    warm, tune = corpus(None), corpus(FINETUNE_PACKAGES)
    print(f"GPT-2 {json.dumps(args.model_config)}, byte-level (vocab 256), {sum(p.numel() for p in model.parameters()) / 1e6:.1f} M "
          f"parameters; batch {args.batch} x {args.seq}; clip {args.clip}; warm-up text {len(warm) / 1e6:.1f} MB (the "
          f"standard library's top-level modules), fine-tune text {len(tune) / 1e6:.1f} MB ({', '.join(FINETUNE_PACKAGES)})",
          flush=True)
    results = {"warmup": phase("warm-up", warm, args.warmup_lr, args.warmup_steps, True, args.min_warmup_steps),
               "finetune": phase("fine-tune", tune, args.finetune_lr, args.finetune_steps, False)}
    return results


if __name__ == "__main__":
    main()
