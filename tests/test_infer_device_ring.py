"""The layer streamer's device path (offload/infer/device_ring.py) on the simulated device.

Generation with every layer streamed through locked host buffers, copied into separate device
buffers on a side stream, gives the tokens and logits of the in-memory transformers model, on the
late schedule (a copy runs only when waited for) and under random delays; a ring that skips a
wait is caught; the ring's device buffers count against the device budget and are given back.
"""

from __future__ import annotations

import shutil

import pytest
import torch
from test_infer_generate import (NEW_TOKENS, PAD, assert_same_generation, build_model, one_thread,  # noqa: F401 (autouse)
                                 prompts, reference, required_and_kv, save_checkpoint, scratch_dir)

from offload.device import DeviceMemoryError, DeviceSyncError, SimulatedDevice
from offload.infer import init_inference
from offload.infer.device_ring import DeviceRing

pytestmark = pytest.mark.simulated


@pytest.fixture(scope="module")
def models():
    """kind -> (checkpoint directory, the in-memory fp32 reference model)."""
    root = scratch_dir("infer-ring-")
    built = {kind: (save_checkpoint(model, root / kind), model)
             for kind, model in ((kind, build_model(kind)) for kind in ("llama", "gpt2"))}
    yield built
    shutil.rmtree(root, ignore_errors=True)


def streamed_settings(directory, batch: int, buffers: str) -> dict:
    """Only what must stay resident in memory; every layer streams, through 1 buffer or the default ring."""
    required, kv, largest = required_and_kv(directory, batch)
    settings = {"max_in_cpu": f"{required + kv}B", "disk_gbps": 1.0}
    if buffers == "one":
        settings.update(buffer_count=1, buffer_size=-(-largest // 4))
    return settings


@pytest.mark.parametrize("schedule,seed", [("late", 0), ("random", 1), ("random", 2)])
@pytest.mark.parametrize("buffers", ["one", "ring"])
@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_generation_through_the_device_ring_equals_transformers(models, kind, batch, buffers, schedule, seed):
    directory, model = models[kind]
    ids, mask = prompts(batch)
    with SimulatedDevice(seed=seed, schedule=schedule) as device:
        with init_inference(directory, compute_device=device, **streamed_settings(directory, batch, buffers)) as engine:
            ours = engine.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, pad_token_id=PAD,
                                   output_logits=True, return_dict_in_generate=True, do_sample=False)
            ring = engine.streamer.stager
            assert isinstance(ring, DeviceRing) and ring.device is device
            assert engine.plan.streamed and device.copies >= NEW_TOKENS * len(engine.plan.streamed)
            assert device.allocated_bytes == engine.settings.buffer_count * engine.plan.buffer_nbytes
        assert device.allocated_bytes == 0  # closing the engine gave the ring's device buffers back
    assert_same_generation(ours, reference(model, batch, do_sample=False), torch.float32)


class _StageWithoutComputeWait(DeviceRing):
    """The bug: the compute stream is not made to wait for the copy."""

    def stage(self, slot, host, nbytes):
        target = self.buffers[slot][:nbytes]
        self._copied[slot] = self.device.to_device(target, host[:nbytes], stream=self.stream)
        self.device.check_ready(target)
        return self.buffers[slot]


class _ReleaseWithoutWaiting(DeviceRing):
    """The bug: the host buffer is handed back for the next read without waiting for the copy."""

    def release(self, slot):
        self._computed[slot] = self.device.compute_stream.record()


@pytest.mark.parametrize("ring,message", [
    (_StageWithoutComputeWait, r"device buffer 'ring\[\d\]' read on stream 'compute' before the event of its copy"),
    (_ReleaseWithoutWaiting, r"host buffer at .* written by the host while copy #\d+ on stream 'ring-copies' may "
                             r"still read it into device buffer 'ring\[\d\]'"),
])
def test_a_ring_that_skips_a_wait_is_caught(models, ring, message):
    directory, _ = models["llama"]
    ids, mask = prompts(1)
    with SimulatedDevice(schedule="late") as device:
        with init_inference(directory, compute_device=device, **streamed_settings(directory, 1, "ring")) as engine:
            engine.streamer.reset()
            engine.streamer.stager.close()
            engine.streamer.stager = ring(device, engine.settings.buffer_count, engine.plan.buffer_nbytes)
            with pytest.raises(DeviceSyncError, match=message):
                engine(ids, attention_mask=mask)
            device.synchronize()  # the buggy ring's copies are seen done, so closing frees its buffers


def test_ring_over_the_device_budget_names_the_figures(models):
    directory, _ = models["llama"]
    settings = streamed_settings(directory, 1, "ring")
    with SimulatedDevice(budget_bytes=100_000, budget_setting="max_memory[0]") as device:
        with pytest.raises(DeviceMemoryError, match=r"ring\[\d\]: allocating .* over its budget of 97.7 KiB "
                                                    r"\(100000 bytes\) \(max_memory\[0\]\)"):
            init_inference(directory, compute_device=device, **settings)
        assert device.allocated_bytes == 0  # nothing left behind
