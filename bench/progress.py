"""Progress of a sweep: a tqdm bar on a terminal, a plain line every tenth of the way in a log.

A bar redraws itself with carriage returns, which a log file keeps as one endless line; where the
stream is not a terminal the same progress is a few whole lines instead.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import TextIO

__all__ = ["Progress"]


class Progress:
    """Counts ``total`` steps on ``stream`` (default stderr); ``enabled=False`` shows nothing.

    Use as a context manager: ``step(description, postfix)`` after each step, ``describe(text)`` before
    one. On a terminal (``stream.isatty()``) a tqdm bar; elsewhere a line such as "sweep: 12/120
    points (10%), 35 s" each time another tenth is done, and the last.
    """

    def __init__(self, total: int, *, enabled: bool = True, stream: TextIO | None = None, unit: str = "points",
                 done: int = 0) -> None:
        self.total, self.unit, self.count = total, unit, done
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled and total > 0
        self._bar = None
        self._lock = threading.Lock()  # devices swept at once step from their own threads
        self._started = time.monotonic()
        self._next_line = self._tenth_after(done)
        if self.enabled and _is_terminal(self.stream):
            from tqdm import tqdm

            self._bar = tqdm(total=total, initial=done, file=self.stream, unit="pt", dynamic_ncols=True)

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def describe(self, text: str) -> None:
        """What the next step is (shown on the bar; not in a log)."""
        with self._lock:
            if self._bar is not None:
                self._bar.set_description_str(text)

    def step(self, postfix: str = "") -> None:
        """One more step done; ``postfix`` is its result (on the bar)."""
        with self._lock:
            self.count += 1
            if self._bar is not None:
                if postfix:
                    self._bar.set_postfix_str(postfix)
                self._bar.update(1)
            elif self.enabled and (self.count >= self._next_line or self.count == self.total):
                elapsed = time.monotonic() - self._started
                print(f"sweep: {self.count}/{self.total} {self.unit} ({self.count / self.total:.0%}), "
                      f"{elapsed:.0f} s", file=self.stream, flush=True)
                self._next_line = self._tenth_after(self.count)

    def close(self) -> None:
        """End the bar (a no-op in a log)."""
        with self._lock:
            if self._bar is not None:
                self._bar.close()
                self._bar = None

    def _tenth_after(self, count: int) -> int:
        tenth = max(1, -(-self.total // 10))
        return (count // tenth + 1) * tenth


def _is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False
