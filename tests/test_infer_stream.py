"""The layer streamer on its own: a ring of buffers over plain Linear layers read from a safetensors
file, called in order, out of order, twice in a row, and with a forward that raises."""

from __future__ import annotations

import os
import threading

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from offload.infer.stream.streamer import LayerStreamer
from offload.infer.stream.unit import ParamRef, Unit
from offload.storage.safetensors_reader import SafetensorsCheckpoint
from tensorio import AioHandle, TensorIOError

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
    assert streamer.reads_in_flight <= 2 and streamer.idle_buffers + streamer.reads_in_flight == 2


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


def test_resident_load_faults_each_buffer_in_before_its_reads_and_binds_a_unit_when_it_is_used(ring, monkeypatch):
    from offload.infer.stream import resident_load as stream

    modules, units, streamer, weights = ring
    streamer.set_units([], 0)
    events = []
    prefault, read_windows = stream.prefault, stream.read_windows
    monkeypatch.setattr(stream, "prefault", lambda buf, *r: events.append(("fault", buf.data_ptr())) or prefault(buf, *r))
    monkeypatch.setattr(stream, "read_windows", lambda h, w, buf: events.append(("read", buf.data_ptr())) or read_windows(h, w, buf))

    load = stream.ResidentLoad(streamer.handle, units[:3], ahead_bytes=1)  # one unit's reads in flight at a time
    assert all(u.state == "loading" and u.loading is load for u in units[:3])
    x = torch.randn(3, 8)
    assert torch.equal(modules[1](x), x @ weights["layer1.weight"].T)  # its forward waited for its reads
    assert units[1].state == "resident" and modules[1].weight.device.type == "cpu"
    assert units[1].load_hooks == [] and not modules[1]._forward_pre_hooks.keys() - {h.id for h in units[1].hooks}
    load.wait_all()
    assert load.done and load.nbytes == sum(u.read_nbytes for u in units[:3]) and load.finished_at is not None
    reads = [i for i, e in enumerate(events) if e[0] == "read"]
    assert len(reads) == 3
    for i in reads:  # each buffer faulted in before its reads start
        assert ("fault", events[i][1]) in events[:i]
    _check_resident = [torch.equal(modules[i](x), x @ weights[f"layer{i}.weight"].T) for i in range(3)]
    assert all(_check_resident)


def test_a_load_that_places_units_gives_a_device_kept_units_host_buffer_back_before_any_forward(ring):
    """Compute with memory of its own: the load's thread places each unit as soon as it is read, so the
    pinned host buffer of a unit the device keeps goes at once (on an H200 the whole device tier's
    host buffers waited for the first forward to reach them, and a generation in a cgroup of its budget
    was killed). A unit kept in host memory keeps its buffer; forwards compute with either."""
    import gc
    import weakref

    from offload.infer.stream import resident_load as stream

    modules, units, streamer, weights = ring
    streamer.set_units([], 0)
    hosts, threads = {}, set()

    def place(unit, host):
        hosts[unit.name] = weakref.ref(host)
        threads.add(threading.current_thread().name)
        if unit.name == "layer2":
            return None  # "the device" keeps layers 0 and 1, not 2
        placed = torch.empty(unit.device_layout.nbytes, dtype=torch.uint8)  # laid out as a device's (aligned)
        for host_at, at, nbytes in unit.device_layout.copies:
            placed[at: at + nbytes] = host[host_at: host_at + nbytes]
        return placed

    load = stream.ResidentLoad(streamer.handle, units[:3], place=place)
    load.join()  # the thread is done; no forward has run
    gc.collect()
    assert threads == {"load-resident"}
    assert hosts["layer0"]() is None and hosts["layer1"]() is None  # given back before any forward
    assert hosts["layer2"]() is not None
    x = torch.randn(3, 8)
    for i in range(2):  # computing from the buffers `place` gave
        assert torch.equal(modules[i](x), x @ weights[f"layer{i}.weight"].T), f"layer {i}"
    load.wait(units[2])  # kept in host memory: the engine's streamer copies it for each forward
    assert [u.state for u in units[:3]] == ["resident", "resident", "host"]
    load.close()


def test_a_unit_whose_load_failed_is_read_again_by_the_forward_that_needs_it(ring, monkeypatch):
    from offload.infer.stream import resident_load as stream

    modules, units, streamer, weights = ring
    streamer.set_units([], 0)
    read_windows, started = stream.read_windows, []
    monkeypatch.setattr(stream, "read_windows", lambda *a: started.append(a) or read_windows(*a))
    faults = []

    def failing_fault(buffer):
        faults.append(buffer.data_ptr())
        if len(faults) == 2:  # the second unit's buffer
            raise OSError(12, "no memory left")
        return True

    monkeypatch.setattr(stream, "prefault", failing_fault)
    load = stream.ResidentLoad(streamer.handle, units[:3])
    load.wait_all()  # the failed unit is read again here; the load went on past it
    assert [u.state for u in units[:3]] == ["resident"] * 3
    assert len(started) == 3
    assert started[1][1] is units[2].windows and started[2][1] is units[1].windows  # unit 1 last, again
    x = torch.randn(3, 8)
    for i in range(3):
        assert torch.equal(modules[i](x), x @ weights[f"layer{i}.weight"].T)
    load.close()


def test_resident_load_read_error_names_the_file_and_the_next_forward_tries_again(ring, disk_dir):
    from offload.infer.stream import resident_load as stream

    modules, units, streamer, weights = ring
    streamer.set_units([], 0)
    path = disk_dir / "model.safetensors"
    saved = path.read_bytes()
    os.truncate(path, 64)  # after the header was read: the tensors are gone
    load = stream.ResidentLoad(streamer.handle, units[:2])
    x = torch.randn(3, 8)
    for _ in range(2):  # the load's read failed, and so does the forward's own
        with pytest.raises(TensorIOError, match="short read.*model.safetensors"):
            modules[1](x)
        assert units[1].state == "loading" and modules[1].weight.device.type == "meta"
    with pytest.raises(TensorIOError, match="model.safetensors"):
        load.wait_all()
    path.write_bytes(saved)  # the file is back: the next forward binds the unit
    assert torch.equal(modules[1](x), x @ weights["layer1.weight"].T)
    assert units[1].state == "resident"
    load.wait_all()
    assert units[0].state == "resident" and load.finished_at is not None
    load.close()


def test_closing_a_load_stops_it_and_waits_for_its_reads(ring, monkeypatch):
    from offload.infer.stream import resident_load as stream

    modules, units, streamer, weights = ring
    streamer.set_units([], 0)
    at_second, go, prefault, faulted = threading.Event(), threading.Event(), stream.prefault, []

    def held_fault(buffer):
        faulted.append(buffer)
        if len(faulted) == 2:
            at_second.set()
            assert go.wait(timeout=120)  # held until the test has asked the load to stop
        return prefault(buffer)

    monkeypatch.setattr(stream, "prefault", held_fault)
    load = stream.ResidentLoad(streamer.handle, units[:4])
    assert at_second.wait(timeout=120)
    closer = threading.Thread(target=load.close)
    closer.start()
    while not {2, 3} <= load.dropped:  # close() has given up the units not yet taken on
        go.wait(0.01)
    go.set()
    closer.join()
    assert len(faulted) == 2  # the held unit finished; none was started after the close
    assert [u.state for u in units[:4]] == ["on disk"] * 4 and all(u.loading is None for u in units[:4])


def test_dropping_a_unit_the_load_has_not_reached_does_not_wait_for_it(ring, monkeypatch):
    from offload.infer.stream import resident_load as stream

    modules, units, streamer, weights = ring
    streamer.set_units([], 0)
    at_second, go, prefault, read_windows = threading.Event(), threading.Event(), stream.prefault, stream.read_windows
    faulted, started = [], []

    def held_fault(buffer):
        faulted.append(buffer)
        if len(faulted) == 2:
            at_second.set()
            assert go.wait(timeout=120)  # held until the test has dropped a later unit
        return prefault(buffer)

    monkeypatch.setattr(stream, "prefault", held_fault)
    monkeypatch.setattr(stream, "read_windows", lambda *a: started.append(a) or read_windows(*a))
    load = stream.ResidentLoad(streamer.handle, units[:4])
    assert at_second.wait(timeout=120)
    load.drop(units[3])  # the thread is held at unit 1: this returns without it
    assert units[3].state == "on disk" and units[3].loading is None and modules[3].weight.device.type == "meta"
    go.set()
    load.wait_all()
    assert [u.state for u in units[:4]] == ["resident"] * 3 + ["on disk"]
    assert len(started) == 3 and load.nbytes == sum(u.read_nbytes for u in units[:3])


def test_the_ring_works_while_its_buffers_are_still_being_made(ring, monkeypatch):
    from offload.infer.stream import streamer as stream

    modules, units, streamer, weights = ring
    streamer.close()
    go, locked_tensor = threading.Event(), stream.locked_tensor
    made = []

    def slow_second_buffer(nbytes, dtype):
        made.append(nbytes)
        if len(made) == 2:
            assert go.wait(timeout=120)
        return locked_tensor(nbytes, dtype)

    monkeypatch.setattr(stream, "locked_tensor", slow_second_buffer)
    streamer.set_units(units, max(u.buffer_nbytes for u in units))
    _check(modules, weights, list(range(LAYERS)))  # one buffer so far: every layer goes through it
    assert len(streamer.buffers) == 1
    go.set()
    streamer.wait_buffers()
    _check(modules, weights, list(range(LAYERS)) * 2)
    assert len(streamer.buffers) == 2 and streamer.idle_buffers + streamer.reads_in_flight == 2


def test_a_forward_reads_the_units_its_load_has_not_taken_on_through_the_ring(ring, monkeypatch):
    """Units 1, 3 and 4 load in the order 4, 1, 3 while 0 and 2 stream: the load is held at unit 4
    until the forward gets to unit 3, so the forward must read 1 and 3 through the ring; the load
    takes them on afterwards."""
    from offload.infer.stream import resident_load as stream

    modules, units, streamer, weights = ring
    streamer.reset()
    reached, prefault, faulted = threading.Event(), stream.prefault, []

    def held_fault(buffer):
        faulted.append(buffer)
        if len(faulted) == 1:
            assert reached.wait(timeout=120)  # unit 4's buffer, held until the forward reaches unit 3
        return prefault(buffer)

    monkeypatch.setattr(stream, "prefault", held_fault)
    load = stream.ResidentLoad(streamer.handle, [units[4], units[1], units[3]])
    streamer.set_units(units, max(u.buffer_nbytes for u in units))
    modules[3].register_forward_pre_hook(lambda *_: reached.set())
    x = torch.randn(3, 8)
    for i in range(LAYERS):
        assert torch.equal(modules[i](x), x @ weights[f"layer{i}.weight"].T), f"layer {i}"
    assert units[4].state == "resident" and streamer.bytes_read >= sum(u.read_nbytes for u in units[:4])
    streamer.reset()  # the ring may have lent unit 1 again, for the next forward: back to its load
    assert [u.state for u in units] == ["on disk", "loading", "on disk", "loading", "resident"]
    assert not any(u.claimed for u in units)
    load.wait_all()
    assert [u.state for u in units[1::2]] == ["resident", "resident"]
    assert load.nbytes == sum(units[i].read_nbytes for i in (1, 3, 4))
    _check(modules, weights, [0, 2])  # the streamed ones stream as before
    assert all(torch.equal(modules[i](x), x @ weights[f"layer{i}.weight"].T) for i in (1, 3, 4))


def test_a_held_load_takes_on_only_what_a_forward_waits_for_until_released(ring, monkeypatch):
    from offload.infer.stream import resident_load as stream

    modules, units, streamer, weights = ring
    streamer.set_units([], 0)
    read_windows, started, prefault, faulted = stream.read_windows, [], stream.prefault, []
    monkeypatch.setattr(stream, "read_windows", lambda *a: started.append(a[1]) or read_windows(*a))
    monkeypatch.setattr(stream, "prefault", lambda buffer: faulted.append(buffer) or prefault(buffer))
    load = stream.ResidentLoad(streamer.handle, units[:3], held=True)  # all three could stream
    assert load.claim(units[0])  # a unit held back may go through the ring
    load.unclaim(units[0])
    x = torch.randn(3, 8)
    assert torch.equal(modules[1](x), x @ weights["layer1.weight"].T)  # a forward waits for it: taken on now
    assert started == [units[1].windows] and len(faulted) == 1  # and nothing else, while held
    assert [u.state for u in units[:3]] == ["loading", "resident", "loading"]
    load.release()
    load.wait_all()
    assert [u.state for u in units[:3]] == ["resident"] * 3 and len(started) == 3 and len(faulted) == 3
    assert all(torch.equal(modules[i](x), x @ weights[f"layer{i}.weight"].T) for i in range(3))
    load.close()


def test_a_held_unit_waits_for_the_ring_being_made_rather_than_for_its_load(ring, monkeypatch):
    """The first forward reaches a held unit before the ring's first buffer is made: it waits for
    that buffer and reads the unit through it (both are fresh memory, and the ring's is on its way),
    instead of asking the load to take the unit on before the first forward is done."""
    from offload.infer.stream import resident_load as stream
    from offload.infer.stream import streamer as ring_module

    modules, units, streamer, weights = ring
    streamer.close()
    go, locked_tensor, prefault, faulted = threading.Event(), ring_module.locked_tensor, stream.prefault, []

    def slow_buffer(nbytes, dtype):
        assert go.wait(timeout=120)
        return locked_tensor(nbytes, dtype)

    def fault(buffer):
        faulted.append(buffer)
        go.set()  # the load took the unit on: let the ring be made anyway, so that nothing hangs
        return prefault(buffer)

    monkeypatch.setattr(ring_module, "locked_tensor", slow_buffer)
    monkeypatch.setattr(stream, "prefault", fault)
    load = stream.ResidentLoad(streamer.handle, units[:2], held=True)
    streamer.set_units(units, max(u.buffer_nbytes for u in units))
    collect = streamer._collect
    monkeypatch.setattr(streamer, "_collect", lambda *, block=False: (block and go.set()) or collect(block=block))
    _check(modules, weights, list(range(LAYERS)))
    assert faulted == [] and streamer.bytes_read >= sum(u.read_nbytes for u in units)
    streamer.reset()  # the ring may have lent units 0 and 1 again, for the next forward: back to their load
    assert [u.state for u in units[:2]] == ["loading", "loading"]
    load.release()
    load.wait_all()
    assert [u.state for u in units[:2]] == ["resident"] * 2 and len(faulted) == 2
    load.close()


def test_closing_a_held_load_gives_its_units_up(ring):
    from offload.infer.stream import resident_load as stream

    modules, units, streamer, weights = ring
    streamer.set_units([], 0)
    load = stream.ResidentLoad(streamer.handle, units[:2], held=True)
    load.close()  # returns: the thread stops waiting for a release that will not come
    assert [u.state for u in units[:2]] == ["on disk"] * 2
    assert not any(thread.name == "load-resident" for thread in threading.enumerate())
    assert load.nbytes == 0


@pytest.mark.skipif(not hasattr(os, "getpriority"), reason="no per-thread priority on this system")
def test_the_load_keeps_the_callers_cpu_priority_held_and_released(ring, monkeypatch):
    """A load at a lower priority stalls the forward on a busy machine (the GIL goes to a thread that
    is rarely scheduled): its fault threads run at the caller's priority, held and released."""
    from offload.infer.stream import resident_load as stream

    modules, units, streamer, weights = ring
    streamer.set_units([], 0)
    prefault, seen = stream.prefault, []
    monkeypatch.setattr(stream, "prefault",
                        lambda buffer: seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
                        or prefault(buffer))
    caller = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    load = stream.ResidentLoad(streamer.handle, units[:2], held=True)
    x = torch.randn(3, 8)
    assert torch.equal(modules[0](x), x @ weights["layer0.weight"].T)  # waited for while held
    load.release()
    load.wait_all()
    assert seen == [caller, caller]
    assert torch.equal(modules[1](x), x @ weights["layer1.weight"].T)
    load.close()
