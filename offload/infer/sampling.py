"""Sampling options of one request, and the pick of its next token: each sequence of a batch samples
with its own temperature, top-p, top-k and seed (a `torch.Generator` of its own), so that a request's
answer does not depend on the others it shares the batch with. Used by the server's batches
(offload/serve/) and by ``python -m offload.generate --prompts-file`` (offload/infer/prompts_file.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from transformers import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

__all__ = ["RequestError", "SamplingParams", "TokenPicker"]

_SEED_RANGE = (-(2**63), 2**64 - 1)  # what torch.Generator.manual_seed takes


class RequestError(ValueError):
    """A request's field is missing or has a value that is not allowed; ``param`` names the field
    (as OpenAI's error body does), None where the request as a whole is wrong."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def _number(name: str, value: object, low: float, high: float, *, low_open: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise RequestError(f"{name}: expected a number, got {value!r}", name)
    if value < low or value > high or (low_open and value == low):
        interval = f"{'(' if low_open else '['}{low:g}, {high:g}]"
        raise RequestError(f"{name}: {value!r} is outside {interval}", name)
    return float(value)


@dataclass(kw_only=True, slots=True)
class SamplingParams:
    """How one request's tokens are picked and when it stops. Raises `RequestError` naming the field
    for a value that is not allowed."""

    max_tokens: int | None = None
    """New tokens at most; None: as many as the model's context leaves (`prompt.fit_context`)."""
    temperature: float = 1.0
    """0: greedy (the most likely token); otherwise the logits are divided by it before sampling. 0 to 2."""
    top_p: float = 1.0
    """Sample among the most likely tokens whose probabilities add up to this (nucleus sampling). (0, 1]."""
    top_k: int = 0
    """Sample among this many most likely tokens; 0: all."""
    stop: tuple[str, ...] = ()
    """Strings that end the answer where they appear (the answer excludes them); at most 16."""
    seed: int | None = None
    """The sequence's own random generator's seed; None: a random one."""
    ignore_eos: bool = False
    """Go on past the end-of-sequence token (benchmarks: every answer max_tokens long)."""

    def __post_init__(self) -> None:
        if self.max_tokens is not None:
            if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int):
                raise RequestError(f"max_tokens: expected an integer, got {self.max_tokens!r}", "max_tokens")
            if self.max_tokens < 1:
                raise RequestError(f"max_tokens: {self.max_tokens} is not allowed; ask for at least 1", "max_tokens")
        self.temperature = _number("temperature", self.temperature, 0.0, 2.0)
        self.top_p = _number("top_p", self.top_p, 0.0, 1.0, low_open=True)
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise RequestError(f"top_k: expected an integer of at least 0 (0: all tokens), got {self.top_k!r}", "top_k")
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) and s for s in stop):
            raise RequestError(f"stop: expected a non-empty string or a list of them, got {self.stop!r}", "stop")
        if len(stop) > 16:
            raise RequestError(f"stop: {len(stop)} strings given; at most 16 are allowed", "stop")
        self.stop = tuple(stop)
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not _SEED_RANGE[0] <= self.seed <= _SEED_RANGE[1]):
            raise RequestError(f"seed: expected a 64-bit integer, got {self.seed!r}", "seed")
        if not isinstance(self.ignore_eos, bool):
            raise RequestError(f"ignore_eos: expected true or false, got {self.ignore_eos!r}", "ignore_eos")

    @property
    def greedy(self) -> bool:
        """Temperature 0, or top-k 1: the most likely token, no randomness."""
        return self.temperature == 0 or self.top_k == 1


class TokenPicker:
    """Picks one sequence's next token from its logits with `SamplingParams`: the arg max when greedy,
    else transformers' temperature, top-k and top-p warpers, then a draw from the sequence's own
    generator (seeded by ``seed``: the same seed gives the same answer, alone or in a batch)."""

    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        self._warpers = []
        if not params.greedy:
            self._warpers.append(TemperatureLogitsWarper(params.temperature))
            if params.top_k:
                self._warpers.append(TopKLogitsWarper(params.top_k))
            if params.top_p < 1.0:
                self._warpers.append(TopPLogitsWarper(params.top_p))
        self._generator = torch.Generator()
        if params.seed is None:
            self._generator.seed()
        else:
            self._generator.manual_seed(params.seed)

    def pick(self, logits: torch.Tensor) -> int:
        """The next token for ``logits`` (one row, the vocabulary's scores, any device and dtype)."""
        if self.params.greedy:
            return int(logits.argmax())
        scores = logits.detach().float().cpu().reshape(1, -1)
        for warper in self._warpers:
            scores = warper(None, scores)
        probabilities = torch.softmax(scores, dim=-1)
        return int(torch.multinomial(probabilities, 1, generator=self._generator))
