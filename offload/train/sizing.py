"""How much host memory each part of the step may hold, chosen once at `initialize` from the config, the
model and the host's memory (`plan_sizes`). Everything here is a policy: the shares are fractions of
the host's memory, and a size the config leaves to us is chosen here.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from offload.config import EngineConfig
from offload.device import HostMemory, auto_budget, host_memory
from offload.optim.subgroups import choose_buffer_count, choose_sub_group_size, host_memory_bytes
from offload.params import ParamRecord, SwapBudget
from offload.train.step.update_mode import UpdateMode

log = logging.getLogger("offload")

_DEEPSPEED_BUCKET = 500_000_000
"""DeepSpeed's default ``reduce_bucket_size`` (2 GB of fp32 per bucket): in a config it counts as not chosen."""

_BUCKET = 1 << 23
"""Elements of a gradient bucket when the config does not choose: 32 MiB of fp32, about PyTorch DDP's 25 MB."""

_SWAP_BUFFER_SHARE = 16
"""OffloadAdam's swap buffers may take at most 1/16 of the host's memory."""

_STATE_AHEAD = 8
"""Bytes per read-ahead window element of optimizer state read ahead during backward for the updates that
the next forward runs first: the fp32 moments of as many elements as the window holds."""

_WINDOW_SHARE = 64
"""The fast paths' read-ahead windows (gradients read back, state read ahead, applied gradients lent to
it, partitions waiting for their update or write-back) hold the swap budget's elements, but at most
1/64 of the host's memory in fp32 bytes each: the budget follows ``offload_param.buffer_size``, which
configs set to the largest parameter (DeepSpeed requires it), and a large embedding would make each
window that large, far more than the one layer of look-ahead that keeps the disk busy."""

_GRADS_SHARE = 4
"""Gradient partitions kept between backward and the update (accumulation, the step in the next forward)
stay in memory while they take at most 1/4 of the host's; beyond that, in the gradient swap file."""

_POOL_SHARE = 16
"""The step's I/O buffers (partitions read, gradients written) are kept for reuse up to 1/16 of the host's
memory (`tensorio.BufferPool`): faulted in once, not in every step."""

_DEEPSPEED_SUB_GROUP_SIZE = 1_000_000_000
"""DeepSpeed's default ``sub_group_size``: in a config it counts as not chosen."""

_SUB_GROUP_FLOOR_SHARE = 8
"""A ``sub_group_size`` the config sets below 1/8 of the size the engine would choose for the model
(`choose_sub_group_size`: the typical parameter's, within the host's memory; at least 1024) is raised to
that eighth: every sub-group is a kernel call, and with the state on NVMe a request per state region, so
tiny sub-groups multiply the step's fixed costs (``sub_group_size`` 1000 made a 4 M-parameter Qwen3's step
about 30x slower, 5-6 s against 0.18 s). Up to 8x the chosen size's sub-groups stay the user's choice."""


@dataclass(frozen=True, slots=True)
class StepSizes:
    """The sizes `plan_sizes` chose for one engine: counts of elements unless said otherwise, fixed for its
    lifetime (nothing here changes once the optimizer and the reducer are built from it)."""

    swap_grads: bool
    """Gradient partitions kept between backward and the update go to disk, not memory."""
    pool_bytes: int
    """Bytes of I/O buffers kept for reuse (`tensorio.BufferPool`)."""
    bucket: int
    """Elements of a gradient reduction bucket."""
    sub_group_size: int
    buffer_count: int
    """OffloadAdam's sub-group size and swap buffer count."""
    window: int
    """The fast paths' read-ahead window (see ``_WINDOW_SHARE``)."""
    spare_limit: int | None
    """Applied gradients lent to the optimizer's read-ahead (None: none; on-disk partitions on a fast path only)."""
    state_ahead: int
    """Bytes of optimizer state read ahead late in backward for the next forward's first updates."""


def plan_sizes(cfg: EngineConfig, trainable: list[ParamRecord], mode: UpdateMode, budget: SwapBudget) -> StepSizes:
    """The sizes of the step's buffers and windows for ``mode`` on this host (logs what it cut or chose)."""
    zero = cfg.zero_optimization
    offload_param = zero.offload_param
    in_backward = mode is not UpdateMode.AFTER_BACKWARD  # the optimizer's thread runs the updates
    grad_bytes = 4 * sum(rec.partition_numel for rec in trainable)
    keep_grads = grad_bytes <= host_memory_bytes() // _GRADS_SHARE  # kept: across micro-batches, into the next forward
    swap_grads = not in_backward or (not keep_grads and (mode is UpdateMode.IN_FORWARD
                                                         or cfg.gradient_accumulation_steps > 1))
    if in_backward and swap_grads:
        log.info("gradient partitions (%.1f GB in fp32) are kept on disk, not in memory (more than 1/%d of this "
                 "host's): each on-disk fp32 partition's in its free parameter slot, the rest in the gradient swap "
                 "file", grad_bytes / 1e9, _GRADS_SHARE)
    # With on-disk partitions updated during backward, applied gradients lent to the optimizer's read-ahead
    # are capped at the swap budget, so that host memory does not grow with the model. A sub-group is
    # updated once all its parameters' gradients are in, so until then their partitions wait in memory:
    # on that path sub-groups are at most one swap buffer.
    sub_group_size, buffer_count = swap_sizes(cfg, [rec.partition_numel for rec in trainable], overlap=in_backward)
    spare_limit = None
    window = min(budget.buffer_elements, host_memory_bytes() // (_WINDOW_SHARE * 4))
    if in_backward and any(rec.on_disk for rec in trainable):
        # In the next forward's step, this memory first holds the state read ahead in backward.
        spare_limit = window * (_STATE_AHEAD if mode is UpdateMode.IN_FORWARD else 4)
        if sub_group_size > offload_param.buffer_size:
            log.info("zero_optimization.sub_group_size %d is cut to offload_param.buffer_size %d: parameters on "
                     "NVMe wait in memory until their whole sub-group is updated", sub_group_size,
                     offload_param.buffer_size)
            sub_group_size = max(1024, offload_param.buffer_size)
    return StepSizes(swap_grads=swap_grads, pool_bytes=host_memory_bytes() // _POOL_SHARE,
                     bucket=zero.reduce_bucket_size if zero.reduce_bucket_size != _DEEPSPEED_BUCKET else _BUCKET,
                     sub_group_size=sub_group_size, buffer_count=buffer_count, window=window,
                     spare_limit=spare_limit, state_ahead=window * _STATE_AHEAD)


def swap_sizes(cfg: EngineConfig, partition_numels: list[int], *, overlap: bool) -> tuple[int, int]:
    """``(sub_group_size, buffer_count)`` for OffloadAdam. With the optimizer state on NVMe, what the user
    did not choose (``sub_group_size`` absent or DeepSpeed's 1e9, ``buffer_count`` absent) is chosen from the
    parameter sizes and the host's memory (`choose_sub_group_size`, `choose_buffer_count`); a size the config
    sets is cut (with a warning) where ``buffer_count`` x the largest sub-group's state (12 bytes an
    element at most) would take more than 1/16 of host memory.

    DeepSpeed allocates its buffers from the configured size, and its default of 1e9 elements is its
    most reported cause of host OOMs; the update is the same for any sub-group size. A size set below
    1/8 of the one `choose_sub_group_size` would choose is raised to it, with a warning naming the cost
    (``_SUB_GROUP_FLOOR_SHARE``), whatever the optimizer's device.
    """
    zero = cfg.zero_optimization
    size = max(1024, zero.sub_group_size)
    count = zero.offload_optimizer.buffer_count
    if count is None:
        count = choose_buffer_count(overlap_backward=overlap)
    host = host_memory_bytes()
    if zero.sub_group_size != _DEEPSPEED_SUB_GROUP_SIZE:
        size = _at_least_the_floor(zero.sub_group_size, partition_numels, count, host)
    if zero.offload_optimizer.device != "nvme":
        return size, count
    if zero.sub_group_size == _DEEPSPEED_SUB_GROUP_SIZE:
        chosen = choose_sub_group_size(partition_numels, buffer_count=count, host_bytes=host)
        wanted = count * min(size, sum(partition_numels)) * 12
        (log.warning if wanted > host // _SWAP_BUFFER_SHARE else log.info)(
            "zero_optimization.sub_group_size %d (DeepSpeed's default) would make offload_optimizer's %d swap "
            "buffers %.1f GB; using %d, chosen from the parameter sizes and this host's memory (docs/engine.md); set "
            "sub_group_size to choose", size, count, wanted / 1e9, chosen)
        return chosen, count
    allowed = host // _SWAP_BUFFER_SHARE // (count * 12)
    if min(size, sum(partition_numels)) <= allowed:
        return size, count
    bounded = max(1024, allowed // 1024 * 1024)
    log.warning("zero_optimization.sub_group_size %d would make offload_optimizer's %d swap buffers %.1f GB; "
                "using %d (buffers at most 1/%d of this host's memory); set sub_group_size to choose",
                size, count, count * min(size, sum(partition_numels)) * 12 / 1e9, bounded, _SWAP_BUFFER_SHARE)
    return bounded, count


def _at_least_the_floor(size: int, partition_numels: list[int], buffer_count: int, host: int) -> int:
    """``size`` (the config's ``sub_group_size``) raised, with a warning naming the cost, to the floor:
    1/``_SUB_GROUP_FLOOR_SHARE`` of the size `choose_sub_group_size` would choose, at least 1024."""
    chosen = choose_sub_group_size(partition_numels, buffer_count=buffer_count, host_bytes=host)
    floor = max(1024, chosen // _SUB_GROUP_FLOOR_SHARE)
    if size >= floor:
        return size
    total = sum(partition_numels)
    log.warning("zero_optimization.sub_group_size %d would cut this rank's %d optimizer elements into about %d "
                "sub-groups, each a kernel call and, on NVMe, a request per state region: a step many times slower "
                "(1000 made a 4 M-parameter model's step 30x slower); using %d, 1/%d of the size the engine would "
                "choose here (docs/engine.md)", size, total, -(-total // max(size, 1)), floor, _SUB_GROUP_FLOOR_SHARE)
    return floor


def auto_max_in_cpu(cfg: EngineConfig, partition_numels: list[int] | None, element_size: int,
                    memory: HostMemory | None = None) -> tuple[int, str]:
    """``offload_param.max_in_cpu`` "auto": (elements, how they were found). The host memory available now
    (`offload.device.host_memory`: MemAvailable, or the cgroup's room) less the memory bound's other terms
    (docs/engine.md, "Memory bound"), each at the most this engine lets it take: the parameter swap budget
    (offload_param.buffer_count x buffer_size), the kept fp32 gradients (at most 1/4 of host memory), the
    I/O buffer pool (1/16), the read-ahead windows (16 bytes per window element, at most 1/16), the
    optimizer's swap buffers (at most 1/16) or its state where it is in memory, less `auto_budget`'s
    margin; in partition elements of ``element_size`` bytes. ``partition_numels`` are this rank's
    trainable partitions (None while the model is being built: the shares at their most)."""
    memory = memory or host_memory()
    host, zero = memory.total, cfg.zero_optimization
    param, opt = zero.offload_param, zero.offload_optimizer
    numel = None if partition_numels is None else sum(partition_numels)
    window = min(param.buffer_count * param.buffer_size, host // (_WINDOW_SHARE * 4))
    state = None if numel is None else numel * (8 if element_size == 4 else 12)
    reserved = {
        "parameter swap budget": param.buffer_count * param.buffer_size * element_size,
        f"kept gradients (at most 1/{_GRADS_SHARE})": host // _GRADS_SHARE if numel is None else min(
            4 * numel, host // _GRADS_SHARE),
        f"I/O buffer pool (1/{_POOL_SHARE})": host // _POOL_SHARE,
        "read-ahead windows": 16 * window,
    }
    if opt.device == "nvme":
        buffers = host // _SWAP_BUFFER_SHARE if state is None else min(state, host // _SWAP_BUFFER_SHARE)
        reserved[f"optimizer swap buffers (at most 1/{_SWAP_BUFFER_SHARE})"] = buffers
        reserved["optimizer state in memory"] = 0 if state is None else int(state * (1 - opt.ratio))
    elif state is not None:
        reserved["optimizer state in memory"] = state
    nbytes, how = auto_budget(memory, reserved)
    return nbytes // element_size, how
