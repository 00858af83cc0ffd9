"""What the swap files' checksums cost a large training step: `benchmarks.train_large` with them (on),
without (``--no-verify``: off), and without while a thread spends the CPU time their hashing took
(floor), interleaved: on, off, floor, then floor, off, on, ... (``--rounds`` of the three).

    python -m benchmarks.verify_cost --rounds 2 -- --layers 4 --batch 1 --steps 5 --skip-reference --nvme-dir DIR

Everything after ``--`` is train_large's arguments (one batch size). Each run is train_large's, in its own
child processes; its steady steps (after the first two, as train_large's summary takes them) are pooled
per side. The floor's thread (`benchmarks._hash_load`, ``train_large --hash-cpu-rate``) hashes memory
during each step for the share of a core that the latest "on" run's hashing took of the latest "off"
run's step: what hashing those bytes costs on this CPU (its cores and its memory bandwidth) wherever it
is done. Reported: pooled median steps on / off (target <= 1.03), floor / off, and on / floor.
"""

from __future__ import annotations

import argparse
import statistics

from benchmarks import train_large

__all__ = ["TARGET", "main", "order"]

TARGET = 1.03
SIDES = ("on", "off", "floor")


def order(rounds: int) -> list[str]:
    """The sides in run order: on, off, floor, then floor, off, on, and so on."""
    return [side for i in range(rounds) for side in (SIDES if i % 2 == 0 else SIDES[::-1])]


def _steady(results: dict) -> tuple[list[float], list[float]]:
    """A run's steady steps: their seconds and their checksums' CPU seconds."""
    run = results["offload"]
    if "error" in run:
        raise SystemExit(f"train_large failed: {run['error']}")
    rows = train_large.steady_steps(run["steps"], results["spec"]["batches"][0])
    return [r["seconds"] for r in rows], [r["hash_cpu_s"] for r in rows]


def main(argv: list[str] | None = None) -> dict:
    """Run the interleaved series; print each run and the pooled ratios; return them."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2, help="runs of each side (default 2)")
    ap.add_argument("train_large_args", nargs=argparse.REMAINDER, help="-- then train_large's arguments")
    args = ap.parse_args(argv)
    if args.rounds < 1:
        raise SystemExit(f"--rounds: {args.rounds} is not allowed; use 1 or more")
    rest = [a for a in args.train_large_args if a != "--"]
    for flag in ("--no-verify", "--hash-cpu-rate"):
        if flag in rest:
            raise SystemExit(f"{flag}: not among train_large's arguments here; the series sets it for each side")
    pooled: dict[str, list[float]] = {side: [] for side in SIDES}
    latest: dict[str, float] = {}  # "hash": the last on run's hashing CPU a step; "off": the last off run's step
    for number, side in enumerate(order(args.rounds), 1):
        extra = {"on": [], "off": ["--no-verify"]}.get(side)
        if extra is None:  # the floor: off, plus the on run's hashing CPU at the off run's pace
            rate = latest["hash"] / latest["off"]
            extra = ["--no-verify", "--hash-cpu-rate", f"{rate:.6f}"]
        seconds, hashing = _steady(train_large.main(rest + extra))
        pooled[side].extend(seconds)
        if side == "on":
            latest["hash"] = statistics.median(hashing)
        elif side == "off":
            latest["off"] = statistics.median(seconds)
        print(f"verify_cost: run {number} ({side}{' ' + extra[-1] + ' of a core hashing' if side == 'floor' else ''}): "
              "steady steps " + " ".join(f"{s:.2f}" for s in seconds) + " s"
              + (f"; checksums {statistics.median(hashing):.2f} s of CPU a step" if side == "on" else ""), flush=True)
    on, off, floor = (statistics.median(pooled[side]) for side in SIDES)
    result = {"on_s": on, "off_s": off, "floor_s": floor, "ratio": on / off, "floor": floor / off,
              "over_floor": on / floor, "steps": pooled}
    print(f"verify_cost: {args.rounds} runs a side, pooled median steps: on / off {on:.2f} / {off:.2f} s = "
          f"{result['ratio']:.3f} (target <= {TARGET}: {'met' if result['ratio'] <= TARGET else 'NOT met'}); "
          f"the floor (off, plus the hashing's CPU) / off {floor:.2f} / {off:.2f} s = {result['floor']:.3f}; "
          f"on / the floor {result['over_floor']:.3f}")
    return result


if __name__ == "__main__":
    main()
