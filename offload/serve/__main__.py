"""``python -m offload.serve CHECKPOINT [--host 127.0.0.1] [--port 8000] [...] [--debug]``: see
offload/serve/cli.py. User errors end in one line; ``--debug`` (or ``OFFLOAD_DEBUG=1``) shows their traceback."""

import sys

from offload.cli_errors import run_command
from offload.serve.cli import main

if __name__ == "__main__":
    sys.exit(run_command(main, "python -m offload.serve"))
