"""CPU threads per rank (offload/train/cpu_threads.py): the node's cores divided among its ranks unless the
user chose (OMP_NUM_THREADS), torchrun's own OMP_NUM_THREADS=1 told apart from the user's, and the plan
printing this rank's share beside the node's cores."""

from __future__ import annotations

import pytest
import torch

from offload.train.cpu_threads import cpu_threads_per_rank, set_cpu_threads
from offload.train.engine import initialize
from test_engine import engine_config, mlp

TORCHRUN = {"TORCHELASTIC_RUN_ID": "none", "LOCAL_WORLD_SIZE": "4"}


@pytest.mark.parametrize("cores,ranks,share", [(16, 8, 2), (16, 3, 5), (2, 4, 1), (1, 1, 7), (7, 2, 3)])
def test_each_rank_takes_its_share_of_the_node(cores, ranks, share):
    chosen = cpu_threads_per_rank(node_cores=cores, local_ranks=ranks, environ={}, current=7)
    assert chosen.threads == share  # alone on the node (ranks 1): torch's own setting stays
    assert chosen.optimizer_threads == max(1, share // 2)
    assert (chosen.node_cores, chosen.local_ranks) == (cores, ranks)


@pytest.mark.parametrize("omp", ["1", "3", "12"])
def test_the_users_omp_num_threads_wins(omp):
    chosen = cpu_threads_per_rank(node_cores=16, local_ranks=4, environ={"OMP_NUM_THREADS": omp}, current=int(omp))
    assert chosen.threads == int(omp) and "set by the user" in chosen.source


def test_torchruns_own_omp_num_threads_1_is_replaced_by_the_share():
    chosen = cpu_threads_per_rank(node_cores=16, local_ranks=4, environ={**TORCHRUN, "OMP_NUM_THREADS": "1"}, current=1)
    assert chosen.threads == 4 and "torchrun's default" in chosen.source
    # Under torchrun any other value is the user's; one rank per node: torchrun sets nothing.
    assert cpu_threads_per_rank(node_cores=16, local_ranks=4, environ={**TORCHRUN, "OMP_NUM_THREADS": "2"},
                                current=2).threads == 2
    assert cpu_threads_per_rank(node_cores=16, local_ranks=1, environ={**TORCHRUN, "OMP_NUM_THREADS": "1"},
                                current=1).threads == 1


def test_bad_counts_are_refused():
    with pytest.raises(ValueError, match="node_cores and local_ranks must be at least 1"):
        cpu_threads_per_rank(node_cores=0, local_ranks=1, environ={}, current=1)


def test_initialize_sets_torchs_threads_and_the_plan_prints_the_share(disk_dir, monkeypatch):
    before = torch.get_num_threads()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setattr("offload.train.cpu_threads.node_cores", lambda: 6)
    try:
        engine, *_ = initialize(model=mlp(), config=engine_config(disk_dir, "nvme", "nvme"))
        assert torch.get_num_threads() == 3
        assert engine.plan.cpu_threads.threads == 3
        assert ("CPU threads: 3 for this rank (the optimizer's worker 1) of the node's 6 cores, 2 ranks on the node: "
                "the node's share, 6 // LOCAL_WORLD_SIZE 2") in str(engine.plan)
        engine.close()
        monkeypatch.setenv("OMP_NUM_THREADS", "5")  # the user's: kept
        torch.set_num_threads(5)
        assert set_cpu_threads().threads == 5 and torch.get_num_threads() == 5
    finally:
        torch.set_num_threads(before)
