"""Two nodes on one machine: two ``torchrun --nnodes 2 --nproc_per_node 1`` launches meeting over
127.0.0.1 (c10d rendezvous), each node's rank with LOCAL_RANK 0, parameters and optimizer state on NVMe
in one shared folder or in a folder per node. The losses equal world size 1's, neither rank's swap
files are touched by the other (their names carry their own pid, and every byte each rank read back
matched its checksums), and the checkpoint the two nodes saved resumes at world size 2 (in the
workers) and at world size 1 (here)."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

import pytest
import torch

from tensorio import checksum
from test_engine_dist import batches, config, gpt2

pytestmark = pytest.mark.multiprocess

REPO = Path(__file__).resolve().parent.parent
TIMEOUT_S = 600
"""Bounded, and generous for a loaded CI machine: the workers take about 20 s on an idle one."""


def _world_size_one(nvme: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    from offload.train.engine import initialize

    engine, *_ = initialize(model=gpt2(), config=config(nvme, "nvme", "nvme", 1, 1, 0.5))
    losses = []
    for batch in batches(4):
        loss = engine(batch, labels=batch).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    params = dict(engine.full_parameters())
    engine.close()
    return losses, params


def _two_nodes(save_dir: Path, nvme: list[Path]) -> dict[int, dict]:
    """Launch the two nodes (one torchrun each) and collect each rank's report."""
    from benchmarks._common import free_port

    import json

    port, run_id = free_port(), f"two-nodes-{uuid.uuid4().hex[:8]}"
    with tempfile.TemporaryDirectory() as reports:
        launches = []
        for node in range(2):
            env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
                   "OFFLOAD_TEST_REPORTS": reports, "OFFLOAD_TEST_NVME": str(nvme[node])}
            for key in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK"):
                env.pop(key, None)
            command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "1",
                       "--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{port}", "--rdzv_id", run_id,
                       "--max_restarts", "0", "-m", "tests.two_node_worker", str(save_dir)]
            launches.append(subprocess.Popen(command, env=env, cwd=REPO, stdout=subprocess.PIPE,
                                             stderr=subprocess.STDOUT, text=True))
        outputs = []
        try:
            for launch in launches:  # waits for each to end (an event), bounded
                outputs.append(launch.communicate(timeout=TIMEOUT_S)[0])
        finally:
            for launch in launches:
                if launch.poll() is None:
                    launch.kill()
                    launch.wait()
        assert [launch.returncode for launch in launches] == [0, 0], "\n".join(o[-3000:] for o in outputs)
        found = {int(name[4:-5]): json.loads(Path(reports, name).read_text()) for name in os.listdir(reports)}
    assert sorted(found) == [0, 1]
    return found


@pytest.mark.parametrize("shared", [True, False], ids=["one-nvme-folder", "a-folder-per-node"])
def test_two_nodes_on_one_machine_train_as_world_size_one(disk_dir, shared):
    nvme = [disk_dir / "nvme0", disk_dir / "nvme1"]
    for folder in nvme:
        folder.mkdir()
    if shared:
        nvme[1] = nvme[0]
    reference, params = _world_size_one(str(disk_dir / "nvme0"))
    ranks = _two_nodes(disk_dir / "ckpt", nvme)
    # Both nodes see LOCAL_RANK 0; each rank's swap files are its own.
    assert [ranks[r]["local_rank"] for r in (0, 1)] == [0, 0]
    assert not set(ranks[0]["files"]) & set(ranks[1]["files"])
    for r in (0, 1):
        assert ranks[r]["files"] and all(f"-{ranks[r]['pid']}-" in os.path.basename(p) for p in ranks[r]["files"])
        assert ranks[r]["verified"] and ranks[r]["left"] == []  # every byte read back matched; all removed
        torch.testing.assert_close(torch.tensor(ranks[r]["losses"]), torch.tensor(reference), rtol=1e-5, atol=0)
        assert ranks[r]["reloaded"] == ranks[r]["params"] == ranks[0]["params"]  # resumed at world size 2
    folders = [{os.path.dirname(p) for p in ranks[r]["files"]} for r in (0, 1)]
    if shared:
        assert folders[0] == folders[1] == {str(nvme[0])}
    else:
        assert folders[0] != folders[1] and folders[0] | folders[1] == {str(nvme[0]), str(nvme[1])}
    # The checkpoint of the two nodes resumes at world size 1: the same parameters.
    from offload.train.engine import initialize

    engine, *_ = initialize(model=gpt2(), config=config(str(disk_dir / "nvme0"), "nvme", "nvme", 1, 1, 0.5))
    try:
        engine.load_checkpoint(disk_dir / "ckpt")
        loaded = dict(engine.full_parameters())
        assert {n: checksum(memoryview(t.contiguous().view(torch.uint8).numpy())) for n, t in loaded.items()} == \
            ranks[0]["params"]
        for name, ref in params.items():  # and world size 1's own run, within Adam's amplification of rounding
            torch.testing.assert_close(loaded[name], ref, rtol=1e-5, atol=1e-5)
        assert engine.global_steps == 4
    finally:
        engine.close()
