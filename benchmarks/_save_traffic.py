"""A checkpoint save's disk traffic without the save: the floor of what a save beside training can cost a step.

`SaveTraffic` reads ``nbytes`` from one file and writes as many to a new one, both at once, each at
``nbytes / seconds`` so that they run for the span a save ran, with fio (or, where fio is missing or fails,
tensorio itself). The shape mirrors the engine's save (offload/train/checkpoint/rank_state.py):

- reads: sequential, O_DIRECT, 1 MiB requests, 8 in flight: the engine's swap handle at the default ``aio``
  settings (the checkpoint benchmark's engine sets none), through which the save reads each partition and
  optimizer sub-group ahead of the one it writes;
- writes: sequential, O_DIRECT, 8 MiB requests, 4 in flight (`StagedWrites`: ``CHUNKS`` chunks of
  ``CHUNK_BYTES``, offload/storage/direct_writes.py; its handle splits each into 1 MiB pieces), into a new file
  preallocated to its size (fio's default ``fallocate``; the save's ``preallocate``), fsynced at the end.

fio runs both as two jobs of one process (io_uring, ``rate``: the read job's read rate, the write job's
write rate); the span starts once its jobs are set up (fio's start-up is left out). tensorio's stand-in
runs each direction on a thread of the caller's process with its own `AioHandle` (as the save's threads,
they take the GIL now and then), issuing 8 MiB requests no faster than the rate; a read request is split
into the read handle's 1 MiB pieces, 8 in flight, two requests at a time (one partition read ahead).

Bytes are rounded up to a whole number of 8 MiB requests (at least one).
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
import threading
import time
import uuid

import torch

from bench.fio import FILE_PREFIX, FioError, FioJob, fio_path, run_fio
from offload.storage.direct_writes import CHUNK_BYTES, CHUNKS
from tensorio import AioConfig, AioHandle, aligned_tensor

__all__ = ["READ_BLOCK", "READ_DEPTH", "WRITE_BLOCK", "WRITE_DEPTH", "SaveTraffic"]

READ_BLOCK = AioConfig().block_size
"""Bytes per read request (the engine's default ``aio.block_size``)."""

READ_DEPTH = AioConfig().queue_depth
"""Read requests in flight (the engine's default ``aio.queue_depth``)."""

WRITE_BLOCK = CHUNK_BYTES
"""Bytes per write request (the save's staging chunk)."""

WRITE_DEPTH = CHUNKS
"""Write requests in flight (the save's staging chunks)."""

SHAPE = (f"reads {READ_BLOCK >> 20} MiB x {READ_DEPTH} in flight and writes {WRITE_BLOCK >> 20} MiB x "
         f"{WRITE_DEPTH} in flight (into a new preallocated file, fsynced), at once, O_DIRECT, sequential")
"""The traffic's shape, as the benchmark prints it."""


class SaveTraffic:
    """The save's bytes moved in ``directory``: `start` reads ``nbytes`` (rounded up to whole 8 MiB
    requests) from a file laid out here once and writes as many to a new one, both paced to last ``seconds``;
    `running` says whether they still run, `finish` waits and gives the seconds each took. ``use_fio``
    False (or fio missing, or failing to lay the file out) moves them with tensorio. Use as a context
    manager: the files are removed on exit.

    Raises FioError (from `finish`) when fio fails, TensorIOError when tensorio's reads or writes do.
    """

    def __init__(self, directory: str, nbytes: int, *, use_fio: bool = True) -> None:
        self.directory = directory
        self.nbytes = max(1, -(-nbytes // WRITE_BLOCK)) * WRITE_BLOCK
        """Bytes read, and as many written, each time."""
        self.mover = "fio" if use_fio and fio_path() else "tensorio"
        """What moves them: "fio" or "tensorio"."""
        self.note = "" if self.mover == "fio" else ("fio off" if not use_fio else "fio is not installed")
        """Why tensorio moves them ("" with fio)."""
        stem = os.path.join(directory, f"{FILE_PREFIX}save-traffic-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        self.source, self.target = f"{stem}-read.dat", f"{stem}-write.dat"
        self._process: subprocess.Popen[str] | None = None
        self._threads: list[threading.Thread] = []
        self._seconds: dict[str, float] = {}
        self._errors: list[BaseException] = []
        self._began = 0.0
        self._lay_out()

    def __enter__(self) -> "SaveTraffic":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self, seconds: float) -> None:
        """Start reading and writing `nbytes` each, paced to take ``seconds`` (at least 10 ms)."""
        if self.running():
            raise RuntimeError("internal error: SaveTraffic started while it still runs")
        rate = max(1, round(self.nbytes / max(seconds, 0.01)))
        self._seconds, self._errors = {}, []
        self._began = time.perf_counter()
        if self.mover == "fio":
            self._process = subprocess.Popen(self._fio_command(rate), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                             text=True)
            # fio's start-up (tenths of a second) is no part of the span: its jobs are set up once the file it
            # writes exists (created and preallocated just before its first write).
            deadline = time.perf_counter() + 10
            while not os.path.exists(self.target) and self._process.poll() is None and time.perf_counter() < deadline:
                time.sleep(0.001)
            self._began = time.perf_counter()
            return
        self._threads = [threading.Thread(target=self._move, args=(write, rate), name=f"save-traffic-{rw}", daemon=True)
                         for write, rw in ((False, "read"), (True, "write"))]
        for thread in self._threads:
            thread.start()

    def running(self) -> bool:
        """Whether the traffic `start` began still runs."""
        if self._process is not None:
            return self._process.poll() is None
        return any(thread.is_alive() for thread in self._threads)

    def finish(self) -> dict[str, float]:
        """Wait for the traffic (sync point); {"read_s", "write_s": each direction's seconds, "span_s": from
        `start` until both ended}. Removes the written file. Raises FioError / TensorIOError."""
        try:
            if self._process is not None:
                process, self._process = self._process, None
                stdout, stderr = process.communicate()
                span = time.perf_counter() - self._began
                self._seconds = _fio_seconds(process.returncode, stdout, stderr, process.args, self.nbytes)
            else:
                for thread in self._threads:
                    thread.join()
                span = time.perf_counter() - self._began
                self._threads = []
                if self._errors:
                    raise self._errors[0]
        finally:
            _unlink(self.target)
        return {"read_s": self._seconds["read"], "write_s": self._seconds["write"], "span_s": span}

    def close(self) -> None:
        """Stop what still runs and remove both files. Idempotent."""
        if self._process is not None:
            self._process.kill()
            self._process.communicate()
            self._process = None
        for thread in self._threads:
            thread.join()
        self._threads = []
        _unlink(self.target)
        _unlink(self.source)

    # ---- the file read from ------------------------------------------------------------------------------

    def _lay_out(self) -> None:
        """Write the file the traffic reads, once, outside any timing (fio where it can, else tensorio)."""
        if self.mover == "fio":
            try:
                run_fio(FioJob(directory=self.directory, rw="write", size=self.nbytes, block_size=WRITE_BLOCK,
                               queue_depth=WRITE_DEPTH), filename=self.source)
                return
            except FioError as error:
                _unlink(self.source)
                self.mover, self.note = "tensorio", f"fio failed: {str(error).splitlines()[0]}"
        self._seconds = {}
        self._move(True, 0, path=self.source)
        if self._errors:
            raise self._errors[0]

    # ---- fio ---------------------------------------------------------------------------------------------

    def _fio_command(self, rate: int) -> list[str]:
        return [fio_path(), "--output-format=json", "--thread", "--ioengine=io_uring", "--direct=1",
                f"--size={self.nbytes}",
                "--name=read", f"--filename={self.source}", "--rw=read", f"--bs={READ_BLOCK}",
                f"--iodepth={READ_DEPTH}", f"--rate={rate},0",
                "--name=write", f"--filename={self.target}", "--rw=write", f"--bs={WRITE_BLOCK}",
                f"--iodepth={WRITE_DEPTH}", f"--rate=0,{rate}", "--end_fsync=1"]

    # ---- tensorio ----------------------------------------------------------------------------------------

    def _move(self, write: bool, rate: int, path: str | None = None) -> None:
        """Read (or write) `nbytes` of ``path`` (the traffic's file of that direction) in 8 MiB requests, the
        i-th not before ``i * 8 MiB / rate`` seconds (``rate`` 0: as fast as it goes); seconds into `_seconds`,
        an error into `_errors`."""
        path = path or (self.target if write else self.source)
        depth = WRITE_DEPTH if write else 2  # reads: a request in use and the next ahead
        began = time.perf_counter()
        try:
            if write:
                _preallocate(path, self.nbytes)
            buffers = [aligned_tensor(WRITE_BLOCK, torch.uint8) for _ in range(depth)]
            if write:
                for buffer in buffers:
                    buffer.copy_(torch.randint(0, 256, (WRITE_BLOCK,), dtype=torch.uint8))
            # The save's write handle (1 MiB pieces, 16 in flight) for writes; the engine's default for reads.
            handle = AioHandle(block_size=1 << 20, queue_depth=16) if write else AioHandle(READ_BLOCK, READ_DEPTH)
            inflight: list = []
            with handle:
                for i, offset in enumerate(range(0, self.nbytes, WRITE_BLOCK)):
                    if len(inflight) == depth:
                        _landed(inflight.pop(0), path, write)  # sync point: the oldest request's buffer is free
                    if rate:
                        time.sleep(max(0.0, began + offset / rate - time.perf_counter()))
                    buffer = buffers[i % depth]
                    future = handle.write(buffer, path, offset) if write else handle.read(buffer, path, offset)
                    inflight.append((future, offset))
                for request in inflight:
                    _landed(request, path, write)
            if write:
                descriptor = os.open(path, os.O_WRONLY)
                try:
                    os.fsync(descriptor)
                finally:
                    os.close(descriptor)
        except BaseException as error:  # raised by `finish` on the caller's thread
            self._errors.append(error)
        self._seconds["write" if write else "read"] = time.perf_counter() - began


def _landed(request: tuple, path: str, write: bool) -> None:
    """Wait for one request; raise OSError naming the file for a short one."""
    future, offset = request
    moved = future.result()
    if moved != WRITE_BLOCK:
        raise OSError(errno.EIO, f"{'wrote' if write else 'read'} {moved} of {WRITE_BLOCK} bytes at offset {offset}",
                      path)


def _preallocate(path: str, nbytes: int) -> None:
    """Create ``path`` anew with ``nbytes`` reserved (where the file system can), as the save's files are."""
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.posix_fallocate(descriptor, 0, nbytes)
    except OSError as error:
        if error.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            raise
        os.ftruncate(descriptor, nbytes)
    finally:
        os.close(descriptor)


def _fio_seconds(returncode: int, stdout: str, stderr: str, command: list[str], nbytes: int) -> dict[str, float]:
    """Each job's seconds from fio's JSON report of the two jobs. Raises FioError naming the command."""
    line = " ".join(command)
    if returncode:
        raise FioError(f"fio failed with exit status {returncode}: {line}\n{stderr.strip()[-2000:]}")
    try:
        report = json.loads(stdout[stdout.find("{"):])
        jobs = {job["jobname"]: job for job in report["jobs"]}
        seconds = {}
        for rw in ("read", "write"):
            stats = jobs[rw][rw]
            if int(stats["io_bytes"]) != nbytes:
                raise FioError(f"fio's {rw} job moved {stats['io_bytes']} of {nbytes} bytes: {line}")
            seconds[rw] = stats["runtime"] / 1000
    except (ValueError, KeyError, TypeError) as error:
        raise FioError(f"fio's JSON report lacks {error}: {line}\n{stderr.strip()[-2000:]}") from None
    return seconds


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
