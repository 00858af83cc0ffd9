"""AFTER_BACKWARD: the chunked step, run in ``step()`` once backward is done.

Used where the fast paths cannot be (a client optimizer, optimizer state not all on NVMe). Gradients
accumulate in the reducer (in memory, or in the gradient swap file); ``step`` then:

1. fp16: checks every gradient for inf/NaN (the step is skipped on overflow);
2. clipping: takes the global norm; both give one factor every gradient is multiplied by (`step_factor`);
3. updates chunk by chunk: on-disk partitions (and offloaded gradients) are read in, stepped and written
   to their uncommitted slot, the slots committed once every write has landed.

A failure during 3 leaves some partitions updated and others not: step and save then refuse until a
load (`FailureState`). With several ranks the ranks agree before 3 and after it (one all-reduce of a flag
each): a failure on one rank before 3 is given up on every rank, one during 3 makes every rank refuse.
"""

from __future__ import annotations

import torch

from offload.config import EngineConfig
from offload.params import ParamRecord, ParamStore
from offload.train.grads.clip import step_factor
from offload.train.step.failure import describe
from offload.train.step.update_mode import PathCounts, StepContext, UpdateMode


class UpdateAfterBackward:
    """The AFTER_BACKWARD update path (see the module docstring)."""

    mode = UpdateMode.AFTER_BACKWARD

    def __init__(self, ctx: StepContext) -> None:
        self.ctx = ctx
        self.chunks = step_chunks(ctx.store.records, ctx.config)

    def before_forward(self) -> None:
        pass  # the step finished in step()

    def forward_failed(self, error: BaseException) -> None:
        pass

    def before_backward(self, boundary: bool) -> None:
        self.ctx.kept.begin_backward(for_update=False)

    def backward_failed(self, error: BaseException, boundary: bool) -> None:
        self.ctx.gradients_lost_in_backward(error)

    def step(self) -> bool:
        ctx = self.ctx
        records, agreement, error, factor = ctx.trainable(), ctx.agreement, None, None
        try:
            ctx.reducer.drain()  # sync point: every offloaded gradient is on disk
        except BaseException as failed:
            error = failed
        try:
            if error is None or agreement.active:  # every rank takes part in the norm's all-reduce
                factor = self._unscale_and_clip(records)
        except BaseException as failed:
            error = error or failed
        # Several ranks: every rank updates, or none (one all-reduce of a flag).
        error = agreement.agreed(error, f"step {ctx.counters.global_steps + 1}")
        if error is not None:  # nothing is updated yet: the parameters are whole
            ctx.gradients_lost_before_update(error)
            raise error
        if factor is None:  # fp16 overflow: the step is skipped
            return False
        # 3. The update, chunk by chunk: NVMe partitions (and offloaded gradients) are read in,
        #    stepped and written back. Three chunks are in memory at most: the next one being read,
        #    this one being stepped, the previous one being written (each a third of the swap budget).
        try:
            self._update_in_chunks(factor)
        except BaseException as failed:
            error = failed
            ctx.failure.partly_updated(f"step {ctx.counters.global_steps + 1} failed part way ({describe(error)})")
        # Several ranks: a rank whose update failed part way makes every rank refuse until a load (the
        # others' updates are whole, but the ranks would hold different steps).
        error = agreement.agreed(error, f"the update of step {ctx.counters.global_steps + 1}", needs_load=True)
        if error is not None:
            raise error
        if ctx.store.region is not None:
            ctx.store.region.commit()  # every partition's write has landed
        ctx.store.refresh_many(records)  # kept whole parameters whose partition is not the parameter itself
        return True

    def after_step(self) -> None:
        self.ctx.store.prefetch_from_start()

    def settle(self) -> None:
        pass  # nothing runs after step()

    def abandon(self) -> None:
        pass  # nothing is handed over

    def counts(self) -> PathCounts:
        return PathCounts()

    def _unscale_and_clip(self, records: list[ParamRecord]) -> float | None:
        """Phases 1 and 2: the factor every gradient is multiplied by as it is applied, or None when fp16
        overflowed."""
        ctx = self.ctx
        # Offloaded gradients are summarised by their partition's norm: the global norm and the
        # overflow check need nothing else.
        grads = [ctx.reducer.grads[rec.index] for rec in records]
        norms = [torch.linalg.vector_norm(grad.value) for grad in grads if grad.value is not None]
        norms += [grad.norm for grad in grads if grad.on_disk]
        return step_factor(norms, loss_scaler=ctx.loss_scaler, clipping=ctx.config.gradient_clipping, group=ctx.group)

    def _update_in_chunks(self, factor: float) -> None:
        """Phase 3."""
        chunks = self.chunks
        grad_reads = self._start_chunk(chunks[0]) if chunks else {}
        writing: tuple[list[ParamRecord], list] = ([], [])
        try:
            self._chunks_in_turn(chunks, grad_reads, factor, writing)
        except BaseException:
            for future in writing[1]:  # no write of a failed step may still land after it raised
                future.exception()
            raise

    def _chunks_in_turn(self, chunks: list[list[ParamRecord]], grad_reads: dict, factor: float,
                        writing: tuple[list[ParamRecord], list]) -> None:
        """`_update_in_chunks`'s loop; ``writing`` holds the last chunk's records and write futures."""
        store, grads = self.ctx.store, self.ctx.reducer.grads
        for i, chunk in enumerate(chunks):
            next_reads = self._start_chunk(chunks[i + 1]) if i + 1 < len(chunks) else {}
            # Sync point: this chunk's partitions and gradients have arrived.
            _finish_loads(chunk)
            for rec in chunk:
                grad = grads[rec.index].value
                if rec.index in grad_reads:
                    buffer, future = grad_reads[rec.index]
                    future.result()
                    grad = buffer
                if grad is not None:
                    rec.partition.grad = (grad if factor == 1.0 else grad.mul_(factor)).to(rec.partition.dtype)
            self.ctx.optimizer.step()
            for rec in chunk:
                rec.partition.grad = None
            _finish_stores(store, *writing)  # sync point: the previous chunk is on disk
            writing[0][:], writing[1][:] = chunk, _start_stores(store, chunk)
            grad_reads = next_reads
        _finish_stores(store, *writing)

    def _start_chunk(self, chunk: list[ParamRecord]) -> dict:
        """Start the reads of a chunk's on-disk partitions and offloaded gradients."""
        for rec in chunk:
            if rec.on_disk and rec.read is None and rec.buffer is None:
                self.ctx.store.start_read(rec)  # counted in the swap budget
        reducer = self.ctx.reducer
        return {rec.index: reducer.start_read(rec) for rec in chunk if reducer.grads[rec.index].on_disk}


def _finish_loads(chunk: list[ParamRecord]) -> None:
    """Wait for the reads `_start_chunk` started (sync point); the partitions then hold their values."""
    for rec in chunk:
        if rec.on_disk:
            if rec.read is not None:
                rec.read.result()
                rec.read = None
            rec.partition.data = rec.buffer


def _start_stores(store: ParamStore, chunk: list[ParamRecord]) -> list:
    """Start writing the updated on-disk partitions of ``chunk`` to their uncommitted slots; return the futures."""
    return [store.region.stage(rec.slots, rec.partition.data) for rec in chunk if rec.on_disk]


def _finish_stores(store: ParamStore, chunk: list[ParamRecord], writes: list) -> None:
    """Wait for `_start_stores`'s writes (sync point: a partition is dropped only once on disk)."""
    for future in writes:
        future.result()
    for rec in chunk:
        if rec.on_disk:
            rec.partition.data = store.placeholder(rec.partition.dtype)
            store.drop_buffer(rec)


def step_chunks(records: list[ParamRecord], cfg: EngineConfig) -> list[list[ParamRecord]]:
    """Trainable records in order, cut so that the on-disk partitions of a chunk fit a third of the swap
    budget (three chunks are in memory during the step); a partition larger than that is a chunk alone."""
    limit = cfg.zero_optimization.offload_param.buffer_count * cfg.zero_optimization.offload_param.buffer_size // 3
    chunks, current, held = [], [], 0
    for rec in records:
        if not rec.param.requires_grad:
            continue
        size = rec.partition_numel if rec.on_disk else 0
        if current and held + size > limit:
            chunks.append(current)
            current, held = [], 0
        current.append(rec)
        held += size
    if current:
        chunks.append(current)
    return chunks
