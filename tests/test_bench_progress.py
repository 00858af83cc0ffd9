"""The sweep's progress (bench/progress.py): a bar on a terminal, a few whole lines in a log."""

from __future__ import annotations

import io

from bench.progress import Progress


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_log_gets_a_line_each_tenth_and_no_carriage_returns():
    log = io.StringIO()
    with Progress(25, stream=log) as progress:
        for _ in range(25):
            progress.describe("io_uring bs=1M qd=8 t=1")
            progress.step("W 1.00 R 2.00 GB/s")
    lines = log.getvalue().splitlines()
    assert "\r" not in log.getvalue()
    assert [line.split()[1] for line in lines] == ["3/25", "6/25", "9/25", "12/25", "15/25", "18/25", "21/25",
                                                   "24/25", "25/25"]
    assert lines[-1].startswith("sweep: 25/25 points (100%), ") and lines[-1].endswith(" s")


def test_a_resumed_count_starts_where_it_was():
    log = io.StringIO()
    with Progress(10, stream=log, done=7) as progress:
        progress.step()
        progress.step()
        progress.step()
    assert [line.split()[1] for line in log.getvalue().splitlines()] == ["8/10", "9/10", "10/10"]


def test_a_terminal_gets_the_bar_and_disabled_shows_nothing():
    terminal = _Terminal()
    with Progress(4, stream=terminal) as progress:
        progress.describe("disk 1/1")
        for _ in range(4):
            progress.step("W 1.00 R 2.00 GB/s")
    assert "\r" in terminal.getvalue() and "4/4" in terminal.getvalue() and "disk 1/1" in terminal.getvalue()
    quiet = _Terminal()
    with Progress(4, stream=quiet, enabled=False) as progress:
        progress.step()
    assert quiet.getvalue() == ""
