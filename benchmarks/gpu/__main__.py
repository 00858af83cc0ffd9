"""``python -m benchmarks.gpu [infer|profile|train|check] [ARGS]``: the GPU benchmarks.

    python -m benchmarks.gpu infer --dir /nvme/bench-gpu      # generation (benchmarks/gpu/infer.py)
    python -m benchmarks.gpu profile --dir /nvme/bench-gpu    # generation with each side's default, traced
                                                              # (benchmarks/gpu/profile.py)
    python -m benchmarks.gpu train ...                        # training (benchmarks/gpu/train.py)
    python -m benchmarks.gpu check OUTDIR                     # the GPU machine's check: the gpu tests and
                                                              # the benchmarks, logs, tables and summary.md in OUTDIR
                                                              # (benchmarks/gpu/check.py; exits 0 when all passed)
    python -m benchmarks.gpu --dir /nvme/bench-gpu            # both: generation with these arguments,
                                                              # then training with its defaults

Each part's ``--help`` lists its arguments.
"""

from __future__ import annotations

import importlib
import sys

PARTS = ("infer", "profile", "train", "check")


def _part(name: str):
    """The module of part ``name``."""
    return importlib.import_module(f"benchmarks.gpu.{name}")


def main(argv: list[str] | None = None) -> dict:
    """Run the part named first in ``argv`` with the rest, or infer and train (see the module docstring);
    return {part: its figures} (for check: its exit status)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in PARTS:
        return {argv[0]: _part(argv[0]).main(argv[1:])}
    if argv and argv[0] in ("-h", "--help"):
        print(__doc__)
        return {}
    figures = {"infer": _part("infer").main(argv)}
    figures["train"] = _part("train").main([])
    return figures


if __name__ == "__main__":
    sys.exit(main().get("check", 0))
