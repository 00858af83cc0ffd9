"""What the benchmark scripts share: peak RSS (sampled, or the kernel's high-water mark), running a
configuration in a child process, and fio's traffic beside one.

Byte sizes ("128K", "1G", "8 GiB", "20GB") are parsed by ``tensorio.parse_size``.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import psutil

from bench.fio import FioLoad

#: The clone's root, put on a child's PYTHONPATH so that ``python -m benchmarks.NAME`` imports there.
REPO = Path(__file__).resolve().parent.parent


class RssSampler:
    """This process's resident set size, measured while the ``with`` block runs.

    By default a thread samples it (psutil) on entry, every ``interval`` seconds, and on exit;
    peaks shorter than ``interval`` can fall between two samples. With ``kernel_peak=True`` no peak
    is missed: the kernel's high-water mark (VmHWM in /proc/self/status) is reset on entry (by
    writing 5 to /proc/self/clear_refs, Linux 4.0+) and read, then reset again, at each `mark` and
    on exit, so each sample is the highest RSS since the one before. That mark is the process's
    own: use one such sampler at a time. Where clear_refs cannot be written, it samples instead.

    ``peak`` is the highest sample. ``mark(name, **figures)`` starts a phase; ``phases()`` gives each
    phase's duration and highest sample.
    """

    def __init__(self, interval: float = 0.002, *, kernel_peak: bool = False) -> None:
        self.interval = interval
        self.kernel_peak = kernel_peak
        """Whether the samples are the kernel's high-water mark (False after entry where it cannot be reset)."""
        self.samples: list[tuple[float, int]] = []
        """(time.perf_counter(), RSS in bytes) of each sample."""
        self.marks: list[tuple[float, str, dict[str, Any]]] = []
        self._process = psutil.Process()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)

    def __enter__(self) -> "RssSampler":
        self.kernel_peak = self.kernel_peak and reset_high_water_mark()
        self._sample()
        if not self.kernel_peak:
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if not self.kernel_peak:
            self._stop.set()
            self._thread.join()
        self._sample()

    def _sample(self) -> None:
        if self.kernel_peak:
            rss = high_water_mark()
            reset_high_water_mark()
        else:
            rss = self._process.memory_info().rss
        self.samples.append((time.perf_counter(), rss))

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample()

    @property
    def peak(self) -> int:
        """The highest RSS sampled, in bytes."""
        return max(rss for _, rss in self.samples)

    def mark(self, name: str, **figures: Any) -> None:
        """End the current phase and start phase ``name`` now; ``figures`` are reported with it."""
        if self.kernel_peak:
            self._sample()  # the ending phase's high-water mark, timed before the new phase starts
        self.marks.append((time.perf_counter(), name, figures))

    def phases(self) -> list[dict[str, Any]]:
        """Per phase: name, seconds, highest RSS sampled in it (0 if none) and the figures of its mark."""
        rows = []
        for (start, name, figures), (end, *_) in zip(self.marks, self.marks[1:]):  # the last mark only ends
            peak = max((rss for t, rss in self.samples if start <= t < end), default=0)
            rows.append({"phase": name, "seconds": end - start, "peak_rss": peak, **figures})
        return rows


def reset_high_water_mark() -> bool:
    """Make the kernel's peak RSS of this process (VmHWM) its current RSS; False where it cannot."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


def live_tensor_peak(call) -> tuple[Any, int]:
    """``call()``'s result and the peak of the bytes torch held allocated on this thread while it ran, over
    those at its start (the profiler's memory events): the tensors themselves, without the allocator's
    reuse of memory freed before (which hides growth from RSS) or its fragmentation (which adds to it)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = call()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")
    live = peak = 0
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    return result, peak


def high_water_mark() -> int:
    """The kernel's peak RSS of this process since the last reset (VmHWM), in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise OSError("/proc/self/status has no VmHWM line")


class ChildError(RuntimeError):
    """`run_child`'s child failed: its ``returncode`` (negative: killed by that signal) and the end of its ``stderr``."""

    def __init__(self, message: str, returncode: int, stderr: str) -> None:
        super().__init__(message)
        self.returncode = returncode
        self.stderr = stderr

    def one_line(self) -> str:
        """What went wrong in the child, in one line: the signal that killed it, or its last error line."""
        if self.returncode < 0:
            import signal

            name = signal.Signals(-self.returncode).name
            return f"killed by {name}" + (" (the OOM killer?)" if self.returncode == -9 else "")
        lines = self.stderr.strip().splitlines()
        return f"exit status {self.returncode}: {lines[-1] if lines else 'no error output'}"


RANK_VARIABLES = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
"""What a launcher (torchrun) sets for its ranks: a child started afresh must not inherit an outer launch's."""


def child_env(drop: Sequence[str] = ()) -> dict[str, str]:
    """This process's environment for a child: without the variables ``drop`` names, and with the clone first
    on PYTHONPATH (so that ``python -m benchmarks.NAME`` imports there)."""
    env = {key: value for key, value in os.environ.items() if key not in drop}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return env


def run_child(module: str, args: Sequence[str], *, mmap_threshold: int | None = None,
              cgroup: Any = None) -> dict[str, Any]:
    """Run ``python -m module *args`` in a fresh interpreter (so that its peak RSS is its own) and
    return the JSON object it printed on its last line of output.

    The child runs in the current directory with the clone on its PYTHONPATH. ``mmap_threshold``
    sets glibc's ``MALLOC_MMAP_THRESHOLD_`` for it (None: glibc's default; a value inherited from
    the environment is dropped either way); ``cgroup`` (a `benchmarks._cgroup.MemoryCgroup`) is the
    memory cgroup it runs in. Raises `ChildError` (a RuntimeError), with the end of the child's error
    output, when it fails.
    """
    env = child_env(drop=("MALLOC_MMAP_THRESHOLD_",))
    if mmap_threshold is not None:
        env["MALLOC_MMAP_THRESHOLD_"] = str(mmap_threshold)
    command = [sys.executable, "-m", module, *args]
    done = subprocess.run(command, capture_output=True, text=True, env=env, check=False,
                          preexec_fn=cgroup.enter if cgroup is not None else None)
    if done.returncode:
        raise ChildError(f"{' '.join(command)} failed with exit status {done.returncode}:\n{done.stderr[-3000:]}",
                         done.returncode, done.stderr[-3000:])
    return json.loads(done.stdout.strip().splitlines()[-1])


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for a process group's MASTER_PORT)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


LEAST_LOAD_RATE = 1 << 20
"""Bytes per second `traffic_at_pace` moves at least each way (a tiny model's offload moves next to nothing)."""


def traffic_at_pace(directory: str, read_bytes: float, written_bytes: float, seconds: float,
                    block_size: int = 1 << 20) -> FioLoad:
    """fio traffic (`bench.fio.fio_load`) that reads ``read_bytes`` and writes ``written_bytes`` every
    ``seconds``: an offload's bytes at the pace of the run without offload, to run that one beside it."""
    return FioLoad(directory=directory, block_size=block_size,
                   read_rate=max(LEAST_LOAD_RATE, round(read_bytes / seconds)),
                   write_rate=max(LEAST_LOAD_RATE, round(written_bytes / seconds)))


def gpt2_on_nvme_after_a_step(root: str, model_config: dict):
    """(model, engine): a random GPT-2 of ``model_config`` (GPT2Config keywords) with parameters and optimizer
    state on NVMe under ``root``, after one step of a 16-token batch; clipping off (the checkpoint benchmarks'
    recorded figures ran so)."""
    import torch
    import transformers

    from offload.train.engine import initialize

    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**model_config))
    config = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
              "gradient_clipping": 0.0,
              "zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": root, "max_in_cpu": 0},
                                    "offload_optimizer": {"device": "nvme", "nvme_path": root}}}
    engine, *_ = initialize(model=model, config=config)
    batch = torch.randint(0, model.config.vocab_size, (1, 16))
    engine.backward(engine(batch, labels=batch).loss)
    engine.step()
    return model, engine
