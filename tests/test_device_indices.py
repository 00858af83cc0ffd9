"""The simulated device's several indices (``simgpu:0`` .. ``simgpu:N-1``, ``OFFLOAD_SIMGPU_COUNT``), as a
node's GPUs: tensors of each index compute there, an operator mixing two indices raises as CUDA does, an
index beyond the count is refused as ``torch.cuda.set_device`` refuses it, each rank takes the index of its
LOCAL_RANK by CUDA's rule, two ranks on one index are refused at ``initialize`` naming both, and
generation computes on ``max_memory``'s device index. The world-size-2 training test on two indices is
tests/test_engine_dist.py's simulated one."""

from __future__ import annotations

import shutil
import socket

import pytest
import torch
from torch import nn

from offload.device import SimulatedDevice, device_for
from offload.device._simtorch import COUNT_ENV, current_device, device_count, set_device

pytestmark = pytest.mark.simulated


@pytest.fixture
def two_devices(monkeypatch):
    """A process that sees two simulated devices; the current one is simgpu:0 again afterwards."""
    monkeypatch.setenv(COUNT_ENV, "2")
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    yield
    set_device(0)


def test_tensors_of_each_index_compute_there_and_mixing_two_raises_as_cuda(two_devices):
    a = torch.arange(6.0).reshape(2, 3).to("simgpu:1")
    b = torch.arange(6.0).reshape(3, 2).to("simgpu:1")
    assert a.device == torch.device("simgpu", 1)
    product = a @ b
    assert product.device == torch.device("simgpu", 1) and (product + 1).device == torch.device("simgpu", 1)
    assert torch.equal(product.cpu(), torch.arange(6.0).reshape(2, 3) @ torch.arange(6.0).reshape(3, 2))
    assert a[0].device == a.t().device == torch.device("simgpu", 1)  # views stay on their index
    on_zero = torch.ones(2, 3, device="simgpu:0")
    with pytest.raises(RuntimeError, match=r"Expected all tensors to be on the same device, but found at least two "
                                           r"devices, simgpu:1 and simgpu:0!"):
        a + on_zero
    with pytest.raises(RuntimeError, match=r"found at least two devices, simgpu:0 and simgpu:1!"):
        torch.cat([on_zero, a])
    # Between indices only an explicit copy, as on CUDA: .to() and copy_.
    moved = a.to("simgpu:0")
    assert moved.device == torch.device("simgpu", 0) and torch.equal(moved.cpu(), a.cpu())
    on_zero.copy_(a)
    assert torch.equal(on_zero.cpu(), a.cpu())


def test_an_index_beyond_the_count_is_refused_as_cuda_refuses_it(two_devices, monkeypatch):
    assert device_count() == 2
    with pytest.raises(RuntimeError, match=r"invalid device ordinal 2: this process sees 2 simulated devices "
                                           r"\(OFFLOAD_SIMGPU_COUNT=2\), simgpu:0 to simgpu:1"):
        torch.ones(3, device="simgpu:2")
    with pytest.raises(RuntimeError, match=r"invalid device ordinal 2"):
        torch.ones(3).to("simgpu:2")
    with pytest.raises(RuntimeError, match=r"invalid device ordinal 2"):
        set_device(2)
    with pytest.raises(RuntimeError, match=r"invalid device ordinal 2"):
        SimulatedDevice(2)
    assert current_device() == 0
    monkeypatch.setenv(COUNT_ENV, "none")
    with pytest.raises(ValueError, match=r"OFFLOAD_SIMGPU_COUNT: 'none' is not a device count"):
        device_count()
    monkeypatch.setenv(COUNT_ENV, "2")


def test_the_current_device_is_where_an_unindexed_tensor_goes(two_devices):
    set_device(1)
    assert current_device() == torch.simgpu.current_device() == 1
    assert torch.empty(2, device="simgpu").device == torch.device("simgpu", 1)
    assert torch.zeros(2, device="simgpu").device == torch.device("simgpu", 1)


def test_a_device_of_index_one_has_its_buffers_streams_and_backward_there(two_devices):
    """Its buffers, copies and streams are its own (the device of index 0 owns none of them); backward on it
    gives index 0's gradients."""
    grads = {}
    for index in (0, 1):
        with SimulatedDevice(index, schedule="late") as device:
            assert device.torch_device == torch.device("simgpu", index)
            host = device.pinned_empty(12, torch.float32)
            host.copy_(torch.linspace(-1, 1, 12))
            weight = device.empty(12, torch.float32, name="weight")
            copied = device.to_device(weight, host, stream=device.new_stream("copy"))
            device.compute_stream.wait_event(copied)
            device.check_ready(weight)
            assert weight.device == device.torch_device and device.owns(weight)
            torch.manual_seed(0)
            layer = nn.Linear(3, 4)
            with torch.no_grad():
                layer.weight.copy_(weight[:12].view(4, 3).cpu())
            layer.to(device.torch_device)
            x = torch.randn(5, 3).to(device.torch_device)
            out = layer(x)
            assert out.device == device.torch_device
            out.square().sum().backward()
            assert layer.weight.grad.device == device.torch_device
            grads[index] = layer.weight.grad.cpu()
            copied.synchronize()
            device.free(weight)
            device.free_pinned(host)
            if index == 1:
                with SimulatedDevice(0) as other:
                    assert not other.owns(out)
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-6, atol=1e-7)


def test_each_rank_takes_its_local_rank_index_by_cudas_rule(two_devices, monkeypatch):
    """Under a launcher a rank computes on simgpu:LOCAL_RANK (made current, as CudaDevice does); a device the
    caller chose wins; a rank with no device of its own is refused naming LOCAL_RANK and the count."""
    monkeypatch.setenv("LOCAL_RANK", "1")
    with device_for("simulated") as device:
        assert device.torch_device == torch.device("simgpu", 1) and current_device() == 1
    with SimulatedDevice(0) as device:  # the caller's choice
        assert device.torch_device == torch.device("simgpu", 0)
    monkeypatch.setenv("LOCAL_RANK", "2")
    set_device(0)
    with pytest.raises(ValueError, match=r"LOCAL_RANK 2: this process sees 2 GPUs, so rank 2 of this node has none "
                                         r"of its own; .*\(OFFLOAD_SIMGPU_COUNT\)"):
        SimulatedDevice()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rank_on_index_zero(rank: int, out: str) -> None:
    """A rank whose caller gives it simgpu:0, as the other rank's does: ``initialize`` must refuse."""
    import gc

    import torch.distributed as dist

    from offload.train.engine import initialize

    dist.init_process_group("gloo", rank=rank, world_size=2)
    device = SimulatedDevice(0, max_delay_s=0.0)
    config = {"train_batch_size": 2, "train_micro_batch_size_per_gpu": 1,
              "zero_optimization": {"stage": 3}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    try:
        initialize(model=nn.Linear(4, 4), config=config, compute_device=device)
    except ValueError as exc:
        with open(f"{out}.{rank}", "w", encoding="utf-8") as file:
            file.write(str(exc))
    device.close()
    del device
    gc.collect()
    dist.destroy_process_group()


@pytest.mark.multiprocess
def test_two_ranks_given_one_device_are_refused_at_initialize_naming_both(two_devices, monkeypatch, tmp_path):
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(_free_port()))
    from ranks import run_ranks

    out = str(tmp_path / "refused")
    run_ranks(_rank_on_index_zero, [(r, out) for r in range(2)], timeout=120)
    for rank in range(2):
        with open(f"{out}.{rank}", encoding="utf-8") as file:
            assert file.read().startswith("ranks 0 and 1 of this node both compute on simgpu:0; give each rank of "
                                          "a node its own device")


def test_generation_computes_on_max_memorys_device_index(two_devices):
    """``max_memory={1: ...}``: the engine computes on simgpu:1, its weights kept there, and the tokens are
    those of the same run on simgpu:0."""
    from offload.infer import init_inference
    from test_infer_generate import build_model, save_checkpoint, scratch_dir

    root = scratch_dir("infer-index-")
    try:
        directory = save_checkpoint(build_model("llama", torch.float32), root / "llama")
        ids = torch.randint(3, 256, (2, 12), generator=torch.Generator().manual_seed(3))
        tokens = {}
        for index in (0, 1):
            with init_inference(directory, disk_gbps=1.0, compute_device="simulated",
                                max_memory={index: "64MiB", "cpu": "64MiB"}) as engine:
                place = torch.device("simgpu", index)
                assert engine.compute.torch_device == place
                kept = [p for p in engine.module.parameters() if p.device.type == "simgpu"]  # streamed: on meta
                assert kept and {p.device for p in kept} == {place}
                tokens[index] = engine.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=0)
                assert tokens[index].device == place
    finally:
        shutil.rmtree(root, ignore_errors=True)
    assert tokens[1].tolist() == tokens[0].tolist()

