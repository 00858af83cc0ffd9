"""One measurement point on a real directory, checked with an independent reader."""

from __future__ import annotations

import numpy as np
import pytest

import bench.measure
from bench.measure import Buffers, MeasurementError, measure_point
from tensorio import AioConfig, AioHandle

MiB = 1 << 20


@pytest.mark.parametrize("backend", ["threads", "io_uring"])
def test_point_writes_the_buffer_and_reports_both_directions(tmp_path, backend):
    from tensorio import probe_io_uring

    if backend == "io_uring" and not probe_io_uring()[0]:
        pytest.skip(f"io_uring unavailable: {probe_io_uring()[1]}")
    buffers = Buffers(2 * MiB)
    path = tmp_path / "point.dat"
    config = AioConfig(block_size=128 * 1024, queue_depth=4, thread_count=2, backend=backend)
    point = measure_point(config, path, buffers, request_size=512 * 1024, repeats=2, direct=True)
    assert point.backend == backend and point.direct is True
    assert np.array_equal(np.fromfile(path, dtype=np.uint8), buffers.source.numpy())
    for m in (point.write, point.read):
        assert m.io_bytes == 2 * MiB and len(m.bw_bytes_samples) == 2
        assert sorted(m.bw_bytes_samples)[0] <= m.bw_bytes <= sorted(m.bw_bytes_samples)[-1]
        assert m.iops == pytest.approx(m.bw_bytes / (128 * 1024))
        assert 0 < m.clat_ns_p50 <= m.clat_ns_p99


def test_pages_of_the_source_differ(tmp_path):
    """The pattern stamps each page, so a misplaced block cannot pass the read-back check."""
    source = Buffers(64 * 1024).source.view(-1, 4096)
    assert len({bytes(row.numpy()) for row in source}) == source.shape[0]


def test_a_corrupted_read_back_is_caught(tmp_path, monkeypatch):
    class Corrupting(AioHandle):
        def read(self, tensor, path, offset=0):
            future = super().read(tensor, path, offset)
            future.result()
            tensor[100] ^= 1
            return future

    monkeypatch.setattr(bench.measure, "AioHandle", Corrupting)
    with pytest.raises(MeasurementError, match="differ from those written, first at byte 100"):
        measure_point(AioConfig(backend="threads"), tmp_path / "x.dat", Buffers(MiB), request_size=MiB,
                      repeats=1, direct=True)
