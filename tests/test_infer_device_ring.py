"""Generation on a device with memory of its own (GPU, pinned host and NVMe tiers), on the simulated device.

The device budget is smaller than the model: the plan keeps what must stay, the activations, the KV
cache and a copy ring on the device, then some decoder layers; the others are kept in pinned host
memory and copied to the device ring ahead of use, or streamed NVMe -> locked ring -> device ring.
Tokens and logits equal the in-memory transformers model on the late schedule (a copy runs only
when waited for) and under random delays; a ring that skips a wait is caught; device buffers count
against the budget and are given back. The same runs on CUDA where there is one (``gpu``).
"""

from __future__ import annotations

import re

import contextlib
import copy
import shutil

import pytest
import torch
import transformers
from test_infer_generate import (NEW_TOKENS, PAD, assert_same_generation, build_model, one_thread,  # noqa: F401 (autouse)
                                 prompts, reference, save_checkpoint, scratch_dir)

from offload.device import DeviceSyncError, SimulatedDevice, cuda_available, device_for
from offload.infer import BudgetError, init_inference
from offload.infer.stream.device_ring import DeviceRing

TOKENS = 8 + NEW_TOKENS
gpu = pytest.mark.skipif(not cuda_available(), reason="needs CUDA (pytest -m gpu on a GPU machine)")


@pytest.fixture(scope="module")
def models():
    """(kind, dtype) -> (checkpoint directory, the in-memory reference model), 6 decoder layers."""
    root = scratch_dir("infer-ring-")
    built = {}
    for kind in ("llama", "gpt2"):
        for dtype in (torch.float32, torch.bfloat16):
            model = build_model(kind, dtype, **{"num_hidden_layers" if kind == "llama" else "n_layer": 6})
            built[kind, dtype] = (save_checkpoint(model, root / f"{kind}-{str(dtype)[6:]}"), model)
    yield built
    shutil.rmtree(root, ignore_errors=True)


def sizes(directory, batch: int) -> dict:
    """What the device tier is made of, from a CPU engine: bytes that must stay, KV cache, activations,
    the largest streamable unit (and its buffer), a decoder layer."""
    with init_inference(directory, device="cpu", disk_gbps=1.0, compute_device="cpu") as probe:
        layers = [u for u in probe.units if u.streamable]
        return {"required": sum(u.buffer_nbytes for u in probe.units if not u.streamable),  # as the device holds them
                "kv": probe.kv_bytes(batch, TOKENS), "activations": probe.activation_bytes(batch, TOKENS, logits=1),
                "slot": max(u.buffer_nbytes for u in layers), "layer": min(u.buffer_nbytes for u in layers),
                "model": sum(u.nbytes for u in probe.units)}


def tier_settings(directory, batch: int, tiers: str) -> tuple[int, dict]:
    """(device budget, engine settings) for ``tiers``:
    "streamed": the device holds what must stay and its ring, the host nothing more (all streamed);
    "host": the same device, every layer kept in pinned host memory;
    "mixed": the device also keeps one layer, the host one more, the rest streamed.
    """
    s = sizes(directory, batch)
    ring = 2 * s["slot"]
    device = s["required"] + s["activations"] + s["kv"] + ring + (s["layer"] if tiers == "mixed" else 0)
    assert device < s["model"] + s["activations"] + s["kv"]  # the point: a device smaller than the model needs
    host = {"streamed": 0, "host": 1 << 30, "mixed": s["slot"]}[tiers]
    return device, {"max_in_cpu": f"{host}B", "disk_gbps": 1.0, "host_to_device_gbps": 10.0}


@contextlib.contextmanager
def small_device(directory, batch: int, tiers: str, **device_args):
    """(device, engine): a simulated device of `tier_settings`' budget, and an engine on it; on exit,
    checks that the engine gave every device buffer back."""
    budget, settings = tier_settings(directory, batch, tiers)
    with SimulatedDevice(budget_bytes=budget, budget_setting="max_memory[0]", **device_args) as device:
        with init_inference(directory, compute_device=device, **settings) as engine:
            yield device, engine
        assert device.allocated_bytes == 0  # closing the engine gave every device buffer back


def check_tiers(engine, tiers: str) -> None:
    plan = engine.plan
    on_device, layers = plan.device.resident, [u for u in engine.units if u.streamable]
    host = {u.name for u in layers if u.name in plan.resident and u.name not in on_device}
    streamed = {u.name for u in plan.streamed}
    assert all(u.name in on_device for u in engine.units if not u.streamable)
    # the plan counts for each unit it keeps the unit's buffer: room for its windows as read and for its
    # tensors aligned on the device (what the device allocates: offload/infer/stream/device_layout.py)
    assert plan.device.resident_bytes == sum(u.buffer_nbytes for u in engine.units if u.name in on_device)
    assert all(u.device_buffer.numel() == u.device_layout.nbytes <= u.buffer_nbytes
               for u in engine.units if u.name in on_device)
    if tiers == "streamed":
        assert streamed == {u.name for u in layers} and not host
    elif tiers == "host":
        assert host == {u.name for u in layers} and not streamed
    else:
        assert len([u for u in layers if u.name in on_device]) >= 1 and host and streamed
    assert plan.host_to_device_bytes_per_forward == sum(u.copy_nbytes for u in layers if u.name not in on_device)
    assert plan.read_bytes_per_forward == sum(u.read_nbytes for u in layers if u.name in streamed)


def generate(engine, batch: int):
    ids, mask = prompts(batch)
    return engine.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, pad_token_id=PAD,
                           output_logits=True, return_dict_in_generate=True, do_sample=False)


@pytest.mark.simulated
@pytest.mark.parametrize("schedule,seed", [("late", 0), ("random", 1), ("random", 2)])
@pytest.mark.parametrize("tiers", ["streamed", "host", "mixed"])
@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_generation_on_a_small_device_equals_transformers(models, kind, batch, tiers, schedule, seed):
    directory, model = models[kind, torch.float32]
    with small_device(directory, batch, tiers, seed=seed, schedule=schedule) as (device, engine):
        ours = generate(engine, batch)
        check_tiers(engine, tiers)
        ring = engine.streamer.stager
        assert isinstance(ring, DeviceRing) and ring.device is device
        assert ring.bytes_copied >= NEW_TOKENS * engine.plan.host_to_device_bytes_per_forward
        assert device.allocated_bytes <= device.budget_bytes
        ids, mask = prompts(batch)
        logits = engine(ids, attention_mask=mask).logits.cpu()  # the model's own forward agrees too
    assert_same_generation(ours, reference(model, batch, do_sample=False), torch.float32)
    with torch.no_grad():
        expected = model(ids, attention_mask=mask).logits
    assert (logits - expected).abs().max() <= 1e-5 * expected.abs().max()


@pytest.mark.simulated
@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_bf16_and_sampling_on_a_small_device_equal_transformers(models, kind):
    directory, model = models[kind, torch.bfloat16]
    ids, mask = prompts(4)
    with small_device(directory, 4, "mixed", seed=3) as (_, engine):
        greedy = generate(engine, 4)
        torch.manual_seed(123)
        sampled = engine.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, pad_token_id=PAD,
                                  do_sample=True, top_k=20, temperature=0.9)
    assert_same_generation(greedy, reference(model, 4, do_sample=False), torch.bfloat16)
    # Sampling draws from the device's generator (as on CUDA): the reference samples on the same device type.
    on_device = torch.device(sampled.device.type, 0)
    torch.manual_seed(123)
    try:
        with torch.no_grad():
            ref = model.to(on_device).generate(ids.to(on_device), attention_mask=mask.to(on_device),
                                               max_new_tokens=NEW_TOKENS, pad_token_id=PAD, do_sample=True, top_k=20,
                                               temperature=0.9)
    finally:
        model.to("cpu")
    assert sampled.device.type != "cpu" and sampled.cpu().tolist() == ref.cpu().tolist()


@pytest.mark.simulated
def test_a_longer_generation_moves_layers_off_the_device_for_its_kv_cache(models):
    """The KV cache is reserved on the device per call: a longer one takes a layer's room, which goes
    to the host tier (read again from NVMe into pinned memory), and comes back for a short one."""
    directory, model = models["llama", torch.float32]
    budget, settings = tier_settings(directory, 1, "mixed")
    budget += sizes(directory, 1)["slot"]  # room for a decoder layer too
    settings["max_in_cpu"] = "1GiB"
    with SimulatedDevice(seed=4, budget_bytes=budget, budget_setting="max_memory[0]") as device:
        with init_inference(directory, compute_device=device, **settings) as engine:
            short = generate(engine, 1)
            kept = engine.plan.device.resident
            ids, mask = prompts(1)
            long = engine.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS + 16, pad_token_id=PAD,
                                   do_sample=False)
            assert engine.plan.device.resident < kept
            again = generate(engine, 1)
            assert engine.plan.device.resident == kept
    assert_same_generation(short, reference(model, 1, do_sample=False), torch.float32)
    assert again.sequences.tolist() == short.sequences.tolist()
    with torch.no_grad():
        expected = model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS + 16, pad_token_id=PAD,
                                  do_sample=False)
    assert long.tolist() == expected.tolist()


@pytest.mark.simulated
def test_a_meta_model_in_another_dtype_reads_every_unit_from_the_converted_copy(models, tmp_path):
    """On a device every unit is copied there as read (no conversion on the way), so a compute dtype
    other than the checkpoint's reads all of them, kept ones included, from the converted copy."""
    directory, model = models["llama", torch.float32]
    with torch.device("meta"):
        meta = transformers.AutoModelForCausalLM.from_config(model.config)
    budget, settings = tier_settings(directory, 1, "mixed")
    ids, mask = prompts(1)
    with SimulatedDevice(seed=5, budget_bytes=budget, budget_setting="max_memory[0]") as device:
        with pytest.raises(ValueError, match=r"offload_param.nvme_path: dtype torch.bfloat16 differs from the "
                                             r"checkpoint's \(torch.float32\) and 9 units are copied to the device as read"):
            init_inference(meta, checkpoint=directory, compute_device=device, dtype="bfloat16", **settings)
        with init_inference(meta, checkpoint=directory, compute_device=device, dtype="bfloat16",
                            nvme_path=str(tmp_path), **settings) as engine:
            assert engine.module is meta and engine.checkpoint.directory.startswith(str(tmp_path))
            assert engine.plan.device.resident - {"model.embed_tokens", "model.norm"}  # some layer kept on the device
            ours = engine.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, pad_token_id=PAD,
                                   do_sample=False)
        assert device.allocated_bytes == 0
    on_device = torch.device(ours.device.type, 0)  # bf16 kernels: the reference computes on the same device type
    with torch.no_grad():
        ref = copy.deepcopy(model).to(torch.bfloat16).to(on_device).generate(
            ids.to(on_device), attention_mask=mask.to(on_device), max_new_tokens=NEW_TOKENS, pad_token_id=PAD,
            do_sample=False)
    assert ours.device.type != "cpu" and ours.cpu().tolist() == ref.cpu().tolist()


def misaligned_copy(directory, target):
    """``directory``'s checkpoint rewritten so that every tensor starts 8 bytes past a 16-byte boundary
    in its file (safetensors pads its header to 8 bytes only; the metadata's length picks the rest)."""
    import json
    import struct

    from safetensors.torch import load_file, save_file

    target.mkdir()
    for path in sorted(directory.iterdir()):
        if path.suffix != ".safetensors":
            shutil.copy(path, target / path.name)
            continue
        tensors = load_file(path)
        for pad in range(16):
            save_file(tensors, target / path.name, metadata={"format": "pt", "pad": "x" * pad})
            with open(target / path.name, "rb") as f:
                header = struct.unpack("<Q", f.read(8))[0]
                offsets = [v["data_offsets"][0] for k, v in json.loads(f.read(header)).items() if k != "__metadata__"]
            if all((8 + header + offset) % 16 == 8 for offset in offsets):
                break
        else:
            raise AssertionError(f"{path}: no metadata length puts its tensors 8 past a 16-byte boundary")
    return target


@pytest.mark.parametrize("where", [pytest.param("simulated", marks=pytest.mark.simulated),
                                   pytest.param("cuda", marks=[pytest.mark.gpu, gpu])])
def test_every_weight_the_device_computes_with_starts_256_byte_aligned(models, tmp_path, where):
    """On a checkpoint whose tensors the file aligns to 8 bytes only, each weight is placed on the device
    (kept there, or copied through the ring from pinned host memory or the disk) at a 256-byte boundary
    of its buffer, as an allocation of its own would be: cuBLAS chooses its kernels by the alignment
    (offload/infer/stream/device_layout.py). The tokens are transformers' (on CUDA: on the GPU)."""
    directory, model = models["llama", torch.float32]
    misaligned = misaligned_copy(directory, tmp_path / "misaligned")
    offsets = []

    def offset_in_a_device_buffer(module, args):
        buffers = [u.device_buffer for u in engine.units if u.device_buffer is not None] + engine.streamer.stager.buffers
        ptr = module.weight.data_ptr()
        offsets.append(next((ptr - b.data_ptr() for b in buffers if 0 <= ptr - b.data_ptr() < b.numel()), None))

    budget, settings = tier_settings(misaligned, 1, "mixed")
    with contextlib.ExitStack() as stack:
        if where == "simulated":
            _, engine = stack.enter_context(small_device(misaligned, 1, "mixed"))
        else:
            engine = stack.enter_context(init_inference(misaligned, compute_device="cuda", max_memory={0: budget},
                                                        **settings))
        for module in engine.module.modules():
            if isinstance(module, torch.nn.Linear):
                module.register_forward_pre_hook(offset_in_a_device_buffer)
        ours = generate(engine, 1)
        check_tiers(engine, "mixed")
    assert len(offsets) == NEW_TOKENS * (7 * 6 + 1)  # every projection of 6 layers, and the head, per token
    assert all(offset is not None and offset % 256 == 0 for offset in offsets), sorted(set(map(str, offsets)))
    if where == "simulated":
        assert_same_generation(ours, reference(model, 1, do_sample=False), torch.float32)
    else:
        assert ours.sequences.tolist() == _on_the_gpu(model, 1).sequences.tolist()


class _StageWithoutComputeWait(DeviceRing):
    """The bug: the compute stream is not made to wait for the copy."""

    def stage(self, key, host, copies):
        if not self.prefetch(key, host, copies):
            self.reset()
            self.prefetch(key, host, copies)
        copy = self._copies[key]
        copy.in_use = True
        self.device.check_ready(self.buffers[copy.slot][:copy.end])
        return self.buffers[copy.slot]


class _ReleaseWithoutWaiting(DeviceRing):
    """The bug: the host buffer is handed back for the next read without waiting for the copy."""

    def release(self, key):
        copy = self._copies.pop(key)
        self._computed[copy.slot] = self.device.compute_stream.record()
        self._free.append(copy.slot)


@pytest.mark.simulated
@pytest.mark.parametrize("ring,message", [
    (_StageWithoutComputeWait, r"device buffer 'ring\[\d\]' read on stream 'compute' before the event of its copy"),
    (_ReleaseWithoutWaiting, r"host buffer at .* written by the host while copy #\d+ on stream 'ring-copies' may "
                             r"still read it into device buffer 'ring\[\d\]'"),
])
def test_a_ring_that_skips_a_wait_is_caught(models, ring, message):
    directory, _ = models["llama", torch.float32]
    budget, settings = tier_settings(directory, 1, "streamed")
    ids, mask = prompts(1)
    with SimulatedDevice(schedule="late", budget_bytes=budget) as device:
        with init_inference(directory, compute_device=device, **settings) as engine:
            engine.streamer.reset()
            engine.streamer.stager.close()
            engine.streamer.stager = ring(device, engine.plan.device.ring_slots, engine.plan.device.slot_nbytes)
            with pytest.raises(DeviceSyncError, match=message):
                engine(ids, attention_mask=mask)
            device.synchronize()  # the buggy ring's copies are seen done, so closing frees its buffers


@pytest.mark.simulated
def test_a_device_smaller_than_two_ring_slots_names_the_figures(models):
    directory, _ = models["llama", torch.float32]
    budget, settings = tier_settings(directory, 1, "streamed")
    small = budget - sizes(directory, 1)["kv"] - 2 * sizes(directory, 1)["slot"] + 1000
    with SimulatedDevice(budget_bytes=small, budget_setting="max_memory[0]") as device:
        with pytest.raises(BudgetError, match=r"max_memory\[0\]: the device budget of .* cannot hold the units that "
                                              r"must stay on the device \(.*model.embed_tokens.*\) \+ activations .* "
                                              r"\+ a copy ring of 2 x .* \(the largest layer\) = .*; raise max_memory"):
            init_inference(directory, compute_device=device, **settings)
        assert device.allocated_bytes == 0  # nothing left behind


@pytest.mark.simulated
def test_a_batch_whose_kv_cache_cannot_fit_the_device_names_it(models):
    directory, _ = models["llama", torch.float32]
    with small_device(directory, 1, "streamed") as (_, engine):
        ids, mask = prompts(4)
        with pytest.raises(BudgetError, match=r"max_memory\[0\]: .* \+ KV cache buffers .* \(one layer's cache for "
                                              r"batch 4 x 24 tokens; the cache itself is on the host\) .* "
                                              r"lower the batch size or the number of tokens.*\. (At batch 4 at most "
                                              r"([\d,]+) tokens fit|No length fits at batch 4)") as refused:
            engine.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, pad_token_id=PAD)
        most = re.search(r"at most ([\d,]+) tokens", str(refused.value))
        if most:  # that many fit on the device's plan (as generate asks it: the last position's logits), one more not
            most = int(most.group(1).replace(",", ""))
            with pytest.raises(BudgetError, match=f"batch 4 x {most + 1} tokens"):
                engine.reserve(4, most + 1, logits=1)
            engine.reserve(4, most, logits=1)
        ids, mask = prompts(1)
        assert engine.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS,
                               pad_token_id=PAD).shape == (1, TOKENS)  # the engine still works


@pytest.mark.simulated
def test_the_printed_plan_shows_the_tiers_and_the_bytes_per_link(models):
    directory, _ = models["llama", torch.float32]
    with small_device(directory, 1, "mixed") as (_, engine):
        generate(engine, 1)
        text, plan = str(engine.plan), engine.plan
    assert "device: budget" in text and "(max_memory[0])" in text and "copy ring: 2 x" in text
    assert "in pinned host memory" in text and "streamed:" in text
    nvme = plan.read_bytes_per_forward / 1e9
    h2d = plan.host_to_device_bytes_per_forward / 10e9
    assert plan.link_seconds() == pytest.approx({"nvme->host": nvme, "host->device": h2d})
    assert plan.bound_seconds() == pytest.approx(max(nvme, h2d))
    assert plan.bound_seconds(compute_seconds=5.0) == 5.0
    assert "per token: nvme->host" in text and "host->device" in text and "bound" in text


# ---- on a GPU, where there is one -------------------------------------------------------------------

def _on_the_gpu(model, batch: int):
    """transformers' greedy generation of ``model`` on the GPU (the model goes back to the CPU after)."""
    ids, mask = prompts(batch)
    on_gpu = device_for("cuda").torch_device
    try:
        with torch.no_grad():
            return model.to(on_gpu).generate(ids.to(on_gpu), attention_mask=mask.to(on_gpu), max_new_tokens=NEW_TOKENS,
                                             pad_token_id=PAD, output_logits=True, return_dict_in_generate=True,
                                             do_sample=False)
    finally:
        model.to("cpu")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("tiers", ["streamed", "host", "mixed"])
@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_generation_on_a_small_gpu_equals_transformers_on_it(models, kind, tiers):
    directory, model = models[kind, torch.float32]
    budget, settings = tier_settings(directory, 4, tiers)
    with init_inference(directory, compute_device="cuda", max_memory={0: budget}, **settings) as engine:
        ours = generate(engine, 4)
        check_tiers(engine, tiers)
    ref = _on_the_gpu(model, 4)
    assert ours.sequences.tolist() == ref.sequences.tolist()
    for a, b in zip(ours.logits, ref.logits):
        assert (a - b).abs().max() <= 1e-4 * b.abs().max()  # TF32 and kernel choice may differ by shape



@pytest.mark.simulated
@pytest.mark.parametrize("tiers", ["all", "streamed", "mixed"])
def test_the_host_waits_for_the_device_no_more_than_transformers_plus_one_per_copied_unit(models, tiers):
    """Where every weight is on the device, a generation makes the host wait for the device exactly where
    transformers' own generate does (its token reads): no per-layer host work. Streaming adds one wait per
    unit copied to the device in a forward (the host buffer refilled from NVMe only once its copy is done).
    Counted on simgpu (`count_host_syncs`: copies to the host, values read back, synchronisations)."""
    from offload.device import count_host_syncs

    directory, model = models["llama", torch.float32]
    ids, mask = prompts(1)
    kwargs = dict(max_new_tokens=NEW_TOKENS, pad_token_id=PAD, do_sample=False)
    on_device = torch.device("simgpu", 0)
    try:
        with torch.no_grad(), count_host_syncs() as theirs:
            model.to(on_device).generate(ids.to(on_device), attention_mask=mask.to(on_device), **kwargs)
    finally:
        model.to("cpu")
    budget, settings = (None, {"disk_gbps": 1.0}) if tiers == "all" else tier_settings(directory, 1, tiers)
    with SimulatedDevice(seed=0, budget_bytes=budget, budget_setting="max_memory[0]") as device:
        with init_inference(directory, compute_device=device, **settings) as engine:
            engine.generate(ids, attention_mask=mask, **kwargs)  # the loads done, the ring made
            engine.wait_loaded()
            copied = [u for u in engine.units if u.name not in engine.plan.device.resident]
            with count_host_syncs() as ours:
                engine.generate(ids, attention_mask=mask, **kwargs)
    forwards = NEW_TOKENS  # the prefill and a forward per new token but the last
    assert theirs.total > 0 and ours.by_cause.get("aten::_local_scalar_dense") == theirs.total
    assert ours.total - theirs.total <= len(copied) * forwards
    if tiers == "all":
        assert copied == [] and ours.by_cause == theirs.by_cause
