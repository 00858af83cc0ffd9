"""The swap space a training run will need, checked before anything is written: a run that cannot
fit is refused at the start with the figures, not hours later with ENOSPC."""

from __future__ import annotations

import errno
import os
import shutil
from dataclasses import dataclass

from offload.config import EngineConfig
from offload.params.partition import partition_numel
from offload.storage.drive_speed import measured_weights
from offload.storage.striped import STRIPE_BYTES, StripeLayout
from offload.storage.swapfile import PAGE, aligned_size

__all__ = ["SwapSpace", "check_swap_space", "swap_space_needed"]

_STATE_BYTES = 8
"""Optimizer state per element of an fp32 parameter: exp_avg and exp_avg_sq (fp32)."""

_MASTER_BYTES = 4
"""Plus, for a 16-bit parameter, its fp32 master copy."""

_SLOTS = 2
"""The optimizer state's A/B slots (see docs/optimizer_offload.md), and the on-disk parameter
partitions' (a step's update goes to the uncommitted one: docs/engine.md, "Swap files")."""


@dataclass(frozen=True, slots=True)
class SwapSpace:
    """Bytes each swap file will hold at most, by directory."""

    params: int
    optimizer: int
    grads: int

    @property
    def total(self) -> int:
        return self.params + self.optimizer + self.grads


def swap_space_needed(cfg: EngineConfig, params: list[tuple[int, int, bool, bool | None]], *, world_size: int,
                      grads_on_disk: bool, grads_in_param_slots: bool = False) -> SwapSpace:
    """The swap space of one rank: ``params`` holds (elements, element size, trainable, on disk) of each
    distinct parameter, in order; "on disk" is None for a parameter not placed yet (its partition goes
    to disk beyond ``max_in_cpu`` elements and above the persistence threshold, in two slots), else
    whether it was placed on disk already (by `offload.zero.Init`: its space is taken). The optimizer
    keeps ``ratio`` of its state on NVMe in two slots; offloaded gradients are fp32, except where
    ``grads_in_param_slots`` puts an on-disk fp32 partition's gradient in its uncommitted slot
    (`GradReducer`). An upper bound: sub-group padding is counted as a page per parameter."""
    zero = cfg.zero_optimization
    on_disk = state = grads = 0
    in_cpu = 0
    for numel, size, trainable, placed in params:
        part = partition_numel(numel, world_size)
        disk = bool(placed)
        if placed is None and zero.offload_param.device == "nvme" and numel > zero.stage3_param_persistence_threshold:
            disk = in_cpu + part > zero.offload_param.max_in_cpu
            if disk:
                on_disk += _SLOTS * aligned_size(part * size)
            else:
                in_cpu += part
        if not trainable:
            continue  # frozen: no optimizer state, no gradient
        state += (_STATE_BYTES + (_MASTER_BYTES if size < 4 else 0)) * part + PAGE
        if not (grads_in_param_slots and disk and size >= 4):
            grads += aligned_size(4 * part)
    off = zero.offload_optimizer
    optimizer = int(_SLOTS * state * off.ratio) if off.device == "nvme" else 0
    return SwapSpace(params=on_disk, optimizer=optimizer, grads=grads if grads_on_disk and off.device == "nvme" else 0)


def check_swap_space(cfg: EngineConfig, needed: SwapSpace, ranks: int | None = None) -> None:
    """Raise OSError(ENOSPC) naming the directories, the bytes needed and the bytes free, when the file
    systems of ``offload_param.nvme_path`` and ``offload_optimizer.nvme_path`` cannot hold ``needed``
    (the two may share one file system) for each of the ``ranks`` of this node (default: ``LOCAL_WORLD_SIZE``,
    `offload.device.local_ranks`) that shares this rank's drive (all of them, or their share of a list of
    ``nvme_path``s), whose partitions are the same size. A rank with several drives (``rank_paths``) needs
    on each its stripes of each swap file (`offload.storage.striped.StripeLayout.drive_bytes`), by the
    drives' weights (``stripe_weights``, or measured as the swap files will measure them)."""
    from offload.device import local_ranks

    ranks = local_ranks() if ranks is None else ranks
    zero = cfg.zero_optimization
    wanted: dict[int, list[tuple[str, str, int]]] = {}
    sharing = 1
    for key, offload, files in (("offload_param.nvme_path", zero.offload_param, (needed.params,)),
                                ("offload_optimizer.nvme_path", zero.offload_optimizer, (needed.optimizer, needed.grads))):
        share = offload.rank_paths or ((offload.nvme_path,) if offload.nvme_path else ())
        if not sum(files) or not share:
            continue
        drives = max(1, len(offload.nvme_paths))  # a list spreads the node's ranks over its drives
        sharing = max(sharing, -(-ranks // drives))
        weights = (offload.rank_weights or measured_weights(share, cfg.aio, key=f"zero_optimization.{key}")
                   if len(share) > 1 else (1,))
        layout = StripeLayout(STRIPE_BYTES, tuple(weights))
        for index, path in enumerate(share):  # this rank's drives: each holds its stripes of each file
            nbytes = sum(layout.drive_bytes(size, index) for size in files)
            wanted.setdefault(os.stat(path).st_dev, []).append((key, os.path.abspath(path), nbytes))
    for entries in wanted.values():
        total = sharing * sum(nbytes for _, _, nbytes in entries)
        free = shutil.disk_usage(entries[0][1]).free
        if total > free:
            what = " and ".join(f"zero_optimization.{key} {path!r} ({_gb(nbytes)})" for key, path, nbytes in entries)
            each = f" for each of the {sharing} ranks of this node on it (LOCAL_WORLD_SIZE {ranks})" if sharing > 1 else ""
            raise OSError(errno.ENOSPC, f"not enough swap space: {what}{each} need {_gb(total)} in all (parameters "
                                        f"{_gb(needed.params)}, optimizer state in two slots {_gb(needed.optimizer)}, "
                                        f"gradients {_gb(needed.grads)}), the file system has {_gb(free)} free; free "
                                        f"space, point nvme_path at a larger disk, or keep more in memory (max_in_cpu, "
                                        f"offload_optimizer.ratio)")


def _gb(nbytes: int) -> str:
    return f"{nbytes / 1e9:.3f} GB"
