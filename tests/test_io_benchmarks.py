"""benchmarks/io_vs_fio.py and benchmarks/io_phases.py at a tiny size, so that they never rot."""

from __future__ import annotations

import json

import pytest

import tensorio
from bench.fio import fio_path
from benchmarks import io_phases, io_vs_fio

pytestmark = pytest.mark.bench


def test_io_vs_fio_reports_gb_per_s_and_cpu_per_io(disk_dir, tmp_path, capsys):
    out = tmp_path / "io.json"
    assert io_vs_fio.main(["--dir", str(disk_dir), "--size", "4M", "--block-sizes", "64K", "--queue-depth", "4",
                           "--rounds", "1", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    engines = {row["engine"] for row in rows}
    assert set(io_vs_fio.available_backends()) <= engines and ("fio" in engines) == (fio_path() is not None)
    assert all(row["gb_per_s"] > 0 and row["cpu_us_per_io"] >= 0 for row in rows)
    assert "CPU us/IO" in capsys.readouterr().out
    assert list(disk_dir.iterdir()) == []


def test_io_phases_splits_the_cpu_per_io(disk_dir, tmp_path, capsys):
    if not tensorio.probe_io_uring()[0]:
        pytest.skip(tensorio.probe_io_uring()[1])
    out = tmp_path / "phases.json"
    assert io_phases.main(["--dir", str(disk_dir), "--size", "4M", "--block-sizes", "16K", "--queue-depth", "8",
                           "--rounds", "1", "--json", str(out)]) == 0
    for rw in ("write", "read"):
        row = json.loads(out.read_text())[f"{16 << 10}/{rw}"]
        assert all(row[phase] >= 0 for phase in io_phases.PHASES)
        assert row["fill"] + row["submit"] + row["reap"] > 0  # the worker's phases were timed
        assert row["worker"] >= row["fill"] + row["submit"] + row["reap"]
    assert list(disk_dir.iterdir()) == []


def test_checksum_speed_measures_the_hash_where_tensorio_meets_the_bytes(disk_dir):
    """The fresh-piece hash speeds and tensorio's on/off transfer at a tiny size: every figure there, the
    verified read passing (a wrong hash would raise ChecksumError), nothing left in the directory."""
    from benchmarks import checksum_speed

    fresh_read, fresh_write = checksum_speed.fresh_hash_speeds(str(disk_dir), piece_bytes=1 << 16, nbytes=1 << 20,
                                                               repeats=1)
    assert fresh_read > 0 and fresh_write > 0
    moved = checksum_speed.transfer_on_off(str(disk_dir), nbytes=1 << 20, repeats=1)
    assert set(moved) == {f"{what}_{side}" for what in ("write", "read", "cpu") for side in ("on", "off")}
    assert all(value >= 0 for value in moved.values()) and moved["write_on"] > 0 and moved["read_on"] > 0
    assert list(disk_dir.iterdir()) == []
