"""An answer's text as its tokens come: what may be shown so far, and where a stop string ends it.

Text is decoded from all of the answer's tokens each time (a token's text can depend on its
neighbours, and a character can span tokens), so what was shown is never taken back. Two things are
held back until the next token settles them: a trailing replacement character (half of a multi-byte
character) and a tail that could be the start of a stop string.
"""

from __future__ import annotations

from typing import Any

__all__ = ["AnswerText"]


class AnswerText:
    """One answer's text. ``add(token)`` returns the text newly safe to show; ``stopped`` turns True
    when a stop string appears (the text ends before it); ``finish()`` returns what was held back."""

    def __init__(self, tokenizer: Any, stop: tuple[str, ...] = ()) -> None:
        self.tokenizer, self.stop = tokenizer, stop
        self.tokens: list[int] = []
        self.text = ""
        """The answer's text so far, cut before a stop string once one appeared."""
        self.stopped = False
        self._shown = 0

    def add(self, token: int) -> str:
        """Take the next token; return the text that can be shown now (maybe "")."""
        if self.stopped:
            raise RuntimeError("AnswerText.add after a stop string ended the answer")
        self.tokens.append(token)
        self.text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        cut = self._stop_at()
        if cut is not None:
            self.text, self.stopped = self.text[:cut], True
            return self._show(len(self.text))
        safe = len(self.text)
        if self.text.endswith("\ufffd"):
            safe -= 1
        return self._show(safe - self._stop_prefix(self.text[:safe]))

    def finish(self) -> str:
        """The answer is over: the text held back so far."""
        return self._show(len(self.text))

    def _stop_at(self) -> int | None:
        """Where the first stop string starts, searching only where one could newly appear."""
        if not self.stop:
            return None
        start = max(0, self._shown - max(len(s) for s in self.stop))
        found = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
        return min(found) if found else None

    def _stop_prefix(self, text: str) -> int:
        """The length of the longest tail of ``text`` that begins a stop string (0: none)."""
        longest = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(text)), longest, -1):
                if text.endswith(s[:n]):
                    longest = n
                    break
        return longest

    def _show(self, upto: int) -> str:
        upto = max(upto, self._shown)
        piece, self._shown = self.text[self._shown:upto], upto
        return piece
