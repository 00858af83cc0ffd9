"""OffloadAdam(overlap_backward=True): updates on a background thread during backward, applied
gradients freed and their memory reused for read-ahead, errors from that thread surfacing."""

from __future__ import annotations

import errno
import threading

import pytest
import torch

from offload.optim.overlap import BackgroundWorker
from offload.optim.spare import PAGE, SparePool
from offload.optim.adam import OffloadAdam
from tensorio import TensorIOError
from tensorio.testing import Fail, inject_faults


class _TiedModel(torch.nn.Module):
    """An embedding whose weight is also the output projection, as GPT-2's wte / lm_head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(300, 48)
        self.body = torch.nn.Sequential(torch.nn.Linear(48, 200), torch.nn.Tanh(), torch.nn.Linear(200, 48))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden = self.body(self.embed(tokens))
        logits = hidden @ self.embed.weight.T
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens.reshape(-1))


def _steps(model, opt, count, seed=3):
    gen = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(count):
        loss = model(torch.randint(0, 300, (4, 9), generator=gen))
        loss.backward()
        opt.step()
        losses.append(loss.item())
        opt.zero_grad()
    return losses


def _count_spare_reads(opt):
    swapper = opt.swapper
    original = swapper.start_read
    counts = {"spare": 0}

    def start_read(rec, *, spare=False):
        counts["spare"] += spare
        return original(rec, spare=spare)
    swapper.start_read = start_read
    return counts


def test_tied_weight_matches_adamw_frees_gradients_and_reads_ahead_into_them(tmp_path):
    ref_model, our_model = _TiedModel(), _TiedModel()
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, weight_decay=0.0, fused=True)
    opt = OffloadAdam(our_model.parameters(), lr=1e-2, nvme_offload_fraction=1.0, nvme_offload_dir=str(tmp_path),
                      overlap_backward=True, sub_group_size=4096, buffer_count=3)
    spare = _count_spare_reads(opt)
    assert _steps(our_model, opt, 6) == _steps(ref_model, ref, 6)
    for ours, theirs in zip(our_model.parameters(), ref_model.parameters()):
        assert torch.equal(ours, theirs)
    assert spare["spare"] > 0  # state read into the memory of gradients already applied

    loss = our_model(torch.randint(0, 300, (4, 9)))
    loss.backward()
    opt.synchronize()  # every update handed to the background thread has run
    assert all(p.grad is None for p in our_model.parameters())  # applied, then freed
    opt.step()
    opt.close()


def test_partly_offloaded_parameters_keep_their_gradients_until_step(tmp_path):
    model = _TiedModel()
    opt = OffloadAdam(model.parameters(), lr=1e-2, nvme_offload_fraction=0.5, nvme_offload_dir=str(tmp_path),
                      overlap_backward=True, sub_group_size=4096, buffer_count=3)
    model(torch.randint(0, 300, (4, 9))).backward()
    opt.synchronize()
    offloaded = [opt.is_offloaded(param) for param in model.parameters()]
    assert any(offloaded) and not all(offloaded)  # half of the state on NVMe
    for (name, param), on_disk in zip(model.named_parameters(), offloaded):
        assert (param.grad is not None) == (not on_disk), name
    opt.step()
    opt.close()


def test_failed_write_in_backward_raises_and_commits_nothing(tmp_path):
    model = _TiedModel()
    opt = OffloadAdam(model.parameters(), lr=1e-2, nvme_offload_fraction=1.0, nvme_offload_dir=str(tmp_path),
                      overlap_backward=True, sub_group_size=4096, buffer_count=3)
    _steps(model, opt, 2)
    before = opt.state_dict()
    with inject_faults(Fail(errno.ENOSPC, op="write", path=lambda path: path == opt.swap_path)):
        with pytest.raises(TensorIOError) as info:
            _steps(model, opt, 2)
    assert info.value.errno == errno.ENOSPC
    after = opt.state_dict()
    for i, entry in before["state"].items():
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(after["state"][i][key], entry[key]), (i, key)
    opt.zero_grad()
    _steps(model, opt, 1)  # and training goes on once the disk is back
    opt.close()


def test_background_worker_runs_in_order_and_reports_the_first_error():
    worker = BackgroundWorker("test")
    seen = []
    worker.submit(seen.append, 1)
    worker.submit(lambda: seen.append(torch.is_grad_enabled()))
    worker.submit(lambda: seen.append(threading.current_thread().name))
    worker.join()
    assert seen == [1, False, "test"]

    def fail(message):
        raise ValueError(message)
    worker.submit(fail, "first")
    worker.submit(fail, "second")
    worker.submit(seen.append, "skipped")
    with pytest.raises(ValueError, match="first"):
        worker.join()
    assert not worker.failed and "skipped" not in seen
    worker.submit(seen.append, 2)  # reported errors are forgotten
    worker.join()
    assert seen[-1] == 2
    worker.close()


def test_spare_pool_cuts_aligned_regions_all_or_nothing_and_reuses_them():
    pool = SparePool()
    big = torch.empty(5 * PAGE + 100, dtype=torch.uint8)
    pool.lend(big, smallest=PAGE)
    pool.lend(torch.empty(PAGE // 2, dtype=torch.uint8), smallest=PAGE)  # too small for any region: let go
    assert pool.cut(5, 2 * PAGE, take=False) is None  # room for at most 2 regions of 2 pages
    cuts = pool.cut(2, 2 * PAGE)
    assert [region.data_ptr() % PAGE for region, _ in cuts] == [0, 0]
    assert all(region.numel() * 4 == 2 * PAGE and region.dtype == torch.float32 for region, _ in cuts)
    first, second = (region.data_ptr() for region, _ in cuts)
    assert second - first == 2 * PAGE
    assert pool.cut(1, 2 * PAGE) is None
    pool.give_back([chunk for _, chunk in cuts])
    again = pool.cut(1, 2 * PAGE)
    assert again[0][0].data_ptr() == first  # the chunk is cut from its start once all is given back
    pool.clear()
    assert not pool.lending and pool.cut(1, PAGE) is None


def test_memory_kept_for_reads_ahead_is_reused_only_once_nothing_of_it_is_in_use(tmp_path):
    """`StateSwapper.lend_kept`: the state read ahead between steps lands in the same memory each step
    (faulted in once), never in memory a region read ahead earlier still holds."""
    model = _TiedModel()
    opt = OffloadAdam(model.parameters(), lr=1e-2, nvme_offload_fraction=1.0, nvme_offload_dir=str(tmp_path),
                      overlap_backward=True, sub_group_size=4096, buffer_count=3)
    _steps(model, opt, 2)
    opt.synchronize()
    swapper = opt.swapper
    first, second = list(swapper.records.values())[:2]
    capacity = 2 * max(first.plan.state_bytes, second.plan.state_bytes)

    def read_ahead(rec):
        swapper.lend_kept(rec.plan.state_bytes, capacity)
        swapper.start_read(rec, spare=True)
        return [region.clone() for region in swapper.wait_read(rec)], rec.regions[0].data_ptr()

    _, address = read_ahead(first)
    swapper.evict(first)  # updated and written in a real step: nothing refers to the memory any more
    swapper.drop_spares()
    state, again = read_ahead(first)
    assert again == address and swapper.kept_reused == 1
    swapper.drop_spares()  # `first` stays in memory, unused this step: its memory is not lent again
    _, elsewhere = read_ahead(second)
    assert not address <= elsewhere < address + capacity
    assert all(torch.equal(region, kept) for region, kept in zip(first.regions, state))
    with pytest.raises(ValueError, match="capacity"):
        swapper.lend_kept(capacity + PAGE, capacity)
    for rec in (first, second):
        swapper.evict(rec)
    opt.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])  # bf16: updated through an fp32 master
def test_a_scaled_step_matches_adamw_on_scaled_gradients_and_leaves_the_gradients_given_alone(tmp_path, dtype):
    """``start_step(grad_scale)`` as the engine calls it (clipping): each gradient handed over is
    multiplied by the scale in fp32 as it is applied, into scratch memory, not in place."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(3000).to(dtype)), torch.nn.Parameter(torch.randn(50, 40).to(dtype))]
    reference = [torch.nn.Parameter(p.detach().float()) for p in params]
    grads = [torch.randn(p.shape).to(dtype) for p in params]
    given = [g.clone() for g in grads]
    opt = OffloadAdam(params, lr=1e-2, nvme_offload_fraction=1.0, nvme_offload_dir=str(tmp_path),
                      overlap_backward=True, sub_group_size=1024, buffer_count=3)
    ref = torch.optim.AdamW(reference, lr=1e-2, weight_decay=0.0, fused=True)
    for _ in range(2):
        opt.start_step(0.5)
        for param, grad in zip(params, grads):
            opt.grad_ready(param, grad=grad)
        opt.step()
        for param, grad in zip(reference, grads):
            param.grad = grad.float() * 0.5
        ref.step()
    assert all(torch.equal(g, kept) for g, kept in zip(grads, given))
    assert all(torch.equal(ours, theirs.to(dtype)) for ours, theirs in zip(params, reference))
    opt.close()


def test_a_second_gradient_in_one_backward_is_refused(tmp_path):
    """Each parameter is updated once per backward; a second hand-over (a parameter shared by two
    reentrant checkpoint segments gets AccumulateGrad twice) raises instead of updating twice."""
    p = torch.nn.Parameter(torch.randn(5000))
    opt = OffloadAdam([p], nvme_offload_fraction=1.0, nvme_offload_dir=str(tmp_path), overlap_backward=True,
                      sub_group_size=4096, buffer_count=3)
    p.grad = torch.randn(5000)
    opt.grad_ready(p)
    with pytest.raises(RuntimeError, match="second gradient in one backward.*use_reentrant=False"):
        opt.grad_ready(p)
    opt.step()
    opt.close()
