"""Quantized weights (int8, int4) with compute on a device, on the simulated device (and on CUDA where there is one).

A device budget smaller than the model: some decoder layers kept on the device, one in pinned host
memory, the rest streamed NVMe -> locked ring -> device ring. Every layer crosses the links packed:
the bytes copied host -> device per forward are the packed sizes, the pinned layers hold packed
bytes, and the greedy tokens and logits equal the CPU path's with the same quantization, under
random copy delays and on the late schedule (a copy runs only when waited for). The device's
kernels come from the device seam (``Device.packed_kernels``); a quantization the device cannot run
is refused naming the setting, before anything is written.
"""

from __future__ import annotations

import shutil

import pytest
import torch
from test_infer_device_ring import _StageWithoutComputeWait
from test_infer_generate import PAD, build_model, one_thread, prompts, save_checkpoint, scratch_dir  # noqa: F401

from offload.device import CPU_KERNELS, CpuDevice, CudaPackedKernels, DeviceSyncError, SimulatedDevice, cuda_available
from offload.infer import init_inference
from offload.infer.config import WeightQuantization
from offload.infer.plan.host import format_bytes
from offload.infer.weights.quantize import QuantLinear, quantize_weight, quantized_layout

NEW = 8
TOKENS = 8 + NEW
BITS = {"int8": {"num_bits": 8}, "int8-asym": {"num_bits": 8, "symmetric": False}, "int4": {"num_bits": 4}}


@pytest.fixture(scope="module")
def llama():
    """A bf16 Llama of 6 decoder layers (hidden 64, intermediate 192: every linear quantizable), and
    a scratch directory for the quantized caches."""
    root = scratch_dir("infer-quant-device-")
    model = build_model("llama", torch.bfloat16, intermediate_size=192, num_hidden_layers=6)
    try:
        yield save_checkpoint(model, root / "llama"), root
    finally:
        shutil.rmtree(root, ignore_errors=True)


def generate(engine, batch: int):
    ids, mask = prompts(batch)
    return engine.generate(ids, attention_mask=mask, max_new_tokens=NEW, pad_token_id=PAD, do_sample=False,
                           output_logits=True, return_dict_in_generate=True)


def on_the_cpu(directory, root, quantization, batch: int, **extra):
    """(greedy output, sizes) of the CPU path with ``quantization``, everything in memory: the
    reference, and the packed units' sizes that the device budget is made of.

    Its attention runs on torch's math kernel, as on the simulated device: torch's fused attention
    kernels are for the CPU and CUDA only, so a PrivateUse1 device (simgpu) takes the math path, whose
    bf16 rounding differs from the CPU's flash kernel (enough to flip a near tie at batch 4). The rest
    (the packed kernels, the copies, the tiers) is compared bit for bit."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with init_inference(directory, weight_quantization=quantization, nvme_path=str(root), device="cpu",
                        compute_device="cpu", **extra) as engine, sdpa_kernel([SDPBackend.MATH]):
        layers = [u for u in engine.units if u.streamable]
        sizes = {"required": sum(u.buffer_nbytes for u in engine.units if not u.streamable),  # as a device holds them
                 "kv": engine.kv_bytes(batch, TOKENS), "activations": engine.activation_bytes(batch, TOKENS, logits=1),
                 "slot": max(u.buffer_nbytes for u in layers), "layer": max(u.nbytes for u in layers),
                 "layer_buffer": max(u.buffer_nbytes for u in layers),
                 "model": sum(u.nbytes for u in engine.units), "cache": engine.checkpoint.directory}
        output = generate(engine, batch)
    with init_inference(directory, device="cpu", compute_device="cpu", **extra) as engine:
        sizes["unquantized"] = {u.name: u.buffer_nbytes for u in engine.units}
        sizes["unquantized_required"] = sum(u.buffer_nbytes for u in engine.units if not u.streamable)
        sizes["unquantized_copies"] = {u.name: u.copy_nbytes for u in engine.units}
    return output, sizes


def mixed_tiers(sizes: dict) -> dict:
    """Settings for a device that holds what must stay, its ring and two more units (the largest first:
    a layer, or the output head and a layer), a host that holds one more layer, the rest streamed."""
    device = sizes["required"] + sizes["activations"] + sizes["kv"] + 3 * sizes["slot"] + sizes["layer_buffer"]
    assert device < sizes["model"] + sizes["activations"] + sizes["kv"]  # smaller than the model needs
    return {"budget": device, "max_in_cpu": f"{sizes['layer']}B", "disk_gbps": 1.0, "host_to_device_gbps": 10.0}


def packed_bytes(unit) -> int:
    """A decoder layer's bytes from the shapes of its linear layers, packed as the issue counts them
    (int8: a byte a weight; int4: half a byte; plus bf16 scales, zeros and offsets), and its norms."""
    total = 0
    for module in unit.module.modules():
        if isinstance(module, QuantLinear):
            out, inp, spec = module.out_features, module.in_features, module.spec
            total += (out * inp + out * 2 * (1 if spec.symmetric else 2) if spec.num_bits == 8
                      else out * inp // 2 + inp // spec.group_size * out * 2 * 2)
        elif not list(module.children()):
            total += sum(p.numel() * p.element_size() for p in module.parameters(recurse=False))
    return total


@pytest.mark.simulated
@pytest.mark.parametrize("schedule,seed", [("late", 0), ("random", 1)])
@pytest.mark.parametrize("bits", list(BITS))
def test_quantized_generation_on_a_small_device_equals_the_cpu_path(llama, bits, schedule, seed):
    directory, root = llama
    batch = 4
    expected, sizes = on_the_cpu(directory, root, BITS[bits], batch)
    settings = mixed_tiers(sizes)
    with SimulatedDevice(budget_bytes=settings.pop("budget"), budget_setting="max_memory[0]", seed=seed,
                         schedule=schedule) as device:
        with init_inference(directory, compute_device=device, weight_quantization=BITS[bits], nvme_path=str(root),
                            **settings) as engine:
            ours = generate(engine, batch)
            plan, layers = engine.plan, [u for u in engine.units if u.streamable and u.name.startswith("model.layers.")]
            on_device = [u for u in layers if u.name in plan.device.resident]
            host = [u for u in layers if u.name in plan.resident and u.name not in plan.device.resident]
            streamed = [u for u in layers if u.name not in plan.resident]
            assert on_device and host and streamed  # the three tiers
            # Every layer is stored packed: pinned host layers hold the packed bytes, and so does the device.
            for unit in layers:
                assert packed_bytes(unit) <= unit.buffer_nbytes < packed_bytes(unit) + 4096  # + page alignment
            assert all(u.host_buffer.numel() == u.buffer_nbytes for u in host)
            assert all(u.device_buffer.numel() == u.device_layout.nbytes <= u.buffer_nbytes for u in on_device)
            assert engine.checkpoint.directory == sizes["cache"]  # the CPU's layout: its cache, not rewritten
            # A forward copies host -> device exactly the packed units the device does not keep, each once (and
            # those it prefetches for the next forward). Over the generated sequences the plan stays the same
            # (the same KV reservation); every load is done first (a unit still loading goes through the ring).
            ids, mask = ours.sequences, torch.cat([prompts(batch)[1], torch.ones(batch, NEW, dtype=torch.long)], 1)
            engine.wait_loaded()
            engine.streamer.reset()  # nothing prefetched: this forward copies all it uses
            ring = engine.streamer.stager
            before = ring.bytes_copied
            engine(ids, attention_mask=mask, logits_to_keep=1)  # as generate's forwards: the last position's logits
            ahead = sum(u.copy_nbytes for u in engine.units if ring.holds(u))  # copied for the next forward
            copied = ring.bytes_copied - before - ahead
            assert (engine.plan.resident, engine.plan.device.resident) == (plan.resident, plan.device.resident)
            not_kept = [u for u in engine.units if u.name not in plan.device.resident]
            assert copied == plan.host_to_device_bytes_per_forward == sum(u.copy_nbytes for u in not_kept)
            unquantized = sum(sizes["unquantized"][u.name] for u in not_kept)
            assert unquantized > 1.9 * copied if bits.startswith("int8") else unquantized > 2.9 * copied
            text = str(plan)
        assert device.allocated_bytes == 0  # every device buffer given back
    assert "copied host->device per forward (packed)" in text and "per token: nvme->host" in text
    assert ours.sequences.tolist() == expected.sequences.tolist()
    for a, b in zip(ours.logits, expected.logits):
        assert a.device.type != "cpu" and torch.equal(a.cpu(), b)  # the same kernels on the same packed bytes


@pytest.mark.simulated
def test_the_plan_shows_each_link_s_bytes_packed_and_unquantized(llama):
    """A device budget of what must stay and a ring of one unquantized layer (``buffer_count`` 1): the
    same budgets keep units on the device packed, and every link carries fewer bytes."""
    directory, root = llama
    _, sizes = on_the_cpu(directory, root, BITS["int4"], 1)
    unquantized = [n for n in sizes["unquantized"] if n.startswith("model.layers.") or n == "lm_head"]
    required = max(sizes["required"], sizes["unquantized_required"])  # both plans must hold what stays
    budget = required + sizes["activations"] + sizes["kv"] + max(sizes["unquantized"].values())
    with SimulatedDevice(budget_bytes=budget, budget_setting="max_memory[0]") as device:
        with init_inference(directory, compute_device=device, weight_quantization="int4", nvme_path=str(root),
                            max_in_cpu="0B", buffer_count=1, disk_gbps=1.0, host_to_device_gbps=10.0) as engine:
            plan = engine.reserve(1, TOKENS, logits=1)
    before = plan.unquantized_host_to_device_bytes
    assert before == sum(sizes["unquantized_copies"][n] for n in unquantized)  # unquantized: every layer through the ring
    assert len(plan.device.resident) > len(sizes["unquantized"]) - len(unquantized)  # packed: some kept there
    assert 0 < plan.host_to_device_bytes_per_forward < before / 3
    assert 0 < plan.read_bytes_per_forward < plan.unquantized_read_bytes / 3
    assert (f"and {format_bytes(plan.host_to_device_bytes_per_forward)} copied host->device per forward (packed), "
            f"unquantized {format_bytes(before)}") in str(plan)


@pytest.mark.simulated
def test_a_ring_that_skips_a_wait_is_caught_on_packed_weights(llama):
    directory, root = llama
    _, sizes = on_the_cpu(directory, root, BITS["int4"], 1)
    settings = mixed_tiers(sizes)
    with SimulatedDevice(schedule="late", budget_bytes=settings.pop("budget")) as device:
        with init_inference(directory, compute_device=device, weight_quantization="int4", nvme_path=str(root),
                            **settings) as engine:
            engine.streamer.reset()
            engine.streamer.stager.close()
            engine.streamer.stager = _StageWithoutComputeWait(device, engine.plan.device.ring_slots,
                                                              engine.plan.device.slot_nbytes)
            ids, mask = prompts(1)
            with pytest.raises(DeviceSyncError, match=r"device buffer 'ring\[\d\]' read on stream 'compute' before "
                                                      r"the event of its copy"):
                engine(ids, attention_mask=mask)
            device.synchronize()


@pytest.mark.simulated
def test_a_quantization_the_device_cannot_run_is_refused_naming_the_setting(llama, tmp_path):
    """The GPU's int4 kernel (tinygemm) takes bfloat16 only; the simulated device keeps that rule, so
    int4 in float32 is refused before the cache is written, while int8 in float32 runs."""
    directory, _ = llama
    with SimulatedDevice(budget_bytes=4 << 20, budget_setting="max_memory[0]") as device:
        with pytest.raises(ValueError, match=r"weight_quantization: int4 \(group 64, asymmetric\) cannot compute on the "
                                             r"simulated device: int4 runs there on torch's tinygemm kernel "
                                             r"\(_weight_int4pack_mm\), which takes bfloat16 activations only, and the "
                                             r"compute dtype is float32 .*; set dtype \"bfloat16\""):
            init_inference(directory, compute_device=device, weight_quantization="int4", dtype="float32",
                           nvme_path=str(tmp_path), disk_gbps=1.0)
        assert list(tmp_path.iterdir()) == [] and device.allocated_bytes == 0  # nothing written, nothing held
        with init_inference(directory, compute_device=device, weight_quantization="int8", dtype="float32",
                            nvme_path=str(tmp_path), disk_gbps=1.0) as engine:
            ours = generate(engine, 1)
    expected, _ = on_the_cpu(directory, tmp_path, "int8", 1, dtype="float32")
    assert ours.sequences.tolist() == expected.sequences.tolist()
    # The CPU runs int4 in float32: the rule is the device's, not the quantization's.
    assert CpuDevice().packed_kernels.unsupported(4, torch.float32) is None


def test_the_seam_gives_each_device_its_kernels_and_the_int4_layouts_move_the_same_bytes():
    spec = WeightQuantization(num_bits=4, group_size=64)
    assert CpuDevice().packed_kernels is CPU_KERNELS and QuantLinear(128, 64, spec, torch.bfloat16, False).kernels is CPU_KERNELS
    with SimulatedDevice() as device:
        assert device.packed_kernels.int4_layout == CPU_KERNELS.int4_layout  # computes on the CPU: one cache
    tinygemm = CudaPackedKernels(torch.device("cuda", 0))  # its shapes are arithmetic: no GPU needed
    for out, inp in [(64, 128), (192, 64), (4096, 11008)]:
        cpu = quantized_layout(out, inp, spec, torch.bfloat16)
        gpu = quantized_layout(out, inp, spec, torch.bfloat16, tinygemm)
        nbytes = {name: [torch.empty(shape, dtype=dtype, device="meta").nbytes for name, (dtype, shape) in layout.items()]
                  for name, layout in (("cpu", cpu), ("gpu", gpu))}
        assert nbytes["cpu"] == nbytes["gpu"] == [out * inp // 2, inp // 64 * out * 2 * 2]
        assert gpu["qweight"][0] == torch.int32 and gpu["qweight"][1][0] == out // 8 and gpu["qweight"][1][2] == 32


# ---- on a GPU, where there is one -------------------------------------------------------------------

gpu = pytest.mark.skipif(not cuda_available(), reason="needs CUDA (pytest -m gpu on a GPU machine)")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("spec", [WeightQuantization(num_bits=8), WeightQuantization(num_bits=8, symmetric=False),
                                  WeightQuantization(num_bits=4, group_size=64)], ids=lambda s: s.name)
def test_the_gpu_kernels_compute_what_the_cpu_kernels_compute(spec):
    """The same weight quantized for each device (int4: packed on the GPU in tinygemm's tiles): the
    products agree within bf16 rounding, so the packing's nibble order and tiles are right."""
    from offload.device import CudaDevice

    torch.manual_seed(0)
    weight, x = torch.randn(256, 512) * 0.05, torch.randn(5, 512).to(torch.bfloat16)
    kernels = CudaDevice().packed_kernels
    ys = []
    for where, k in (("cpu", CPU_KERNELS), (kernels.device, kernels)):
        layer = QuantLinear(512, 256, spec, torch.bfloat16, bias=False, device=where, kernels=k)
        for name, value in quantize_weight(weight, spec, torch.bfloat16, k).items():
            getattr(layer, name).data = value.to(where)
        with torch.no_grad():
            ys.append(layer(x.to(where)).float().cpu())
    assert (ys[0] - ys[1]).norm() <= 0.01 * ys[0].norm()


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("bits", list(BITS))
def test_quantized_generation_on_a_small_gpu_equals_the_gpu_holding_everything(llama, bits, tmp_path):
    directory, root = llama
    _, sizes = on_the_cpu(directory, root, BITS[bits], 4)
    settings = mixed_tiers(sizes)
    budget = settings.pop("budget")
    with init_inference(directory, compute_device="cuda", weight_quantization=BITS[bits], nvme_path=str(tmp_path),
                        disk_gbps=1.0) as engine:
        everything = generate(engine, 4)
    with init_inference(directory, compute_device="cuda", max_memory={0: budget}, weight_quantization=BITS[bits],
                        nvme_path=str(tmp_path), **settings) as engine:
        ours = generate(engine, 4)
        assert engine.plan.streamed and engine.streamer.stager.bytes_copied >= NEW * engine.plan.host_to_device_bytes_per_forward
    assert ours.sequences.tolist() == everything.sequences.tolist()
    for a, b in zip(ours.logits, everything.logits):
        assert (a - b).abs().max() <= 1e-3 * b.abs().max()
