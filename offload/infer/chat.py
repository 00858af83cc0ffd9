"""``python -m offload.generate CHECKPOINT --chat`` without ``--prompt``: a conversation on the terminal.

Each line read is a user turn; the conversation so far (every turn, the model's answers included) goes
through the checkpoint's chat template and the answer is printed as it comes, then kept for the next
turn. The conversation ends at the end of input (Ctrl-D), Ctrl-C, an empty line or ``/exit``. Each turn
prefills the whole conversation again (no cache is kept between turns), so a turn costs one forward
per prompt token more than the last; the engine's streamed weights are read once per forward as ever.

`converse` is the loop alone: it reads the turns and keeps the conversation, and leaves answering to the
function it is given (offload/infer/cli.py's, which runs the engine's generate and prints the answer).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TextIO

__all__ = ["EXIT_WORDS", "converse"]

EXIT_WORDS = ("/exit", "/quit")
"""A line holding only one of these ends the conversation, as an empty line does."""

Message = dict[str, str]


def converse(answer: Callable[[list[Message]], str], lines: TextIO, out: TextIO) -> list[Message]:
    """Read user turns from ``lines`` (one a line; ``> `` is written to ``out`` before each where ``lines``
    is a terminal) until the end of input, an empty line, ``/exit`` or Ctrl-C; for each, call
    ``answer(messages)`` with the conversation so far, the new user turn last, and keep what it returns
    as the assistant's turn. Returns the conversation (a turn cut short by Ctrl-C is left out). Errors
    ``answer`` raises (other than Ctrl-C) go to the caller."""
    messages: list[Message] = []
    prompt = "> " if _isatty(lines) else ""
    try:
        while True:
            if prompt:
                out.write(prompt)
                out.flush()
            line = lines.readline()
            text = line.strip()
            if not line or not text or text in EXIT_WORDS:
                if not line and prompt:  # Ctrl-D leaves the cursor after the prompt
                    out.write("\n")
                break
            turn = [*messages, {"role": "user", "content": text}]
            reply = answer(turn)
            messages = [*turn, {"role": "assistant", "content": reply}]
    except KeyboardInterrupt:  # Ctrl-C while reading or answering: the conversation ends, not the process
        out.write("\n")
        out.flush()
    return messages


def _isatty(stream: TextIO) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False
