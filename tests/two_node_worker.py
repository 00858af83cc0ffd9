"""One "node" of tests/test_two_nodes.py, started by torchrun with ``--nnodes 2 --nproc_per_node 1``:
trains test_engine_dist's GPT-2 on this rank's share of each global batch with parameters and optimizer
state on NVMe in ``OFFLOAD_TEST_NVME`` (this node's folder), saves a checkpoint with the other node into
the shared ``save_dir``, loads it back at world size 2, and reports losses, parameters' checksums and
the swap files it made (`tests/torchrun.py`'s ``report``)."""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

from tensorio import checksum
from tests.test_engine_dist import batches, config, gpt2
from tests.torchrun import finish, report


def _digest(params: dict[str, torch.Tensor]) -> dict[str, int]:
    return {name: checksum(memoryview(t.contiguous().view(torch.uint8).numpy())) for name, t in params.items()}


def main(save_dir: str) -> None:
    from offload.train.engine import initialize

    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    nvme = os.environ["OFFLOAD_TEST_NVME"]
    engine, *_ = initialize(model=gpt2(), config=config(nvme, "nvme", "nvme", world_size, 1, 0.5))
    files = sorted(p for p in (engine._store.swap.path, engine.optimizer._swapper.path) if p)
    assert all(f"-{os.getpid()}-" in os.path.basename(p) for p in files), files
    losses = []
    for batch in batches(4):
        share = batch.chunk(world_size)[rank]
        loss = engine(share, labels=share).loss
        engine.backward(loss)
        engine.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / world_size)
    swap = engine._store.swap
    verified = swap.bytes_verified == swap.bytes_read > 0  # another process writing into our slots would fail this
    params = dict(engine.full_parameters())
    path = engine.save_checkpoint(save_dir)
    engine.close()
    gone = [p for p in files if os.path.exists(p)]
    fresh, *_ = initialize(model=gpt2(), config=config(nvme, "nvme", "nvme", world_size, 1, 0.5))
    fresh.load_checkpoint(save_dir)
    reloaded = dict(fresh.full_parameters())
    fresh.close()
    report({"rank": rank, "losses": losses, "params": _digest(params), "reloaded": _digest(reloaded),
            "files": files, "left": gone, "verified": verified, "checkpoint": path, "pid": os.getpid(),
            "local_rank": int(os.environ["LOCAL_RANK"]), "steps": len(losses)})
    finish()


if __name__ == "__main__":
    main(sys.argv[1])
