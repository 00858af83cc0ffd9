"""Coalesced all-gathers: the partitions a module needs, gathered across ranks in one collective.

A module's forward gathers every partition of it that is not gathered yet at once (`ParamStore.gather_together`),
and so does backward for the parameters of one module its saved tensors need. Per call, in order:

1. pack: the partitions, in the module's order, side by side in one flat input of ``total`` elements;
2. gather: one all-gather (`all_gather_flat`) of that input into a flat buffer of ``world_size x total``
   elements: row ``r`` holds rank ``r``'s partitions;
3. unpack: each parameter's full tensor is copied out of its column of every row into a buffer of its
   own (its own storage: the saved-tensor hooks find a parameter by its storage, and a device buffer is
   released by its own references), then the flat buffers go.

A module with a single partition to gather skips 1 and 3: it is all-gathered straight into its full
buffer. Partitions of different dtypes go in one call per dtype. The extra memory, the flat buffers,
lives from step 1 to the end of step 3: on a device with memory of its own it is taken from the device
budget (`Device.empty`) as the full buffers are.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
import torch.distributed as dist

from offload.device import Device
from offload.params.record import ParamRecord

Member = tuple[ParamRecord, torch.Tensor]
"""A record to gather and its partition (host memory, or a device buffer), ``partition_numel`` elements at least."""


def all_gather_flat(output: torch.Tensor, input: torch.Tensor, *, group: object, async_op: bool = False):
    """All-gather ``input`` from every rank into ``output`` (``world_size x input.numel()`` elements, rank
    ``r``'s at ``r * input.numel()``): torch's ``all_gather_single`` where it has one, else
    ``all_gather_into_tensor`` (gloo has both in torch 2.13). Looked up at each call, so that a test
    may count the calls. Returns the work handle where ``async_op``."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather(output, input, group=group, async_op=async_op)


def by_dtype(members: Sequence[Member]) -> Iterator[list[tuple[int, Member]]]:
    """``members`` split by their partitions' dtype, first appearance first: (position in ``members``, member)."""
    groups: dict[torch.dtype, list[tuple[int, Member]]] = {}
    for position, member in enumerate(members):
        groups.setdefault(member[0].partition.dtype, []).append((position, member))
    return iter(groups.values())


def columns(recs: Sequence[ParamRecord]) -> tuple[list[int], int]:
    """Each record's first column in a row of the flat buffer, and the row's length (step 1)."""
    starts, total = [], 0
    for rec in recs:
        starts.append(total)
        total += rec.partition_numel
    return starts, total


def unpack_row_major(rows: torch.Tensor, rec: ParamRecord, start: int, full: torch.Tensor) -> None:
    """Step 3 for one record: copy its column ``start`` of ``rows`` (``world_size x total``) into ``full``
    (``world_size x partition_numel`` elements, flat)."""
    part = rec.partition_numel
    full.view(rows.shape[0], part).copy_(rows[:, start:start + part])


class HostGather:
    """Steps 1 to 3 for partitions in host memory, the collectives run where ``collectives``' backend needs
    their tensors (gloo: host memory itself). Issued when made (``async_op``: without waiting for them);
    `wait` waits (sync point) and unpacks. The members' partitions must stay unchanged until then."""

    def __init__(self, members: Sequence[Member], *, collectives: Device, world_size: int, group: object,
                 async_op: bool = False) -> None:
        self.members, self._collectives, self._world = list(members), collectives, world_size
        self._calls = []
        """Per dtype: (its (position, member) list, the output, the input, the work handle or None)."""
        for batch in by_dtype(self.members):
            recs = [rec for _, (rec, _) in batch]
            if len(batch) == 1:  # straight into the full buffer
                sent = batch[0][1][1][:recs[0].partition_numel].contiguous()
                what = repr(recs[0].name)
            else:
                sent = torch.cat([local[:rec.partition_numel] for _, (rec, local) in batch])
                what = f"{len(recs)} parameters from {recs[0].name!r}"
            sent = collectives.collective_tensor(sent)
            out = collectives.collective_empty(sent.numel() * world_size, sent.dtype)
            collectives.check_collective(sent, out, op=f"all_gather of {what}")
            work = all_gather_flat(out, sent, group=group, async_op=async_op)
            self._calls.append((batch, out, sent, work))

    def wait(self) -> list[torch.Tensor]:
        """Each member's full flat tensor (``rec.numel`` elements, host memory), in the order of ``members``."""
        fulls: list[torch.Tensor | None] = [None] * len(self.members)
        calls, self._calls = self._calls, []
        for batch, out, _, work in calls:
            if work is not None:
                work.wait()  # sync point
            gathered = self._collectives.collective_to_host(out)
            if len(batch) == 1:
                (position, (rec, _)), = batch
                fulls[position] = gathered[:rec.numel]
                continue
            recs = [rec for _, (rec, _) in batch]
            starts, total = columns(recs)
            rows = gathered.view(self._world, total)
            for (position, (rec, _)), start in zip(batch, starts):
                full = torch.empty(rec.partition_numel * self._world, dtype=rec.partition.dtype)
                unpack_row_major(rows, rec, start, full)
                fulls[position] = full[:rec.numel]
        return fulls
