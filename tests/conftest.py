"""Shared fixtures (scratch directories on the disk, with O_DIRECT, and on tmpfs) and the test tiers.

Tiers: a test that starts Python child processes is marked ``subprocess``, one that runs several
ranks ``multiprocess``, one that runs the fio binary ``fio``, one that runs a benchmark script end to
end ``bench`` (per module with ``pytestmark``, or per test). Each of these is also ``slow``, so
``pytest -m "not slow"`` is the fast tier (under 5 minutes on a 2-core machine) and ``./run test``
runs everything. A ``fio`` test is skipped, saying how to install it, where fio is missing.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

# Under pytest-xdist (`./run test`: 2 workers), each worker computes on its share of the cores, and so do
# the processes it starts (ranks, benchmarks, snippets: the variable is inherited). torch's default, a
# thread per core in every worker, oversubscribes the cores, and OpenMP's waiting threads then spin
# against each other: tests/test_engine.py and test_infer_kv.py took 4.8 minutes on 2 workers with 2
# threads each, 28 s with one (the same tests passing).
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // _WORKERS)))

import pytest  # noqa: E402
import torch  # noqa: E402

if _WORKERS > 1:
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

from bench.fio import fio_path  # noqa: E402
from offload.device import cuda_available  # noqa: E402
from offload.device._simtorch import CUDA_CONFLICT, install as install_simulated_device  # noqa: E402

# The simulated device's torch device type ("simgpu") must exist before the process's first backward:
# torch's autograd sizes its per-device queues then (`offload.device._simtorch.install`). Where CUDA is
# available it is not installed: torch would take it as the process's accelerator and fail every CUDA
# backward (`CUDA_CONFLICT`); the `simulated` tests are skipped there instead.
CUDA = cuda_available()
if not CUDA:
    install_simulated_device()


def pytest_configure(config):
    # torch's composite kernels for a backend without its own (the simulated device) hand the CPU kernel
    # a 0-dim out= tensor to resize; torch warns about that resize, which is not the test's doing.
    config.addinivalue_line("filterwarnings", "ignore:An output with one or more elements was resized:UserWarning")

REPO = Path(__file__).resolve().parent.parent

#: Markers whose tests are left out of the fast tier (registered in pyproject.toml).
SLOW_KINDS = ("subprocess", "multiprocess", "fio", "bench")


@pytest.hookimpl(tryfirst=True)  # before -m deselects: the added marks must count
def pytest_collection_modifyitems(config, items):
    """Every test of a slow kind is ``slow`` too; ``fio`` tests skip where fio is not installed."""
    no_fio = pytest.mark.skip(reason="fio not installed: apt-get install fio") if fio_path() is None else None
    no_simulated = pytest.mark.skip(reason="CUDA is available: " + CUDA_CONFLICT) if CUDA else None
    for item in items:
        if no_simulated is not None and item.get_closest_marker("simulated") and not item.get_closest_marker("gpu"):
            item.add_marker(no_simulated)
        if any(item.get_closest_marker(kind) for kind in SLOW_KINDS):
            item.add_marker(pytest.mark.slow)
        if no_fio is not None and item.get_closest_marker("fio"):
            item.add_marker(no_fio)


@pytest.fixture
def disk_dir():
    """A scratch directory on the local disk, inside the clone (ext4 here: O_DIRECT works)."""
    root = REPO / ".tio_scratch"
    root.mkdir(exist_ok=True)
    path = Path(tempfile.mkdtemp(dir=root))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def tmpfs_dir():
    """A scratch directory on tmpfs (/dev/shm), where there is no direct I/O to a device."""
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm tmpfs on this machine")
    path = Path(tempfile.mkdtemp(dir="/dev/shm"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(params=["io_uring", "threads"])
def aio_backend(request):
    """Each of tensorio's backends in turn, for the tests of what the engine does with its I/O (checksums,
    faults, caches): ``{"backend": name}``, an ``aio`` section. io_uring skips where it cannot run."""
    import tensorio

    if request.param == "io_uring" and not tensorio.probe_io_uring()[0]:
        pytest.skip(f"io_uring cannot run here: {tensorio.probe_io_uring()[1]}")
    return {"backend": request.param}
