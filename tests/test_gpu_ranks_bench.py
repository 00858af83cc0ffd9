"""The several-GPU check (benchmarks/gpu/ranks.py) runs end to end on a node of two simulated devices at a
tiny size, so that the next machine with several GPUs runs it as it is; it refuses where CUDA has fewer
GPUs than ranks."""

from __future__ import annotations

import pytest

from offload.device import cuda_available

pytestmark = [pytest.mark.bench, pytest.mark.simulated, pytest.mark.multiprocess]


def test_two_ranks_each_on_its_own_index_give_world_size_ones_losses(tmp_path, capsys):
    pytest.importorskip("transformers")
    from benchmarks.gpu import ranks

    figures = ranks.main(["--dir", str(tmp_path), "--device", "simulated", "--nproc", "2", "--tiny", "--steps", "3",
                          "--json", str(tmp_path / "ranks.json")])
    out = capsys.readouterr().out
    assert [(r["rank"], r["local_rank"], r["device"]) for r in figures["ranks"]] == [(0, 0, "simgpu:0"),
                                                                                    (1, 1, "simgpu:1")]
    assert [list(r["device_memory"]) for r in figures["ranks"]] == [["0"], ["1"]]  # each rank's memory: its index
    assert figures["world_size_1"]["device"] == "simgpu:0"
    assert len(figures["mean_losses"]) == 3 and figures["largest_relative_difference"] <= 1e-5, figures
    assert "rank 1 (LOCAL_RANK 1) computed on simgpu:1" in out and "largest relative difference" in out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ranks.json"]  # swap files and the ranks' output removed


@pytest.mark.skipif(cuda_available(), reason="checks the refusal where CUDA is missing")
def test_it_refuses_without_the_gpus_it_needs(tmp_path):
    from benchmarks.gpu import ranks

    with pytest.raises(SystemExit, match=r"CUDA is not available here; this row needs 2 GPUs"):
        ranks.main(["--dir", str(tmp_path)])


def test_the_stop_check_sees_every_rank_stop_naming_the_one_that_failed(tmp_path, capsys):
    """--stop-at: rank 1 raises in its forward at step 2; rank 0 stops at once with RanksStopped naming it
    (over gloo on the simulated device here; over NCCL, the same check on a machine with several GPUs)."""
    pytest.importorskip("transformers")
    from benchmarks.gpu import ranks

    figures = ranks.main(["--dir", str(tmp_path), "--device", "simulated", "--nproc", "2", "--tiny", "--steps", "3",
                          "--stop-at", "2"])
    first, second = figures["ranks"]
    assert first["stopped"]["error"] == "RanksStopped" and first["stopped"]["step"] == 2
    assert "rank 1 failed in forward at step 2: ValueError: bad batch" in first["stopped"]["message"]
    assert second["stopped"]["error"] == "ValueError" and second["stopped"]["step"] == 2
    assert len(first["losses"]) == len(second["losses"]) == 1  # step 1 trained, step 2 stopped on both
    assert figures["stopped_together"] and "every rank stopped at step 2, naming rank 1" in capsys.readouterr().out
