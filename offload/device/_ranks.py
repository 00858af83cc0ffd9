"""Rank to device: which device index each rank of a node computes on, and the check that no two ranks of a
node compute on one device. The same rule for CUDA's GPUs and the simulated device's indices (docs/engine.md,
"Several GPUs and nodes")."""

from __future__ import annotations

import socket
import zlib

import torch
import torch.distributed as dist

from offload.device._base import Device

__all__ = ["check_rank_devices", "rank_gpu"]


def rank_gpu(current: int, local_rank: str | None, count: int, *, count_setting: str = "CUDA_VISIBLE_DEVICES") -> int:
    """The device index this process computes on: ``current`` (torch.cuda.current_device()) where the caller
    chose one (anything but 0) or no launcher set ``LOCAL_RANK``; else ``LOCAL_RANK``, so that the ranks of a
    node each take their own GPU instead of all computing on GPU 0. Raises ValueError naming LOCAL_RANK when
    it is not an index of the ``count`` devices this process sees (``count_setting`` says what sets them)."""
    if current != 0 or local_rank is None or local_rank.strip() == "":
        return current
    if not local_rank.strip().isdigit():
        raise ValueError(f"LOCAL_RANK: {local_rank!r} is not a GPU index")
    index = int(local_rank)
    if index >= count:
        raise ValueError(f"LOCAL_RANK {index}: this process sees {count} GPU{'s' if count != 1 else ''}, so rank "
                         f"{index} of this node has none of its own; run at most {count} ranks per node "
                         f"(torchrun --nproc_per_node {count}) or give each rank its GPU ({count_setting})")
    return index


def check_rank_devices(device: Device, group: dist.ProcessGroup | None = None) -> None:
    """Raise ValueError naming both ranks, the device and the fix where two ranks of ``group`` (default: the
    world) on one node compute on the same device (the caller gave both the same one, e.g. the same
    ``torch.cuda.set_device``): their kernels and memory would share one GPU, and NCCL refuses it. Nothing to
    check where compute is on the host. A collective over the group (every rank calls it, at ``initialize``)."""
    if not device.separate_memory:
        return
    world = dist.get_world_size(group)
    node = zlib.crc32(socket.gethostname().encode())
    mine = device.collective_tensor(torch.tensor([node, device.torch_device.index or 0], dtype=torch.int64))
    gathered = [device.collective_empty(2, torch.int64) for _ in range(world)]
    device.check_collective(mine, *gathered, op="check_rank_devices")
    dist.all_gather(gathered, mine, group=group)
    seen: dict[tuple[int, int], int] = {}
    for rank, pair in enumerate(device.collective_to_host(t) for t in gathered):
        key = (int(pair[0]), int(pair[1]))
        if key in seen:
            raise ValueError(
                f"ranks {seen[key]} and {rank} of this node both compute on {device.torch_device.type}:{key[1]}; "
                f"give each rank of a node its own device: leave the choice to the engine (under torchrun each rank "
                f"takes the device of its LOCAL_RANK) or set a different one on each rank before initialize")
        seen[key] = rank
