"""From ``deepspeed.initialize``'s arguments to an engine: the config resolved, the process group
started where the launcher asks for one, the engine assembled (`offload.train.assemble`) and the
DataLoader of ``training_data`` made. `offload.train.engine.initialize` is the documented entry point.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Iterable, Mapping

import torch
import torch.distributed as dist
from torch import nn

from offload.config import EngineConfig, world_size_from_env
from offload.device import Device, check_process_group, check_rank_devices, device_for, start_process_group
from offload.train.assemble import assemble
from offload.train.step.stop import destroy_group
from offload.train.surface import check_distributed_arguments, config_from_arguments


def engine_from_arguments(*, args: Any, model: nn.Module | None, optimizer: Any, model_parameters: Iterable[Any] | None,
                          training_data: Any, lr_scheduler: Any, mpu: Any, dist_init_required: bool | None,
                          collate_fn: Callable | None, config: Mapping[str, Any] | str | os.PathLike | None,
                          mesh_param: Any, config_params: Mapping[str, Any] | None,
                          make_engine: Callable[..., Any], compute_device: Device | str | None = None,
                          ) -> tuple[Any, torch.optim.Optimizer, Any, Any]:
    """`offload.train.engine.initialize`'s work (see its docstring for the arguments and what it raises);
    ``make_engine`` builds the engine from its assembled parts."""
    if model is None and isinstance(args, nn.Module):
        raise ValueError("model: missing; the first positional argument of initialize is args, as in "
                         "deepspeed.initialize: pass model=...")
    if model is None:
        raise ValueError("model: missing; pass model=<the torch.nn.Module to train>")
    config = config_from_arguments(args, config, config_params)
    check_distributed_arguments(dist_init_required, mpu, mesh_param, world_size_from_env())
    started = dist.is_available() and dist.is_initialized()
    # The config first (its compute_device says which process group to start), checked against the
    # world size the group will have.
    world_size = dist.get_world_size() if started else world_size_from_env()
    if isinstance(config, EngineConfig):
        cfg = config
    elif isinstance(config, Mapping):
        cfg = EngineConfig.from_dict(config, world_size=world_size)
    else:
        cfg = EngineConfig.from_file(config, world_size=world_size)
    device = compute_device_of(cfg, compute_device)
    if dist_init_required and not started:
        start_process_group(device)
    world_size, rank, group = _process_group(device)
    try:
        if world_size > 1:
            check_rank_devices(device, group)  # no two ranks of a node on one device (a collective: every rank)
        engine = assemble(model, cfg, world_size=world_size, rank=rank, group=group, optimizer=optimizer,
                          lr_scheduler=lr_scheduler, model_parameters=model_parameters, make_engine=make_engine,
                          device=device)
    except BaseException:
        destroy_group(group)
        raise
    loader = None
    if training_data is not None:
        loader = torch.utils.data.DataLoader(training_data, batch_size=cfg.train_micro_batch_size_per_gpu,
                                             collate_fn=collate_fn, shuffle=world_size == 1,
                                             sampler=None if world_size == 1 else
                                             torch.utils.data.DistributedSampler(training_data, world_size, rank))
    return engine, engine.optimizer, loader, engine.lr_scheduler


def compute_device_of(cfg: EngineConfig, given: Device | str | None) -> Device:
    """The `Device` the engine computes on: ``given`` (a Device, as tests pass the simulated one, or a
    choice overriding the config's), else the config's ``compute_device`` with its budget. Raises
    ValueError naming ``compute_device`` for "cuda" without CUDA, and ``compute_device_budget`` with the
    figures for a budget over the device's free memory."""
    if isinstance(given, Device):
        return given
    return device_for(given or cfg.compute_device, setting="compute_device", budget_bytes=cfg.compute_device_budget,
                      budget_setting="compute_device_budget")


def check_group_carries(device: Device, backend: str) -> None:
    """Raise ValueError naming the backend, the device and the fix when a process group the caller started
    with ``backend`` cannot carry collectives of tensors on ``device`` (gloo for compute on a GPU, whose
    all-gathers and reduce-scatters take GPU tensors: DeepSpeed needs NCCL there too)."""
    if backend == "gloo" and device.collective_backend == "nccl":
        raise ValueError(f"the torch.distributed process group uses \"gloo\", but the engine computes on the "
                         f"{device.name} device, whose all-gathers and reduce-scatters need \"nccl\"; start the group "
                         f"with torch.distributed.init_process_group(\"nccl\"), or leave it to the engine")


def _process_group(device: Device) -> tuple[int, int, Any]:
    """World size, rank and the engine's process group (`engine_group`); starts the default process group
    when launched by torchrun. Raises ValueError when a group the caller started cannot carry the engine's
    collectives."""
    if dist.is_available() and dist.is_initialized():
        check_process_group(device)
        check_group_carries(device, dist.get_backend())
    else:
        if world_size_from_env() == 1:
            return 1, 0, None  # no process group needed
        start_process_group(device)
    world_size = dist.get_world_size()
    return world_size, dist.get_rank(), engine_group(device) if world_size > 1 else None


def engine_group(device: Device) -> Any:
    """The process group the engine's collectives run in: over gloo, a group of its own of every rank, made
    now (a collective: every rank); None (the default group) over NCCL, whose second communicator would cost
    device memory.

    Why its own: a rank that fails outside the ranks' agreement stops the others by destroying the group
    (offload/train/step/stop.py), and gloo closes a group's connections only once nothing holds it, which
    the default group cannot promise (``import torch.distributed.nn`` after ``init_process_group`` binds it
    as a default argument for good). The default group stays the caller's, usable after such a stop."""
    return dist.new_group(backend="gloo") if device.collective_backend == "gloo" else None
