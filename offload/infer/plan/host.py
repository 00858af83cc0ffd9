"""Placement: which weights stay in memory and which are streamed from the disk each forward.

Pure arithmetic on sizes (no model, no disk), so it is tested on its own. Every streamed byte is read
once per forward, so a byte kept resident saves the same one byte per forward wherever it is: the
plan keeps what must stay (embeddings, norms, tied weights), then as many whole units (decoder
layers, the output head) as the budget holds after the KV cache. Resident layers are spread evenly
through the forward rather than bunched at its start, so that the disk keeps reading the next
streamed layer while each resident one computes.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from offload.infer.largest import largest_where
from offload.infer.plan.experts import ExpertPlan
from offload.infer.plan.units import BudgetError, UnitSize, format_bytes, spread_order, unit_names

if TYPE_CHECKING:
    from offload.infer.plan.device import DeviceTier

__all__ = ["BudgetError", "KVPlacement", "Plan", "UnitSize", "format_bytes", "kv_in_memory", "make_plan", "place_kv",
           "with_longest_fit"]


@dataclass(frozen=True, slots=True)
class KVPlacement:
    """Where each decoder layer's KV cache lives for one batch and length: in memory, or on NVMe
    read through a ring of ``buffer_count`` buffers of one layer's cache."""

    layers: int
    layer_nbytes: int
    """One layer's keys and values at the full length."""
    nvme_layers: tuple[int, ...] = ()
    """The layers whose cache is on NVMe, in forward order."""
    buffer_count: int = 0
    micro_batches: int = 1
    """The block schedule's micro-batches: each ring buffer holds one micro-batch's part of a layer."""
    staged_nbytes: int = 0
    """With compute on a device of its own and the cache on the host (offload/infer/kv/device.py): one
    layer's keys and values for one micro-batch at the full length in the compute dtype, the size of
    each buffer that carries them to the device (two pinned on the host, two on the device); 0: the
    cache is not staged (it lives where compute runs)."""

    @property
    def memory_layers(self) -> int:
        return self.layers - len(self.nvme_layers)

    @property
    def slot_nbytes(self) -> int:
        """One ring buffer: a layer's cache for one micro-batch."""
        return -(-self.layer_nbytes // self.micro_batches)

    @property
    def ring_bytes(self) -> int:
        """The read-ahead ring's buffers (0 when no layer is on NVMe)."""
        return self.buffer_count * self.slot_nbytes if self.nvme_layers else 0

    @property
    def memory_bytes(self) -> int:
        """What the cache takes in host memory: the layers held there, the ring and the pinned staging buffers."""
        return self.memory_layers * self.layer_nbytes + self.ring_bytes + 2 * self.staged_nbytes

    @property
    def nvme_bytes(self) -> int:
        """The cache's bytes on NVMe, each read once per step at the full length."""
        return len(self.nvme_layers) * self.layer_nbytes


def with_longest_fit(error: BudgetError, plan_for: Callable[[int], object], batch: int, tokens: int) -> BudgetError:
    """``error`` (``tokens`` tokens at ``batch`` do not fit) with the most tokens that would: the largest
    length under ``tokens`` for which ``plan_for(length)`` raises no BudgetError, found by halving (what
    fits only gets harder as the cache and the activations grow)."""
    def fits(length: int) -> bool:
        try:
            plan_for(length)
        except BudgetError:
            return False
        return True

    low = largest_where(fits, 0, tokens)  # 0 fits trivially, tokens does not
    return BudgetError(f"{error}. " + (f"At batch {batch} at most {low:,} tokens fit (prompt and new tokens together)"
                                       if low else f"No length fits at batch {batch}"))


def place_kv(units: Sequence[UnitSize], *, budget: int | None, layers: int, layer_nbytes: int, device: str,
             cpu_percent: float | None, buffer_count: int, kv_shape: tuple[int, int] = (0, 0),
             micro_batches: int = 1) -> KVPlacement:
    """Place ``layers`` layers' caches of ``layer_nbytes`` each. ``device`` "cpu": all in memory;
    "nvme": ``cpu_percent`` (None: 0) of the layers in memory, the rest on NVMe; "auto": all in
    memory when the budget holds them beside the units that must stay (or when there is no budget:
    None, or 0), else as many layers as fit beside the ring, the rest on NVMe. The layers kept in
    memory are spread through the forward, so that the reads of the others interleave with compute.
    With ``micro_batches`` (the block schedule) a ring buffer holds one micro-batch's part of a layer.

    ``kv_shape`` (batch, tokens) is for the message. Raises BudgetError naming the figures when
    "auto" finds no room even for the ring.
    """
    if device == "cpu" or layers == 0:
        return KVPlacement(layers, layer_nbytes, micro_batches=micro_batches)
    if device == "nvme":
        keep = math.floor(layers * (cpu_percent or 0) / 100)
    else:
        room = None if not budget else budget - sum(u.nbytes for u in units if not u.streamable)
        if room is None or layers * layer_nbytes <= room:
            return KVPlacement(layers, layer_nbytes, micro_batches=micro_batches)
        ring = KVPlacement(layers, layer_nbytes, (0,), buffer_count, micro_batches).ring_bytes
        if room < ring:
            must, total = budget - room, layers * layer_nbytes
            raise BudgetError(
                f"zero_optimization.offload_param.max_in_cpu: the budget of {format_bytes(budget)} cannot hold the "
                f"weights that must stay in memory ({format_bytes(must)}) plus a KV cache of {format_bytes(total)} for "
                f"batch {kv_shape[0]} x {kv_shape[1]} tokens; raise max_in_cpu to at least "
                f"{format_bytes(must + total, up=True)} or lower the batch size or the number of tokens (kv_offload would "
                f"put the cache's layers on NVMe, but even its read-ahead ring of {buffer_count} x "
                f"{format_bytes(ring // buffer_count, up=True)}, one layer's cache each, needs a budget of "
                f"{format_bytes(must + ring, up=True)}; kv_offload.buffer_count 1 halves it, --kv-buffer-count 1 on the "
                f"command line)")
        keep = min(layers, (room - ring) // layer_nbytes)
    memory = set(spread_order(layers)[:keep])
    return KVPlacement(layers, layer_nbytes, tuple(i for i in range(layers) if i not in memory), buffer_count,
                       micro_batches)


@dataclass(frozen=True, slots=True)
class Plan:
    """What stays in memory, what is streamed, and what it costs per forward."""

    units: tuple[UnitSize, ...]
    """Every unit, in forward order."""
    resident: frozenset[str]
    budget: int
    """Bytes for resident weights and the KV cache (``max_in_cpu``); -1 with device "cpu" (no limit); 0
    streams everything streamable (what must stay in memory stays)."""
    kv_bytes: int
    """KV cache reserved in the budget (0 until a batch is known)."""
    kv_shape: tuple[int, int]
    """(batch, tokens) the KV reservation is for."""
    buffer_count: int
    buffer_nbytes: int
    """Bytes per ring buffer (0 when nothing is streamed)."""
    disk_bps: float | None = None
    """Disk read speed in bytes per second, or None when unknown."""
    disk_source: str = ""
    """How ``disk_bps`` was obtained ("measured: ..." or "given")."""
    quantization: str = ""
    """The decoder layers' weight quantization ("int4 (group 64, asymmetric)"), "" for none."""
    kv_quantization: str = ""
    """How the KV cache's keys and values are stored ("int8 (group 64, asymmetric)"), "" for the compute dtype."""
    unquantized_read_bytes: int | None = None
    """With ``quantization``: the bytes per forward the same budget would read with unquantized weights."""
    unquantized_host_to_device_bytes: int | None = None
    """With ``quantization`` and ``device``: the bytes per forward the same budgets would copy to the
    device with unquantized weights (None without a device, or where they would not fit)."""
    kv: KVPlacement | None = None
    """Where the KV cache of ``kv_shape`` lives (None until a batch is known); ``kv_bytes`` is its memory."""
    device: DeviceTier | None = None
    """Where compute has memory of its own (a GPU): what it keeps (offload/infer/plan/device.py); the units in
    ``resident`` but not in ``device.resident`` are kept in pinned host memory. None: the host is the device."""
    budget_source: str = ""
    """How an "auto" ``budget`` was found (the memory available, from where, less what): "" for a number given."""
    experts: ExpertPlan | None = None
    """Where a mixture-of-experts model's experts are read by the router's choice (offload/infer/experts/):
    their reads per forward, slots and cache; None where experts are streamed with their layers."""

    @property
    def streamed(self) -> tuple[UnitSize, ...]:
        """The streamed units, in forward order."""
        return tuple(u for u in self.units if u.name not in self.resident)

    @property
    def resident_bytes(self) -> int:
        """Weight bytes kept in host memory (those the device keeps aside)."""
        on_device = self.device.resident if self.device is not None else frozenset()
        return sum(u.nbytes for u in self.units if u.name in self.resident and u.name not in on_device)

    @property
    def host_to_device_bytes_per_forward(self) -> int:
        """Bytes copied from host to device per forward (per token): every unit the device does not keep, and
        the picked experts it does not keep."""
        if self.device is None:
            return 0
        return (sum(u.device_copy_nbytes for u in self.units if u.name not in self.device.resident)
                + self.device.kv_link_bytes + (self.experts.host_to_device_bytes_per_forward if self.experts else 0))

    def link_seconds(self) -> dict[str, float | None]:
        """Per forward (per token), each link's time at its speed (None where the speed is unknown):
        "nvme->host" (the streamed reads), and with a device "host->device" (its copies)."""
        links: dict[str, float | None] = {"nvme->host": self.disk_seconds_per_forward if self.streamed else 0.0}
        if self.device is not None:
            speed, nbytes = self.device.host_to_device_bps, self.host_to_device_bytes_per_forward
            links["host->device"] = nbytes / speed if speed else (0.0 if not nbytes else None)
        return links

    def bound_seconds(self, compute_seconds: float | None = None) -> float | None:
        """The time per token the links and compute allow, all overlapped: the max over the links (and
        ``compute_seconds`` where given). None while a link's speed is unknown."""
        times = list(self.link_seconds().values()) + ([compute_seconds] if compute_seconds is not None else [])
        return None if any(t is None for t in times) else max(times)

    @property
    def streamed_bytes(self) -> int:
        """Weight bytes streamed per forward."""
        return sum(u.nbytes for u in self.streamed)

    @property
    def read_bytes_per_forward(self) -> int:
        """Bytes read from the disk per forward (the streamed units' windows, alignment slack included, and
        the picked experts the cache does not hold)."""
        return sum(u.read_nbytes for u in self.streamed) + (self.experts.read_bytes_per_forward if self.experts else 0)

    @property
    def buffers_bytes(self) -> int:
        return self.buffer_count * self.buffer_nbytes if self.streamed else 0

    @property
    def disk_seconds_per_forward(self) -> float | None:
        """Time the disk needs to read one forward's streamed bytes, or None when its speed is unknown."""
        if not self.disk_bps:
            return None
        return self.read_bytes_per_forward / self.disk_bps

    @property
    def memory_bytes(self) -> int:
        """Resident weights + ring buffers + reserved KV cache (+ the experts' slots and cache): the plan's
        memory, activations aside."""
        return self.resident_bytes + self.buffers_bytes + self.kv_bytes + (self.experts.memory_bytes if self.experts else 0)

    def describe(self) -> str:
        """The plan as a few lines for people."""
        resident = [u for u in self.units if u.name in self.resident]
        budget = ("no limit (device cpu)" if self.budget < 0 else "0" if self.budget == 0
                  else format_bytes(self.budget) + (f" = {self.budget_source}" if self.budget_source else ""))
        lines = [f"placement: budget {budget} for resident weights and the KV cache"
                 + (" (everything streamable is streamed; only what must stay is in memory)" if self.budget == 0 else "")]
        device = self.device
        if device is not None:
            on_device = [u for u in resident if u.name in device.resident]
            resident = [u for u in resident if u.name not in device.resident]
            lines[0] = f"placement: host budget {budget} for weights kept in pinned memory"
            lines.append(f"  device: budget {format_bytes(device.budget)} ({device.setting}), "
                         f"{format_bytes(device.used_bytes)} reserved")
            lines.append(f"    kept there: {format_bytes(device.resident_bytes)}: {unit_names(on_device)}")
            if device.ring_slots:
                lines.append(f"    copy ring: {device.ring_slots} x {format_bytes(device.slot_nbytes)} (the other units, "
                             f"copied ahead of use on a side stream)")
            batch, tokens = self.kv_shape
            where = (f" buffers (the cache on the host: {format_bytes(device.kv_link_bytes)} to the device per token)"
                     if device.kv_link_bytes else "")
            lines.append(f"    KV cache{where} {format_bytes(device.kv_bytes)}"
                         + (f" (batch {batch} x {tokens} tokens)" if batch else " (none yet: reserved per generate call)")
                         + f", activations {format_bytes(device.activation_bytes)}")
        lines.append(f"  resident: {format_bytes(self.resident_bytes)} in {'pinned host ' if device else ''}memory: "
                     f"{unit_names(resident)}")
        streamed = self.streamed
        if streamed:
            lines.append(f"  streamed: {format_bytes(self.streamed_bytes)} per forward from the checkpoint "
                         f"({format_bytes(sum(u.read_nbytes for u in streamed))} read, alignment included): {unit_names(streamed)}")
            lines.append(f"  buffers: {self.buffer_count} x {format_bytes(self.buffer_nbytes)} (locked ring, "
                         f"read ahead while a layer computes)")
        else:
            lines.append("  streamed: nothing (every weight is in memory)")
        if self.experts is not None:
            lines.append(self.experts.describe())
        if self.quantization:
            lines.append(f"  quantized: {self.quantization} linear weights in the decoder layers: "
                         + _before_after(self.read_bytes_per_forward, self.unquantized_read_bytes, "read per forward"))
            if device is not None:
                lines.append("    and " + _before_after(self.host_to_device_bytes_per_forward,
                                                      self.unquantized_host_to_device_bytes,
                                                      "copied host->device per forward (packed)"))
        batch, tokens = self.kv_shape
        if device is None:
            lines.append(f"  KV cache: {format_bytes(self.kv_bytes)} reserved"
                         + (f" (batch {batch} x {tokens} tokens)" if batch else " (none yet: reserved per generate call)"))
        if self.kv_quantization:
            lines.append(f"  KV cache quantized: keys and values stored as {self.kv_quantization}, in memory and on NVMe")
        kv = self.kv
        if kv is not None and kv.nvme_layers:
            lines.append(f"  KV on NVMe: {format_bytes(kv.nvme_bytes)} for {len(kv.nvme_layers)} of {kv.layers} layers "
                         f"(read each step, written behind), {kv.memory_layers} layers in memory, ring "
                         f"{kv.buffer_count} x {format_bytes(kv.slot_nbytes)}")
        if kv is not None and kv.micro_batches > 1:
            lines.append(f"  block schedule: batch {batch} as {kv.micro_batches} micro-batches of "
                         f"{batch // kv.micro_batches} through each layer's one read")
        lines.append(f"  memory: {format_bytes(self.memory_bytes)} = resident + buffers + KV cache"
                     + (" + experts" if self.experts else "") + ", activations aside")
        if streamed or self.experts is not None:
            if self.disk_bps:
                lines.append(f"  disk: {self.disk_bps / 1e9:.2f} GB/s ({self.disk_source}): "
                             f"{self.disk_seconds_per_forward:.3f} s per forward to read the streamed weights")
            else:
                lines.append("  disk: speed unknown")
        if device is not None:
            lines.append(self._describe_links())
        return "\n".join(lines)

    def _describe_links(self) -> str:
        """Per token: the bytes over each link, their time at its speed, and the bound."""
        nbytes = {"nvme->host": self.read_bytes_per_forward, "host->device": self.host_to_device_bytes_per_forward}
        seconds = self.link_seconds()
        parts = [f"{link} {format_bytes(nbytes[link])}" + (f" ({t:.4f} s)" if t is not None else " (speed unknown)")
                 for link, t in seconds.items()]
        bound = self.bound_seconds()
        return (f"  per token: {', '.join(parts)}; bound "
                + (f"{bound:.4f} s (the slower link; compute overlaps, so it adds only where it is slower)"
                   if bound is not None else "unknown until every link's speed is (disk_gbps, host_to_device_gbps)"))

    def __str__(self) -> str:
        return self.describe()


def _before_after(nbytes: int, before: int | None, what: str) -> str:
    """ "X read per forward, unquantized Y (Zx fewer bytes)"; without ``before``, that the unquantized
    weights would not fit the budgets."""
    if before is None:
        return f"{format_bytes(nbytes)} {what} (unquantized, the weights would not fit these budgets)"
    return (f"{format_bytes(nbytes)} {what}, unquantized {format_bytes(before)}"
            + (f" ({before / nbytes:.2f}x fewer bytes)" if before and nbytes else ""))


def kv_in_memory(placement: KVPlacement) -> str:
    """What of the KV cache the budget holds, for the errors, when some of it is on NVMe ("" otherwise)."""
    if not placement.nvme_layers:
        return ""
    ring = (f"read-ahead ring, {placement.buffer_count} x {format_bytes(placement.slot_nbytes)} "
            f"(kv_offload.buffer_count, --kv-buffer-count: 1 halves it)")
    if placement.memory_layers:
        return (f"the KV cache's {placement.memory_layers} layers kept in memory and its {ring}, its other "
                f"{len(placement.nvme_layers)} layers ({format_bytes(placement.nvme_bytes)}) being on NVMe")
    return f"the KV cache's {ring}, the cache itself ({format_bytes(placement.nvme_bytes)}) being on NVMe"


def make_plan(units: Sequence[UnitSize], *, budget: int | None, buffer_count: int, buffer_nbytes: int | None = None,
              kv_bytes: int = 0, kv_shape: tuple[int, int] = (0, 0), disk_bps: float | None = None,
              disk_source: str = "", budget_source: str = "", kv_what: str = "") -> Plan:
    """Place ``units`` (in forward order) within ``budget`` bytes (None: everything resident, device "cpu";
    0: every streamable unit streamed, the others and the KV cache resident whatever they take, as
    DeepSpeed configs use ``max_in_cpu`` 0 for "everything on NVMe").

    The units that are not streamable and ``kv_bytes`` of KV cache come first; then streamable units,
    largest first (ties spread evenly through the forward), while they fit. ``buffer_nbytes`` is the
    user's buffer size in bytes (None: the largest streamed unit's). ``budget_source`` says how an "auto"
    budget was found (`offload.device.auto_budget`); the plan and its errors print it. ``kv_what`` names
    what the ``kv_bytes`` are in the errors when they are not the cache itself (its ring, the cache on NVMe).

    Raises BudgetError naming the figures when the budget cannot hold the units that must stay plus
    the KV cache, or when ``buffer_nbytes`` cannot hold a streamed unit.
    """
    if budget is None:
        return Plan(tuple(units), frozenset(u.name for u in units), -1, kv_bytes, kv_shape, buffer_count, 0,
                    disk_bps, disk_source)
    # 1. What must stay, and the KV cache: both have to fit.
    required = [u for u in units if not u.streamable]
    must = sum(u.nbytes for u in required) + kv_bytes
    if budget == 0:
        return _streaming_all(units, required, kv_bytes, kv_shape, buffer_count, buffer_nbytes, disk_bps, disk_source)
    if must > budget:
        kv = "" if not kv_bytes else (
            f" plus {format_bytes(kv_bytes)} for batch {kv_shape[0]} x {kv_shape[1]} tokens: {kv_what}" if kv_what
            else f" plus a KV cache of {format_bytes(kv_bytes)} for batch {kv_shape[0]} x {kv_shape[1]} tokens")
        if budget_source:
            raise BudgetError(
                f"zero_optimization.offload_param.max_in_cpu: the budget of {format_bytes(budget)} = {budget_source} "
                f"cannot hold the weights that must stay in memory ({format_bytes(must - kv_bytes)}: {unit_names(required)})"
                f"{kv}; this host needs {format_bytes(must - budget, up=True)} more available memory: free memory (or "
                f"raise the cgroup's limit), " + ("lower the batch size or the number of tokens, " if kv_bytes else "")
                + "or run on a larger host")
        raise BudgetError(
            f"zero_optimization.offload_param.max_in_cpu: the budget of {format_bytes(budget)} cannot hold the weights "
            f"that must stay in memory ({format_bytes(must - kv_bytes)}: {unit_names(required)}){kv}; raise max_in_cpu to at "
            f"least {format_bytes(must, up=True)}" + (" or lower the batch size or the number of tokens" if kv_bytes else ""))
    # 2. Then whole streamable units, largest first; equal ones spread through the forward.
    streamable = [u for u in units if u.streamable]
    rank = {streamable[i].name: r for r, i in enumerate(spread_order(len(streamable)))}
    room = budget - must
    resident = {u.name for u in required}
    for unit in sorted(streamable, key=lambda u: (-u.nbytes, rank[u.name])):
        if unit.nbytes <= room:
            resident.add(unit.name)
            room -= unit.nbytes
    need = _ring_buffer_nbytes(units, resident, buffer_nbytes)
    return Plan(tuple(units), frozenset(resident), budget, kv_bytes, kv_shape, buffer_count, need, disk_bps, disk_source,
                budget_source=budget_source)


def _streaming_all(units: Sequence[UnitSize], required: Sequence[UnitSize], kv_bytes: int, kv_shape: tuple[int, int],
                   buffer_count: int, buffer_nbytes: int | None, disk_bps: float | None, disk_source: str) -> Plan:
    """The plan of budget 0: only the units that must stay are resident."""
    resident = {u.name for u in required}
    need = _ring_buffer_nbytes(units, resident, buffer_nbytes)
    return Plan(tuple(units), frozenset(resident), 0, kv_bytes, kv_shape, buffer_count, need, disk_bps, disk_source)


def _ring_buffer_nbytes(units: Sequence[UnitSize], resident: set[str], buffer_nbytes: int | None) -> int:
    """Bytes a ring buffer needs: the largest streamed unit's windows. Raises BudgetError when the
    user's ``buffer_nbytes`` is smaller."""
    streamed = [u for u in units if u.name not in resident]
    need = max((u.buffer_nbytes for u in streamed), default=0)
    if buffer_nbytes is not None and streamed and buffer_nbytes < need:
        largest = max(streamed, key=lambda u: u.buffer_nbytes)
        raise BudgetError(
            f"zero_optimization.offload_param.buffer_size: a buffer of {format_bytes(buffer_nbytes)} cannot hold "
            f"{largest.name!r}, which is streamed and needs {format_bytes(need, up=True)} ({need} bytes, its aligned "
            f"windows); raise buffer_size or leave it out to size the buffers to the largest streamed layer")
    return need
