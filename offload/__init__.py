"""Offload of parameters, gradients and optimizer states to host memory or NVMe, built on tensorio."""

__all__: list[str] = []
