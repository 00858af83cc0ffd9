"""`host_copy`: a copy between CPU tensors on the calling thread alone.

torch's ``copy_`` splits a large copy over its OpenMP threads, which wait for each other at the end; on a
machine whose few cores are busy (tensorio's I/O and checksum threads, other jobs) that wait dominates, and
copies ran 5-10x slower than one thread's memcpy (docs/engine.md, "Checkpoints"). numpy's copy is that
memcpy, and releases the GIL while it runs. numpy has no bfloat16: the bytes are copied, as uint8.
"""

from __future__ import annotations

import torch

__all__ = ["host_copy"]


def host_copy(dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """Copy ``src`` into ``dst`` (as ``dst.copy_(src)``) and return ``dst``.

    Two contiguous CPU tensors of the same dtype and shape (any dtype: the bytes are copied) are copied by
    one memcpy on this thread; anything else (a conversion, broadcasting, strides, another device) goes to
    ``copy_``, which raises its RuntimeError for tensors that do not fit.
    """
    if (dst.dtype != src.dtype or dst.shape != src.shape or dst.device.type != "cpu" or src.device.type != "cpu"
            or not dst.is_contiguous() or not src.is_contiguous() or src.is_conj() or src.is_neg()):
        return dst.copy_(src)
    if dst.numel():
        dst.detach().reshape(-1).view(torch.uint8).numpy()[:] = src.detach().reshape(-1).view(torch.uint8).numpy()
    return dst
