"""The command line's one-line errors and exit statuses (shared by `bench.cli` and the modules it calls)."""

from __future__ import annotations

EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 1, 2, 130


class CliError(Exception):
    """A failure to report in one line and exit with ``status``, without a traceback."""

    def __init__(self, message: str, status: int = EXIT_FAILED) -> None:
        super().__init__(message)
        self.status = status
