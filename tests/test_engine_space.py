"""The engine computes the swap space it needs before writing anything, and refuses a file system
that cannot hold it, naming the figures."""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import tempfile

import pytest
import torch
from torch import nn

from offload.config import EngineConfig
from offload.train.engine import initialize
from offload.train.space import swap_space_needed
from test_engine import engine_config


@pytest.fixture
def small_filesystem():
    """A 32 MiB ext4 image, loop-mounted (root only)."""
    if os.geteuid() != 0 or shutil.which("mkfs.ext4") is None:
        pytest.skip("mounting a loop image needs root and mkfs.ext4")
    root = tempfile.mkdtemp()
    image, mount = os.path.join(root, "fs.img"), os.path.join(root, "mnt")
    os.mkdir(mount)
    with open(image, "wb") as file:
        file.truncate(32 << 20)
    subprocess.run(["mkfs.ext4", "-q", "-F", image], check=True)
    if subprocess.run(["mount", "-o", "loop", image, mount]).returncode != 0:
        shutil.rmtree(root)
        pytest.skip("loop mounts are not allowed here")
    yield mount
    subprocess.run(["umount", mount], check=True)
    shutil.rmtree(root)


def test_a_file_system_too_small_is_refused_before_anything_is_written(small_filesystem):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(2048, 2048), nn.Linear(2048, 8))  # 4.2 M parameters: ~135 MB of swap
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    with pytest.raises(OSError, match=r"not enough swap space: zero_optimization\.offload_param\.nvme_path .* and "
                                      r"zero_optimization\.offload_optimizer\.nvme_path .* need 0\.10\d GB in all "
                                      r"\(parameters 0\.034 GB, optimizer state in two slots 0\.067 GB, gradients "
                                      r"0\.000 GB\), the file system has 0\.0\d\d GB free") as info:
        initialize(model=model, config=engine_config(small_filesystem, "nvme", "nvme"))
    assert info.value.errno == errno.ENOSPC
    assert os.listdir(small_filesystem) == ["lost+found"]  # nothing written
    assert all(torch.equal(p, before[name]) for name, p in model.named_parameters())


def test_the_space_needed_counts_what_goes_to_disk():
    cfg = EngineConfig.from_dict(engine_config("/tmp", "nvme", "nvme"), world_size=1)
    params = [(1000, 4, True, None), (1024, 4, False, None), (2000, 2, True, None)]
    needed = swap_space_needed(cfg, params, world_size=1, grads_on_disk=True)
    assert needed.params == 2 * (4096 + 4096 + 4096)  # each partition padded to a page, in two slots
    assert needed.optimizer == 2 * (8 * 1000 + 4096 + 12 * 2000 + 4096)  # fp32: two moments; 16-bit: and a master
    assert needed.grads == 4096 + 8192  # the frozen one has neither
    # On the fast paths an on-disk fp32 partition's gradient waits in its free slot; a 16-bit one's does not fit
    assert swap_space_needed(cfg, params, world_size=1, grads_on_disk=True, grads_in_param_slots=True).grads == 8192
    cfg.zero_optimization.offload_param.max_in_cpu = 1000  # the first one stays in memory
    in_cpu = swap_space_needed(cfg, params, world_size=1, grads_on_disk=False, grads_in_param_slots=True)
    assert (in_cpu.params, in_cpu.grads) == (2 * 4096 + 2 * 4096, 0)
    placed = [(1000, 4, True, True), (1024, 4, False, False)]  # placed by zero.Init: their space is taken already
    needed = swap_space_needed(cfg, placed, world_size=1, grads_on_disk=True, grads_in_param_slots=True)
    assert (needed.params, needed.grads) == (0, 0)


def test_the_ranks_of_a_node_are_counted_on_its_file_system(tmp_path, monkeypatch):
    """Each of the node's ranks (LOCAL_WORLD_SIZE) writes as much swap as this one on the same paths: a disk
    that holds one rank's and not eight ranks' is refused at the start, naming the ranks."""
    from offload.train.space import SwapSpace, check_swap_space

    cfg = EngineConfig.from_dict(engine_config(str(tmp_path), "nvme", "nvme"), world_size=8)
    free = shutil.disk_usage(tmp_path).free
    one = SwapSpace(params=free // 12, optimizer=free // 12, grads=0)  # a rank's: a sixth of the free space
    check_swap_space(cfg, one, ranks=1)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    with pytest.raises(OSError, match=r"for each of the 8 ranks of this node on it \(LOCAL_WORLD_SIZE 8\) need") as info:
        check_swap_space(cfg, one)
    assert info.value.errno == errno.ENOSPC
    for key in ("offload_param", "offload_optimizer"):  # four drives: two ranks on each, which this disk holds
        getattr(cfg.zero_optimization, key).nvme_paths = (str(tmp_path),) * 4
    check_swap_space(cfg, one)


def test_a_rank_writes_its_swap_files_on_its_drive_of_the_list(tmp_path, monkeypatch):
    """``nvme_path`` as a list: local rank 1 of the node keeps its parameter and optimizer swap files on the
    second drive, and trains as on one."""
    from test_engine import mlp, mlp_batches, mlp_loss, train

    drives = [tmp_path / "nvme0", tmp_path / "nvme1"]
    for drive in drives:
        drive.mkdir()
    config = engine_config(drives[0], "nvme", "nvme")
    for key in ("offload_param", "offload_optimizer"):
        config["zero_optimization"][key]["nvme_path"] = [str(d) for d in drives]
    monkeypatch.setenv("LOCAL_RANK", "1")
    engine, *_ = initialize(model=mlp(), config=config)
    try:
        losses = train(engine, mlp_batches(2), mlp_loss)
        assert os.listdir(drives[0]) == [] and any(n.startswith("offload-params-") for n in os.listdir(drives[1]))
        assert any(n.startswith("offload-adam-") for n in os.listdir(drives[1])) and len(losses) == 2
    finally:
        engine.close()
