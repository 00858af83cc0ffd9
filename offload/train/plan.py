"""The training engine's plan: where this rank's partitions and optimizer state live, and where the
update runs; printable (``print(engine.plan)``), and the source of the warning when the config keeps
in memory what it asked to offload."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Sequence

from offload.config.engine import EngineConfig
from offload.params import ParamRecord
from offload.train.cpu_threads import CpuThreads

__all__ = ["TrainingPlan", "training_plan"]

log = logging.getLogger("offload")

_MODES = {"during backward": "during backward, as each gradient is final",
          "in the next forward": "in the next forward, in its order (clipping or fp16)",
          "after backward": "after backward, in chunks"}


@dataclass(frozen=True)
class TrainingPlan:
    """Where this rank's share of the model lives. Element counts are of partitions (this rank's)."""

    world_size: int
    rank: int
    param_device: str
    """``offload_param.device``: "none", "cpu" or "nvme"."""
    max_in_cpu: int
    """``offload_param.max_in_cpu``: partition elements kept in memory before the rest go to NVMe."""
    persistent: tuple[int, int]
    """(parameters, bytes) kept whole on every rank (``stage3_param_persistence_threshold``)."""
    in_memory: tuple[int, int]
    """(parameters, bytes) of the other partitions held in memory."""
    on_disk: tuple[int, int]
    """(parameters, bytes) of partitions in the parameter swap file."""
    optimizer_device: str
    """``offload_optimizer.device``."""
    optimizer_state_bytes: int
    """This rank's optimizer state (fp32 moments, and fp32 masters for 16-bit parameters)."""
    optimizer_on_nvme: float
    """The share of that state on NVMe (``offload_optimizer.ratio`` with device nvme, else 0)."""
    update: str
    """Where the update runs: "during backward", "in the next forward" or "after backward" (docs/engine.md,
    "Where the update runs")."""
    max_in_cpu_source: str = ""
    """How a ``max_in_cpu`` "auto" was found (`offload.train.sizing.auto_max_in_cpu`); "" for a number."""
    gradient_clipping: float = 0.0
    """The global gradient norm the step clips to (``gradient_clipping``); 0: no clipping."""
    clipping_by_default: bool = False
    """The config has no ``gradient_clipping``: DeepSpeed's default (1.0) is in force."""
    cpu_threads: CpuThreads | None = None
    """This rank's CPU threads and the node's cores (`offload.train.cpu_threads`); None: not chosen here."""

    @property
    def clipping(self) -> str:
        """The clipping in force, in words, with where it comes from."""
        if self.gradient_clipping == 0:
            return "off (gradient_clipping 0)"
        if self.clipping_by_default:
            return (f"global norm clipped at {self.gradient_clipping:g} (DeepSpeed's default: the config has no "
                    f"gradient_clipping; set it to 0 to turn clipping off)")
        return f"global norm clipped at {self.gradient_clipping:g} (gradient_clipping)"

    @property
    def kept_by_max_in_cpu(self) -> bool:
        """Parameters were asked on NVMe, and ``max_in_cpu`` keeps some of them in memory."""
        return self.param_device == "nvme" and self.in_memory[0] > 0

    def describe(self) -> str:
        """The plan as a few lines for people."""
        def share(count_bytes: tuple[int, int]) -> str:
            return f"{count_bytes[0]} parameters, {_gb(count_bytes[1])}"

        lines = [f"training plan (rank {self.rank} of {self.world_size}):",
                 f"  parameters (offload_param.device {self.param_device!r}):",
                 f"    on NVMe:   {share(self.on_disk)}",
                 f"    in memory: {share(self.in_memory)}"
                 + (f" (max_in_cpu {self.max_in_cpu:,} elements)" if self.param_device == "nvme" else "")
                 + (f"\n      max_in_cpu {self.max_in_cpu:,} elements = {self.max_in_cpu_source}"
                    if self.max_in_cpu_source else ""),
                 f"    whole on every rank (persistence threshold): {share(self.persistent)}"]
        on_nvme = round(self.optimizer_state_bytes * self.optimizer_on_nvme)
        lines.append(f"  optimizer state (offload_optimizer.device {self.optimizer_device!r}): "
                     f"{_gb(on_nvme)} on NVMe, {_gb(self.optimizer_state_bytes - on_nvme)} in memory")
        lines.append(f"  gradient clipping: {self.clipping}")
        lines.append(f"  the update runs {_MODES[self.update]}")
        if self.cpu_threads is not None:
            lines.append(f"  CPU threads: {self.cpu_threads.describe()}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.describe()


def training_plan(cfg: EngineConfig, records: Sequence[ParamRecord], update: str, *, world_size: int,
                  rank: int, max_in_cpu_source: str = "") -> TrainingPlan:
    """The plan of an engine built from ``cfg`` with ``records``; ``update`` is where the update runs;
    ``max_in_cpu_source`` how a ``max_in_cpu`` "auto" was found. Logs a warning (once, here) when a
    number given as ``max_in_cpu`` keeps in memory partitions the config put on NVMe, and (at info) the
    clipping in force when it is DeepSpeed's default rather than the config's."""
    zero = cfg.zero_optimization
    persistent, in_memory, on_disk = [0, 0], [0, 0], [0, 0]
    state_bytes = 0
    for rec in records:
        nbytes = rec.partition_numel * rec.partition.element_size()
        kind = (on_disk if rec.on_disk else persistent if rec.numel <= zero.stage3_param_persistence_threshold
                else in_memory)
        kind[0] += 1
        kind[1] += nbytes
        if rec.param.requires_grad:
            state_bytes += rec.partition_numel * (8 if rec.partition.element_size() == 4 else 12)
    optimizer = zero.offload_optimizer
    plan = TrainingPlan(world_size=world_size, rank=rank, param_device=zero.offload_param.device,
                        max_in_cpu=zero.offload_param.max_in_cpu, persistent=tuple(persistent),
                        in_memory=tuple(in_memory), on_disk=tuple(on_disk), optimizer_device=optimizer.device,
                        optimizer_state_bytes=state_bytes,
                        optimizer_on_nvme=optimizer.ratio if optimizer.device == "nvme" else 0.0, update=update,
                        max_in_cpu_source=max_in_cpu_source, gradient_clipping=cfg.gradient_clipping,
                        clipping_by_default=bool(cfg.source) and "gradient_clipping" not in cfg.source)
    if plan.kept_by_max_in_cpu and rank == 0 and not max_in_cpu_source:
        log.warning("zero_optimization.offload_param.device is \"nvme\", but max_in_cpu (%s elements) keeps %d of "
                    "%d partitions (%s) in memory and puts %d (%s) on NVMe; set max_in_cpu to 0 to put every "
                    "partition on NVMe (print(engine.plan) shows the placement)", f"{plan.max_in_cpu:,}",
                    plan.in_memory[0], plan.in_memory[0] + plan.on_disk[0], _gb(plan.in_memory[1]),
                    plan.on_disk[0], _gb(plan.on_disk[1]))
    if plan.clipping_by_default and rank == 0:
        log.info("gradient clipping: %s", plan.clipping)
    return plan


def _gb(nbytes: int) -> str:
    return f"{nbytes / 1e9:.3f} GB" if nbytes >= 1e7 else f"{nbytes / 1e6:.2f} MB"
