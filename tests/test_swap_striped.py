"""One rank's swap files striped over several drives (``nvme_path`` a list longer than the node's ranks):
the stripe layout, even and weighted (pure, against an independent formula), bytes on each drive read back
with plain ``open().read()``, checksums per piece, preallocation per drive, a missing or read-only drive
named, the space check counting each drive's share, the drives' weights (stated and checked in the config,
or measured: the rounding of fake speeds, no timing), and the engine training the same losses on two drives
as on one."""

from __future__ import annotations

import errno
import logging
import math
import os
import re
import shutil
import subprocess
import tempfile

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from offload.config import EngineConfig
from offload.storage import StripedSwapFile, SwapFile, open_swap_file
from offload.storage import drive_speed
from offload.storage.drive_speed import measured_weights, probe_speeds, stripe_weights
from offload.storage.striped import STRIPE_BYTES, StripeLayout
from offload.train.engine import initialize
from offload.train.space import SwapSpace, check_swap_space
from tensorio import AioConfig, ChecksumError, aligned_tensor
from test_engine import engine_config, train

STRIPE = 8192  # two pages: small files still cross many units


def _where(byte: int, stripe: int, weights) -> tuple[int, int]:
    """(drive, byte of its file) of ``byte`` of the striped space, straight from the layout's definition:
    cycles of sum(weights) units, drive i holding weights[i] units of each after those of the drives before
    it, cycle by cycle in its file. All ones: RAID 0 (unit u on drive u % drives)."""
    cycle, unit = divmod(byte // stripe, sum(weights))
    for drive, weight in enumerate(weights):
        if unit < weight:
            return drive, (cycle * weight + unit) * stripe + byte % stripe
        unit -= weight
    raise AssertionError("unreachable")


def _reduced(weights) -> tuple[int, ...]:
    return tuple(w // math.gcd(*weights) for w in weights)


@settings(max_examples=300, deadline=None)
@given(offset=st.integers(0, 5 * 4096), nbytes=st.integers(0, 9 * 4096 + 7), stripe=st.sampled_from([4096, 8192, 12288]),
       weights=st.lists(st.integers(1, 5), min_size=1, max_size=4), chunk=st.one_of(st.none(), st.integers(1, 20000)))
def test_pieces_cover_the_request_in_order_and_map_each_byte_as_the_layout_says(offset, nbytes, stripe, weights, chunk):
    layout = StripeLayout(stripe, tuple(weights))
    pieces = layout.pieces(offset, nbytes, chunk)
    reduced = _reduced(weights)  # weights are ratios: (2, 2) is (1, 1)
    assert sum(p.length for p in pieces) == nbytes and all(p.length > 0 for p in pieces)
    start = 0
    for index, piece in enumerate(pieces):
        assert piece.start == start
        first, last = offset + start, offset + start + piece.length - 1
        for byte in (first, last, *range(-(-first // stripe) * stripe, last, stripe)):  # every unit it touches
            assert _where(byte, stripe, reduced) == (piece.drive, piece.file_offset + byte - first)  # one drive, in a row
        if chunk:  # its drive's file checksums the request's chunks: it starts at one's start, or stays in one
            assert start % chunk == 0 or start // chunk == (start + piece.length - 1) // chunk
        if index:  # cut only where the drive's run ends or where a piece begun inside a chunk reaches its end:
            before = pieces[index - 1]  # requests as large as the layout allows
            assert before.drive != piece.drive or (offset + start) % (stripe * sum(reduced)) == 0 or \
                (chunk and start % chunk == 0 and before.start % chunk != 0)
        start += piece.length
    end = offset + nbytes  # each drive's file ends after the last byte of [0, end) it holds: each unit's last
    ends = [0] * len(weights)
    for unit in range(-(-end // stripe)):
        drive, at = _where(min(end, (unit + 1) * stripe) - 1, stripe, reduced)
        ends[drive] = max(ends[drive], at + 1)
    assert [layout.drive_bytes(end, d) for d in range(len(weights))] == ends


@settings(max_examples=100, deadline=None)
@given(offset=st.integers(0, 9 * 4096), nbytes=st.integers(0, 9 * 4096 + 7), drives=st.integers(1, 4),
       times=st.integers(1, 4), chunk=st.one_of(st.none(), st.integers(1, 20000)))
def test_equal_weights_are_the_even_layout_of_before(offset, nbytes, drives, times, chunk):
    """Equal weights, whatever their value, lay the bytes out as RAID 0 with one unit per drive did."""
    even = StripeLayout.even(4096, drives)
    weighted = StripeLayout(4096, (times,) * drives)
    assert weighted.pieces(offset, nbytes, chunk) == even.pieces(offset, nbytes, chunk)
    for piece in even.pieces(offset, nbytes, chunk):
        unit = (offset + piece.start) // 4096  # the formula of docs/engine.md, "Striped over several drives"
        assert (piece.drive, piece.file_offset) == (unit % drives, (unit // drives) * 4096 + (offset + piece.start) % 4096)
    assert StripeLayout(4096, (times,) * drives) == StripeLayout.even(4096, drives)


def test_a_weighted_drive_gets_its_share_as_one_piece_per_cycle():
    """(3, 1) over 1 MiB units: a 16 MiB request is 3 MiB on the first drive, 1 MiB on the second, four times."""
    layout = StripeLayout(1 << 20, (3, 1))
    pieces = layout.pieces(0, 16 << 20)
    assert [(p.drive, p.length >> 20) for p in pieces] == [(0, 3), (1, 1)] * 4
    assert layout.pieces(0, 16 << 20, chunk=1 << 20) == pieces  # checksummed in 1 MiB chunks: still a piece per run
    assert [p.file_offset >> 20 for p in pieces] == [0, 0, 3, 1, 6, 2, 9, 3]
    assert [layout.drive_bytes(16 << 20, d) >> 20 for d in (0, 1)] == [12, 4]


def test_bad_arguments_are_named(tmp_path):
    with pytest.raises(ValueError, match=r"StripeLayout.pieces: offset -1 and size 10 must be at least 0"):
        StripeLayout.even(4096, 2).pieces(-1, 10)
    with pytest.raises(ValueError, match=r"StripeLayout.pieces: chunk 0 must be at least 1"):
        StripeLayout.even(4096, 2).pieces(0, 10, chunk=0)
    with pytest.raises(ValueError, match=r"stripe_bytes: 0 must be at least 1"):
        StripeLayout(0, (1, 1))
    for weights in ([], [0, 1], [1.5, 1], [True, 1]):
        with pytest.raises(ValueError, match=r"stripe weights: .* is not allowed; give one integer of at least 1"):
            StripeLayout(4096, tuple(weights))
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    with pytest.raises(ValueError, match=r"nvme_path: 3 stripe weights \[1, 2, 3\] for 2 directories; give one per"):
        StripedSwapFile([tmp_path / "a", tmp_path / "b"], AioConfig(), kind="params", weights=[1, 2, 3])
    with pytest.raises(ValueError, match=r"stripe weights: \(0, 1\) is not allowed"):
        StripedSwapFile([tmp_path / "a", tmp_path / "b"], AioConfig(), kind="params", weights=[0, 1])
    assert os.listdir(tmp_path / "a") == os.listdir(tmp_path / "b") == []  # refused before any file was made
    with pytest.raises(ValueError, match=r"nvme_path: striping needs two or more distinct directories"):
        StripedSwapFile([tmp_path, tmp_path], AioConfig(), kind="params")
    with pytest.raises(ValueError, match=r"stripe_bytes: 1000 is not a positive multiple of 4096"):
        StripedSwapFile([tmp_path / "a", tmp_path / "b"], AioConfig(), kind="params", stripe_bytes=1000)


@pytest.fixture
def drives(tmp_path):
    """Two directories: on the disk and, where it exists, on a tmpfs (two file systems, as two drives)."""
    second = tempfile.mkdtemp(dir="/dev/shm") if os.path.isdir("/dev/shm") else str(tmp_path / "drive1")
    os.makedirs(second, exist_ok=True)
    (tmp_path / "drive0").mkdir()
    yield [str(tmp_path / "drive0"), second]
    shutil.rmtree(second, ignore_errors=True)


def _drive_contents(file: StripedSwapFile, offset: int, nbytes: int) -> bytes:
    """The bytes ``[offset, offset + nbytes)`` of the striped space, read from the drives' files with plain
    reads, byte by byte from the layout's definition (not through the pieces the file itself uses)."""
    data = [open(path, "rb").read() for path in file.paths]
    out = bytearray()
    for byte in range(offset, offset + nbytes):
        drive, at = _where(byte, file.stripe_bytes, file.weights)
        out.append(data[drive][at])
    return bytes(out)


@pytest.mark.parametrize("weights", [(1, 1), (3, 1), (2, 5)])
@pytest.mark.parametrize("verify", [True, False])
@pytest.mark.parametrize("nbytes", [1, 4095, 4096 * 10 + 1, 3 * STRIPE + 5, 9 * STRIPE + 4097])
def test_bytes_land_on_every_drive_and_read_back(drives, nbytes, verify, weights):
    file = StripedSwapFile(drives, AioConfig(verify=verify), kind="params", stripe_bytes=STRIPE, weights=weights)
    try:
        assert file.weights == weights
        first, second = file.allocate(nbytes), file.allocate(nbytes, slots=2)
        assert (first, second) == (0, -(-nbytes // 4096) * 4096)
        file.preallocate()
        sizes = [os.stat(path).st_size for path in file.paths]
        assert sizes == [StripeLayout(STRIPE, tuple(weights)).drive_bytes(file.allocated_bytes, d) for d in range(2)]
        values = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(nbytes))
        source = aligned_tensor(nbytes, torch.uint8)
        source.copy_(values)
        assert file.write(source, second).result() == nbytes
        assert _drive_contents(file, second, nbytes) == values.numpy().tobytes()
        back = aligned_tensor(nbytes, torch.uint8)
        assert file.read(back, second).result() == nbytes and torch.equal(back, values)
        assert file.bytes_written == file.bytes_read == nbytes
        assert file.bytes_verified == (nbytes if verify else 0)
        touched = {_where(byte, STRIPE, weights)[0] for byte in range(second, second + nbytes, 512)}
        assert {d for d, f in enumerate(file.files) if f.bytes_written > 0 and f.bytes_read > 0} == touched
    finally:
        file.close()
    assert not any(os.path.exists(path) for path in file.paths) and file.closed


@pytest.mark.parametrize("weights", [(1, 1), (1, 3)])
@pytest.mark.parametrize("chunk", [3 * 4096 + 512, 2 * STRIPE], ids=["unaligned", "two-units"])
def test_chunks_read_alone_verify_and_a_flipped_byte_names_the_drives_file(drives, weights, chunk):
    """As the optimizer does: a slot written whole in chunks (its state regions), one chunk read alone. The
    chunks are regions not aligned to the stripe, or two units each (a drive's run holds several)."""
    file = StripedSwapFile(drives, AioConfig(), kind="adam", stripe_bytes=STRIPE, weights=weights)
    try:
        offset = file.allocate(4 * chunk)
        values = torch.arange(chunk // 4, dtype=torch.float32)  # four regions of chunk bytes each
        state = torch.cat([values + 10000 * r for r in range(4)])
        file.write(state, offset, chunk=chunk).result()
        region = torch.empty(chunk // 4, dtype=torch.float32)
        file.read(region, offset + 2 * chunk, chunk=chunk, what="region 2").result()
        assert torch.equal(region, values + 20000)
        whole = torch.empty_like(state)
        file.read(whole, offset, chunk=chunk).result()
        assert torch.equal(whole, state)
        drive, at = _where(offset + 2 * chunk + 10, STRIPE, weights)  # flip a byte of region 2, on whichever drive holds it
        with open(file.paths[drive], "r+b") as raw:
            raw.seek(at)
            byte = raw.read(1)[0]
            raw.seek(at)
            raw.write(bytes([byte ^ 0x10]))
        with pytest.raises(ChecksumError, match=rf"\(region 2\): {re.escape(file.paths[drive])} at offset"):
            file.read(region, offset + 2 * chunk, chunk=chunk, what="region 2").result()
    finally:
        file.close()


@pytest.mark.parametrize("weights", [(1, 1), (1, 3), (3, 2)])
@pytest.mark.parametrize("chunk", [3 * 4096 + 512, 2 * STRIPE, 5 * STRIPE], ids=["unaligned", "two-units", "five-units"])
def test_chunks_written_one_by_one_verify_when_read_whole_and_the_other_way(drives, weights, chunk):
    """As the optimizer's swapper does (a slot's regions written one request each, or its fixed buffer as one,
    read back either way): the pieces of one write and of the other read differ, the chunks they verify don't."""
    file = StripedSwapFile(drives, AioConfig(), kind="adam", stripe_bytes=STRIPE, weights=weights)
    try:
        regions = [torch.arange(chunk // 4, dtype=torch.float32) + 10000 * r for r in range(5)]
        whole = torch.cat(regions)
        first, second = file.allocate(whole.nbytes), file.allocate(whole.nbytes)
        for r, region in enumerate(regions):  # one write per region; read back whole
            file.write(region, first + r * chunk, chunk=chunk).result()
        back = torch.empty_like(whole)
        file.read(back, first, chunk=chunk).result()
        assert torch.equal(back, whole)
        file.write(whole, second, chunk=chunk).result()  # written whole; read back a region at a time
        for r, region in enumerate(regions):
            part = torch.empty_like(region)
            file.read(part, second + r * chunk, chunk=chunk).result()
            assert torch.equal(part, region)
    finally:
        file.close()


def test_a_missing_drive_is_named_and_nothing_is_left_on_the_others(drives):
    missing = os.path.join(drives[1], "gone")
    with pytest.raises(FileNotFoundError, match=rf"nvme_path '{missing}' does not exist"):
        StripedSwapFile([drives[0], missing], AioConfig(), kind="params")
    assert os.listdir(drives[0]) == []
    assert isinstance(open_swap_file(drives[0], AioConfig(), kind="params"), SwapFile)


@pytest.fixture
def read_only_dir():
    """A directory this process cannot create files in: a read-only tmpfs mount as root, else mode 0500."""
    root = tempfile.mkdtemp()
    if os.geteuid() == 0:
        if subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", root]).returncode != 0:
            os.rmdir(root)
            pytest.skip("cannot mount a read-only tmpfs here")
        yield root
        subprocess.run(["umount", root], check=True)
    else:
        os.chmod(root, 0o500)
        yield root
        os.chmod(root, 0o700)
    os.rmdir(root)


MODEL_IN, MODEL_HIDDEN = 256, 1024


def _model() -> nn.Module:
    torch.manual_seed(0)  # 0.53 M parameters: 4 MB of partitions in two slots, 8 MB of optimizer state
    return nn.Sequential(nn.Linear(MODEL_IN, MODEL_HIDDEN), nn.GELU(), nn.Linear(MODEL_HIDDEN, MODEL_IN))


def _batches(n: int = 3) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(4, MODEL_IN, generator=g), torch.randn(4, MODEL_IN, generator=g)) for _ in range(n)]


def _loss(model, batch):
    x, y = batch
    return nn.functional.mse_loss(model(x), y)


def _config(nvme_path, stripe_weights=None) -> dict:
    config = engine_config("unused", "nvme", "nvme")
    for key in ("offload_param", "offload_optimizer"):
        config["zero_optimization"][key]["nvme_path"] = nvme_path
        if stripe_weights is not None:
            config["zero_optimization"][key]["stripe_weights"] = stripe_weights
    config["zero_optimization"]["offload_param"].update(buffer_size=1 << 18)
    return config


def _fake_probe(path, aio, **_):
    """A seam for the probe: the tmpfs three times the disk (bytes/s), nothing timed."""
    return 3e9 if os.path.realpath(path).startswith("/dev/shm") else 1e9


@pytest.fixture
def fake_speeds(monkeypatch, drives):
    """The swap files' own measurement (the default path) answered by `_fake_probe`, from an empty cache;
    yields the weights it gives ``drives``: (1, 3) on disk + tmpfs, (1, 1) on one file system."""
    monkeypatch.setattr(drive_speed, "probe_speeds", lambda paths, aio, **_: [_fake_probe(p, aio) for p in paths])
    monkeypatch.setattr(drive_speed, "_speeds", {})
    weights = measured_weights(drives, AioConfig(), probe=_fake_probe)
    assert weights == ((1, 3) if os.stat(drives[0]).st_dev != os.stat(drives[1]).st_dev else (1, 1))
    yield weights


def _swap_sizes(directory: str) -> dict[str, int]:
    """Bytes of each kind of swap file in ``directory``."""
    return {name.split("-")[1]: os.stat(os.path.join(directory, name)).st_size for name in os.listdir(directory)}


def test_one_rank_stripes_its_swap_files_over_two_drives_and_trains_as_on_one(tmp_path, drives, monkeypatch,
                                                                               read_only_dir, fake_speeds):
    """With the default config: stripes in proportion to the drives' measured speeds."""
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)  # alone on the node: both drives are this rank's
    one = tmp_path / "one"
    one.mkdir()
    engine, *_ = initialize(model=_model(), config=_config(str(one)))
    try:
        expected = train(engine, _batches(), _loss)
        alone = _swap_sizes(str(one))
    finally:
        engine.close()
    engine, *_ = initialize(model=_model(), config=_config(drives))
    try:
        losses = train(engine, _batches(), _loss)
        on_drives = [_swap_sizes(d) for d in drives]
    finally:
        engine.close()
    assert losses == expected
    assert set(alone) == {"params", "adam"}
    for kind, size in alone.items():  # each file's bytes split over the drives as the stripes fall, none lost
        assert [sizes[kind] for sizes in on_drives] == [StripeLayout(STRIPE_BYTES, fake_speeds).drive_bytes(size, d)
                                                        for d in range(2)]
        assert min(sizes[kind] for sizes in on_drives) > 0
    assert all(os.listdir(d) == [] for d in drives)  # removed at close
    # A second drive missing, or read-only, is named at initialize, before anything is written.
    missing = os.path.join(drives[1], "gone")
    with pytest.raises(FileNotFoundError, match=rf"offload_param\.nvme_path: '{missing}' does not exist"):
        initialize(model=_model(), config=_config([drives[0], missing]))
    with pytest.raises(PermissionError, match=rf"offload_param\.nvme_path: '{read_only_dir}': permission denied"):
        initialize(model=_model(), config=_config([drives[0], read_only_dir]))
    assert os.listdir(drives[0]) == []


def test_the_ranks_share_of_the_drives_follows_local_world_size(tmp_path, monkeypatch):
    paths = [str(tmp_path / f"nvme{i}") for i in range(5)]
    section = {"device": "nvme", "nvme_path": paths}
    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3, "offload_param": section}}
    for ranks, rank, share in (("2", "0", paths[0::2]), ("2", "1", paths[1::2]), ("1", "0", paths),
                               ("5", "3", [paths[3]]), ("8", "6", [paths[1]]), ("", "0", paths)):
        monkeypatch.setenv("LOCAL_WORLD_SIZE", ranks)
        monkeypatch.setenv("LOCAL_RANK", rank)
        offload = EngineConfig.from_dict(config, world_size=8).zero_optimization.offload_param
        assert (offload.nvme_path, offload.rank_paths or (offload.nvme_path,)) == (share[0], tuple(share))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "0")
    with pytest.raises(ValueError, match=r"LOCAL_WORLD_SIZE: '0' is not a positive integer"):
        EngineConfig.from_dict(config, world_size=8)


def test_the_space_check_counts_each_drives_share(tmp_path, drives, monkeypatch, fake_speeds):
    """Half of the swap on each of two file systems: a size that neither holds whole but each holds half of
    passes on the two, and is refused on the smaller alone, naming it."""
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    if os.stat(drives[0]).st_dev == os.stat(drives[1]).st_dev:
        pytest.skip("needs two file systems")
    free = [shutil.disk_usage(d).free for d in drives]
    small = drives[free.index(min(free))]
    needed = SwapSpace(params=min(free) * 3 // 2, optimizer=0, grads=0)
    check_swap_space(EngineConfig.from_dict(_config(drives, [1, 1]), world_size=1), needed, ranks=1)
    with pytest.raises(OSError, match=rf"not enough swap space: zero_optimization\.offload_param\.nvme_path "
                                      rf"'{small}'") as info:
        check_swap_space(EngineConfig.from_dict(_config(small), world_size=1), needed, ranks=1)
    assert info.value.errno == errno.ENOSPC
    same = [str(tmp_path / "a"), str(tmp_path / "b")]  # two directories of one file system: no more room
    for path in same:
        os.mkdir(path)
    big = SwapSpace(params=shutil.disk_usage(tmp_path).free * 3 // 2, optimizer=0, grads=0)
    with pytest.raises(OSError, match=r"not enough swap space: .*/a' \(.* and .*/b' \("):
        check_swap_space(EngineConfig.from_dict(_config(same), world_size=1), big, ranks=1)


def test_a_failed_drive_fails_the_request_naming_its_file_and_its_bytes_are_not_trusted(drives):
    from tensorio import TensorIOError
    from tensorio.testing import Fail, inject_faults

    file = StripedSwapFile(drives, AioConfig(), kind="params", stripe_bytes=STRIPE, weights=(1, 1))
    try:
        offset = file.allocate(4 * STRIPE)
        data = aligned_tensor(4 * STRIPE, torch.uint8).fill_(7)
        with inject_faults(Fail(errno.ENOSPC, path=lambda path: path == file.paths[1])):
            future = file.write(data, offset)
            with pytest.raises(TensorIOError, match=re.escape(file.paths[1])) as info:
                future.result()
        assert info.value.errno == errno.ENOSPC and future.done()
        with pytest.raises(TensorIOError, match=r"the last write of these bytes failed"):
            file.read(aligned_tensor(4 * STRIPE, torch.uint8), offset)
    finally:
        file.close()


@pytest.mark.bench
def test_striped_swap_benchmark_tiny(drives, capsys):
    """benchmarks/striped_swap.py runs end to end at a tiny size (no timing asserted) and leaves nothing."""
    from benchmarks import striped_swap

    result = striped_swap.main([*drives, "--size", "2M", "--request-size", "256K", "--rounds", "1", "--no-fio"])
    out = capsys.readouterr().out
    assert "write: striped" in out and "read: striped" in out and "stripe weights: " in out and "(measured;" in out
    assert result["striped write"] > 0 and result["striped read"] > 0 and {"alone 0 read", "alone 1 read"} <= set(result)
    assert result["weight 0"] >= 1 and result["weight 1"] >= 1
    result = striped_swap.main([*drives, "--size", "2M", "--request-size", "256K", "--rounds", "1", "--no-fio",
                                "--weights", "1,3", "--compare-even"])
    out = capsys.readouterr().out
    assert "stripe weights: 1:3 (given;" in out and "(even stripes " in out and result["striped even read"] > 0
    assert (result["weight 0"], result["weight 1"]) == (1, 3)
    assert all(os.listdir(d) == [] for d in drives)
    with pytest.raises(SystemExit):
        striped_swap.main([*drives, "--weights", "1,0"])
    assert "--weights '1,0': give" in capsys.readouterr().err


@pytest.mark.bench
@pytest.mark.fio
def test_striped_swap_benchmark_floor_of_fio_with_hashing_tiny(drives, capsys):
    """With checksums on, fio at once runs again beside as many bytes hashed (the floor), per round and as
    medians; with ``--no-verify`` that side is left out. No timing asserted; nothing left behind."""
    from benchmarks import striped_swap

    result = striped_swap.main([*drives, "--size", "2M", "--request-size", "256K", "--rounds", "1"])
    out = capsys.readouterr().out
    for rw in ("write", "read"):
        assert all(result[f"{name} {rw}"] > 0 for name in ("fio at once+hash", "hashed beside fio",
                                                           "striped / floor", "ratio to floor", "ratio to fio"))
        assert f"{rw}: striped " in out and "x the floor, fio at once while as many bytes are hashed" in out
    result = striped_swap.main([*drives, "--size", "2M", "--request-size", "256K", "--rounds", "1", "--no-verify"])
    assert "the floor" not in capsys.readouterr().out and not any("floor" in name for name in result)
    assert result["fio at once write"] > 0
    assert all(os.listdir(d) == [] for d in drives)


def test_a_non_contiguous_buffer_is_refused_before_any_io(drives):
    file = StripedSwapFile(drives, AioConfig(), kind="params", stripe_bytes=STRIPE, weights=(1, 1))
    try:
        with pytest.raises(ValueError, match=r"the buffer must be a contiguous CPU tensor, got a non-contiguous one"):
            file.write(torch.zeros(64, 64).t(), file.allocate(64 * 64 * 4))
        assert file.bytes_written == 0
    finally:
        file.close()


def test_a_model_built_under_zero_init_stripes_its_partitions_and_trains_as_on_one_drive(tmp_path, drives, monkeypatch):
    """The other way in: `offload.zero.Init` places the partitions as the model is built, on both drives."""
    from offload import zero

    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    one = tmp_path / "one"
    one.mkdir()
    losses, sizes = [], []
    for nvme_path in (str(one), drives):
        config = _config(nvme_path, [2, 1] if nvme_path is drives else None)  # stated: nothing measured
        with zero.Init(config_dict_or_path=config):
            model = _model()
        engine, *_ = initialize(model=model, config=config)
        try:
            losses.append(train(engine, _batches(2), _loss))
            sizes.append([_swap_sizes(d).get("params", 0) for d in ([str(one)] if nvme_path == str(one) else drives)])
        finally:
            engine.close()
    assert losses[0] == losses[1]
    assert sizes[1] == [StripeLayout(STRIPE_BYTES, (2, 1)).drive_bytes(sizes[0][0], d) for d in range(2)]
    assert min(sizes[1]) > 0


def test_stated_stripe_weights_are_checked_naming_the_key_and_shared_as_the_drives_are(tmp_path, monkeypatch):
    paths = [str(tmp_path / f"nvme{i}") for i in range(4)]
    key = "zero_optimization.offload_param.stripe_weights"

    def offload(nvme_path, weights):
        section = {"device": "nvme", "nvme_path": nvme_path, "stripe_weights": weights}
        config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3, "offload_param": section}}
        return EngineConfig.from_dict(config, world_size=1).zero_optimization.offload_param

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert offload(paths, [4, 3, 2, 1]).rank_weights == (3, 1)  # entries 1 and 3, as rank_paths takes them
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")  # one drive each: nothing to stripe
    assert offload(paths, [4, 3, 2, 1]).rank_weights == ()
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    monkeypatch.delenv("LOCAL_RANK")
    assert offload(paths, None).rank_weights == ()  # not set: measured when the files are made
    assert offload(paths, [2.0, 1, 1, 1]).rank_weights == (2, 1, 1, 1)
    for weights, message in (([3, 1], r": expected a list of 4 integers from 1 to 16, one per nvme_path directory"),
                             ("fast", r": expected a list of 4 integers"),
                             ([1, 0, 1, 1], r"\[1\]: 0 is not allowed; use an integer >= 1"),
                             ([1, 1, 17, 1], r"\[2\]: 17 is not allowed; use an integer from 1 to 16"),
                             ([1, 1, 1.5, 1], r"\[2\]: expected an integer, got 1.5")):
        with pytest.raises(ValueError, match=re.escape(key) + message):
            offload(paths, weights)
    with pytest.raises(ValueError, match=rf"{re.escape(key)}: \[2, 1\] needs nvme_path to be a list of directories"):
        offload(paths[0], [2, 1])
    optimizer = {"device": "nvme", "nvme_path": paths[:2], "stripe_weights": [1]}
    with pytest.raises(ValueError, match=r"zero_optimization\.offload_optimizer\.stripe_weights: expected a list of 2"):
        EngineConfig.from_dict({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {
            "stage": 3, "offload_optimizer": optimizer}}, world_size=1)


@settings(max_examples=200, deadline=None)
@given(speeds=st.lists(st.floats(0.05, 20.0), min_size=1, max_size=6), data=st.data())
def test_weights_of_speeds_are_small_ordered_and_symmetric(speeds, data):
    """Fake throughputs, nothing timed: a cycle of at most 16 units, a faster drive never gets fewer units,
    the same speeds (in any order) the same weights, and weights reduced."""
    weights = stripe_weights(speeds)
    assert len(weights) == len(speeds) and sum(weights) <= 16 and math.gcd(*weights) == 1
    for i, j in ((i, j) for i in range(len(speeds)) for j in range(len(speeds))):
        if speeds[i] >= speeds[j]:
            assert weights[i] >= weights[j]
    order = data.draw(st.permutations(range(len(speeds))))
    assert stripe_weights([speeds[i] for i in order]) == tuple(weights[i] for i in order)


def test_weights_follow_speed_ratios_and_noise_between_equal_drives_is_ignored():
    assert stripe_weights([1e9, 1e9]) == (1, 1)
    assert stripe_weights([1.0e9, 1.25e9]) == stripe_weights([1.25e9, 1.0e9]) == (1, 1)  # a noisy probe of twins
    assert stripe_weights([0.7e9, 2.1e9]) == (1, 3) and stripe_weights([2.1e9, 0.7e9]) == (3, 1)
    assert stripe_weights([1.0, 1.5]) == (2, 3)
    assert stripe_weights([1.0, 1.1, 3.0]) == (1, 1, 3)  # the two near-equal drives stay equal
    assert stripe_weights([1.0, 100.0]) == (1, 15)  # the cycle is capped at 16 units
    assert stripe_weights([5.0] * 20) == (1,) * 20  # more drives than the cap: all equal
    for bad in ([], [1.0, 0.0], [1.0, float("nan")]):
        with pytest.raises(ValueError, match=r"stripe_weights: speeds .* must be one or more positive numbers"):
            stripe_weights(bad)


def test_measured_weights_probe_each_file_system_once_and_fall_back_to_even(tmp_path, drives, caplog):
    calls = []

    def probe(path, aio):
        calls.append(path)
        return _fake_probe(path, aio)

    two_fs = os.stat(drives[0]).st_dev != os.stat(drives[1]).st_dev
    assert measured_weights(drives, AioConfig(), probe=probe) == ((1, 3) if two_fs else (1, 1))
    same = [tmp_path / "a", tmp_path / "b", tmp_path / "c"]
    for path in same:
        path.mkdir()
    calls.clear()
    assert measured_weights(same, AioConfig(), probe=probe) == (1, 1, 1) and len(calls) == 1  # one file system

    def failing(path, aio):
        raise OSError(errno.ENOSPC, "No space left on device")

    with caplog.at_level(logging.WARNING, logger="offload.storage.drive_speed"):
        assert measured_weights(drives, AioConfig(), probe=failing, key="some.nvme_path") == (1, 1)
    assert "some.nvme_path: could not measure the drives' speeds" in caplog.text and "striping evenly" in caplog.text


def test_the_probe_moves_bytes_and_leaves_nothing(tmp_path):
    """`probe_speeds` itself, tiny: a figure (not checked against anything) and no file left behind."""
    assert probe_speeds([tmp_path], AioConfig(), nbytes=64 << 10)[0] > 0
    assert os.listdir(tmp_path) == []


@pytest.fixture
def probe_files(monkeypatch):
    """`SwapFile` as the probe makes it, noting each file's settings and each request: yields the list of
    ``("made", directory, aio)`` and ``(op, directory, bytes)``, op "write" or "read", in the order made."""
    events = []

    class Noted(SwapFile):
        def __init__(self, directory, aio, **kwargs):
            super().__init__(directory, aio, **kwargs)
            events.append(("made", str(directory), aio))

        def write(self, tensor, offset, **kwargs):
            events.append(("write", os.path.dirname(self.path), tensor.nbytes))
            return super().write(tensor, offset, **kwargs)

        def read(self, buffer, offset, **kwargs):
            events.append(("read", os.path.dirname(self.path), buffer.nbytes))
            return super().read(buffer, offset, **kwargs)

    monkeypatch.setattr(drive_speed, "SwapFile", Noted)
    yield events


def test_the_probe_times_the_raw_drives_in_alternating_rounds(tmp_path, probe_files):
    """No checksums (the swap file's other settings kept), a warm-up write each, then the drives in turn,
    each round starting one drive later, every request the round's size; nothing left behind."""
    dirs = [str(tmp_path / name) for name in "abc"]
    for d in dirs:
        os.mkdir(d)
    aio = AioConfig(verify=True, queue_depth=3, direct=False)
    speeds = drive_speed.probe_speeds(dirs, aio, nbytes=64 << 10, rounds=4, seconds=math.inf)
    assert len(speeds) == 3 and all(s > 0 for s in speeds)
    made = [e for e in probe_files if e[0] == "made"]
    assert [d for _, d, _ in made] == dirs
    assert all(cfg == AioConfig(verify=False, queue_depth=3, direct=False) for _, _, cfg in made)
    moves = [e for e in probe_files if e[0] != "made"]
    assert all(nbytes == 64 << 10 for _, _, nbytes in moves)
    warm_up, rounds = moves[:3], moves[3:]
    assert warm_up == [("write", d, 64 << 10) for d in dirs]
    order = [0, 1, 2, 1, 2, 0, 2, 0, 1, 0, 1, 2]  # four rounds, each drive written then read in turn
    assert [(op, d) for op, d, _ in rounds] == [(op, dirs[i]) for i in order for op in ("write", "read")]
    assert all(os.listdir(d) == [] for d in dirs)


def test_the_probe_sizes_its_rounds_by_the_queue_and_stops_when_out_of_time(tmp_path, probe_files, monkeypatch):
    assert drive_speed.probe_config(AioConfig(queue_depth=5)) == AioConfig(queue_depth=5, verify=False)
    assert drive_speed.probe_bytes(AioConfig()) == drive_speed.PROBE_BYTES == 16 << 20  # 2 x 8 x 1 MiB
    assert drive_speed.probe_bytes(AioConfig(queue_depth=16)) == 32 << 20
    assert drive_speed.probe_bytes(AioConfig(queue_depth=64, thread_count=4)) == drive_speed.MAX_PROBE_BYTES
    assert drive_speed.probe_bytes(AioConfig(queue_depth=1, block_size=4096)) == drive_speed.PROBE_BYTES
    monkeypatch.setattr(drive_speed, "PROBE_BYTES", 16 << 10)  # a tiny probe: two queues of 4 KiB x 4
    aio = AioConfig(block_size=4096, queue_depth=4, thread_count=2)
    drive_speed.probe_speeds([tmp_path], aio, seconds=0)  # out of time at once: the fewest rounds
    assert [e[1:] for e in probe_files if e[0] == "read"] == [(str(tmp_path), 64 << 10)] * drive_speed.PROBE_MIN_ROUNDS
    assert [e[1:] for e in probe_files if e[0] == "write"] == \
        [(str(tmp_path), 64 << 10)] * (1 + drive_speed.PROBE_MIN_ROUNDS)


def test_a_drive_counts_at_its_fastest_write_plus_its_fastest_read(monkeypatch):
    """Other work only slows a round: each direction's fastest round counts, not the fastest or median
    round trip (a fake clock that the fake files' requests move on)."""
    clock = [0.0]
    seconds = {"a": {"write": [9.0, 0.5, 0.1, 0.3], "read": [0.2, 0.4, 0.1]},  # warm-up write first
               "b": {"write": [9.0, 1.0, 1.0, 1.0], "read": [1.0, 1.0, 1.0]}}

    class Timed:
        def __init__(self, directory, aio, **_):
            self.left = {op: list(times) for op, times in seconds[str(directory)].items()}

        def allocate(self, nbytes):
            return 0

        def preallocate(self):
            pass

        def _move(self, op):
            took = self.left[op].pop(0)
            return type("Done", (), {"result": lambda _: clock.__setitem__(0, clock[0] + took)})()

        def write(self, tensor, offset):
            return self._move("write")

        def read(self, buffer, offset):
            return self._move("read")

        def close(self):
            assert not any(self.left.values())  # every scripted request was made

    monkeypatch.setattr(drive_speed, "SwapFile", Timed)
    monkeypatch.setattr(drive_speed, "time", type("Clock", (), {"perf_counter": staticmethod(lambda: clock[0])}))
    speeds = drive_speed.probe_speeds(["a", "b"], AioConfig(), nbytes=1000, rounds=3, seconds=math.inf)
    assert speeds == [pytest.approx(2000 / 0.2), pytest.approx(2000 / 2.0)]


def test_new_file_systems_are_probed_together_once_whatever_the_checksums(drives, tmp_path, monkeypatch):
    calls = []

    def probe_speeds(paths, aio, **_):
        calls.append((list(paths), aio))
        return [_fake_probe(p, aio) for p in paths]

    monkeypatch.setattr(drive_speed, "probe_speeds", probe_speeds)
    monkeypatch.setattr(drive_speed, "_speeds", {})
    two_fs = os.stat(drives[0]).st_dev != os.stat(drives[1]).st_dev
    (tmp_path / "more").mkdir()
    listed = [*drives, str(tmp_path / "more")]  # the third on the first one's file system
    assert measured_weights(listed, AioConfig()) == ((1, 3, 1) if two_fs else (1, 1, 1))
    assert calls == [(drives if two_fs else drives[:1], AioConfig())]  # one probe of every file system, in order
    assert measured_weights(drives, AioConfig(verify=False)) == ((1, 3) if two_fs else (1, 1))
    assert len(calls) == 1  # the figures are kept, checksums or not
    measured_weights(drives, AioConfig(queue_depth=4))
    assert len(calls) == 2 and calls[1][1] == AioConfig(queue_depth=4)  # other settings: measured again


def test_a_real_probe_that_fails_stripes_evenly_and_leaves_nothing(drives, monkeypatch, caplog):
    two_fs = os.stat(drives[0]).st_dev != os.stat(drives[1]).st_dev
    full = drives[1] if two_fs else drives[0]  # the last file system probed is full

    class Full(SwapFile):
        def preallocate(self):
            if os.path.dirname(self.path) == full:
                raise OSError(errno.ENOSPC, "No space left on device")
            super().preallocate()

    monkeypatch.setattr(drive_speed, "SwapFile", Full)
    monkeypatch.setattr(drive_speed, "_speeds", {})
    with caplog.at_level(logging.WARNING, logger="offload.storage.drive_speed"):
        assert measured_weights(drives, AioConfig(), key="some.nvme_path") == (1, 1)
    assert "some.nvme_path: could not measure the drives' speeds" in caplog.text and "No space left" in caplog.text
    assert drive_speed._speeds == {}  # nothing half-measured is kept
    assert all(os.listdir(d) == [] for d in drives)


def test_a_striped_file_measures_its_drives_by_default(drives, fake_speeds):
    file = StripedSwapFile(drives, AioConfig(), kind="params", stripe_bytes=STRIPE)
    try:
        assert file.weights == fake_speeds
        again = open_swap_file(drives, AioConfig(), kind="grads")  # measured once: the figures are kept
        assert again.weights == fake_speeds
        again.close()
        stated = open_swap_file(drives, AioConfig(), kind="adam", weights=[5, 5])
        assert stated.weights == (1, 1)
        stated.close()
    finally:
        file.close()
