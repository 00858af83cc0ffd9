"""Parameter all-gathers on a side stream, at world size 2 on the simulated device (one `simgpu` index per
rank, gloo underneath): every coalesced all-gather runs on the stream "param-gather" (the device's
`collective_log`), neither side stream ever waits for compute, and the losses equal, bit for bit, those of
the same run with the gathers on the compute stream. Leaving out the compute stream's wait for a gather, or
the `record_stream` that keeps a gathered buffer's memory until compute has read it, is caught."""

from __future__ import annotations

import collections
import gc
import json
import math
import os

import pytest
import torch.distributed as dist

from offload.device import DeviceSyncError, SimulatedDevice
from offload.params.device_gather import DeviceGathers
from offload.train.engine import initialize
from test_engine_dist import _free_port, batches, config, gpt2
from test_engine_dist_comm import _GATHERS, counted

pytestmark = [pytest.mark.multiprocess, pytest.mark.simulated]

transformers = pytest.importorskip("transformers")

MODES = ("side", "compute", "no wait", "unchecked", "no record_stream")
"""How a rank runs: gathers on the side stream (as shipped) or on the compute stream; or on the side stream
with a bug put in on purpose: the compute stream not waiting for the gathers, the same without the
device's `check_ready` on the gathered buffers, or compute not named to `record_stream` for them."""


def _break(device: SimulatedDevice, mode: str) -> None:
    """Put ``mode``'s bug into ``device``'s use by the engine."""
    if mode in {"no wait", "unchecked"}:
        wait = device.compute_stream.wait_event
        device.compute_stream.wait_event = lambda event: None if event.stream_name == "param-gather" else wait(event)
    if mode == "unchecked":
        check = device.check_ready
        device.check_ready = lambda tensor, stream=None: (
            None if device.describe(tensor).startswith("device buffer 'gathered") else check(tensor, stream))
    if mode == "no record_stream":
        record = device.record_stream
        device.record_stream = lambda tensor, stream: (
            None if stream is device.compute_stream else record(tensor, stream))


def train(rank: int, out: str, mode: str) -> None:
    """Four steps of a 2-layer GPT-2 on this rank's half of each batch, on ``simgpu:rank`` (``mode``: see
    `MODES`; "unchecked" runs one forward only). Rank 0 writes the losses, the streams of the device's
    collectives, the all-gathers torch.distributed saw and what the side streams waited for to ``out``."""
    dist.init_process_group("gloo", rank=rank, world_size=2)
    os.environ["LOCAL_RANK"] = str(rank)
    DeviceGathers.side_stream_gathers = mode != "compute"
    device = SimulatedDevice(seed=rank, schedule="late" if mode != "side" else "random", max_delay_s=0.0002)
    engine, *_ = initialize(model=gpt2(), config=config("unused", "cpu", "cpu", 2, 1, 0.0), compute_device=device)
    _break(device, mode)
    first = len(device.collective_log)  # after initialize's gather of the parameters kept whole
    losses, calls = [], []
    with counted(calls):
        for batch in batches(1 if mode == "unchecked" else 4):
            share = batch.chunk(2)[rank]
            loss = engine(share, labels=share).loss
            if mode != "unchecked":
                engine.backward(loss)
                engine.step()
            total = loss.detach().float()
            dist.all_reduce(total)
            losses.append(total.item() / 2)
    gathers = engine.param_store.gathers
    ours = [record for record in device.collective_log[first:] if record.op.startswith("all_gather")]
    result = {"losses": losses, "gathers": len([call for call in calls if call[0] in _GATHERS]),
              "streams": collections.Counter(record.stream for record in ours),
              "ahead": engine.param_store.ahead.issued,
              # where each side stream is ordered after compute (0: it never waited for compute)
              "after_compute": {s.name: s.clock.get(0, 0) for s in (gathers.side, gathers.gather_stream)}}
    engine.close()
    if rank == 0:
        with open(out, "w", encoding="utf-8") as file:
            json.dump(result, file)
    device.synchronize()
    device.raise_faults()
    device.close()
    del engine, device, gathers
    gc.collect()  # device buffers collectives used, freed before gloo's teardown (docs/engine.md)
    dist.destroy_process_group()


def run_two(disk_dir, monkeypatch, mode: str) -> dict:
    """`train` on two ranks in ``mode``; rank 0's results."""
    out = str(disk_dir / f"{mode.replace(' ', '_')}.json")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(_free_port()))
    monkeypatch.setenv("OFFLOAD_SIMGPU_COUNT", "2")
    from ranks import run_ranks

    run_ranks(train, [(rank, out, mode) for rank in range(2)], timeout=180)
    with open(out, encoding="utf-8") as file:
        return json.load(file)


def test_gathers_run_on_their_side_stream_and_match_the_compute_stream_bit_for_bit(disk_dir, monkeypatch):
    """Every all-gather the ranks make is ordered on "param-gather" (issued ahead of its module from step 2
    on), neither "param-copy" nor "param-gather" ever waits for compute, and the fp32 losses are those of
    the gathers on the compute stream, exactly."""
    side = run_two(disk_dir, monkeypatch, "side")
    on_compute = run_two(disk_dir, monkeypatch, "compute")
    assert side["gathers"] > 0 and side["streams"] == {"param-gather": side["gathers"]}, side
    assert on_compute["streams"] == {"compute": on_compute["gathers"]} and on_compute["gathers"] == side["gathers"]
    assert side["ahead"] > 0 and side["ahead"] == on_compute["ahead"]
    assert side["after_compute"] == {"param-copy": 0, "param-gather": 0}, side["after_compute"]
    assert side["losses"] == on_compute["losses"], (side["losses"], on_compute["losses"])
    assert not any(map(math.isnan, side["losses"]))


def test_compute_that_does_not_wait_for_a_gather_is_caught(disk_dir, monkeypatch):
    """The compute stream skipping its wait for a gather's event: the device raises at the first gathered
    parameter compute takes, naming it and the stream; without that check, the forward computes on the
    NaN the gathered buffer holds until the gather lands (the late schedule)."""
    with pytest.raises(AssertionError, match=r"DeviceSyncError: device buffer 'gathered .*' read on stream 'compute' "
                                             r"before the event of its .* on stream 'param-gather' was waited for"):
        run_two(disk_dir, monkeypatch, "no wait")
    unchecked = run_two(disk_dir, monkeypatch, "unchecked")
    assert len(unchecked["losses"]) == 1 and math.isnan(unchecked["losses"][0]), unchecked


def test_a_gathered_buffer_freed_without_record_stream_for_compute_is_caught(disk_dir, monkeypatch):
    """A gathered parameter's buffer (allocated for "param-gather") released without compute named to
    `record_stream`: a GPU's allocator could give its memory to the next gather while compute still reads
    it; the device raises at the release, naming the buffer."""
    with pytest.raises(AssertionError, match=f"{DeviceSyncError.__name__}: device buffer 'gathered .*' freed while "
                                             f"compute may still read it"):
        run_two(disk_dir, monkeypatch, "no record_stream")
