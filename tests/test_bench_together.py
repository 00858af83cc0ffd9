"""Several directories swept at once (bench/device.py, bench/together.py): which device a directory is on,
two directories on one device refused unless asked, every device starting each step together, one
failure stopping them all, and the sum reported."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

import bench.sweep
from bench.cli import main
from bench.device import device_of, shared_devices
from bench.measure import Buffers, MeasurementError
from bench.sweep import GRIDS, sweep_plan
from bench.together import sweep_together
from bench.validate import validate_directory

MiB = 1 << 20
REPO = Path(__file__).resolve().parents[1]
TINY = ["--quick", "--size", "2M", "--request-size", "1M", "--repeats", "1", "--no-progress", "--no-fio",
        "--backend", "threads"]


def _fake_sysfs(root: Path, directory: Path, node: str) -> None:
    """Point ``directory``'s device number at ``root/devices/<node>`` in a fake /sys."""
    st = os.stat(directory)
    (root / "dev" / "block").mkdir(parents=True, exist_ok=True)
    (root / "devices" / node).mkdir(parents=True, exist_ok=True)
    (root / "dev" / "block" / f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}").symlink_to(root / "devices" / node)


def test_a_partition_is_its_whole_disk(tmp_path):
    sys_root = tmp_path / "sys"
    _fake_sysfs(sys_root, tmp_path, "pci0/nvme0n1/nvme0n1p2")
    (sys_root / "devices" / "pci0" / "nvme0n1" / "nvme0n1p2" / "partition").write_text("2\n")
    device = device_of(tmp_path, sys_root=sys_root)
    assert device.name == "nvme0n1" and device.disks == {"nvme0n1"}


def test_a_logical_volume_is_the_disks_below_it(tmp_path):
    sys_root = tmp_path / "sys"
    _fake_sysfs(sys_root, tmp_path, "virtual/block/dm-0")
    for disk, part in (("sda", "sda1"), ("sdb", "sdb1")):
        (sys_root / "devices" / "pci0" / disk / part).mkdir(parents=True)
        (sys_root / "devices" / "pci0" / disk / part / "partition").write_text("1\n")
    slaves = sys_root / "devices" / "virtual" / "block" / "dm-0" / "slaves"
    slaves.mkdir()
    (slaves / "sda1").symlink_to(sys_root / "devices" / "pci0" / "sda" / "sda1")
    (slaves / "sdb1").symlink_to(sys_root / "devices" / "pci0" / "sdb" / "sdb1")
    device = device_of(tmp_path, sys_root=sys_root)
    assert device.name == "dm-0 (on sda, sdb)" and device.disks == {"sda", "sdb"}


def test_without_a_block_device_the_file_system_is_the_device(tmp_path):
    device = device_of(tmp_path, sys_root=tmp_path / "empty-sys")
    st = os.stat(tmp_path)
    assert device.disks == {f"fs {os.major(st.st_dev)}:{os.minor(st.st_dev)}"}


def test_two_directories_of_one_file_system_share_its_device(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    (shared,) = shared_devices([a, b])
    assert shared[:2] == (a, b) and shared[2] == ", ".join(sorted(device_of(a).disks))
    assert shared_devices([a]) == []


def test_the_sweep_refuses_one_device_twice_unless_asked(tmp_path, capsys):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    out = tmp_path / "r"
    for dirs in ([a, b], [a, a]):  # two directories of one disk, or one directory named twice
        assert main(["sweep", *map(str, dirs), *TINY, "--out-dir", str(out), "--config-out", str(tmp_path / "x.json")]) == 2
        err = capsys.readouterr().err
        assert f"{dirs[0]} and {dirs[1]} are on the same device (" in err and "--same-device" in err
        assert err.count("\n") == 1 and not out.exists()

    assert main(["sweep", str(a), str(b), "--same-device", *TINY, "--out-dir", str(out),
                 "--config-out", str(tmp_path / "x.json")]) == 0
    printed = capsys.readouterr().out
    assert "2 disk(s), all at once" in printed
    doc = json.loads((out / "sweep.json").read_text())
    assert [len(d["points"]) for d in doc["disks"]] == [8, 8]  # the thread backend's quick grid, on each
    together = doc["together"]["chosen"]
    assert together["aio"] == doc["chosen"]["aio"] and len(together["both_bw_bytes"]) == 2
    assert together["sum_bw_bytes"] == pytest.approx(sum(together["both_bw_bytes"]), abs=2)
    figures = " + ".join(f"{f / 1e9:.2f}" for f in together["both_bw_bytes"])
    assert f"{figures} = {together['sum_bw_bytes'] / 1e9:.2f} GB/s" in printed
    assert list(a.iterdir()) == [] and list(b.iterdir()) == []


@pytest.fixture
def three(tmp_path):
    dirs = [tmp_path / name for name in ("a", "b", "c")]
    for d in dirs:
        d.mkdir()
    return [validate_directory(d) for d in dirs], [Buffers(2 * MiB) for _ in dirs]


def test_every_directory_starts_each_step_together(three):
    validations, buffers = three
    plan = sweep_plan(GRIDS["quick"].configs(backends=["threads"]))
    events, lock = [], threading.Lock()

    def on_step(disk, phase, step, result):
        with lock:
            events.append((phase, plan.index(step), disk))

    # a resumed sweep: the directories kept different numbers of steps from before
    earlier = sweep_together(validations, plan[:3], buffers, request_size=MiB, repeats=1, with_fio=False)
    done = [{s.key: r for s, r in zip(plan[:kept], [*d.references[:1], *d.points])} for kept, d in
            zip((3, 2, 0), earlier)]
    disks = sweep_together(validations, plan, buffers, request_size=MiB, repeats=1, with_fio=False, done=done,
                           on_step=on_step)
    assert [len(d.points) for d in disks] == [8, 8, 8] and [len(d.references) for d in disks] == [5, 5, 5]
    starts = [(step, disk) for phase, step, disk in events if phase == "start"]
    assert sorted(starts) == sorted([(i, d) for i in range(len(plan)) for d, kept in enumerate((3, 2, 0)) if i >= kept])
    assert [step for step, _ in starts] == sorted(step for step, _ in starts)  # no step begins before the last began
    assert disks[0].points[0] is done[0][plan[1].key]  # kept, not measured again
    assert all(list(v.directory.iterdir()) == [] for v in validations)


def test_a_failure_on_one_directory_stops_them_all(three, monkeypatch):
    validations, buffers = three
    plan = sweep_plan(GRIDS["quick"].configs(backends=["threads"]))
    measure = bench.sweep.measure_point
    started: list[str] = []

    def failing(config, path, *args, **kwargs):
        started.append(Path(path).parent.parent.name)
        if Path(path).parent.parent.name == "b" and started.count("b") == 4:
            raise MeasurementError(f"{path}: request 0 moved 0 bytes, expected {MiB}")
        return measure(config, path, *args, **kwargs)

    monkeypatch.setattr(bench.sweep, "measure_point", failing)
    with pytest.raises(MeasurementError, match="request 0 moved 0 bytes"):
        sweep_together(validations, plan, buffers, request_size=MiB, repeats=1, with_fio=False)
    assert all(started.count(name) <= 4 for name in "abc")  # none went on to a fifth step
    assert all(list(v.directory.iterdir()) == [] for v in validations)


@pytest.mark.subprocess
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_interrupting_several_directories_keeps_their_points_and_leaves_no_files(tmp_path, sig):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    out = tmp_path / "r"
    cmd = [sys.executable, "-m", "bench.cli", "sweep", str(a), str(b), "--same-device", "--quick", "--size", "64M",
           "--repeats", "2", "--no-fio", "--out-dir", str(out), "--config-out", str(tmp_path / "x.json")]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    first = proc.stderr.readline()  # a tenth of the 42 steps (21 on each directory) is done
    assert first.startswith("sweep: 5/42 points"), (first, proc.communicate())
    proc.send_signal(sig)
    _, err = proc.communicate()
    assert proc.returncode == 130, err
    assert "waiting for the step in flight on each directory" in err and "--resume" in err
    saved = json.loads((out / "sweep.json").read_text())
    assert saved["complete"] is False and all(d["points"] for d in saved["disks"])
    assert list(a.iterdir()) == [] and list(b.iterdir()) == [] and not (tmp_path / "x.json").exists()
