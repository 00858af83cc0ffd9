"""The optimizer's worker thread runs its OpenMP kernels on half of torch's threads; the caller keeps its own."""

from __future__ import annotations

import threading

import pytest
import torch

from offload.optim.overlap import BackgroundWorker
from offload.optim.threads import limit_this_thread, update_thread_count

pytestmark = pytest.mark.skipif(not torch._C.has_openmp, reason="torch built without OpenMP")


@pytest.fixture(params=["torch's default", "set_num_threads"])
def threads_set(request):
    """Both ways a process's count comes: torch's default, or set by the user (which torch applies to
    each new thread at its first kernel)."""
    before = torch.get_num_threads()
    if request.param == "set_num_threads":
        torch.set_num_threads(before)
    yield
    torch.set_num_threads(before)


def test_the_worker_uses_half_the_threads_and_the_caller_keeps_its_own(threads_set):
    before = torch.get_num_threads()
    worker = BackgroundWorker("test-updates")
    seen = []
    worker.submit(lambda: seen.append(torch.get_num_threads()))
    worker.join()
    worker.close()
    assert seen == [max(1, before // 2)] == [update_thread_count()]
    assert torch.get_num_threads() == before


def test_a_limit_set_in_one_thread_stays_in_it(threads_set):
    before = torch.get_num_threads()
    seen = []

    def limited() -> None:
        assert limit_this_thread(1)
        seen.append(torch.get_num_threads())
        x = torch.arange(1 << 20, dtype=torch.float32)
        seen.append(float((x * 2).sum()) == float(x.sum()) * 2)  # a parallel kernel still computes right

    thread = threading.Thread(target=limited)
    thread.start()
    thread.join()
    assert seen == [1, True]
    assert torch.get_num_threads() == before
