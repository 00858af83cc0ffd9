"""A unit's tensors in a device buffer: each at a 256-byte aligned offset, whatever the file's
alignment (safetensors aligns to 8 bytes only), with the same bytes as read, in as few copies as the
offsets allow, and never in more bytes than the unit's buffer has room for."""

from __future__ import annotations

import pytest
import torch

from offload.infer.stream.device_layout import DEVICE_ALIGN, DeviceLayout, whole
from offload.storage.safetensors_reader import TensorEntry, plan_windows, tensor_views, windows_nbytes


def _entries(start: int, sizes: list[int], path: str = "f", dtype=torch.float32) -> list[TensorEntry]:
    entries, offset = [], start
    for i, nbytes in enumerate(sizes):
        itemsize = torch.empty((), dtype=dtype).element_size()
        entries.append(TensorEntry(f"{path}.t{i}", path, dtype, (nbytes // itemsize,), offset, nbytes))
        offset += nbytes
    return entries


def _host_buffer(windows) -> torch.Tensor:
    """A host buffer as `read_windows` would fill it: every byte its window's file offset (mod 251)."""
    buffer = torch.zeros(windows_nbytes(windows), dtype=torch.uint8)
    for w in windows:
        buffer[w.buffer_offset: w.buffer_offset + w.nbytes] = torch.arange(w.offset, w.offset + w.nbytes) % 251
    return buffer


def _copied(layout: DeviceLayout, host: torch.Tensor) -> torch.Tensor:
    device = torch.full((layout.nbytes,), 255, dtype=torch.uint8)
    for host_at, device_at, nbytes in layout.copies:
        device[device_at: device_at + nbytes] = host[host_at: host_at + nbytes]
    return device


@pytest.mark.parametrize("header", [8, 16, 4096 + 8, 3 * 4096 - 8])
def test_each_tensor_starts_aligned_with_the_bytes_read(header):
    """Tensors of sizes a transformer has (multiples of 256 bytes) at a file offset 8 past a 16-byte
    boundary: one copy per window, every tensor 256-aligned, the same bytes as the host's views."""
    entries = _entries(header, [64 * 64 * 4, 64 * 4, 64 * 256 * 4, 256 * 64 * 4])
    entries += _entries(1 << 20, [64 * 4, 128 * 4], path="g")
    windows = plan_windows(entries, {"f": 1 << 20, "g": 2 << 20})
    layout = DeviceLayout.of(windows)
    assert len(layout.copies) == len(windows) == 2
    assert all(at % DEVICE_ALIGN == 0 for _, at in layout.places)
    host = _host_buffer(windows)
    device, expected = layout.views(_copied(layout, host)), tensor_views(windows, host)
    assert device.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(device[name].view(torch.uint8), tensor.view(torch.uint8)), name
    assert layout.nbytes <= windows_nbytes(windows)


def test_a_tensor_off_the_alignment_starts_a_new_copy():
    """A 100-byte tensor puts the next one 100 bytes on: that one is copied on its own, aligned."""
    entries = _entries(8, [256, 100, 512, 256], dtype=torch.uint8)
    windows = plan_windows(entries, {"f": 1 << 20})
    layout = DeviceLayout.of(windows)
    assert [n for _, _, n in layout.copies] == [356, 768]
    assert [at for _, at in layout.places] == [0, 256, 512, 1024]
    host = _host_buffer(windows)
    device, expected = layout.views(_copied(layout, host)), tensor_views(windows, host)
    assert all(torch.equal(device[name], expected[name]) for name in expected)


def test_the_unit_buffer_has_room_for_either_layout():
    """Many small tensors each on their own alignment need more than their page-aligned window:
    the unit's buffer is the larger of the two, so the device ring's slots hold it."""
    from offload.infer.stream.unit import Unit

    entries = _entries(8, [100] * 64, dtype=torch.uint8)
    windows = plan_windows(entries, {"f": 1 << 20})
    layout = DeviceLayout.of(windows)
    assert layout.nbytes > windows_nbytes(windows) == 8192
    unit = Unit("u", torch.nn.Module(), (), windows, 6400, True)
    assert unit.buffer_nbytes == layout.nbytes and unit.device_layout is unit.device_layout
    unit.windows = plan_windows(entries[:1], {"f": 1 << 20})  # a converted copy replaces the windows
    assert unit.device_layout.nbytes == 100 and unit.buffer_nbytes == 4096


def test_whole_is_one_copy_of_the_first_bytes():
    assert whole(4096) == ((0, 0, 4096),) and whole(0) == ()
