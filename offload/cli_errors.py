"""User errors of the ``python -m offload.*`` commands as one line, tracebacks on request.

A command's ``main`` raises; `run_command` prints ``prog: error: <message>`` for what a user can fix
(a path that is missing or may not be read, a directory that is not a model, a bad value: OSError,
ValueError and the safetensors library's errors) and exits with status 2, as argparse does for bad
options. ``--debug`` on the command line, or ``OFFLOAD_DEBUG=1`` in the environment, lets the
traceback through instead. Anything else (a bug) keeps its traceback.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Callable

__all__ = ["DEBUG_ENV", "run_command", "user_error_types"]

DEBUG_ENV = "OFFLOAD_DEBUG"
"""Set to 1 (or any value but "", "0") to see tracebacks of user errors."""


def user_error_types() -> tuple[type[BaseException], ...]:
    """The exception types that report a user's mistake rather than a bug."""
    from safetensors import SafetensorError

    return (OSError, ValueError, SafetensorError)


def run_command(main: Callable[[list[str]], Any], prog: str, argv: list[str] | None = None) -> int:
    """Run ``main(argv)`` (``argv`` without ``--debug``); return 0, or 2 after printing a user error
    as one line on stderr. ``--debug`` or ``OFFLOAD_DEBUG`` re-raises it with its traceback."""
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv or os.environ.get(DEBUG_ENV, "") not in ("", "0")
    argv = [arg for arg in argv if arg != "--debug"]
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
