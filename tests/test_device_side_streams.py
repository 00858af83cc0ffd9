"""Work ordered on a side stream through the device seam: copies between device buffers (`device_copy`),
collectives (`collective_on`) and buffers allocated for a side stream (`empty(stream=)`, `record_stream`),
as CUDA's streams and caching allocator order them. On the simulated device each wait left out raises, and
where nothing checks, the buffer still holds NaN; on the CPU device each is plain and done at once.

Tests wait on events or run on the "late" schedule (work runs only when something waits for it), never on
wall-clock time. The collectives here are stand-ins (`issue` copies its input): what is under test is where
the result lands and when, not the transport.
"""

from __future__ import annotations

import pytest
import torch

from offload.device import CpuDevice, DeviceSyncError, SimulatedDevice

pytestmark = pytest.mark.simulated


@pytest.fixture
def late():
    """A simulated device whose side-stream work runs only when something waits for it."""
    with SimulatedDevice(schedule="late") as device:
        yield device


def on_device(device, values: list[float], name: str, stream=None) -> torch.Tensor:
    """A device buffer holding ``values``, its copy waited for by ``stream`` (default: compute) and the host."""
    host = device.pinned_empty(len(values), torch.float32)
    host.copy_(torch.tensor(values))
    buffer = device.empty(len(values), torch.float32, name=name, stream=stream)
    device.to_device(buffer, host, stream=stream or device.compute_stream).synchronize()
    return buffer


def twice(output: torch.Tensor, input: torch.Tensor) -> None:
    """A stand-in all-gather of two ranks that hold the same input."""
    output.view(2, -1).copy_(input.expand(2, -1))


def test_a_collective_on_a_side_stream_lands_only_once_its_event_is_waited_for(late):
    """The output of a collective ordered on a side stream holds NaN until that stream runs past it; compute
    that reads it before waiting for its event raises, naming the collective and the stream."""
    gather = late.new_stream("param-gather")
    sent = on_device(late, [1.0, 2.0, 3.0], "partition w", stream=gather)
    out = late.empty(6, torch.float32, name="gathered w", stream=gather)
    done = late.collective_on(gather, twice, out, sent, op="all_gather of 'w'")
    assert [(r.op, r.buffer, r.stream) for r in late.collective_log] == [("all_gather of 'w'", "gathered w",
                                                                         "param-gather")]
    assert torch.isnan(out.cpu()).all()  # not run: nothing waited for it
    with pytest.raises(DeviceSyncError, match=r"'gathered w' read on stream 'compute' before the event of its "
                                              r"collective #1 \(all_gather of 'w'\) on stream 'param-gather'"):
        late.check_ready(out)
    late.compute_stream.wait_event(done)
    late.check_ready(out)
    assert out.cpu().tolist() == [1.0, 2.0, 3.0] * 2


def test_a_side_stream_that_skips_the_wait_for_a_copy_is_caught(late):
    """A collective or a device copy on one stream reading a buffer another stream filled, without waiting
    for that copy's event, raises; after ``wait_event`` it reads the copied values."""
    copies, gather = late.new_stream("param-copy"), late.new_stream("param-gather")
    host = late.pinned_empty(4, torch.float32)
    host.copy_(torch.tensor([4.0, 3.0, 2.0, 1.0]))
    partition = late.empty(4, torch.float32, name="partition b", stream=copies)
    copied = late.to_device(partition, host, stream=copies)
    flat = late.empty(4, torch.float32, name="flat", stream=gather)
    out = late.empty(8, torch.float32, name="rows", stream=gather)
    with pytest.raises(DeviceSyncError, match="'partition b' read on stream 'param-gather' before the event of its "
                                              "copy #1 on stream 'param-copy' was waited for"):
        late.collective_on(gather, twice, out, partition, op="all_gather of 'b'")
    with pytest.raises(DeviceSyncError, match="'partition b' copied on stream 'param-gather' before the event"):
        late.device_copy(flat, partition, stream=gather)
    gather.wait_event(copied)
    late.device_copy(flat, partition, stream=gather)
    late.compute_stream.wait_event(late.collective_on(gather, twice, out, flat, op="all_gather of 'b'"))
    late.check_ready(out)
    assert out.cpu().tolist() == [4.0, 3.0, 2.0, 1.0] * 2


def test_a_buffer_of_a_side_stream_freed_after_compute_read_it_needs_record_stream(late):
    """A buffer allocated for a side stream may be reused by that stream's next work as soon as it is freed
    (CUDA's caching allocator): freeing it after compute read it raises unless compute was named to
    ``record_stream`` (or the side stream waited for compute, or the host saw compute done)."""
    gather = late.new_stream("param-gather")
    full = on_device(late, [1.0, 2.0], "gathered w", stream=gather)
    late.compute_stream.wait_event(gather.record())
    late.check_ready(full)  # compute reads it
    with pytest.raises(DeviceSyncError, match="'gathered w' freed while compute may still read it: it was allocated "
                                              "for stream 'param-gather'.*record_stream"):
        late.free(full)
    late.record_stream(full, late.compute_stream)
    late.free(full)
    ordered = on_device(late, [1.0], "ordered", stream=gather)
    late.check_ready(ordered)
    gather.wait_event(late.compute_stream.record())  # the side stream's next work comes after that read
    late.free(ordered)


def test_a_buffer_freed_under_work_of_an_unrecorded_stream_is_caught(late):
    """Freeing a buffer while another stream's copy from it may still run raises, naming that copy; with that
    stream named to ``record_stream`` the free is fine, and the memory is poisoned (reusable) only once the
    streams have run what they were given before it."""
    copies, gather = late.new_stream("param-copy"), late.new_stream("param-gather")
    partition = on_device(late, [5.0, 6.0], "partition c", stream=copies)
    flat = late.empty(2, torch.float32, name="flat", stream=gather)
    late.device_copy(flat, partition, stream=gather)
    with pytest.raises(DeviceSyncError, match="'partition c' freed while copy #2 on stream 'param-gather' may still "
                                              "use it.*record_stream"):
        late.free(partition)
    late.record_stream(partition, gather)
    late.free(partition)  # the copy from it has not run: its bytes stay until it has
    late.compute_stream.wait_event(gather.record())
    late.check_ready(flat)
    assert flat.cpu().tolist() == [5.0, 6.0]
    late.synchronize()
    assert torch.isnan(partition).all()  # reusable now: poisoned
    with pytest.raises(DeviceSyncError, match="'partition c' copied from after it was freed"):
        late.device_copy(flat, partition, stream=gather)


def test_buffers_of_a_side_stream_go_without_a_wait_when_only_that_stream_used_them(late):
    """The flat buffers of a gather (written and read on its own stream) are freed at once, before that
    stream ran: its next work comes after, so nothing waits, and their bytes stay until the stream ran."""
    gather = late.new_stream("param-gather")
    sent = on_device(late, [7.0, 8.0], "flat input", stream=gather)
    rows = late.empty(4, torch.float32, name="flat output", stream=gather)
    full = late.empty(4, torch.float32, name="gathered", stream=gather)
    late.collective_on(gather, twice, rows, sent, op="all_gather")
    done = late.device_copy(full, rows, stream=gather)
    late.free(sent)
    late.free(rows)
    late.compute_stream.wait_event(done)
    late.check_ready(full)
    assert full.cpu().tolist() == [7.0, 8.0, 7.0, 8.0]


@pytest.mark.parametrize("seed", range(4))
def test_the_random_schedule_gives_the_same_values(seed):
    """The same work on the random schedule (side streams running at their own pace), waits in place: the
    values of a plain computation."""
    with SimulatedDevice(seed=seed, max_delay_s=0.0005) as device:
        copies, gather = device.new_stream("param-copy"), device.new_stream("param-gather")
        partitions = [on_device(device, [float(i), float(i) + 0.5], f"partition {i}", stream=copies) for i in range(3)]
        flat = device.empty(6, torch.float32, name="flat", stream=gather)
        for i, partition in enumerate(partitions):
            device.device_copy(flat[2 * i:2 * i + 2], partition, stream=gather)
            device.record_stream(partition, gather)
            device.free(partition)
        rows = device.empty(12, torch.float32, name="rows", stream=gather)
        done = device.collective_on(gather, twice, rows, flat, op="all_gather")
        device.free(flat)
        device.compute_stream.wait_event(done)
        device.check_ready(rows)
        assert rows.cpu().tolist() == [0.0, 0.5, 1.0, 1.5, 2.0, 2.5] * 2
        device.record_stream(rows, device.compute_stream)
        device.free(rows)
        device.synchronize()


def test_the_cpu_device_runs_them_at_once():
    """On the CPU a device copy and a collective are plain and done when issued; ``record_stream`` is nothing."""
    cpu = CpuDevice()
    side = cpu.new_stream("param-gather")
    src = cpu.empty(3, torch.float32, name="src", stream=side)
    src.copy_(torch.tensor([1.0, 2.0, 3.0]))
    dst = cpu.empty(3, torch.float32, name="dst")
    assert cpu.device_copy(dst, src, stream=side).query() and dst.tolist() == [1.0, 2.0, 3.0]
    out = cpu.empty(6, torch.float32, name="out")
    assert cpu.collective_on(side, twice, out, src, op="all_gather").query()
    assert out.tolist() == [1.0, 2.0, 3.0] * 2
    cpu.record_stream(src, cpu.compute_stream)
    for buffer in (src, dst, out):
        cpu.free(buffer)
    assert cpu.allocated_bytes == 0
