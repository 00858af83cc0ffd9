"""``python -m benchmarks.gpu [infer|train] [ARGS]``: the GPU benchmarks.

    python -m benchmarks.gpu infer --dir /nvme/bench-gpu      # generation (benchmarks/gpu/infer.py)
    python -m benchmarks.gpu train ...                        # training (benchmarks/gpu/train.py)
    python -m benchmarks.gpu --dir /nvme/bench-gpu            # both: generation with these arguments,
                                                              # then training with its defaults

Each part's ``--help`` lists its arguments.
"""

from __future__ import annotations

import importlib
import sys

PARTS = ("infer", "train")


def _part(name: str):
    """The module of part ``name``; exits with a clear message where it is not on this branch."""
    try:
        return importlib.import_module(f"benchmarks.gpu.{name}")
    except ModuleNotFoundError as exc:
        if exc.name != f"benchmarks.gpu.{name}":
            raise  # the part is there, something it imports is not: its own error says what
        raise SystemExit(f"python -m benchmarks.gpu {name}: benchmarks/gpu/{name}.py is not in this checkout "
                         f"(the {'training' if name == 'train' else 'generation'} part of issue 25); run the other "
                         f"part: python -m benchmarks.gpu {'infer' if name == 'train' else 'train'}") from None


def main(argv: list[str] | None = None) -> dict:
    """Run the part named first in ``argv`` with the rest, or both (see the module docstring);
    return {part: its figures}."""
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
    main()
