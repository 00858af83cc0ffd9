"""The device seam (offload/device): the simulated device catches each GPU-only bug class, correct
use passes under many random schedules, the CPU device copies plainly, the budget returns to zero,
and device and backend selection give clear errors.

Every bug test commits the bug on purpose and asserts the error and what its message names. Tests
wait on events (or on the "late" schedule, where a copy runs only when something waits for it),
never on wall-clock time.
"""

from __future__ import annotations

import math

import pytest
import torch

from offload.device import (CollectiveDeviceError, CpuDevice, DeviceMemoryError, DeviceSyncError, PinnedMemoryError,
                            SimulatedDevice, check_process_group, collective_device, cuda_available, device_for,
                            process_group_backend, start_process_group)

pytestmark = pytest.mark.simulated


@pytest.fixture
def late():
    """A simulated device whose copies run only when something waits for them (the latest a GPU may)."""
    with SimulatedDevice(schedule="late") as device:
        yield device


def filled(device, n: int, value: float) -> torch.Tensor:
    host = device.pinned_empty(n, torch.float32)
    host.fill_(value)
    return host


# ---- what torch sees: a device of its own, as CUDA ---------------------------------------------------


def test_device_tensors_are_another_device_to_torch_and_compute_as_the_cpu(late):
    """Device buffers report the simulated device type; compute on them is the CPU's, bit for bit."""
    buffer = late.empty(12, torch.float32, name="w")
    assert buffer.device == late.torch_device and buffer.device.type == "simgpu" and late.owns(buffer)
    late.compute_stream.wait_event(late.to_device(buffer, filled(late, 12, 0.5), stream=late.new_stream("s")))
    late.check_ready(buffer)
    x = torch.randn(3, 4)
    out = torch.nn.functional.gelu(x.to(late.torch_device) @ buffer.view(4, 3))
    assert out.device == late.torch_device and not late.owns(x)
    assert torch.equal(out.cpu(), torch.nn.functional.gelu(x @ torch.full((4, 3), 0.5)))
    values = torch.arange(12.0).to(late.torch_device)
    values.view(3, 4).unbind(0)[1].fill_(-1)  # views share the device tensor's bytes, as on a GPU
    values.split(4)[2].mul_(2)
    host = values.cpu()  # a copy
    host.zero_()
    assert values.cpu().tolist() == [0, 1, 2, 3, -1, -1, -1, -1, 16, 18, 20, 22]


def test_an_op_mixing_device_and_host_tensors_raises_as_on_a_gpu(late):
    """As CUDA: a non-scalar host tensor in a device op raises CUDA's error, naming both devices (torch's
    own check where it has one, the device's otherwise); a 0-dim host tensor and copies are fine."""
    device_tensor = torch.ones(4, 8).to(late.torch_device)
    mixed = r"Expected all tensors to be on the same device, but found at least two devices, simgpu:0 and cpu!"
    with pytest.raises(RuntimeError, match=mixed):
        torch.nn.functional.mse_loss(device_tensor, torch.zeros(4, 8))
    with pytest.raises(RuntimeError, match=mixed + r" \(in aten::cat.*\.to\(device\) first"):
        torch.cat([device_tensor, torch.zeros(1, 8)])
    assert float((device_tensor * torch.tensor(2.0)).sum()) == 64.0
    host = torch.empty(4, 8)
    host.copy_(device_tensor)
    assert torch.equal(host, torch.ones(4, 8))


def test_histc_counts_integers_on_the_device_as_cuda_does(late):
    """CUDA's histc takes integers (transformers' experts count tokens per expert so off the CPU), the CPU's
    refuses them: on the device integer counts come back in their dtype, equal to the float count on the CPU,
    the maximum in the last bin; on the host the CPU's refusal stands."""
    picks = torch.tensor([0, 3, 3, 1, 7, 7, 7, 2], dtype=torch.int32)
    counts = torch.histc(picks.to(late.torch_device), bins=8, min=0, max=7)
    assert counts.device == late.torch_device and counts.dtype == torch.int32
    assert counts.cpu().tolist() == torch.histc(picks.float(), bins=8, min=0, max=7).int().tolist() == [1, 1, 1, 2, 0, 0, 0, 3]
    floats = torch.histc(picks.float().to(late.torch_device), bins=4, min=0, max=8)
    assert torch.equal(floats.cpu(), torch.histc(picks.float(), bins=4, min=0, max=8))
    with pytest.raises(RuntimeError, match="histogram_cpu|not implemented"):
        torch.histc(picks, bins=8, min=0, max=7)


def test_attention_on_the_device_is_torchs_math_path_bit_for_bit(late):
    """simgpu has no fused attention kernel (torch has them for the CPU and CUDA only): its
    scaled_dot_product_attention is the CPU's math path to the bit, with and without a mask (the reference
    the device tests compare with: docs/device.md, "What it does not catch")."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    torch.manual_seed(0)
    q, k, v = (torch.randn(4, 4, 8, 16, dtype=torch.bfloat16) for _ in range(3))
    mask = torch.ones(4, 1, 8, 8, dtype=torch.bool).tril()
    mask[1, :, :, :3] = False  # a left-padded row
    on = late.torch_device
    for kwargs in ({"is_causal": True}, {"attn_mask": mask}):
        with sdpa_kernel([SDPBackend.MATH]):
            expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, **kwargs)
        device_kwargs = {key: value.to(on) if isinstance(value, torch.Tensor) else value for key, value in kwargs.items()}
        ours = torch.nn.functional.scaled_dot_product_attention(q.to(on), k.to(on), v.to(on), **device_kwargs)
        assert ours.device.type == on.type and torch.equal(ours.cpu(), expected)


def test_a_device_tensor_as_parameter_data_replaces_its_gradient_accumulator_as_cuda():
    """What broke training on an H100: autograd gives a parameter a new AccumulateGrad node when its
    ``.data`` changes device type (a hook on the old node no longer runs). The simulated device's tensors
    do that, as CUDA's; CPU data of another size does not."""
    with SimulatedDevice() as device:
        param = torch.nn.Parameter(torch.zeros(3, 5))
        first = param.view_as(param).grad_fn.next_functions[0][0]
        param.data = torch.zeros(0)
        assert param.view_as(param).grad_fn.next_functions[0][0] is first
        param.data = torch.ones(3, 5).to(device.torch_device)
        assert param.device.type == "simgpu"
        assert param.view_as(param).grad_fn.next_functions[0][0] is not first
        (param * 2).sum().backward()
        assert param.grad.device.type == "simgpu" and torch.equal(param.grad.cpu(), torch.full((3, 5), 2.0))


# ---- bug class 1: a device buffer read before its copy's event ------------------------------------


def test_the_simulated_device_refuses_a_process_that_can_use_cuda(monkeypatch):
    """Registered beside CUDA, the simulated device would become torch's accelerator and break every CUDA
    backward (an H200 showed it): installing it where CUDA is available is refused, naming the fix."""
    from offload.device._simtorch import install

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(RuntimeError, match=r"cannot share a process with CUDA.*CUDA_VISIBLE_DEVICES="):
        install()
    with pytest.raises(RuntimeError, match="cannot share a process with CUDA"):
        SimulatedDevice()


def test_device_buffer_read_before_the_compute_stream_waited_is_caught(late):
    buffer = late.empty(1000, torch.float32, name="layer.0.weight")
    copied = late.to_device(buffer, filled(late, 1000, 3.0), stream=late.new_stream("prefetch"))
    with pytest.raises(DeviceSyncError, match=r"'layer\.0\.weight' read on stream 'compute' before the event of its "
                                              r"copy #1 on stream 'prefetch'.*compute\.wait_event"):
        late.check_ready(buffer)
    assert torch.isnan(buffer).all()  # ground truth: the bytes are not there (a slipped read computes on NaN)
    late.compute_stream.wait_event(copied)
    late.check_ready(buffer)  # now ordered: the compute stream runs the copy first
    assert torch.equal(buffer.cpu(), torch.full((1000,), 3.0))


def test_a_view_of_the_buffer_is_checked_too(late):
    buffer = late.empty(4096, torch.uint8, name="ring[0]")
    late.to_device(buffer[:100], late.pinned_empty(100), stream=late.new_stream("copies"))
    with pytest.raises(DeviceSyncError, match="'ring\\[0\\]'"):
        late.check_ready(buffer[8:16].view(torch.float32))


def test_copy_from_a_device_buffer_before_its_event_is_caught(late):
    buffer = late.empty(10, torch.float32, name="grad.bucket")
    late.to_device(buffer, filled(late, 10, 1.0), stream=late.new_stream("h2d"))
    back = late.pinned_empty(10, torch.float32)
    with pytest.raises(DeviceSyncError, match="'grad.bucket' copied to the host before the event of its copy #1"):
        late.to_host(back, buffer, stream=late.new_stream("d2h"))


def test_waiting_on_another_stream_does_not_order_compute(late):
    side, other = late.new_stream("a"), late.new_stream("b")
    buffer = late.empty(8, torch.float32, name="w")
    copied = late.to_device(buffer, filled(late, 8, 2.0), stream=side)
    other.wait_event(copied)  # orders stream b, not compute
    with pytest.raises(DeviceSyncError, match="'w' read on stream 'compute'"):
        late.check_ready(buffer)
    late.check_ready(buffer, stream=other)


def test_host_synchronize_orders_every_later_read(late):
    buffer = late.empty(8, torch.float32, name="w")
    late.to_device(buffer, filled(late, 8, 5.0), stream=late.new_stream("copies")).synchronize()
    late.check_ready(buffer)
    assert torch.equal(buffer.cpu(), torch.full((8,), 5.0))


# ---- bug class 2: a host buffer refilled while a copy still reads it --------------------------------


def test_host_buffer_refilled_before_the_copy_was_seen_done_is_caught(late):
    host = filled(late, 64, 1.0)
    buffer = late.empty(64, torch.float32, name="ring[1]")
    copied = late.to_device(buffer, host, stream=late.new_stream("copies"))
    late.compute_stream.wait_event(copied)
    late.check_ready(buffer)  # compute has it; the host has not seen the copy finish
    with pytest.raises(DeviceSyncError, match=r"host buffer at 0x[0-9a-f]+ \(40 bytes\) written by the host while "
                                              r"copy #1 on stream 'copies' may still read it into device buffer "
                                              r"'ring\[1\]'"):
        late.check_writable(host[10:20])
    copied.synchronize()
    late.check_writable(host)


def test_a_write_under_an_inflight_copy_is_caught_by_the_copy_itself(late):
    """Ground truth without the model check: the copy sees its source changed since it was issued."""
    host = filled(late, 16, 1.0)
    buffer = late.empty(16, torch.float32, name="ring[2]")
    copied = late.to_device(buffer, host, stream=late.new_stream("copies"))
    host.fill_(9.0)  # the bug: refilled with the copy in flight
    with pytest.raises(DeviceSyncError, match=r"host buffer .* was written while copy #1 from it to device buffer "
                                              r"'ring\[2\]' was in flight"):
        copied.synchronize()


def test_host_reads_a_copy_back_only_after_its_event(late):
    buffer = late.empty(4, torch.float32, name="norm")
    source = filled(late, 4, 7.0)
    written = late.to_device(buffer, source, stream=late.compute_stream)
    back = late.pinned_empty(4, torch.float32)
    d2h = late.new_stream("d2h")
    with pytest.raises(DeviceSyncError, match="'norm' copied to the host before the event of its copy #1 on stream "
                                              "'compute' was waited for: d2h.wait_event"):
        late.to_host(back, buffer, stream=d2h)
    d2h.wait_event(written)
    copied = late.to_host(back, buffer, stream=d2h)
    with pytest.raises(DeviceSyncError, match="read by the host while copy #2 from device buffer 'norm'"):
        late.check_ready(back)
    with pytest.raises(DeviceSyncError, match="may still fill it from device buffer 'norm'"):
        late.check_writable(back)
    copied.synchronize()
    late.check_ready(back)
    assert torch.equal(back, torch.full((4,), 7.0))


def test_freeing_a_buffer_under_a_copy_and_using_it_after_free_are_caught(late):
    buffer = late.empty(8, torch.float32, name="param.7")
    copied = late.to_device(buffer, filled(late, 8, 1.0), stream=late.new_stream("copies"))
    with pytest.raises(DeviceSyncError, match="'param.7' freed while copy #1 on stream 'copies' may still use it"):
        late.free(buffer)
    copied.synchronize()
    late.free(buffer)
    with pytest.raises(DeviceSyncError, match="'param.7' read on stream 'compute' after it was freed"):
        late.check_ready(buffer)
    assert torch.isnan(buffer).all()


# ---- bug class 3: pageable memory where pinned is required ------------------------------------------


def test_async_copy_from_pageable_memory_is_caught(late):
    buffer = late.empty(32, torch.float32, name="layer.3")
    with pytest.raises(PinnedMemoryError, match=r"to_device: asynchronous copy from pageable host memory \(host "
                                                r"buffer .*\).*Device\.pinned_empty"):
        late.to_device(buffer, torch.ones(32), stream=late.new_stream("copies"))
    with pytest.raises(PinnedMemoryError, match="to_host: asynchronous copy into pageable host memory"):
        late.to_host(torch.empty(32), buffer, stream=late.new_stream("copies"))


def test_a_view_into_a_locked_buffer_counts_as_pinned(late):
    pinned = late.pinned_empty(4096)
    buffer = late.empty(100, name="b")
    late.to_device(buffer, pinned[1000:1100], stream=late.compute_stream)


def test_locked_buffers_are_registered_through_the_seam(tmp_path):
    """tensorio knows no GPU: the device seam installs the host registration (CUDA's where there is a
    GPU; here the simulated device's), and every tensorio locked buffer made from then on, the device's
    own and those tensorio makes for its I/O, is pinned through it, as CUDA needs; one made before is not
    taken as pinned by a device that needs registration. Freeing a buffer unregisters it."""
    import tensorio

    before = tensorio.locked_tensor(4096)  # mlocked: no registration installed
    assert not tensorio.lock_status(before).startswith("simulated")
    with SimulatedDevice(schedule="late", register_host=True) as device:
        pinned = device.pinned_empty(4096)
        pool = tensorio.BufferPool(1 << 20, make=tensorio.locked_tensor)  # as an NVMe read pool makes them
        read_buffer = pool.take(4096, torch.uint8)
        for host in (pinned, read_buffer):
            assert tensorio.lock_status(host) == "simulated-registered"
            assert device.registered_host[host.untyped_storage().data_ptr()] >= 4096
        buffer = device.empty(4096, name="partition")
        device.to_device(buffer, pinned, stream=device.new_stream("copies")).synchronize()
        device.to_device(buffer, read_buffer, stream=device.new_stream("copies")).synchronize()
        with pytest.raises(PinnedMemoryError, match="asynchronous copy from pageable host memory"):
            device.to_device(buffer, before, stream=device.new_stream("copies"))  # locked, but not registered
        address = pinned.data_ptr()
        device.free_pinned(pinned)
        assert address not in device.registered_host
        device.free(buffer)
    after = tensorio.locked_tensor(4096)  # closing the device removed its registration
    assert not tensorio.lock_status(after).startswith("simulated")


def test_copies_must_go_between_host_and_this_device(late):
    buffer, other = late.empty(8, name="a"), late.empty(8, name="b")
    with pytest.raises(ValueError, match="to_device: the src must be host memory, got device buffer 'b'"):
        late.to_device(buffer, other, stream=late.compute_stream)
    with pytest.raises(ValueError, match="to_device: the dst is not memory of the simulated device"):
        late.to_device(late.pinned_empty(8), late.pinned_empty(8), stream=late.compute_stream)
    with pytest.raises(ValueError, match=r"dst is \(8,\) torch.uint8 but src is \(4,\) torch.uint8"):
        late.to_device(buffer, late.pinned_empty(4), stream=late.compute_stream)
    with SimulatedDevice() as other_device:
        with pytest.raises(ValueError, match="stream 'theirs' is not a stream of this simulated device"):
            late.to_device(buffer, late.pinned_empty(8), stream=other_device.new_stream("theirs"))


# ---- bug class 4: a collective given a tensor on the wrong device -----------------------------------


def test_collective_on_a_host_tensor_is_caught(late):
    with pytest.raises(CollectiveDeviceError, match=r"all_reduce: tensor 0 \(\(1,\), torch.float32\) is host memory.*"
                                                    r"device\.collective_tensor"):
        late.check_collective(torch.zeros(1), op="all_reduce")
    moved = late.collective_tensor(torch.tensor([2.5]))
    late.check_collective(moved, op="all_reduce")
    assert moved.tolist() == [2.5] and late.allocated_bytes == 4
    del moved
    assert late.allocated_bytes == 0


def test_collective_on_a_buffer_whose_copy_compute_has_not_waited_for_is_caught(late):
    buffer = late.empty(4, torch.float32, name="partition")
    late.to_device(buffer, filled(late, 4, 1.0), stream=late.new_stream("copies"))
    with pytest.raises(DeviceSyncError, match="'partition' read on stream 'compute' before"):
        late.check_collective(buffer, op="all_gather")


def test_cpu_collectives_take_cpu_tensors():
    device = CpuDevice()
    device.check_collective(torch.zeros(3))
    meta = torch.empty(3, device="meta")
    with pytest.raises(CollectiveDeviceError, match="tensor 0 .* is on meta, but gloo on the cpu device needs it on cpu"):
        device.check_collective(meta, op="broadcast")


# ---- bug class 5: device memory over its budget -----------------------------------------------------


def test_allocation_over_the_budget_names_the_figures():
    with SimulatedDevice(memory_bytes=1 << 20, budget_bytes=300_000, budget_setting="max_memory[0]") as device:
        device.empty(200_000, name="ring[0]")
        with pytest.raises(DeviceMemoryError, match=r"ring\[1\]: allocating 195.3 KiB \(200000 bytes\) would take "
                                                    r"simulated device memory to 390.6 KiB \(400000 bytes\), over its "
                                                    r"budget of 293.0 KiB \(300000 bytes\) \(max_memory\[0\]\); held "
                                                    r"now: .* in 1 buffers: ring\[0\]"):
            device.empty(200_000, name="ring[1]")
        assert device.allocated_bytes == 200_000  # the refused allocation holds nothing


def test_budget_accounting_returns_to_zero_after_frees():
    with SimulatedDevice(budget_bytes=1 << 20) as device:
        buffers = [device.empty(n, dtype, name=f"b{i}") for i, (n, dtype) in
                   enumerate([(1, torch.uint8), (4095, torch.float16), (4096 * 10 + 1, torch.float32)])]
        assert device.allocated_bytes == 1 + 2 * 4095 + 4 * (4096 * 10 + 1)
        for buffer in buffers:
            device.free(buffer)
        assert device.allocated_bytes == 0
        with pytest.raises(ValueError, match="not a buffer that simulated.empty returned, or was freed already"):
            device.free(buffers[0])
        with pytest.raises(ValueError, match="not a buffer that simulated.empty returned"):
            device.free(torch.empty(3))


def test_budget_over_the_device_memory_is_refused():
    with pytest.raises(ValueError, match=r"max_memory\[0\]: 2.0 GiB \(2147483648 bytes\) is more than the simulated "
                                         r"device's free memory, 1.0 GiB \(1073741824 bytes\) of 1.0 GiB"):
        SimulatedDevice(memory_bytes=1 << 30, budget_bytes=2 << 30, budget_setting="max_memory[0]")
    with pytest.raises(ValueError, match=r"offload_param.max_in_gpu: .* is more than the cpu device's free memory"):
        CpuDevice(budget_bytes=1 << 60, budget_setting="offload_param.max_in_gpu")


# ---- correct use passes, whatever the schedule ------------------------------------------------------


def pipeline(device, layers: int, slots: int, n: int) -> list[float]:
    """A prefetch ring as a GPU path runs it: host slot refilled, copied on a side stream, computed on,
    released; returns each layer's result."""
    side = device.new_stream("prefetch")
    hosts = [device.pinned_empty(n, torch.float32) for _ in range(slots)]
    buffers = [device.empty(n, torch.float32, name=f"ring[{s}]") for s in range(slots)]
    copied, computed, out = [None] * slots, [None] * slots, []
    for layer in range(layers):
        slot = layer % slots
        if copied[slot] is not None:
            copied[slot].synchronize()  # the copy has read the host slot
        device.check_writable(hosts[slot])
        hosts[slot].copy_(torch.arange(n, dtype=torch.float32) * (layer + 1))  # the "read from disk"
        if computed[slot] is not None:
            side.wait_event(computed[slot])  # compute is done with the device slot
        copied[slot] = device.to_device(buffers[slot], hosts[slot], stream=side)
        device.compute_stream.wait_event(copied[slot])
        device.check_ready(buffers[slot])
        out.append(float(buffers[slot].sum()))
        computed[slot] = device.compute_stream.record()
    device.synchronize()
    for buffer in buffers:
        device.free(buffer)
    assert device.allocated_bytes == 0
    return out


@pytest.mark.parametrize("seed", range(20))
def test_correct_pipeline_passes_under_random_delays(seed):
    n = 257
    expected = [float(torch.arange(n, dtype=torch.float32).sum() * (layer + 1)) for layer in range(12)]
    with SimulatedDevice(seed=seed, max_delay_s=0.001) as device:
        assert pipeline(device, layers=12, slots=1 + seed % 3, n=n) == expected


def test_correct_pipeline_passes_on_the_late_schedule_and_the_cpu(late):
    expected = [float(torch.arange(64, dtype=torch.float32).sum() * (layer + 1)) for layer in range(6)]
    assert pipeline(late, layers=6, slots=2, n=64) == expected
    assert pipeline(CpuDevice(), layers=6, slots=2, n=64) == expected


def test_query_observes_only_a_finished_copy(late):
    host = filled(late, 4, 1.0)
    buffer = late.empty(4, torch.float32, name="w")
    copied = late.to_device(buffer, host, stream=late.new_stream("copies"))
    assert not copied.query()  # late: nothing has waited for it
    late.compute_stream.wait_event(copied)
    late.check_ready(buffer)  # compute waits for it, so it runs
    assert copied.query()
    late.check_writable(host)  # a True query is the host seeing it done


@pytest.mark.gpu
@pytest.mark.skipif(not cuda_available(), reason="needs CUDA")
def test_correct_pipeline_passes_on_cuda():
    """The same prefetch ring on a real GPU, through CudaDevice (never run on the development machine)."""
    from offload.device import CudaDevice

    expected = [float(torch.arange(257, dtype=torch.float32).sum() * (layer + 1)) for layer in range(12)]
    device = CudaDevice(budget_bytes=1 << 20)
    assert pipeline(device, layers=12, slots=3, n=257) == expected
    moved = device.collective_tensor(torch.ones(2))
    device.check_collective(moved)
    with pytest.raises(CollectiveDeviceError, match="nccl on the cuda device needs it on cuda"):
        device.check_collective(torch.ones(2))


# ---- the CPU device ---------------------------------------------------------------------------------


def test_cpu_device_copies_plainly_and_its_events_are_done():
    device = CpuDevice()
    assert not device.separate_memory and device.collective_backend == "gloo"
    buffer = device.empty(5, torch.float64, name="x")
    stream = device.new_stream("copies")
    source = torch.arange(5, dtype=torch.float64)  # pageable is fine: nothing is asynchronous
    event = device.to_device(buffer, source, stream=stream)
    assert event.query() and torch.equal(buffer, source)
    back = torch.empty(5, dtype=torch.float64)
    device.to_host(back, buffer, stream=stream).synchronize()
    assert torch.equal(back, source)
    stream.wait_event(event)
    device.compute_stream.wait_event(event)
    device.check_ready(buffer)
    device.check_writable(source)
    device.free(buffer)
    assert device.allocated_bytes == 0
    assert device.collective_tensor(source) is source


# ---- selection and backends -------------------------------------------------------------------------


def test_device_for_each_choice():
    assert isinstance(device_for("cpu"), CpuDevice)
    with device_for("simulated") as simulated:
        assert isinstance(simulated, SimulatedDevice) and simulated.separate_memory
    assert device_for("auto").name == ("cuda" if cuda_available() else "cpu")
    with pytest.raises(ValueError, match="compute_device: 'gpu' is not allowed; use one of 'auto', 'cpu', 'cuda', "
                                         "'simulated'"):
        device_for("gpu")


@pytest.mark.skipif(cuda_available(), reason="checks the error where CUDA is missing")
def test_cuda_without_cuda_names_the_setting():
    with pytest.raises(ValueError, match=r"compute_device: \"cuda\" is asked for but CUDA is not available here "
                                         r"\(torch .*\); use \"cpu\" or \"auto\""):
        device_for("cuda")


def test_process_group_backend():
    assert process_group_backend(CpuDevice()) == "gloo"
    assert process_group_backend(CpuDevice(), "gloo") == "gloo"
    with pytest.raises(ValueError, match="dist_backend: \"nccl\" needs compute on CUDA, but compute is on the cpu"):
        process_group_backend(CpuDevice(), "nccl")
    with SimulatedDevice() as simulated:
        with pytest.raises(ValueError, match="nccl\" needs compute on CUDA, but compute is on the simulated"):
            process_group_backend(simulated, "nccl")
    with pytest.raises(ValueError, match="dist_backend: 'tcp' is not a torch.distributed backend"):
        process_group_backend(CpuDevice(), "tcp")


def test_collective_device_follows_the_group_backend(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        assert collective_device() == torch.device("cpu")
    finally:
        dist.destroy_process_group()


def test_poison_reads_as_nan_in_every_float_dtype(late):
    raw = late.empty(8, name="raw")
    for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        assert all(math.isnan(v) for v in raw.view(dtype).tolist())


def test_the_engine_starts_gloo_for_cpu_compute_even_where_cuda_exists(tmp_path, monkeypatch):
    import torch.distributed as dist

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a GPU machine, compute on the CPU
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(_free_port()))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    start_process_group(CpuDevice())
    try:
        assert dist.get_backend() == "gloo"
        check_process_group(CpuDevice())  # accepted
    finally:
        dist.destroy_process_group()


def test_a_caller_started_nccl_group_under_cpu_compute_is_a_clear_error(monkeypatch):
    import torch.distributed as dist

    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    with pytest.raises(ValueError, match=r"process group uses \"nccl\", but the engine computes on the cpu device "
                                         r"and NCCL reduces only GPU tensors; start the group with "
                                         r"torch.distributed.init_process_group\(\"gloo\"\)"):
        check_process_group(CpuDevice())


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_each_rank_of_a_node_takes_its_own_gpu():
    """Under a launcher (LOCAL_RANK) a rank computes on its own GPU, not GPU 0; a GPU the caller made
    current wins; a rank with no GPU of its own is refused naming LOCAL_RANK and the count (the decision
    `CudaDevice` takes; its set_device needs a GPU)."""
    from offload.device._cuda import rank_gpu

    assert rank_gpu(0, None, 8) == 0  # no launcher
    assert [rank_gpu(0, str(rank), 8) for rank in range(8)] == list(range(8))
    assert rank_gpu(3, "5", 8) == 3  # the caller's torch.cuda.set_device(3)
    with pytest.raises(ValueError, match=r"LOCAL_RANK 2: this process sees 2 GPUs, so rank 2 of this node has none"):
        rank_gpu(0, "2", 2)
    with pytest.raises(ValueError, match=r"LOCAL_RANK: 'x' is not a GPU index"):
        rank_gpu(0, "x", 2)
