"""``python -m offload.generate CHECKPOINT --prompt TEXT | --prompt-ids 1,2,3 [...] [--debug]``: see
offload/infer/cli.py. User errors end in one line; ``--debug`` (or ``OFFLOAD_DEBUG=1``) shows their traceback."""

import sys

from offload.cli_errors import run_command
from offload.infer.cli import main

if __name__ == "__main__":
    sys.exit(run_command(main, "python -m offload.generate"))
