"""User errors of the ``python -m offload.*`` commands as one line, tracebacks on request.

A command's ``main`` raises; `run_command` prints ``prog: error: <message>`` for what a user can fix
(a path that is missing or may not be read, a directory that is not a model, a bad value: OSError,
ValueError and the safetensors library's errors) and exits with status 2, as argparse does for bad
options. ``--debug`` on the command line (anywhere: before or after a subcommand), or
``OFFLOAD_DEBUG=1`` in the environment, lets the traceback through instead. Anything else (a bug)
keeps its traceback. A command's parsers declare the flag with `add_debug_flag`, so that ``--help``
lists it.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Callable

__all__ = ["DEBUG_ENV", "add_debug_flag", "debug_requested", "run_command", "user_error_types"]

DEBUG_ENV = "OFFLOAD_DEBUG"
"""Set to 1 (or any value but "", "0") to see tracebacks of user errors."""


def user_error_types() -> tuple[type[BaseException], ...]:
    """The exception types that report a user's mistake rather than a bug."""
    from safetensors import SafetensorError

    return (OSError, ValueError, SafetensorError)


def add_debug_flag(parser: argparse.ArgumentParser) -> None:
    """Declare ``--debug`` on ``parser`` (and so in its ``--help``); `debug_requested` reads it."""
    parser.add_argument("--debug", action="store_true",
                        help=f"show the traceback of an error instead of one line (or set {DEBUG_ENV}=1)")


def debug_requested(argv: list[str]) -> tuple[bool, list[str]]:
    """(whether ``--debug`` is in ``argv`` or ``OFFLOAD_DEBUG`` is set, ``argv`` without ``--debug``)."""
    debug = "--debug" in argv or os.environ.get(DEBUG_ENV, "") not in ("", "0")
    return debug, [arg for arg in argv if arg != "--debug"]


def run_command(main: Callable[[list[str]], Any], prog: str, argv: list[str] | None = None) -> int:
    """Run ``main(argv)`` (``argv`` without ``--debug``); return 0, or 2 after printing a user error
    as one line on stderr. ``--debug`` or ``OFFLOAD_DEBUG`` re-raises it with its traceback."""
    debug, argv = debug_requested(list(sys.argv[1:] if argv is None else argv))
    try:
        main(argv)
    except user_error_types() as error:
        if debug:
            raise
        print(f"{prog}: error: {_one_line(error)} (--debug or {DEBUG_ENV}=1 shows the traceback)", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        if debug:
            raise
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    return 0


def _one_line(error: BaseException) -> str:
    text = str(error) or type(error).__name__
    if isinstance(error, OSError) and error.filename is not None and os.fspath(error.filename) not in text:
        text = f"{error.filename}: {text}"
    return " ".join(text.split())
