"""One request's answer as it is generated, whatever runs the batch: its next token picked from its
own row of logits, its text, and the rule that ends it (``max_tokens``, a stop string, the
end-of-sequence token). The server's loop (offload/infer/batch/batcher.py) and the prompts file's batches
(offload/infer/prompts_file.py) keep one per sequence."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from offload.infer.answer_text import AnswerText
from offload.infer.sampling import SamplingParams, TokenPicker

__all__ = ["Answer"]


class Answer:
    """The answer to one prompt of ``prompt_tokens`` tokens. ``params.max_tokens`` must be set (the
    context's check, `offload.infer.prompt.fit_context`, resolves it). ``tokenizer`` None: token ids
    only, no text (and stop strings cannot match)."""

    def __init__(self, prompt_tokens: int, params: SamplingParams, tokenizer: Any = None,
                 eos_token_ids: Iterable[int] = ()) -> None:
        if params.max_tokens is None:
            raise ValueError("max_tokens: unset; resolve it against the context first (prompt.fit_context)")
        if params.stop and tokenizer is None:
            raise ValueError("stop: stop strings need a tokenizer to read the answer's text")
        self.prompt_tokens, self.params = prompt_tokens, params
        self.tokens: list[int] = []
        """Every token generated, the end-of-sequence token that ended it included."""
        self.finish_reason: str | None = None
        """None while it runs; then "stop" (the end-of-sequence token or a stop string) or "length"."""
        self._picker = TokenPicker(params)
        self._text = AnswerText(tokenizer, params.stop) if tokenizer is not None else None
        self._eos = frozenset(() if params.ignore_eos else eos_token_ids)

    @property
    def text(self) -> str | None:
        """The answer's text so far (None without a tokenizer), cut before a stop string."""
        return self._text.text if self._text is not None else None

    @property
    def done(self) -> bool:
        """The answer is over (`finish_reason` is set)."""
        return self.finish_reason is not None

    def pick(self, logits: torch.Tensor) -> int:
        """The next token from this sequence's row of logits (its sampling options, its own generator)."""
        return self._picker.pick(logits)

    def add(self, token: int) -> str:
        """Take the next token; return the text it makes showable (maybe ""). Sets `finish_reason` when
        the answer is over; then also returns the text held back until then."""
        if self.done:
            raise RuntimeError(f"Answer.add after the answer finished ({self.finish_reason})")
        self.tokens.append(token)
        shown = ""
        if token in self._eos:
            self.finish_reason = "stop"
        elif self._text is not None:
            shown = self._text.add(token)
            if self._text.stopped:
                self.finish_reason = "stop"
        if self.finish_reason is None and len(self.tokens) >= self.params.max_tokens:
            self.finish_reason = "length"
        if self.done and self._text is not None:
            shown += self._text.finish()
        return shown

    def usage(self) -> dict[str, int]:
        """OpenAI's token counts: ``prompt_tokens``, ``completion_tokens``, ``total_tokens``."""
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": len(self.tokens),
                "total_tokens": self.prompt_tokens + len(self.tokens)}
