"""Gradients: taken from autograd as each parameter's gradient is final, reduced to the owning rank's
partition (averaged over ranks), and accumulated in float32 beside the record: in memory, or, when
the optimizer state is on NVMe, in a gradient swap file (so host memory does not grow with the model).

Per parameter and backward, in order:
1. AccumulateGrad's pre-hook: if the parameter was released, give it a full-shaped zero-stride
   stand-in so that autograd's shape check passes (no memory is allocated for it);
2. the post-accumulate-grad hook: take ``param.grad`` (autograd has summed every use of a tied
   parameter into it), clear it, reduce it to this rank's partition and accumulate it.
"""

from __future__ import annotations

import collections
import functools
from typing import Callable

import torch
import torch.distributed as dist

from tensorio import aligned_tensor

from offload.params.store import ParamRecord, ParamStore
from offload.storage.swapfile import SwapFile

_WRITES_IN_FLIGHT = 2
"""Offloaded gradient writes in flight at once before backward waits for the oldest."""


class GradReducer:
    """Installs the two gradient hooks on every trainable parameter and reduces into its record."""

    def __init__(self, store: ParamStore, *, world_size: int, rank: int, group: object = None,
                 swap: SwapFile | None = None,
                 consumer: Callable[[ParamRecord, torch.Tensor], None] | None = None, norms: bool = False) -> None:
        self.store, self.world_size, self.rank, self.group = store, world_size, rank, group
        self.swap = swap
        self.consumer = consumer
        """Takes each reduced gradient partition of the accumulation's last micro-batch, with the earlier
        ones added, instead of accumulating it (updates during backward)."""
        self.norms = norms
        """Take each accumulated partition's norm (``rec.grad_norm``) in the last micro-batch, as it is
        reduced (the step in the next forward validates with them)."""
        self.boundary = True
        """This backward ends a gradient accumulation (the engine sets it before each backward)."""
        self._nccl = world_size > 1 and dist.get_backend(group) == "nccl"
        self._writes: collections.deque = collections.deque()
        self._hooks = []
        for rec in store.records:
            if rec.accumulator is None:
                continue
            if swap is not None:
                rec.grad_offset = swap.allocate(rec.partition_numel * 4)
            before, after = functools.partial(self._before_accumulate, rec), functools.partial(self._after_accumulate, rec)
            self._hooks.append(rec.accumulator.register_prehook(before))
            self._hooks.append(rec.param.register_post_accumulate_grad_hook(after))

    def _before_accumulate(self, rec: ParamRecord, grads: tuple) -> None:
        if rec.full is None:  # released: a stand-in of the full shape, zero strides, one element
            rec.param.data = torch.zeros((), dtype=rec.param.dtype).expand(rec.shape)

    def _after_accumulate(self, rec: ParamRecord, param: torch.Tensor) -> None:
        grad, param.grad = param.grad, None
        if rec.full is None:
            param.data = self.store.placeholder(param.dtype)
        self.reduce(rec, grad)

    def reduce(self, rec: ParamRecord, grad: torch.Tensor) -> None:
        """Reduce a full gradient to this rank's partition (mean over ranks) and accumulate it in fp32."""
        flat = grad.reshape(-1)
        if self.world_size == 1:
            part = flat.float()  # no copy for fp32: autograd handed this tensor over
        else:
            padded = torch.zeros(rec.partition_numel * self.world_size, dtype=torch.float32)
            padded[:rec.numel] = flat
            if self._nccl:
                part = torch.empty(rec.partition_numel, dtype=torch.float32)
                dist.reduce_scatter_tensor(part, padded, group=self.group)
            else:  # gloo has no reduce-scatter: all-reduce, keep this rank's slice
                dist.all_reduce(padded, group=self.group)
                part = padded.chunk(self.world_size)[self.rank].clone()  # not a view: the rest is freed
            part.div_(self.world_size)
        if self.consumer is not None and self.boundary:
            if rec.grad is not None:  # the earlier micro-batches', kept: added as autograd accumulates
                part, rec.grad = rec.grad.add_(part), None
            elif rec.grad_on_disk:  # kept in the swap file (sync points: its last write, then the read)
                self.drain()
                part, rec.grad_on_disk = self.read(rec).add_(part), False
            rec.grad_norm = torch.linalg.vector_norm(part)
            self.consumer(rec, part)
            return
        if self.swap is None:
            if rec.grad is None:
                rec.grad = part if part.is_contiguous() else part.contiguous()
            else:
                rec.grad.add_(part)
            if self.norms and self.boundary:  # one pass, while the gradient is in cache
                rec.grad_norm = torch.linalg.vector_norm(rec.grad)
            return
        # Offloaded: read-add-write when accumulating, then write behind (bounded writes in flight),
        # always from a page-aligned buffer so that the write goes straight to the disk (O_DIRECT).
        if rec.grad_on_disk:
            self.drain()  # sync point: this record's previous write must have landed
            buffer = self.read(rec)
            buffer.add_(part)
        else:
            buffer = aligned_tensor(rec.partition_numel, torch.float32)
            buffer.copy_(part)
        del part, grad, flat
        rec.grad_norm = torch.linalg.vector_norm(buffer)  # one pass, while the buffer is in cache
        self._writes.append((self.swap.write(buffer, rec.grad_offset), buffer))
        rec.grad_on_disk = True
        while len(self._writes) > _WRITES_IN_FLIGHT:
            self._writes.popleft()[0].result()

    def read(self, rec: ParamRecord) -> torch.Tensor:
        """This step's offloaded gradient partition of ``rec`` (float32), read now."""
        buffer, future = self.start_read(rec)
        future.result()
        return buffer

    def start_read(self, rec: ParamRecord):
        """Start reading this step's offloaded gradient partition: (buffer, future)."""
        return self.swap.read_new(rec.partition_numel, torch.float32, rec.grad_offset)

    def drain(self) -> None:
        """Wait for every gradient write in flight (sync point). Raises TensorIOError."""
        while self._writes:
            self._writes.popleft()[0].result()

    def clear(self) -> None:
        """Forget this step's gradients (after the step, or when it is skipped)."""
        self.drain()
        for rec in self.store.records:
            rec.grad = None
            rec.grad_on_disk = False
            rec.grad_norm = None

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        self.drain()
        if self.swap is not None:
            self.swap.close()
