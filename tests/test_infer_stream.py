"""The layer streamer on its own: a ring of buffers over plain Linear layers read from a safetensors
file, called in order, out of order, twice in a row, and with a forward that raises."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from offload.infer.stream import LayerStreamer, ParamRef, Unit
from offload.storage.safetensors_reader import SafetensorsCheckpoint
from tensorio import AioHandle

LAYERS = 5


@pytest.fixture
def ring(disk_dir):
    gen = torch.Generator().manual_seed(0)
    weights = {f"layer{i}.weight": torch.randn(8 + i, 8, generator=gen) for i in range(LAYERS)}
    save_file(weights, str(disk_dir / "model.safetensors"))
    handle = AioHandle()
    checkpoint = SafetensorsCheckpoint(disk_dir, handle)
    modules, units = [], []
    for i in range(LAYERS):
        with torch.device("meta"):
            module = nn.Linear(8, 8 + i, bias=False)
        placeholder = module.weight
        name = f"layer{i}.weight"
        ref = ParamRef(((module, "weight"),), name, placeholder)
        units.append(Unit(f"layer{i}", module, (ref,), checkpoint.windows([name]), placeholder.numel() * 4, True))
        modules.append(module)
    streamer = LayerStreamer(handle, buffer_count=2)
    for unit in units:
        streamer.attach(unit)
    streamer.set_units(units, max(u.buffer_nbytes for u in units))
    yield modules, units, streamer, weights
    streamer.close()
    handle.close()


def _check(modules, weights, order):
    x = torch.randn(3, 8)
    for i in order:
        assert torch.equal(modules[i](x), x @ weights[f"layer{i}.weight"].T), f"layer {i}"
        assert modules[i].weight.device.type == "meta"  # released after its forward


def test_in_order_then_out_of_order(ring):
    modules, units, streamer, weights = ring
    _check(modules, weights, list(range(LAYERS)) * 3)
    assert streamer.bytes_read >= 3 * sum(u.read_nbytes for u in units)
    _check(modules, weights, [3, 0, 4, 4, 1, 1, 2, 0])
    assert all(u.state in ("on disk", "in flight") for u in units)
    assert len(streamer._inflight) <= 2 and len(streamer._free) + len(streamer._inflight) == 2


def test_a_forward_that_raises_gives_its_buffer_back(ring):
    modules, units, streamer, weights = ring
    with pytest.raises(RuntimeError):
        modules[0](torch.randn(3, 7))  # wrong width: raises inside the forward, after the pre-hook bound it
    assert units[0].state == "on disk" and modules[0].weight.device.type == "meta"
    _check(modules, weights, [0, 1, 2, 3, 4, 0])


def test_nested_call_of_the_same_layer(ring):
    modules, units, streamer, weights = ring
    x = torch.randn(3, 8)
    streamer.acquire(units[2])  # as a module whose forward calls itself would
    assert torch.equal(modules[2](x), x @ weights["layer2.weight"].T)
    assert units[2].state == "in use" and modules[2].weight.device.type == "cpu"
    streamer.release(units[2])
    assert units[2].state == "on disk"
    _check(modules, weights, [2, 3])



def test_load_resident_faults_each_buffer_in_before_its_reads(ring, monkeypatch):
    from offload.infer import stream

    modules, units, streamer, weights = ring
    streamer.reset()
    events = []
    prefault, read_windows = stream.prefault, stream.read_windows
    monkeypatch.setattr(stream, "prefault", lambda buf, *r: events.append(("fault", buf.data_ptr())) or prefault(buf, *r))
    monkeypatch.setattr(stream, "read_windows", lambda h, w, buf: events.append(("read", buf.data_ptr())) or read_windows(h, w, buf))

    nbytes = stream.load_resident(streamer.handle, units[:2], meanwhile=lambda: events.append(("meanwhile", 0)))
    assert nbytes == sum(u.read_nbytes for u in units[:2])
    assert [e for e in events if e[0] == "meanwhile"] == [("meanwhile", 0)]
    reads = [i for i, e in enumerate(events) if e[0] == "read"]
    assert len(reads) == 2
    for i in reads:  # each buffer faulted in before its reads start
        assert ("fault", events[i][1]) in events[:i]
    assert all(u.state == "resident" for u in units[:2])
    x = torch.randn(3, 8)
    assert torch.equal(modules[1](x), x @ weights["layer1.weight"].T)


def test_load_resident_raises_meanwhile_and_fault_errors_after_the_reads(ring, monkeypatch):
    from offload.infer import stream

    modules, units, streamer, weights = ring
    streamer.reset()

    def meanwhile():
        raise RuntimeError("meanwhile failed")

    with pytest.raises(RuntimeError, match="meanwhile failed"):  # raised once the reads are done
        stream.load_resident(streamer.handle, units[:2], meanwhile=meanwhile)
    assert all(u.state != "resident" for u in units[:2])  # nothing bound

    read_windows, started = stream.read_windows, []
    monkeypatch.setattr(stream, "read_windows", lambda *a: started.append(a) or read_windows(*a))
    calls = []

    def failing_fault(buffer):
        calls.append(buffer.data_ptr())
        if len(set(calls)) == 2:  # the second unit's buffer
            raise OSError(12, "no memory left")
        return True

    monkeypatch.setattr(stream, "prefault", failing_fault)
    with pytest.raises(OSError, match="no memory left"):
        stream.load_resident(streamer.handle, units[:3])
    assert len(started) == 1  # the first unit's reads started (and were waited for); none after the error
    assert all(u.state != "resident" for u in units[:3])
