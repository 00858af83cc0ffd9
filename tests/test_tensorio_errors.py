"""Every failure raises TensorIOError naming the path, the offset and the length; nothing is lost."""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import tempfile

import pytest
import torch

import tensorio
from tensorio import AioHandle, TensorIOError

BACKENDS = ["threads", "io_uring"]


@pytest.fixture(params=BACKENDS)
def handle(request):
    if request.param == "io_uring" and not tensorio.probe_io_uring()[0]:
        pytest.skip(f"io_uring unavailable: {tensorio.probe_io_uring()[1]}")
    with AioHandle(block_size=4096, queue_depth=2, backend=request.param) as h:
        yield h


def test_short_read_names_path_offset_and_length(disk_dir, handle):
    path = disk_dir / "short.bin"
    path.write_bytes(b"x" * 10000)
    future = handle.read(torch.empty(20000, dtype=torch.uint8), path, 100)
    with pytest.raises(TensorIOError) as info:
        future.result()
    err = info.value
    assert err.errno == errno.EIO and err.path == str(path)
    assert "short read: the file is 10000 bytes long" in str(err) and str(path) in str(err) and "20100" in str(err)
    assert 100 <= err.offset < 20100 and err.length > 0


def test_read_of_missing_file(disk_dir, handle):
    with pytest.raises(TensorIOError) as info:
        handle.read(torch.empty(10), disk_dir / "nope.bin")
    assert info.value.errno == errno.ENOENT and "nope.bin" in str(info.value)


def test_write_into_missing_directory(disk_dir, handle):
    with pytest.raises(TensorIOError) as info:
        handle.write(torch.empty(10), disk_dir / "no_such_dir" / "x.bin")
    assert "no_such_dir" in str(info.value) and "does not exist" in str(info.value)


@pytest.mark.parametrize("direct", ["auto", False])
@pytest.mark.parametrize("op", ["read", "write"])
def test_a_directory_is_named_as_one(disk_dir, op, direct):
    # O_DIRECT opens of a directory fail with EINVAL, which used to read "try direct=False".
    with AioHandle(backend="threads", direct=direct) as h:
        with pytest.raises(TensorIOError) as info:
            getattr(h, op)(torch.empty(10), disk_dir)
    err = info.value
    assert err.errno == errno.EISDIR and err.path == str(disk_dir)
    assert f"cannot {op} a directory: {disk_dir}" in str(err) and "pass the path of a file" in str(err)
    assert "direct=False" not in str(err)


@pytest.mark.parametrize("direct", ["auto", False])
def test_wrong_paths_name_what_is_missing(disk_dir, direct):
    (disk_dir / "file").write_bytes(b"x")
    with AioHandle(backend="threads", direct=direct) as h:
        with pytest.raises(TensorIOError) as info:
            h.read(torch.empty(10), disk_dir / "nope.bin")
        assert info.value.errno == errno.ENOENT
        assert f"the file does not exist: {disk_dir / 'nope.bin'}" in str(info.value)
        with pytest.raises(TensorIOError) as info:
            h.read(torch.empty(10), disk_dir / "no_dir" / "x.bin")
        assert f"directory does not exist: {disk_dir / 'no_dir' / 'x.bin'}" in str(info.value)
        assert f"{disk_dir / 'no_dir'} does not exist" in str(info.value) and "create" not in str(info.value)
        with pytest.raises(TensorIOError) as info:
            h.write(torch.empty(10), disk_dir / "no_dir" / "x.bin")
        assert info.value.errno == errno.ENOENT and f"create {disk_dir / 'no_dir'} first" in str(info.value)
        with pytest.raises(TensorIOError) as info:
            h.write(torch.empty(10), disk_dir / "file" / "x.bin")
        assert info.value.errno == errno.ENOTDIR
        assert f"parent is not a directory: {disk_dir / 'file' / 'x.bin'}" in str(info.value)
        assert f"{disk_dir / 'file'} is a file, not a directory" in str(info.value)


def test_permission_problem(disk_dir, handle):
    path = disk_dir / "ro.bin"
    path.write_bytes(b"\0" * 100)
    if os.geteuid() == 0:
        # root ignores permission bits; an immutable file refuses even root.
        if shutil.which("chattr") is None or subprocess.run(["chattr", "+i", str(path)]).returncode != 0:
            pytest.skip("running as root without chattr +i: cannot make a file unwritable")
    else:
        path.chmod(0o400)
    try:
        with pytest.raises(TensorIOError) as info:
            handle.write(torch.zeros(10), path)
        assert info.value.errno in (errno.EACCES, errno.EPERM)
        assert str(path) in str(info.value) and "permissions" in str(info.value)
    finally:
        if os.geteuid() == 0:
            subprocess.run(["chattr", "-i", str(path)])


@pytest.fixture
def tiny_tmpfs():
    """A 1 MiB tmpfs, so that a write fills the disk for real (needs root to mount)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tiny tmpfs needs root")
    path = tempfile.mkdtemp(prefix="tio-full-")
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", path]).returncode != 0:
        os.rmdir(path)
        pytest.skip("mount -t tmpfs is not permitted here")
    yield path
    subprocess.run(["umount", path])
    os.rmdir(path)


def test_disk_full_raises_enospc_from_result(tiny_tmpfs, handle):
    future = handle.write(torch.zeros(4 << 20, dtype=torch.uint8), os.path.join(tiny_tmpfs, "big.bin"), 0)
    with pytest.raises(TensorIOError) as info:
        future.result()
    assert info.value.errno == errno.ENOSPC
    assert "disk is full" in str(info.value) and "big.bin" in str(info.value)


def test_device_error_surfaces_from_wait(disk_dir, monkeypatch):
    # Inject EIO at the system-call boundary of the thread backend (no real failing device here).
    real = os.pwritev

    def failing(fd, buffers, offset):
        if offset >= 8192:
            raise OSError(errno.EIO, "Input/output error")
        return real(fd, buffers, offset)

    monkeypatch.setattr(os, "pwritev", failing)
    with AioHandle(block_size=4096, backend="threads") as h:
        assert h.async_pwrite(torch.zeros(5 * 4096, dtype=torch.uint8), str(disk_dir / "eio.bin")) == 0
        with pytest.raises(TensorIOError) as info:
            h.wait()
    assert info.value.errno == errno.EIO and "device reported an I/O error" in str(info.value)
    assert info.value.offset >= 8192


@pytest.mark.parametrize(
    "args, exc, words",
    [
        ((torch.zeros(4, 4).t(), "x"), ValueError, ["not contiguous", "contiguous()"]),
        (([1, 2, 3], "x"), TypeError, ["torch.Tensor", "list"]),
        ((torch.zeros(4), "x", -1), ValueError, ["offset", "-1"]),
        ((torch.zeros(4), 3.5), TypeError, ["filename", "float"]),
    ],
)
def test_bad_arguments_raise_before_any_io(disk_dir, args, exc, words):
    with AioHandle(backend="threads") as h:
        with pytest.raises(exc) as info:
            h.write(*args)
    for word in words:
        assert word in str(info.value)


def test_bad_fd(handle):
    with pytest.raises(TensorIOError, match="fd 987654"):
        handle.read(torch.zeros(4), 987654)


def test_pickled_error_keeps_its_fields():
    import pickle

    err = TensorIOError(errno.ENOSPC, "write failed", path="/x", offset=4096, length=10)
    copy = pickle.loads(pickle.dumps(err))
    assert (copy.errno, copy.path, copy.offset, copy.length, str(copy)) == (err.errno, "/x", 4096, 10, str(err))


def test_io_uring_refused_clearly_when_forced_and_missing(monkeypatch):
    import tensorio._handle as handle_module

    monkeypatch.setattr(handle_module, "probe_io_uring", lambda: (False, "Linux 5.4 is older than 6.14"))
    with pytest.raises(RuntimeError, match="io_uring cannot run here: Linux 5.4"):
        AioHandle(backend="io_uring")
    with AioHandle(backend="auto") as h:
        assert h.backend_name == "threads"


def test_short_direct_transfer_is_finished_through_the_page_cache(disk_dir, monkeypatch):
    # The kernel may move fewer bytes than asked; an unaligned remainder cannot go back to O_DIRECT.
    real = os.pwritev
    calls = []

    def short_first(fd, buffers, offset):
        calls.append(offset)
        if len(calls) == 1:  # move one page, report 1000 bytes: an unaligned remainder is left
            real(fd, [memoryview(buffers[0])[:4096]], offset)
            return 1000
        return real(fd, buffers, offset)

    tensor = tensorio.locked_tensor(3 * 4096, torch.uint8)
    tensor.copy_(torch.arange(3 * 4096).remainder(251).to(torch.uint8))
    with AioHandle(block_size=3 * 4096, backend="threads") as h:
        h.write(tensor[:1], disk_dir / "probe.bin").result()  # the directory's O_DIRECT probe, done
        monkeypatch.setattr(os, "pwritev", short_first)
        assert h.write(tensor, disk_dir / "short.bin").result() == 3 * 4096
    assert calls[:2] == [0, 1000]
    assert (disk_dir / "short.bin").read_bytes() == tensor.numpy().tobytes()


def test_a_failed_io_worker_is_named_not_blamed_on_the_device(disk_dir, monkeypatch):
    """When the io_uring worker itself fails (a bug, not the disk), its requests fail with a TensorIOError
    naming the worker's exception, not "the device reported an I/O error"."""
    import tensorio
    from tensorio import _uring

    if not tensorio.probe_io_uring()[0]:
        pytest.skip(tensorio.probe_io_uring()[1])

    def broken(self, *args, **kwargs):
        raise RuntimeError("worker bug")
    monkeypatch.setattr(_uring._Worker, "_fill", broken)
    with AioHandle(block_size=4096, backend="io_uring") as h:
        with pytest.raises(TensorIOError) as info:
            h.write(torch.zeros(4 * 4096, dtype=torch.uint8), disk_dir / "w.bin").result(timeout=60)
    assert "the I/O worker failed (RuntimeError('worker bug'))" in str(info.value)
    assert "device reported" not in str(info.value) and info.value.errno == errno.EIO


@pytest.mark.parametrize("direct", ["auto", True])
def test_a_directory_removed_after_its_probe_is_named_and_probed_once(disk_dir, direct, monkeypatch):
    """O_DIRECT is probed once per directory (a probe writes a file); a directory removed after that is
    still named by the next request, as a missing one is before."""
    import tensorio._fs as fs

    probes = []
    real_probe = fs.probe_direct
    monkeypatch.setattr(fs, "probe_direct", lambda d: probes.append(d) or real_probe(d))
    monkeypatch.setattr(fs, "_direct_cache", {})
    directory = disk_dir / "gone"
    directory.mkdir()
    with AioHandle(backend="threads", direct=direct) as h:
        for offset in (0, 4096, 8192):
            h.write(torch.ones(1024), directory / "x.bin", offset).result()
        assert probes == [str(directory)]
        shutil.rmtree(directory)
        with pytest.raises(TensorIOError) as info:
            h.write(torch.ones(1024), directory / "x.bin")
    assert info.value.errno == errno.ENOENT and f"create {directory} first" in str(info.value)
