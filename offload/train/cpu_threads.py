"""CPU threads per rank: the node's cores shared by its ranks, unless the user chose.

With several ranks on a node (``LOCAL_WORLD_SIZE``), each rank's torch would start a team of one thread
per core, and the ranks' teams would preempt each other (their threads spinning at barriers while a
partner is off the core). So at `initialize` each rank takes ``cores // LOCAL_WORLD_SIZE`` intra-op
threads (at least one; the cores are this process's CPU affinity, hyperthreads included); the optimizer's
worker takes half of them (`offload.optim.threads`). Alone on its node a rank keeps torch's default.

The user has chosen when ``OMP_NUM_THREADS`` is set, with one exception that is detected, not guessed:
torchrun itself sets ``OMP_NUM_THREADS=1`` when the user did not and it starts several processes per
node. Under torchrun (``TORCHELASTIC_RUN_ID`` set) with several local ranks, ``OMP_NUM_THREADS=1`` is
therefore taken as torchrun's default and replaced by the share; the two cases cannot be told apart,
so a user who wants one thread per rank there calls ``torch.set_num_threads(1)`` after `initialize`
(torch's setting is not changed again). Any other value of ``OMP_NUM_THREADS`` is the user's.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping

import torch

__all__ = ["CpuThreads", "cpu_threads_per_rank", "set_cpu_threads"]


@dataclass(frozen=True, slots=True)
class CpuThreads:
    """This rank's CPU threads and where the number comes from."""

    threads: int
    """torch's intra-op threads for this rank."""
    node_cores: int
    """The cores this node's ranks share (this process's CPU affinity)."""
    local_ranks: int
    """The ranks of this job on the node (``LOCAL_WORLD_SIZE``)."""
    source: str
    """Why ``threads``: the node's share, or the user's setting."""

    @property
    def optimizer_threads(self) -> int:
        """The optimizer worker's OpenMP threads: half of this rank's, at least one (`offload.optim.threads`)."""
        return max(1, self.threads // 2)

    def describe(self) -> str:
        """One line for the plan."""
        return (f"{self.threads} for this rank (the optimizer's worker {self.optimizer_threads}) of the node's "
                f"{self.node_cores} cores, {self.local_ranks} rank{'s' if self.local_ranks > 1 else ''} on the "
                f"node: {self.source}")


def cpu_threads_per_rank(*, node_cores: int, local_ranks: int, environ: Mapping[str, str],
                         current: int) -> CpuThreads:
    """This rank's threads (a pure function of its inputs): ``node_cores // local_ranks`` (at least 1), unless
    ``environ``'s ``OMP_NUM_THREADS`` is the user's (see the module docstring), then ``current`` (torch's
    setting, which follows it). Raises ValueError for a ``node_cores`` or ``local_ranks`` below 1."""
    if node_cores < 1 or local_ranks < 1:
        raise ValueError(f"node_cores and local_ranks must be at least 1, got {node_cores} and {local_ranks}")
    omp = environ.get("OMP_NUM_THREADS", "").strip()
    torchrun_default = omp == "1" and local_ranks > 1 and bool(environ.get("TORCHELASTIC_RUN_ID"))
    if omp and not torchrun_default:
        return CpuThreads(current, node_cores, local_ranks, f"OMP_NUM_THREADS={omp} (set by the user)")
    if local_ranks == 1:
        return CpuThreads(current, node_cores, local_ranks, "torch's default (one rank on the node)")
    share = max(1, node_cores // local_ranks)
    why = f"the node's share, {node_cores} // LOCAL_WORLD_SIZE {local_ranks}"
    if torchrun_default:
        why += " (OMP_NUM_THREADS=1 is torchrun's default, replaced)"
    return CpuThreads(share, node_cores, local_ranks, why)


def node_cores() -> int:
    """The cores this process may run on (its CPU affinity, which torchrun's ranks share), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # no affinity on this platform
        return max(1, os.cpu_count() or 1)


def set_cpu_threads() -> CpuThreads:
    """Set torch's intra-op threads to this rank's share (`cpu_threads_per_rank`, from this process's
    environment) before the optimizer's worker starts; return what was chosen. Raises ValueError for a bad
    ``LOCAL_WORLD_SIZE`` (naming it)."""
    from offload.device import local_ranks

    chosen = cpu_threads_per_rank(node_cores=node_cores(), local_ranks=local_ranks(), environ=os.environ,
                                  current=torch.get_num_threads())
    if chosen.threads != torch.get_num_threads():
        torch.set_num_threads(chosen.threads)
    return chosen
