"""Ranks of a multi-process test, started quickly: forked from one server process per test worker that
imported torch and transformers' GPT-2 once (multiprocessing's "forkserver"), rather than each a fresh
interpreter that imports them again (4 s of CPU a rank here, with "spawn").

Not "fork": a child forked from a process that ran OpenMP kernels can hang in its first one; the server
never runs any. It forks a child for each rank, which then unpickles its target (importing the test's
module). Two things "spawn" gave that a server started earlier does not, made explicit: each rank gets
the environment of the test at the moment it starts (MASTER_PORT, ...), and a rank's exception comes back
in the test's failure message (the server's standard error may be another test's captured one).
"""

from __future__ import annotations

import multiprocessing
import os
import tempfile
import traceback
from pathlib import Path
from typing import Any, Callable, Sequence

__all__ = ["run_ranks"]

_PRELOAD = ["torch", "torch.distributed", "transformers.models.gpt2.modeling_gpt2"]
_context = None


def _forkserver():
    global _context
    if _context is None:
        _context = multiprocessing.get_context("forkserver")
        _context.set_forkserver_preload(_PRELOAD)  # modules that fail to import are skipped by the server
    return _context


def _rank_main(environ: dict[str, str], report: str, target: Callable[..., Any], args: tuple) -> None:
    os.environ.clear()
    os.environ.update(environ)
    try:
        target(*args)
    except BaseException:
        with open(report, "w", encoding="utf-8") as file:
            file.write(traceback.format_exc())
        raise


def run_ranks(target: Callable[..., Any], args: Sequence[tuple], *, timeout: float | None = None) -> None:
    """Run ``target(*args[r])`` in one process per rank ``r``, all at once, each with this process's
    environment as it is now; wait for them (``timeout`` seconds each at most). Raises AssertionError with
    each failed rank's exit code and traceback unless every rank exited 0."""
    ctx = _forkserver()
    environ = dict(os.environ)
    with tempfile.TemporaryDirectory(prefix="ranks-") as reports:
        paths = [os.path.join(reports, f"rank{r}.txt") for r in range(len(args))]
        procs = [ctx.Process(target=_rank_main, args=(environ, path, target, rank_args))
                 for path, rank_args in zip(paths, args)]
        for proc in procs:
            proc.start()
        for proc in procs:
            proc.join(timeout)
        failed = []
        for rank, (proc, path) in enumerate(zip(procs, paths)):
            if proc.exitcode is None:
                proc.kill()
                proc.join()
                failed.append(f"rank {rank}: still running after {timeout} s (killed)")
            elif proc.exitcode != 0:
                told = Path(path).read_text(encoding="utf-8") if os.path.exists(path) else "(no traceback)"
                failed.append(f"rank {rank}: exit code {proc.exitcode}\n{told}")
    assert not failed, "\n".join(failed)
