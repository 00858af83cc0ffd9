"""Host buffers: page-aligned tensors, locked (pinned) where the system allows, and the staging pool.

`locked_tensor` locks with mlock, or with the `HostRegistration` the layer above installed
(`set_host_registration`: offload.device installs a GPU's host registration where there is a GPU, so
that the GPU copies from these buffers directly); tensorio itself knows no GPU.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import os
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

log = logging.getLogger("tensorio")

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mlock.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.munlock.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_MADV_POPULATE_WRITE = 23  # Linux 5.14; older kernels answer EINVAL
# Bytes one prefault call takes. The kernel holds the process's memory map (mmap_lock) for reading
# through a whole call, and another thread's mmap or munmap (glibc's large malloc and free, as torch
# allocates every activation) waits for it, so a call long enough to fault in tens of MiB of cold
# memory stalls a forward running beside it (docs/tensorio.md, "Buffers", has the figures). 4 MiB
# keeps each wait short.
_FAULT_PIECE = 4 << 20
_FAULT_THREADS = 8  # prefault's threads by default: one per core, at most this many
_HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", None)



@dataclass(frozen=True, slots=True)
class HostRegistration:
    """How `locked_tensor` pins its buffers instead of mlock (installed with `set_host_registration`).

    ``status``: what `lock_status` says of a buffer it pinned (offload.device's GPU registration's);
    ``register(ptr, nbytes)``: pin the bytes, returning None, or the reason it failed (the buffer is then
    "not locked: <reason>"); ``unregister(ptr)``: undo it, when the buffer is freed.
    """

    status: str
    register: Callable[[int, int], str | None]
    unregister: Callable[[int], None]


_registration: HostRegistration | None = None
# Every registration installed so far, by status: a buffer is unregistered by the one that registered it.
_registrations: dict[str, HostRegistration] = {}


def set_host_registration(registration: HostRegistration | None) -> HostRegistration | None:
    """Pin the buffers `locked_tensor` makes from now on with ``registration`` (None: mlock); return the
    one installed before. Buffers made already stay as they were locked. Raises ValueError for a status
    that `lock_status` uses for something else ("mlocked", "not locked: ...")."""
    global _registration
    if registration is not None:
        if registration.status == "mlocked" or registration.status.startswith("not locked"):
            raise ValueError(f"set_host_registration: status {registration.status!r} is taken; name the registration")
        _registrations[registration.status] = registration
    previous, _registration = _registration, registration
    return previous


class LockTable:
    """The live `locked_tensor` buffers: data_ptr -> (how the buffer is locked: a registration's status,
    "mlocked" or "not locked: <reason>", its bytes), under one lock (any thread)."""

    def __init__(self) -> None:
        self.entries: dict[int, tuple[str, int]] = {}
        self.lock = threading.RLock()
        """Re-entrant: a buffer's last reference can go (and its finalizer, `forget`, run) on a thread that
        holds it, when a garbage collection starts inside a locked section (any allocation may start one)."""

    def add(self, ptr: int, entry: tuple[str, int]) -> None:
        """Register the buffer at ``ptr`` (replacing any entry there)."""
        with self.lock:
            self.entries[ptr] = entry

    def get(self, ptr: int) -> tuple[str, int] | None:
        """The entry of the buffer at ``ptr``, or None."""
        with self.lock:
            return self.entries.get(ptr)

    def pop(self, ptr: int) -> tuple[str, int] | None:
        """Remove and return the entry at ``ptr`` (None: there was none)."""
        with self.lock:
            return self.entries.pop(ptr, None)

    def forget(self, ptr: int, entry: tuple[str, int]) -> bool:
        """Remove ``entry`` at ``ptr`` unless a newer buffer now holds the address; whether it did."""
        with self.lock:
            if self.entries.get(ptr) is not entry:
                return False
            del self.entries[ptr]
            return True

    def snapshot(self) -> dict[int, tuple[str, int]]:
        """A copy of the entries (a finalizer may remove one while the caller iterates)."""
        with self.lock:
            return self.entries.copy()


lock_table = LockTable()


def _mapped_tensor(num_elem: int, dtype: torch.dtype) -> tuple[torch.Tensor, mmap.mmap]:
    if num_elem < 0:
        raise ValueError(f"num_elem must be >= 0, got {num_elem}")
    itemsize = torch.empty((), dtype=dtype).element_size()
    region = mmap.mmap(-1, max(num_elem * itemsize, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if len(region) >= _HUGE_PAGE and _MADV_HUGEPAGE is not None:
        # Large buffers are filled whole, so 2 MiB pages cost no memory and fault in 512x fewer
        # steps, much faster to first touch (docs/tensorio.md, "Buffers"). Only a hint: a
        # kernel without transparent huge pages refuses it, and the buffer keeps small pages.
        try:
            region.madvise(_MADV_HUGEPAGE)
        except OSError:
            pass
    # The tensor (and every view of it) keeps the mapping alive through the buffer it was made from.
    return torch.frombuffer(region, dtype=torch.uint8)[: num_elem * itemsize].view(dtype), region


def aligned_tensor(num_elem: int, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
    """A zero-filled 1-D CPU tensor whose storage starts on a page boundary (any dtype).

    The memory is an anonymous mapping: pages are only touched, and so only count toward RSS,
    once written. Raises ValueError for a negative ``num_elem``.
    """
    return _mapped_tensor(num_elem, dtype)[0]


def prefault(tensor: torch.Tensor, start: int = 0, stop: int | None = None, *, threads: int | None = None) -> bool:
    """Fault in bytes ``[start, stop)`` of a CPU tensor's storage for writing, now, without writing them.

    A read into memory never touched faults its pages in on the reading thread, one at a time; on a
    virtual machine whose host backs memory lazily that can cost more than the read itself
    (docs/tensorio.md, "Buffers"). Faulting in ahead takes that off the reads' path,
    and ``threads`` (default: one per core, at most 8) share it in 4 MiB pieces, short enough that
    the other threads' mmap and munmap calls are not held up behind them; the calls release the
    GIL. The range is widened to whole pages. Returns False, having done nothing, where the kernel
    lacks MADV_POPULATE_WRITE (Linux < 5.14). Raises ValueError for a range outside the storage,
    OSError for any other refusal (ENOMEM: no memory left).
    """
    nbytes = tensor.untyped_storage().nbytes()
    stop = nbytes if stop is None else stop
    if not 0 <= start <= stop <= nbytes:
        raise ValueError(f"prefault: range [{start}, {stop}) outside the tensor's {nbytes} bytes")
    base = tensor.untyped_storage().data_ptr()
    threads = min(os.cpu_count() or 1, _FAULT_THREADS) if threads is None else threads
    if threads < 1:
        raise ValueError(f"prefault: threads must be >= 1, got {threads}")
    pieces = [(begin, min(begin + _FAULT_PIECE, stop)) for begin in range(start, stop, _FAULT_PIECE)]
    if threads == 1 or len(pieces) < 2:
        return all([_populate(base, begin, end) for begin, end in pieces])
    with ThreadPoolExecutor(max_workers=min(threads, len(pieces)), thread_name_prefix="prefault") as pool:
        return all(list(pool.map(lambda piece: _populate(base, *piece), pieces)))


def _populate(base: int, start: int, stop: int) -> bool:
    first = (base + start) & ~(mmap.PAGESIZE - 1)
    if _libc.madvise(first, base + stop - first, _MADV_POPULATE_WRITE) == 0:
        return True
    err = ctypes.get_errno()
    if err == errno.EINVAL:
        return False
    raise OSError(err, f"prefault: faulting in bytes [{start}, {stop}) failed: {os.strerror(err)}")


def _lock(tensor: torch.Tensor) -> str:
    ptr, nbytes = tensor.data_ptr(), tensor.untyped_storage().nbytes()
    if nbytes == 0:
        return "not locked: empty"
    registration = _registration
    if registration is not None:  # pinned for a device's copies (offload.device installs it)
        reason = registration.register(ptr, nbytes)
        if reason is None:
            return registration.status
    else:
        if _libc.mlock(ptr, nbytes) == 0:
            return "mlocked"
        err = ctypes.get_errno()
        reason = f"mlock refused {nbytes} bytes ({os.strerror(err)}; raise `ulimit -l` to lock)"
    return "not locked: " + reason


def _unlock(ptr: int, nbytes: int, status: str) -> None:
    if status == "mlocked":
        _libc.munlock(ptr, nbytes)
    elif status in _registrations:
        _registrations[status].unregister(ptr)


def locked_tensor(num_elem: int, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
    """A page-aligned tensor locked in RAM: pinned by the installed `HostRegistration` (a GPU's, where
    offload.device installed one), else mlock'ed.

    Where locking is refused (the memlock limit), the tensor is plain aligned memory; the reason is
    logged once and reported by ``lock_status(tensor)``. Release with ``free_locked_tensor``; a
    locked tensor that is simply dropped is unlocked when its memory is freed. The memory is faulted
    in on every core first (`prefault`), which locking alone does on one.
    """
    tensor, region = _mapped_tensor(num_elem, dtype)
    try:  # locking faults the memory in on this one thread; first on every core, it only pins
        prefault(tensor)
    except OSError:
        pass  # the lock faults in what is left and reports its own refusal
    status = _lock(tensor)
    ptr, nbytes = tensor.data_ptr(), tensor.untyped_storage().nbytes()
    entry = (status, nbytes)
    lock_table.add(ptr, entry)
    if status.startswith("not locked") and not getattr(locked_tensor, "_warned", False):
        locked_tensor._warned = True  # type: ignore[attr-defined]
        log.warning("tensorio: buffers are %s", status)
    # Unlock when the memory goes away: the mapping lives exactly as long as the last view. CPython
    # unmaps an mmap before it runs its finalizers, with the GIL released, so another thread may have
    # mapped and registered a new buffer at ``ptr`` by then: the finalizer drops only this entry.
    weakref.finalize(region, _forget, ptr, entry)
    return tensor


def lock_status(tensor: torch.Tensor) -> str:
    """How ``tensor``'s memory is locked: the `HostRegistration`'s status,
    "mlocked" or "not locked: <reason>"."""
    entry = lock_table.get(tensor.untyped_storage().data_ptr())
    return entry[0] if entry else "not locked: not a tensorio locked buffer"


def free_locked_tensor(tensor: torch.Tensor) -> None:
    """Unlock a tensor from ``locked_tensor`` now; its memory is freed with its last reference.

    Raises ValueError for a tensor that ``locked_tensor`` did not make.
    """
    if not unlock_at(tensor.untyped_storage().data_ptr()):
        raise ValueError("free_locked_tensor: this tensor was not made by locked_tensor/new_cpu_locked_tensor")


def _forget(ptr: int, entry: tuple[str, int]) -> None:
    """The finalizer of a `locked_tensor` mapping: drop its entry, unless a newer buffer now holds ``ptr``."""
    if lock_table.forget(ptr, entry):
        _unlock(ptr, entry[1], entry[0])


def unlock_at(ptr: int) -> bool:
    """Unlock the ``locked_tensor`` buffer starting at address ``ptr``; False when there is none."""
    entry = lock_table.pop(ptr)
    if entry is None:
        return False
    _unlock(ptr, entry[1], entry[0])
    return True


def in_locked_buffer(tensor: torch.Tensor) -> bool:
    """Whether all of ``tensor``'s bytes lie inside one live ``locked_tensor`` buffer (a view counts)."""
    if tensor.device.type != "cpu":
        return False
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    buffers = lock_table.snapshot()  # a finalizer may pop an entry mid-iteration
    return any(base <= start and end <= base + nbytes for base, (_, nbytes) in buffers.items())
