"""benchmarks/node_memory.py: one rank, then two under torchrun inside one memory cgroup, at a tiny size
(no memory figure asserted beyond its presence and the cgroup's accounting); and its targets and torchrun
failure lines from given figures."""

from __future__ import annotations

import pytest

from benchmarks import node_memory
from benchmarks._cgroup import MemoryCgroup


@pytest.mark.bench
@pytest.mark.subprocess
@pytest.mark.multiprocess
def test_two_ranks_run_inside_one_cgroup_with_world_size_ones_losses(tmp_path, capsys):
    pytest.importorskip("transformers")
    probe = MemoryCgroup.create("offload-test")
    if isinstance(probe, str):
        pytest.skip(f"no memory cgroup here: {probe}")
    probe.close()
    # A tiny model's ranks are mostly the interpreter and torch (about 0.25 GiB each), which no share shrinks:
    # the limit is 3x the one-rank peak so that two of them fit; the structure is what is tested here.
    result = node_memory.main(["--dir", str(tmp_path), "--model", "tiny", "--ranks", "2", "--steps", "2",
                               "--slack", "3"])
    printed = capsys.readouterr().out
    one, two = result["runs"][1], result["runs"][2]
    assert "error" not in one and "error" not in two, (one.get("error"), two.get("error"))

    # World size 1 alone in a cgroup without a limit; the node's cgroup limited to 3x its peak.
    solo = one["per_rank"][0]
    assert (solo["world"], solo["local_world"], one["cgroup_limit"]) == (1, 1, None)
    assert one["cgroup_peak"] > 0 and result["limit"] == two["cgroup_limit"] == int(3 * one["cgroup_peak"])

    # Both ranks ran, each knew it shares the node with one other, and both were inside the node's cgroup.
    assert [(r["rank"], r["world"], r["local_world"]) for r in two["per_rank"]] == [(0, 2, 2), (1, 2, 2)]
    assert all(r["cgroup"] and two["cgroup"].endswith(r["cgroup"]) for r in two["per_rank"])
    assert "offload-node" in two["per_rank"][0]["cgroup"] and "offload-node" in two["per_rank"][1]["cgroup"]
    assert two["per_rank"][0]["cgroup"] != solo["cgroup"]  # a new group per launch

    # The plan's node total is the cgroup's limit (each rank's share x 2), and each rank's "auto" says so.
    assert abs(node_memory.node_total(two) - two["cgroup_limit"]) <= 2
    assert all("this rank's 1/2 (LOCAL_WORLD_SIZE 2) of cgroup" in r["memory_source"] for r in two["per_rank"])
    assert "LOCAL_WORLD_SIZE 2" in node_memory.plan_budget_line(two["per_rank"][0]["plan"])

    # The figures: each rank's peak at least what it held after import; the cgroup's peak within its limit.
    for r in two["per_rank"]:
        assert r["peak_rss"] >= r["rss"]["imported"] > 0 and set(r["rss"]) == {"imported", "built", "initialized",
                                                                                 "trained"}
    assert 0 < two["cgroup_peak"] <= two["cgroup_limit"] and two["agent_peak_rss"] > 0
    assert two["cgroup_oom_kills"] == 0

    # The same losses as world size 1 (the ranks' mean), which the targets say too.
    assert len(two["per_rank"][0]["losses"]) == 2 and two["per_rank"][0]["losses"] == two["per_rank"][1]["losses"]
    for a, b in zip(solo["losses"], two["per_rank"][0]["losses"]):
        assert b == pytest.approx(a, rel=node_memory.LOSS_RTOL)
    met = {row["target"]: row["met"] for row in result["targets"][2]}
    assert met["losses equal world size 1's"] is True and met["every rank inside the node's cgroup"] is True
    assert set(met) == {"losses equal world size 1's", "the sum of the ranks' peaks within the plan's node total",
                        "no OOM kill", "no limit hit (no failed charge)", "every rank inside the node's cgroup"}
    assert printed.index("config: ") < printed.index("1 rank: ") < printed.index("2 ranks: ") < printed.index("targets:")
    assert "2 ranks: losses equal world size 1's: met" in printed
    assert list(tmp_path.iterdir()) == []  # its work directory (swap files, results) removed


def _run(peaks, *, losses=(2.0, 1.9), limit_hits=0, oom_kills=0, share_total=1 << 30):
    ranks = [{"rank": r, "peak_rss": p, "losses": list(losses), "share_total": share_total, "local_world": len(peaks),
              "cgroup": "/offload-node-1"} for r, p in enumerate(peaks)]
    return {"per_rank": ranks, "cgroup": "/sys/fs/cgroup/memory/offload-node-1", "cgroup_limit": 2 << 30,
            "cgroup_limit_hits": limit_hits, "cgroup_oom_kills": oom_kills}


def test_each_target_fails_on_its_own_figure():
    one = {"per_rank": [{"losses": [2.0, 1.9]}]}
    verdicts = lambda run, dtype="fp32": {t: m for t, m, _ in node_memory.targets(one, run, dtype)}  # noqa: E731
    assert all(verdicts(_run([1 << 30, 1 << 30])).values())  # exactly the node's total (2 x 1 GiB)
    assert verdicts(_run([1 << 30, (1 << 30) + 1]))["the sum of the ranks' peaks within the plan's node total"] is False
    assert verdicts(_run([1, 1], limit_hits=3))["no limit hit (no failed charge)"] is False
    assert verdicts(_run([1, 1], oom_kills=1))["no OOM kill"] is False
    # fp32 within 1e-4, bf16 within 2e-3 of world size 1's losses
    assert verdicts(_run([1, 1], losses=(2.0, 1.9 * (1 + 5e-4))))["losses equal world size 1's"] is False
    assert verdicts(_run([1, 1], losses=(2.0, 1.9 * (1 + 5e-4))), "bf16")["losses equal world size 1's"] is True
    outside = _run([1, 1])
    outside["per_rank"][1]["cgroup"] = "/"
    assert verdicts(outside)["every rank inside the node's cgroup"] is False
    failed = node_memory.targets(one, {"error": "torchrun exit status 1: rank 1 exit code -9"}, "fp32")
    assert failed == [("the run", False, "torchrun exit status 1: rank 1 exit code -9")]


def test_torchruns_failure_names_each_rank_and_its_exit_code():
    log = """Traceback (most recent call last):
ValueError: LOCAL_WORLD_SIZE: 'x' is not a positive integer
Root Cause (first observed failure):
[0]:
  time      : 2026-11-29_02:52:48
  host      : localhost
  rank      : 1 (local_rank: 1)
  exitcode  : -9 (pid: 29868)
  error_file: <N/A>
[1]:
  rank      : 0 (local_rank: 0)
  exitcode  : -15 (pid: 29867)
"""
    assert node_memory._failure(log) == ("rank 1 exit code -9; rank 0 exit code -15; ValueError: LOCAL_WORLD_SIZE: "
                                         "'x' is not a positive integer")
