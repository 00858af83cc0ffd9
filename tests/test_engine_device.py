"""The engine computing on a device with its own memory (docs/gpu.md): on the simulated device (marked
``simulated``: partitions gathered onto it by copies on a side stream, gradients copied back, every
copy after a random delay or as late as possible, so a missing wait raises DeviceSyncError) and, where
CUDA exists, on the GPU (marked ``gpu``). Losses and parameters equal plain PyTorch's within the CPU
tests' tolerance per dtype."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from offload.device import CpuDevice, DeviceSyncError, Event, SimulatedDevice, cuda_available
from offload.train.engine import initialize
from test_engine import (FAST_CASES, LR, assert_close, engine_config, gpt2, gpt2_batches, gpt2_loss, mlp, mlp_batches,
                         mlp_loss, reference, reference_16bit, train)

transformers = pytest.importorskip("transformers")

#: The devices each test runs on: the simulated one on two schedules (the late one outside the fast tier:
#: ``pytest -m simulated`` runs both), and CUDA where there is a GPU.
DEVICES = [pytest.param("random", marks=pytest.mark.simulated),
           pytest.param("late", marks=[pytest.mark.simulated, pytest.mark.slow]),
           pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not cuda_available(), reason="no CUDA")])]


@pytest.fixture(params=DEVICES)
def device(request):
    """What ``initialize(compute_device=)`` takes: a SimulatedDevice, or "cuda"."""
    if request.param == "cuda":
        yield "cuda"
        return
    # register_host: host buffers count as pinned only where registered through the seam, as on CUDA
    sim = SimulatedDevice(seed=7, schedule=request.param, max_delay_s=0.0005, register_host=True)
    yield sim
    sim.raise_faults()  # a host write that raced a copy, found after the last call
    sim.close()


GPU_ATOL = 1e-6
"""Where the reference and the engine both compute on a GPU, their kernels may differ (cuBLAS picks one by
the operands' alignment; the engine's parameters are views of gathered buffers), so sums round
differently: one weight near zero came out 1.7e-7 apart after 4 steps on an H200, against the 1e-7 of
the comparisons on the CPU and the simulated device, whose kernels are the same on both sides."""


def atol_on(device) -> float:
    return GPU_ATOL if device == "cuda" else 1e-7


def set_aside_key_biases(params: dict, ref_params: dict, n_embd: int, steps: int) -> None:
    """GPT-2's attention key bias has a gradient of zero in exact arithmetic (softmax ignores a shift that
    is the same for every key), so what a step computes for it is rounding noise, which Adam scales to a
    step of ``LR`` of either sign. Where the two sides' kernels differ (a GPU), the noise differs: check
    that each side moved it by at most ``LR`` a step, then give the engine's copy the reference's values
    so that the rest is compared as before."""
    for name, ref in ref_params.items():
        if name.endswith("attn.c_attn.bias"):
            keys = slice(n_embd, 2 * n_embd)
            assert (params[name][keys] - ref[keys]).abs().max() <= 2 * LR * steps * (1 + 1e-3), name
            params[name][keys] = ref[keys]


def on(device) -> torch.device:
    """Where the plain PyTorch reference computes: the same device (the GPU, or the simulated one)."""
    return torch.device("cuda") if device == "cuda" else device.torch_device


def to(batches, where: torch.device):
    return [tuple(t.to(where) for t in b) if isinstance(b, tuple) else b.to(where) for b in batches]


def host(params: dict) -> dict:
    return {name: p.cpu() for name, p in params.items()}


def run_reference(build, batches, loss_fn, gas, device, dtype=None, clip=0.0, loss_scale=1.0):
    where = on(device)
    model = build().to(where)
    if dtype is None:
        losses, params = reference(model, to(batches, where), loss_fn, gas, clip=clip)
    else:
        losses, params = reference_16bit(model, to(batches, where), loss_fn, gas, dtype, clip=clip,
                                         loss_scale=loss_scale)
    return losses, host(params)


@pytest.mark.simulated
def test_a_loss_with_its_label_left_on_the_host_raises_as_on_a_gpu(disk_dir):
    """A loss computed from the engine's output with the label on the host: the engine never sees that
    loss (docs/gpu.md moves the label, as DeepSpeed's users do); the device raises CUDA's error, naming
    both devices. Labels handed to the engine itself are moved with the inputs."""
    device = SimulatedDevice(seed=1, max_delay_s=0.0, register_host=True)
    engine, *_ = initialize(model=mlp(), config=engine_config(disk_dir, "cpu", "none"), compute_device=device)
    x, y = mlp_batches(1)[0]
    out = engine(x)
    assert out.device == engine.device.torch_device == torch.device("simgpu", 0)
    with pytest.raises(RuntimeError, match=r"Expected all tensors to be on the same device, but found at least "
                                           r"two devices, simgpu:0 and cpu!"):
        nn.functional.mse_loss(out, y)
    engine.backward(nn.functional.mse_loss(out, y.to(engine.device.torch_device)))  # the fix
    engine.step()
    assert engine.global_steps == 1
    engine.close()
    device.close()
    gpt2_engine, *_ = initialize(model=gpt2(), config=engine_config(disk_dir, "cpu", "none", micro=2),
                                 compute_device=SimulatedDevice(seed=2, max_delay_s=0.0, register_host=True))
    batch = gpt2_batches(1)[0]
    engine_loss = gpt2_engine(batch, labels=batch).loss  # host labels, moved with the inputs
    assert engine_loss.device.type == "simgpu"
    gpt2_engine.backward(engine_loss)
    gpt2_engine.step()
    sim = gpt2_engine.device
    gpt2_engine.close()
    sim.close()


@pytest.mark.parametrize("gas", [1, pytest.param(2, marks=pytest.mark.slow)])
@pytest.mark.parametrize("param,opt", [("none", "none"), ("cpu", "none"), ("cpu", "nvme"), ("nvme", "nvme"),
                                       ("nvme", "none")])
def test_matches_plain_pytorch_on_the_device(disk_dir, device, param, opt, gas):
    """fp32, every placement of the partitions and of the optimizer state, with and without accumulation:
    the losses and parameters of plain PyTorch on the same device (AdamW on the CPU here)."""
    batches = mlp_batches(6 * gas)
    ref_losses, ref_params = run_reference(mlp, batches, mlp_loss, gas, device)
    engine, *_ = initialize(model=mlp(), config=engine_config(disk_dir, param, opt, gas, micro=4),
                            compute_device=device)
    assert engine.device.separate_memory
    losses = train(engine, batches, mlp_loss)
    assert engine.global_steps == 6
    assert_close(losses, host(dict(engine.full_parameters())), ref_losses, ref_params)
    if param == "nvme":
        assert all(p.numel() == 0 for p in engine.module.parameters())  # partitions rest on disk
    if param == "none":  # every parameter stays gathered on the device, each update copied there
        assert all(rec.full is not None and rec.keep_full for rec in engine.records)
        assert all(p.shape == rec.shape for p, rec in zip(engine.module.parameters(), engine.records))
    engine.close()


@pytest.mark.parametrize("case", [pytest.param("clipping", marks=pytest.mark.slow), "clipping-accumulation",
                                  "bf16-clipping", pytest.param("bf16-accumulation", marks=pytest.mark.slow),
                                  "fp16-clipping-accumulation"])
def test_16_bit_clipping_and_accumulation_match_plain_pytorch_on_the_device(disk_dir, device, case):
    """bf16, fp16 with a loss scale, gradient clipping and accumulation, parameters and optimizer state on
    NVMe, on the fast paths (the update during backward, or in the next forward with clipping or fp16):
    plain PyTorch's results bit for bit on the simulated device (fp32 master weights for 16-bit), as on
    the CPU; on a GPU within the dtype's tolerance (its kernels round differently from the CPU's)."""
    fast_path_matches_plain_pytorch(disk_dir, device, case, "nvme")


@pytest.mark.parametrize("case", ["clipping-accumulation", "bf16-accumulation"])
def test_parameters_kept_on_the_device_take_every_update(disk_dir, device, case):
    """``offload_param.device`` "none": every parameter stays gathered on the device, and each update
    (in the next forward with clipping, during backward without) is copied there before its next use."""
    fast_path_matches_plain_pytorch(disk_dir, device, case, "none")


def fast_path_matches_plain_pytorch(disk_dir, device, case: str, param: str) -> None:
    """Train FAST_CASES[case] (optimizer state on NVMe, parameters at ``param``) on ``device``; compare."""
    extra, gas, dtype, scale = FAST_CASES[case]
    batches = mlp_batches(4 * gas)
    if dtype is not None:
        batches = [(x.to(dtype), y.to(dtype)) for x, y in batches]
    clip = extra.get("gradient_clipping", 0.0)
    ref_losses, ref_params = run_reference(mlp, batches, mlp_loss, gas, device, dtype, clip=clip, loss_scale=scale)
    engine, *_ = initialize(model=mlp(), config=engine_config(disk_dir, param, "nvme", gas, micro=4, **extra),
                            compute_device=device)
    in_forward = bool(clip) or dtype is torch.float16
    assert engine.stats().mode.value == ("in the next forward" if in_forward else "during backward")
    losses = train(engine, batches, mlp_loss)
    assert engine.global_steps == 4 and engine.skipped_steps == 0
    assert engine.stats().steps_in_forward == (4 if in_forward else 0)
    params = host(dict(engine.full_parameters()))
    engine.close()
    if device == "cuda":
        tolerance = 1e-5 if dtype is None else 2e-2
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=tolerance, atol=0)
        for name, ref in ref_params.items():
            torch.testing.assert_close(params[name], ref, rtol=tolerance, atol=1e-7 if dtype is None else 1e-2)
        return
    assert losses == ref_losses
    for name, ref in ref_params.items():
        assert torch.equal(params[name], ref), name


def pending_partition_is_not_copied_ahead(engine) -> None:
    """Right after a step handed to the next forward: a partition whose update has not run yet offers no
    host values to copy ahead, even with its read done (they are about to change in place)."""
    store, step = engine.param_store, engine.param_store.updates
    pending = [rec for rec in engine.records if not step.settled(rec)]  # their update is still to run
    assert pending
    for rec in pending:
        if rec.read is not None:
            rec.read.result()  # the read the forward prefetches has landed
        assert not step.settled(rec) and store.host_partition(rec) is None, rec.name


@pytest.mark.parametrize("param", ["cpu", "nvme"])
def test_the_update_in_the_next_forward_copies_the_next_partitions_ahead(disk_dir, device, param):
    """With clipping the updates run in the next forward; that forward still copies the next partitions to
    the device ahead of their gathers (those whose update has run, up to stage3_prefetch_bucket_size), and
    the results stay plain PyTorch's. Before each forward the test lets the optimizer's thread finish the
    updates handed over at the step (partitions in memory: all of them), so every copy ahead is allowed; with
    the partitions on NVMe, a partition whose update is still to come is not copied ahead."""
    extra, gas, _, _ = FAST_CASES["clipping-accumulation"]
    batches = mlp_batches(4 * gas)
    ref_losses, ref_params = run_reference(mlp, batches, mlp_loss, gas, device, clip=extra["gradient_clipping"])
    config = engine_config(disk_dir, param, "nvme", gas, micro=4, **extra)
    config["zero_optimization"]["stage3_prefetch_bucket_size"] = 1  # one partition ahead: the bucket is honoured
    engine, optimizer, *_ = initialize(model=mlp(), config=config, compute_device=device)
    assert engine.stats().mode.value == "in the next forward"
    gathers = engine.param_store.gathers
    largest = max(rec.partition_numel for rec in engine.records)
    ahead, losses = [], []
    for i, batch in enumerate(batches):
        optimizer.wait_for_updates(lambda: False)
        before = gathers.copied_ahead
        loss = mlp_loss(engine, batch)
        ahead.append(gathers.copied_ahead - before)
        assert gathers.waiting_ahead_elements <= largest
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        if param == "nvme" and i % gas == gas - 1:  # a step was handed over: its partitions wait for their reads
            pending_partition_is_not_copied_ahead(engine)
    assert engine.stats().steps_in_forward == 4
    if param == "cpu":  # every forward after the first (which records the order) copies ahead, a step's updates in it
        assert ahead[0] == 0 and all(n > 0 for n in ahead[1:]), ahead
    params = host(dict(engine.full_parameters()))
    engine.close()
    assert_close(losses, params, ref_losses, ref_params, rtol=1e-5 if device == "cuda" else 0)


@pytest.mark.parametrize("param", ["cpu", pytest.param("nvme", marks=pytest.mark.slow)])
def test_gpt2_matches_plain_pytorch_on_the_device(disk_dir, device, param):
    """GPT-2 (a tied embedding, attention buffers that move to the device with the model's inputs, layer
    norms small enough to be persistent: kept on the device, each update copied there)."""
    batches = gpt2_batches(4)
    build = lambda: gpt2(dropout=0.0)  # noqa: E731 - no dropout: the same numbers on any device
    ref_losses, ref_params = run_reference(build, batches, gpt2_loss, 1, device)
    config = engine_config(disk_dir, param, "nvme", micro=2)
    config["zero_optimization"]["stage3_param_persistence_threshold"] = 100
    engine, *_ = initialize(model=build(), config=config, compute_device=device)
    kept = [rec for rec in engine.records if rec.keep_full]
    assert kept and all(rec.numel <= 100 and rec.full is not None for rec in kept)
    assert any(not rec.keep_full for rec in engine.records)
    losses = train(engine, batches, gpt2_loss)
    params = host(dict(engine.full_parameters()))
    if device == "cuda":  # an H200 gave 33 of 96 c_attn biases apart: the 32 of the keys, and one at 1e-7
        set_aside_key_biases(params, ref_params, n_embd=32, steps=len(batches))
    assert_close(losses, params, ref_losses, ref_params, rtol=1e-4, atol=atol_on(device))
    engine.close()


class _Checkpointed(nn.Module):
    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(16, 16)  # so that the checkpointed blocks' inputs require grad
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.GELU()) for _ in range(3))
        self.head = nn.Linear(16, 8)
        self.reentrant = reentrant

    def forward(self, x):
        x = self.inp(x)
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=self.reentrant)
        return self.head(x)


@pytest.mark.parametrize("reentrant", [True, False])
def test_activation_checkpointing_on_the_device(disk_dir, device, reentrant):
    """Checkpointed blocks re-run their forward in backward: the re-run gathers onto the device again."""
    batches = mlp_batches(4)
    ref_losses, ref_params = run_reference(lambda: _Checkpointed(reentrant), batches, mlp_loss, 1, device)
    engine, *_ = initialize(model=_Checkpointed(reentrant), config=engine_config(disk_dir, "nvme", "nvme"),
                            compute_device=device)
    losses = train(engine, batches, mlp_loss)
    assert_close(losses, host(dict(engine.full_parameters())), ref_losses, ref_params, atol=atol_on(device))
    engine.close()


@pytest.mark.simulated
@pytest.mark.parametrize("param", ["none", "cpu", "nvme"])
def test_device_memory_does_not_grow_over_many_steps(disk_dir, param):
    """After every step the device holds the same bytes (the two gradient buckets): gathered buffers and
    copies ahead are all given back, at the end of each backward at the latest."""
    device = SimulatedDevice(seed=3, max_delay_s=0.0002)
    batches = gpt2_batches(30)
    engine, *_ = initialize(model=gpt2(), config=engine_config(disk_dir, param, "nvme", micro=2), compute_device=device)
    held = []
    for batch in batches:
        loss = gpt2_loss(engine, batch)
        engine.backward(loss)
        engine.step()
        held.append(device.allocated_bytes)
    assert held[0] > 0 and held == [held[0]] * len(held)
    gathers = engine.param_store.gathers
    copies = engine.stats().device_bytes
    assert copies["to_device"] > 0 and copies["to_host"] > 0
    assert gathers.copied_ahead > 0 or param == "none"  # the next partitions copied while one computes
    engine.close()
    assert device.allocated_bytes == 0
    device.close()


@pytest.mark.simulated
def test_a_device_budget_too_small_for_the_gathers_fails_naming_it(disk_dir):
    """The buffers a step needs on the device are counted against its budget; over it, the error names
    the buffer and the setting."""
    device = SimulatedDevice(budget_bytes=2048, budget_setting="compute_device_budget")
    engine, *_ = initialize(model=mlp(), config=engine_config(disk_dir, "cpu", "none"), compute_device=device)
    with pytest.raises(MemoryError, match="compute_device_budget"):
        mlp_loss(engine, mlp_batches(1)[0])
    device.close()


class _NoWait(Event):
    """An event whose synchronize and query do not wait: the bug of a host that does not wait for a copy."""

    def __init__(self, real: Event) -> None:
        self.raw = real

    def query(self) -> bool:
        return False

    def synchronize(self) -> None:
        pass


@pytest.mark.simulated
def test_a_gather_that_does_not_wait_for_its_copy_is_caught(disk_dir, monkeypatch):
    """Compute that skips the wait for a partition's copy reads a buffer the copy has not filled: the
    simulated device raises, naming the buffer."""
    device = SimulatedDevice(schedule="late")
    engine, *_ = initialize(model=mlp(), config=engine_config(disk_dir, "cpu", "none"), compute_device=device)
    monkeypatch.setattr(device.compute_stream, "wait_event", lambda event: None)
    with pytest.raises(DeviceSyncError, match="partition"):
        mlp_loss(engine, mlp_batches(1)[0])
    monkeypatch.undo()
    engine.close()  # before the device: the engine's copies in flight end first
    device.close()


@pytest.mark.simulated
def test_gradients_read_before_their_copy_to_the_host_are_caught(disk_dir, monkeypatch):
    """A host that takes a gradient bucket without waiting for its copy from the device reads a buffer
    the copy has not filled: the simulated device raises."""
    device = SimulatedDevice(schedule="late")
    engine, *_ = initialize(model=mlp(), config=engine_config(disk_dir, "cpu", "none"), compute_device=device)
    real = device.to_host
    monkeypatch.setattr(device, "to_host", lambda dst, src, *, stream: _NoWait(real(dst, src, stream=stream)))
    loss = mlp_loss(engine, mlp_batches(1)[0])
    with pytest.raises(DeviceSyncError):
        engine.backward(loss)
    monkeypatch.undo()
    engine.close()
    device.close()


class _SeenDone:
    """A copy's event whose ``query`` answers done without asking the device: the bug of a host that gives
    a buffer back without its copy's event (``synchronize`` waits as it should)."""

    def __init__(self, real: Event) -> None:
        self._real = real

    def __getattr__(self, name: str):
        return getattr(self._real, name)

    def query(self) -> bool:
        return True


@pytest.mark.simulated
def test_the_host_does_not_wait_for_a_copy_to_give_its_nvme_read_buffer_back(disk_dir, monkeypatch):
    """A forward with the partitions on NVMe: each read buffer goes back to the pool and the budget on its
    copy's event (done by the time the next reads start), never through the host's wait for the copies
    that read a partition (`host_released`, for a write in place); the end of backward gives every buffer back."""
    device = SimulatedDevice(schedule="late")
    engine, *_ = initialize(model=mlp(), config=engine_config(disk_dir, "nvme", "none"), compute_device=device)
    store = engine.param_store

    def waits(rec, host):
        raise AssertionError(f"the host waited for the copies of {rec.name!r} to give its read buffer back")

    for batch in mlp_batches(2):
        monkeypatch.setattr(store.gathers, "host_released", waits)
        loss = mlp_loss(engine, batch)
        assert store.budget.held <= store.budget.buffer_elements
        monkeypatch.undo()  # the updates during backward write partitions in place: they do wait
        engine.backward(loss)
        assert store.gathers.returning_buffers == 0
        engine.step()
    engine.close()
    device.close()


@pytest.mark.simulated
def test_an_nvme_read_buffer_given_back_before_its_copy_is_seen_done_is_caught(disk_dir, monkeypatch):
    """A host that takes a copy as done without its event (so the pool may refill the buffer while the copy
    reads it): the simulated device raises, naming the copy and the device buffer."""
    device = SimulatedDevice(schedule="late")
    engine, *_ = initialize(model=mlp(), config=engine_config(disk_dir, "nvme", "none"), compute_device=device)
    real = device.to_device
    monkeypatch.setattr(device, "to_device",
                        lambda dst, src, *, stream: _SeenDone(real(dst, src, stream=stream)))
    with pytest.raises(DeviceSyncError, match=r"written by the host while copy #\d+ on stream 'param-copy' may still "
                                              r"read it into device buffer 'partition"):
        mlp_loss(engine, mlp_batches(1)[0])
    monkeypatch.undo()
    engine.close()
    device.close()


def test_cuda_without_cuda_is_refused_naming_the_setting_and_writing_nothing(disk_dir):
    if cuda_available():
        pytest.skip("CUDA is available here")
    with pytest.raises(ValueError, match=r"compute_device: \"cuda\" is asked for but CUDA is not available"):
        initialize(model=mlp(), config=engine_config(disk_dir, "nvme", "nvme", compute_device="cuda"))
    assert os.listdir(disk_dir) == []


def test_an_unknown_compute_device_and_a_budget_over_free_memory_are_refused(disk_dir):
    with pytest.raises(ValueError, match="compute_device: 'tpu' is not allowed"):
        initialize(model=mlp(), config=engine_config(disk_dir, compute_device="tpu"))
    with pytest.raises(ValueError, match=r"compute_device_budget: .* is more than the cpu device's free memory"):
        initialize(model=mlp(), config=engine_config(disk_dir, "nvme", "nvme", compute_device="cpu",
                                                     compute_device_budget="1000TiB"))
    with pytest.raises(ValueError, match="compute_device_budget"):
        initialize(model=mlp(), config=engine_config(disk_dir, compute_device_budget="lots"))
    assert os.listdir(disk_dir) == []


def test_compute_device_auto_is_a_value_not_a_placeholder(disk_dir):
    """DeepSpeed's "auto" placeholders are resolved or refused; compute_device's "auto" is its own choice."""
    from offload import resolve_auto
    from offload.config import EngineConfig

    raw = resolve_auto({"train_micro_batch_size_per_gpu": "auto", "compute_device": "auto"}, micro_batch_size=2)
    assert raw["compute_device"] == "auto"
    assert EngineConfig.from_dict(raw, world_size=1).compute_device == "auto"
    engine, *_ = initialize(model=mlp(), config=engine_config(disk_dir, compute_device="auto"))
    assert engine.device.name == ("cuda" if cuda_available() else "cpu")
    engine.close()


@pytest.mark.simulated
def test_a_gloo_group_for_compute_on_a_gpu_is_refused_naming_the_fix():
    from offload.device import CpuDevice
    from offload.train.setup import check_group_carries

    class NcclDevice(SimulatedDevice):  # a device whose collectives need NCCL, as CUDA's do
        collective_backend = "nccl"
    device = NcclDevice()
    with pytest.raises(ValueError, match=r"uses \"gloo\", but the engine computes on the simulated device.*"
                                         r"init_process_group\(\"nccl\"\)"):
        check_group_carries(device, "gloo")
    check_group_carries(device, "nccl")
    check_group_carries(CpuDevice(), "gloo")
    device.close()


def test_the_cpu_device_uses_host_buffers_in_place(disk_dir):
    """On the CPU nothing is staged: no device gathers, no gradient buckets, partitions kept whole."""
    engine, *_ = initialize(model=mlp(), config=engine_config(disk_dir, "none", "none"), compute_device="cpu")
    assert not engine.device.separate_memory
    assert engine.param_store.gathers is None and engine.stats().device_bytes == {"to_device": 0, "to_host": 0}
    assert all(rec.keep_full for rec in engine.records)
    engine.close()


@pytest.mark.simulated
def test_a_released_parameter_buffer_is_kept_while_a_view_of_it_lives(disk_dir):
    """Backward's autograd node holds the view an unpack returned until it has run, after the store has
    released the parameter: its device buffer is given back only once no view is left."""
    device = SimulatedDevice(seed=1)
    engine, *_ = initialize(model=mlp(), config=engine_config(disk_dir, "cpu", "none"), compute_device=device)
    store = engine.param_store
    first, second = store.records[0], store.records[1]
    a, b = first.partition_numel * 4, second.partition_numel * 4  # fp32
    view = store.gather(first).view(first.shape)
    assert device.allocated_bytes == a
    store.release(first)
    store.gather(second)  # a gather frees what no view refers to any more
    assert device.allocated_bytes == a + b  # the view keeps the first buffer
    assert not torch.isnan(view).any()
    del view
    store.release(second)
    store.gather(second)
    assert device.allocated_bytes == b
    store.release_all()
    engine.close()
    device.close()


@pytest.mark.parametrize("param,opt", [pytest.param("cpu", "none", marks=pytest.mark.slow), ("nvme", "nvme")])
def test_checkpoint_resume_on_the_device_is_identical_to_an_uninterrupted_run(disk_dir, tmp_path, device, param, opt):
    """A checkpoint saved and loaded with compute on the device: the resumed run continues bit for bit."""
    build = lambda: gpt2(dropout=0.0)  # noqa: E731 (the RNG state is not part of a checkpoint)
    batches = gpt2_batches(6)
    config = engine_config(disk_dir, param, opt, micro=2)
    engine, *_ = initialize(model=build(), config=config, compute_device=device)
    straight = train(engine, batches, gpt2_loss)
    expected = dict(engine.full_parameters())
    engine.close()
    first, *_ = initialize(model=build(), config=config, compute_device=device)
    train(first, batches[:3], gpt2_loss)
    first.save_checkpoint(tmp_path)
    first.close()
    second, *_ = initialize(model=build(), config=config, compute_device=device)
    second.load_checkpoint(tmp_path)
    assert train(second, batches[3:], gpt2_loss) == straight[3:]
    resumed = dict(second.full_parameters())
    assert all(torch.equal(resumed[name], ref) for name, ref in expected.items())
    assert all(t.device.type == "cpu" for t in resumed.values())  # full_parameters are host copies
    second.close()


def test_save_16bit_model_on_the_device_writes_every_weight(disk_dir, tmp_path, device):
    from safetensors.torch import load_file

    config = engine_config(disk_dir, "nvme", "nvme", micro=2, bf16={"enabled": True})
    config["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = True
    engine, *_ = initialize(model=gpt2(), config=config, compute_device=device)
    train(engine, gpt2_batches(2), gpt2_loss)
    assert engine.save_16bit_model(tmp_path, "model.safetensors")
    weights, expected = load_file(tmp_path / "model.safetensors"), dict(engine.full_parameters())
    assert set(weights) == {rec.name for rec in engine.records}
    assert all(torch.equal(tensor, expected[name]) for name, tensor in weights.items())
    engine.close()


def test_parameters_read_between_backward_and_step_leave_no_stale_copy(disk_dir, device):
    """Gathers outside the passes (full_parameters between backward and the step after it) copy nothing
    ahead: the step then updates the partitions, and the next forward copies the updated values."""
    batches = mlp_batches(4)
    ref_losses, ref_params = run_reference(mlp, batches, mlp_loss, 1, device)
    engine, *_ = initialize(model=mlp(), config=engine_config(disk_dir, "cpu", "none"), compute_device=device)
    assert engine.stats().mode.value == "after backward"
    losses = []
    for batch in batches:
        loss = mlp_loss(engine, batch)
        engine.backward(loss)
        dict(engine.full_parameters())
        engine.step()
        losses.append(loss.item())
    assert_close(losses, host(dict(engine.full_parameters())), ref_losses, ref_params)
    engine.close()


@pytest.mark.simulated
def test_wall_clock_breakdown_waits_for_the_device_before_each_clock_read(disk_dir, monkeypatch):
    """With ``wall_clock_breakdown`` a phase's time includes the device work it queued: the timers
    synchronize the device before reading the clock (on the CPU there is nothing to wait for)."""
    sim = SimulatedDevice(seed=3, max_delay_s=0.0005)
    waits = []
    real = sim.synchronize
    monkeypatch.setattr(sim, "synchronize", lambda: (waits.append(1), real())[1])
    try:
        engine, *_ = initialize(model=mlp(), config=engine_config(disk_dir, wall_clock_breakdown=True),
                                compute_device=sim)
        before = len(waits)
        train(engine, mlp_batches(1), mlp_loss)
        assert len(waits) > before
        engine.close()
    finally:
        sim.close()
    cpu_device, cpu_waits = CpuDevice(), []
    monkeypatch.setattr(cpu_device, "synchronize", lambda: cpu_waits.append(1))
    cpu, *_ = initialize(model=mlp(), config=engine_config(disk_dir, wall_clock_breakdown=True), compute_device=cpu_device)
    train(cpu, mlp_batches(1), mlp_loss)
    assert cpu_waits == []
    cpu.close()
