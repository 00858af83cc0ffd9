"""Choosing the device and the collective backend from a setting, with clear errors."""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from offload.device._base import Device
from offload.device._cpu import CpuDevice
from offload.device._cuda import CudaDevice, cuda_available
from offload.device._simulated import SimulatedDevice

__all__ = ["DEVICE_CHOICES", "check_process_group", "collective_device", "device_for", "process_group_backend",
           "start_process_group"]

DEVICE_CHOICES = ("auto", "cpu", "cuda", "simulated")
"""What ``device_for`` takes: "auto" is CUDA where available, else the CPU; "simulated" is for tests."""


def device_for(choice: str, *, setting: str = "compute_device", budget_bytes: int | None = None,
               budget_setting: str = "device budget", index: int | None = None) -> Device:
    """The `Device` a setting names (see DEVICE_CHOICES), with an optional memory budget, on device ``index``
    where it has several (default: the current one, or under a launcher the rank's, `rank_gpu`; the CPU has one).

    Raises ValueError naming ``setting`` for an unknown choice or "cuda" without CUDA, and naming
    ``budget_setting`` with the figures for a budget over the device's free memory.
    """
    if choice not in DEVICE_CHOICES:
        raise ValueError(f"{setting}: {choice!r} is not allowed; use one of {', '.join(map(repr, DEVICE_CHOICES))}")
    if choice == "cuda" and not cuda_available():
        raise ValueError(f"{setting}: \"cuda\" is asked for but CUDA is not available here (torch {torch.__version__}, "
                         f"{'a CPU build' if torch.version.cuda is None else 'no GPU visible'}); use \"cpu\" or \"auto\"")
    if choice == "simulated":
        return SimulatedDevice(index, budget_bytes=budget_bytes, budget_setting=budget_setting)
    if choice == "cuda" or (choice == "auto" and cuda_available()):
        return CudaDevice(index, budget_bytes=budget_bytes, budget_setting=budget_setting)
    return CpuDevice(budget_bytes=budget_bytes, budget_setting=budget_setting)


def process_group_backend(device: Device, requested: str | None = None, *, setting: str = "dist_backend") -> str:
    """The torch.distributed backend to start for compute on ``device``: ``requested``, or the
    device's own (NCCL on CUDA, gloo otherwise). Raises ValueError naming ``setting`` when NCCL is
    asked for where compute is not on CUDA, or for a backend torch does not know."""
    backend = requested or device.collective_backend
    if backend == "nccl" and device.name != "cuda":
        raise ValueError(f"{setting}: \"nccl\" needs compute on CUDA, but compute is on the {device.name} device"
                         f"{'' if cuda_available() else ' (CUDA is not available here)'}; use \"gloo\" or leave it out")
    if backend not in ("nccl", "gloo", "mpi", "ucc"):
        raise ValueError(f"{setting}: {backend!r} is not a torch.distributed backend; use \"gloo\" or \"nccl\"")
    return backend


def start_process_group(device: Device) -> None:
    """Start torch.distributed's default process group (from torchrun's environment) with the
    backend for compute on ``device``: gloo for the CPU, whether or not CUDA exists. Raises what
    ``torch.distributed.init_process_group`` raises for a bad launch environment."""
    dist.init_process_group(backend=process_group_backend(device))


def check_process_group(device: Device, group: dist.ProcessGroup | None = None) -> None:
    """Raise ValueError naming the backend and the fix when the process group the caller started
    cannot carry collectives for compute on ``device`` (NCCL reduces GPU tensors only)."""
    backend = dist.get_backend(group)
    if backend == "nccl" and device.name != "cuda":
        raise ValueError(f"the torch.distributed process group uses \"nccl\", but the engine computes on the "
                         f"{device.name} device and NCCL reduces only GPU tensors; start the group with "
                         f"torch.distributed.init_process_group(\"gloo\"), or leave it to the engine "
                         f"(dist_init_required=True or no group started)")


def collective_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """Where a collective over ``group`` (default: the world) needs its tensors, by the group's
    backend: the current GPU for NCCL, the CPU for gloo and the others. For code that holds a
    process group but no `Device` (the norm, overflow and checkpoint flags); code that holds a
    `Device` uses ``device.collective_tensor``."""
    return _backend_device(dist.get_backend(group)).collective_device()


@functools.lru_cache(maxsize=None)
def _backend_device(backend: str) -> Device:
    return CudaDevice() if backend == "nccl" else CpuDevice()
