"""``python -m offload.swapfiles DIR [--remove]``: the stale swap files in DIR, and their removal.

A swap file (``offload-<kind>-<pid>-<random>.swp``, see docs/engine.md) is removed by ``engine.close()``
or at exit; one left by a process that was killed (SIGKILL, the OOM killer, a power cut) stays until
the next engine or OffloadAdam with swap files in the same directory starts, which removes it with a
log line. This command lists such files at any time, with their size and the process that left them,
and removes them with ``--remove``. Files of running processes are never listed: their owner holds a
lock on them (see `offload.storage.swapfile`).

    $ python -m offload.swapfiles /nvme/swap
    /nvme/swap/offload-params-81234-1f2e3d4c.swp  512.0 MB  process 81234 is not running
    1 stale swap file (512.0 MB) in /nvme/swap; 2 of running processes left alone; --remove deletes it

Exit status: 0, or 1 when a file could not be removed, 2 for a directory that cannot be listed.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Sequence

from offload.storage.swapfile import is_swap_file_name, remove_stale_swap_files, stale_swap_files

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command with ``argv`` (default: ``sys.argv[1:]``); return its exit status."""
    parser = argparse.ArgumentParser(prog="python -m offload.swapfiles", description=__doc__.split("\n\n")[0])
    parser.add_argument("directory", help="a directory that holds swap files (an nvme_path)")
    parser.add_argument("--remove", action="store_true", help="delete the stale swap files listed")
    args = parser.parse_args(argv)
    directory = os.path.abspath(args.directory)
    try:
        if not os.path.isdir(directory):
            raise NotADirectoryError(f"{directory} is not a directory" if os.path.exists(directory)
                                     else f"{directory} does not exist")
        stale = stale_swap_files(directory)
        total = sum(1 for name in os.listdir(directory) if is_swap_file_name(name))
    except OSError as exc:
        print(f"python -m offload.swapfiles: {exc}", file=sys.stderr)
        return 2
    for entry in stale:
        print(f"{entry.path}  {entry.nbytes / 1e6:.1f} MB  {entry.reason}")
    live = total - len(stale)
    nbytes = sum(entry.nbytes for entry in stale)
    files = f"{len(stale)} stale swap file{'' if len(stale) == 1 else 's'} ({nbytes / 1e6:.1f} MB) in {directory}"
    if not args.remove:
        hint = f"; --remove deletes {'it' if len(stale) == 1 else 'them'}" if stale else ""
        print(f"{files}; {live} of running processes left alone{hint}")
        return 0
    removed = {entry.path for entry in remove_stale_swap_files(directory)}
    failed = [entry for entry in stale if entry.path not in removed and os.path.exists(entry.path)]
    for entry in failed:
        print(f"could not remove {entry.path} (see the warning above)", file=sys.stderr)
    print(f"{files}: {len(removed)} removed; {live} of running processes left alone")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
