"""tensorio: asynchronous reads and writes of tensors to files, at the disk's full speed.

It knows files, buffers and bytes, nothing of models. See docs/tensorio.md.
"""

from ._buffers import (HostRegistration, aligned_tensor, free_locked_tensor, in_locked_buffer, lock_status, locked_tensor,
                       prefault, set_host_registration)
from ._checksum import ALGORITHM as CHECKSUM_ALGORITHM, ChecksumError, Checksums, checksum, checksum_chunks
from ._config import AioConfig
from ._errors import TensorIOError
from ._fs import DIRECT_ALIGN, filesystem_type, probe_direct
from ._handle import AioHandle
from ._landing import ChecksumTotals, checksum_totals
from ._phases import PHASES, PhaseTimer, phase_timer
from ._pool import BufferPool, storage_references
from ._request import IOFuture
from ._units import format_size, parse_size
from ._uring import probe_io_uring

__all__ = [
    "storage_references",
    "DIRECT_ALIGN",
    "AioConfig",
    "AioHandle",
    "CHECKSUM_ALGORITHM",
    "ChecksumError",
    "ChecksumTotals",
    "Checksums",
    "BufferPool",
    "HostRegistration",
    "IOFuture",
    "PHASES",
    "PhaseTimer",
    "TensorIOError",
    "aligned_tensor",
    "checksum",
    "checksum_chunks",
    "checksum_totals",
    "filesystem_type",
    "format_size",
    "free_locked_tensor",
    "in_locked_buffer",
    "lock_status",
    "locked_tensor",
    "parse_size",
    "phase_timer",
    "prefault",
    "probe_direct",
    "probe_io_uring",
    "set_host_registration",
]
