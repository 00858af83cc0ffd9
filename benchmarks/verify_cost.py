"""What the swap files' checksums cost a large training step: `benchmarks.train_large` with them and
without (``--no-verify``), interleaved on, off, off, on, on, off, ... (``--pairs`` of each).

    python -m benchmarks.verify_cost --pairs 3 -- --layers 4 --batch 1 --steps 5 --skip-reference --nvme-dir DIR

Everything after ``--`` is train_large's arguments (one batch size). Each run is train_large's, in its own
child processes; its steady steps (after the first two, as train_large's summary takes them) are pooled
per side. Reported: the pooled median step with checksums over without (target <= 1.03), and the same
for each step's time over its bytes at fio's speed just before and after it (`train_large.io_seconds_beside`),
which takes out the disk's swings between runs: this disk's speed moves by 2x within minutes, more than
the cost being measured.
"""

from __future__ import annotations

import argparse
import statistics

from benchmarks import train_large

__all__ = ["TARGET", "main", "order"]

TARGET = 1.03


def order(pairs: int) -> list[bool]:
    """Whether each run has checksums on: on, off, off, on, ... (each side first in half the pairs)."""
    return [(i % 2 == 0) == (j == 0) for i in range(pairs) for j in range(2)]


def _steady(results: dict) -> tuple[list[float], list[float]]:
    """A run's steady steps: their seconds, and their seconds over their bytes at fio's speed beside them."""
    run = results["offload"]
    if "error" in run:
        raise SystemExit(f"train_large failed: {run['error']}")
    batch = results["spec"]["batches"][0]
    rows = train_large._steady(run["steps"], batch)
    return [r["seconds"] for r in rows], [r["seconds"] / train_large.io_seconds_beside(run, r) for r in rows]


def main(argv: list[str] | None = None) -> dict:
    """Run the interleaved series; print each run and the pooled ratios; return them."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pairs", type=int, default=3, help="runs of each side (default 3)")
    ap.add_argument("train_large_args", nargs=argparse.REMAINDER, help="-- then train_large's arguments")
    args = ap.parse_args(argv)
    if args.pairs < 1:
        raise SystemExit(f"--pairs: {args.pairs} is not allowed; use 1 or more")
    rest = [a for a in args.train_large_args if a != "--"]
    if "--no-verify" in rest:
        raise SystemExit("--no-verify: not among train_large's arguments here; the series runs both sides itself")
    pooled: dict[bool, tuple[list[float], list[float]]] = {True: ([], []), False: ([], [])}
    for number, on in enumerate(order(args.pairs), 1):
        seconds, beside = _steady(train_large.main(rest + ([] if on else ["--no-verify"])))
        pooled[on][0].extend(seconds)
        pooled[on][1].extend(beside)
        print(f"verify_cost: run {number} (checksums {'on' if on else 'off'}): steady steps "
              + " ".join(f"{s:.2f}" for s in seconds) + " s; over their bytes at fio's speed beside them "
              + " ".join(f"{b:.2f}" for b in beside), flush=True)
    on_s, off_s = (statistics.median(pooled[side][0]) for side in (True, False))
    on_b, off_b = (statistics.median(pooled[side][1]) for side in (True, False))
    result = {"on_s": on_s, "off_s": off_s, "ratio": on_s / off_s, "on_beside": on_b, "off_beside": off_b,
              "ratio_beside": on_b / off_b, "steps": {"on": pooled[True], "off": pooled[False]}}
    print(f"verify_cost: checksums on / off, {args.pairs} runs each, pooled median steps {on_s:.2f} / {off_s:.2f} s = "
          f"{result['ratio']:.3f}; over the disk's speed beside each step {on_b:.2f} / {off_b:.2f} = "
          f"{result['ratio_beside']:.3f} (target <= {TARGET}: "
          f"{'met' if result['ratio_beside'] <= TARGET else 'NOT met'} against the disk, "
          f"{'met' if result['ratio'] <= TARGET else 'NOT met'} in seconds)")
    return result


if __name__ == "__main__":
    main()
