"""``wall_clock_breakdown``: wall-clock time of named phases per step, logged as one line every
``steps_per_print`` steps::

    timers = PhaseTimers.from_config(config)
    for batch in data:
        with timers.phase("forward"):
            loss = engine(batch)
        with timers.phase("backward"):
            ...
        timers.step_done()   # every steps_per_print steps: "step 10 | ms per step ... | forward 12.31 | ..."
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from typing import Callable, Iterator

from offload.config import EngineConfig

__all__ = ["PhaseTimers"]


class PhaseTimers:
    """Accumulates the wall-clock time spent in named phases (forward, backward, step, swap_in, ...).

    Args:
        enabled: when False, ``phase`` does nothing and ``step_done`` never logs (no clock reads).
        steps_per_print: log the mean time per step of each phase over the last this many steps.
        log: called with each summary line (for example a rank-0 logger's ``info``).
        synchronize: called before each clock read, for example the compute device's ``synchronize`` so that
            queued device work is counted in the phase that queued it; None for host-only work.
        clock: seconds from a monotonic clock.

    A phase may run inside another (its time is then counted in both) and in any thread.
    Raises ValueError if steps_per_print < 1.
    """

    def __init__(
        self,
        *,
        enabled: bool = True,
        steps_per_print: int = 10,
        log: Callable[[str], None] = print,
        synchronize: Callable[[], None] | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        if isinstance(steps_per_print, bool) or not isinstance(steps_per_print, int) or steps_per_print < 1:
            raise ValueError(f"steps_per_print: {steps_per_print!r} is not allowed; use an integer >= 1")
        self.enabled = enabled
        self.steps_per_print = steps_per_print
        self._log = log
        self._synchronize = synchronize
        self._clock = clock
        self._lock = threading.Lock()
        self._window: dict[str, float] = {}
        self._totals: dict[str, float] = {}
        self._steps = 0
        self._window_steps = 0

    @classmethod
    def from_config(cls, config: EngineConfig, *, log: Callable[[str], None] = print,
                    synchronize: Callable[[], None] | None = None) -> "PhaseTimers":
        """Timers enabled by ``wall_clock_breakdown`` and logging every ``steps_per_print`` steps."""
        return cls(enabled=config.wall_clock_breakdown, steps_per_print=config.steps_per_print, log=log,
                   synchronize=synchronize)

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time the block as phase ``name`` (its time counts even if the block raises)."""
        if not self.enabled:
            yield
            return
        start = self._now()
        try:
            yield
        finally:
            elapsed = self._now() - start
            with self._lock:
                self._window[name] = self._window.get(name, 0.0) + elapsed
                self._totals[name] = self._totals.get(name, 0.0) + elapsed

    def step_done(self) -> str | None:
        """Count one step; every ``steps_per_print`` steps log the summary line and return it, else None."""
        if not self.enabled:
            return None
        with self._lock:
            self._steps += 1
            self._window_steps += 1
            if self._window_steps < self.steps_per_print:
                return None
            steps = self._window_steps
            parts = " | ".join(f"{name} {seconds * 1e3 / steps:.2f}" for name, seconds in self._window.items())
            line = f"step {self._steps} | ms per step over the last {steps} steps | {parts or 'no phases'}"
            self._window = dict.fromkeys(self._window, 0.0)
            self._window_steps = 0
        self._log(line)
        return line

    @property
    def totals(self) -> dict[str, float]:
        """Seconds spent in each phase since the start, in the order the phases first ran."""
        with self._lock:
            return dict(self._totals)

    @property
    def steps(self) -> int:
        """Steps counted by ``step_done`` so far."""
        return self._steps

    def _now(self) -> float:
        if self._synchronize is not None:
            self._synchronize()
        return self._clock()
