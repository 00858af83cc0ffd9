"""The disk's floor for a benchmark's bound: fio's O_DIRECT sequential read and write of ``size`` bytes
in a directory, or, where fio is missing or cannot run, a tensorio sequential write then read of the
same size with the same settings (`bench.measure`), which `DiskRates.source` says.

    rates = disk_rates(AioConfig(block_size=1 << 20, queue_depth=32), "/nvme/tmp", 1 << 30)
    print(rates.describe())    # "disk (fio): read 2.55 GB/s, write 3.08 GB/s"
"""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass
from pathlib import Path

from bench.fio import FioError, job_for_config, run_fio
from bench.measure import DEFAULT_REQUEST_BYTES, Buffers, measure_point
from tensorio import AioConfig, free_locked_tensor, probe_direct


@dataclass(frozen=True, slots=True)
class DiskRates:
    """Sequential read and write speeds of one directory's disk, and what measured them."""

    read_bps: float
    write_bps: float
    source: str
    """"fio", or "tensorio" where fio could not run (``fio_missing`` says why)."""
    fio_missing: str | None = None
    """Why fio did not measure (not installed, or its error's first line); None when it did."""

    def describe(self) -> str:
        """One line: the speeds and their source."""
        how = "fio" if self.source == "fio" else (
            f"a tensorio sequential write/read of the same size, not fio: {self.fio_missing}")
        return f"disk ({how}): read {self.read_bps / 1e9:.2f} GB/s, write {self.write_bps / 1e9:.2f} GB/s"


def disk_rates(aio: AioConfig, directory: str | os.PathLike, size: int) -> DiskRates:
    """fio's sequential read and write of ``size`` bytes in ``directory`` with ``aio``'s settings
    (O_DIRECT, io_uring); where fio is not installed or fails, tensorio's (`bench.measure.measure_point`:
    one write, then one read, of ``size`` bytes rounded down to whole requests, bytes checked).

    Holds two locked buffers of ``size`` bytes for the tensorio measurement. Raises FileNotFoundError
    for a missing directory, TensorIOError or MeasurementError from tensorio's I/O.
    """
    try:
        read = run_fio(job_for_config(aio, directory=directory, rw="read", size=size)).bw_bytes
        write = run_fio(job_for_config(aio, directory=directory, rw="write", size=size)).bw_bytes
        return DiskRates(read_bps=read, write_bps=write, source="fio")
    except FioError as exc:
        reason = str(exc).splitlines()[0]
    request = min(DEFAULT_REQUEST_BYTES, size)
    nbytes = max(size // request, 1) * request
    direct, _ = probe_direct(directory)
    buffers = Buffers(nbytes)
    path = Path(directory) / f"tensorio-floor-{os.getpid()}-{uuid.uuid4().hex[:8]}.dat"
    try:
        point = measure_point(aio, path, buffers, request_size=request, repeats=1, direct=direct)
    finally:
        path.unlink(missing_ok=True)
        free_locked_tensor(buffers.source)
        free_locked_tensor(buffers.dest)
    return DiskRates(read_bps=point.read.bw_bytes, write_bps=point.write.bw_bytes, source="tensorio",
                     fio_missing=reason)
