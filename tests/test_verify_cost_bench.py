"""benchmarks.verify_cost: the interleaved series and its pooled ratios, train_large stood in for."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.bench


def _results(seconds: list[float], read_speed: float) -> dict:
    """train_large's figures for a run whose steps took ``seconds``, each moving 2 GB read at ``read_speed``
    (fio's read speed beside every step) and nothing written."""
    fio = {"read": read_speed, "write": 1e9}
    steps = [{"batch": 1, "seconds": s, "read": 2e9, "written": 0, "fio_after": fio} for s in seconds]
    return {"spec": {"batches": [1]}, "offload": {"steps": steps, "fio_before_steps": fio}}


def test_verify_cost_interleaves_and_pools_the_steady_steps(monkeypatch, capsys):
    from benchmarks import train_large, verify_cost

    calls = []

    def run(argv):
        calls.append(argv)
        on = "--no-verify" not in argv
        # on: 10 s a step on a disk at 1 GB/s (5x its 2 s of I/O); off: 8 s at 2 GB/s (8x its 1 s)
        return _results([99.0, 99.0, 10.0, 10.0] if on else [99.0, 99.0, 8.0, 8.0], 1e9 if on else 2e9)

    monkeypatch.setattr(train_large, "main", run)
    result = verify_cost.main(["--pairs", "2", "--", "--layers", "4"])
    out = capsys.readouterr().out
    assert [("--no-verify" not in argv) for argv in calls] == [True, False, False, True]
    assert all(argv[:2] == ["--layers", "4"] for argv in calls)
    assert result["ratio"] == pytest.approx(10 / 8)  # the first two steps of each run left out
    assert result["ratio_beside"] == pytest.approx(5 / 8)  # against the disk, checksums on was the faster
    assert len(result["steps"]["on"][0]) == 4
    assert "met against the disk, NOT met in seconds" in out


def test_verify_cost_refuses_what_it_decides_itself():
    from benchmarks import verify_cost

    assert verify_cost.order(3) == [True, False, False, True, True, False]
    with pytest.raises(SystemExit, match="--no-verify: not among"):
        verify_cost.main(["--", "--no-verify"])
    with pytest.raises(SystemExit, match="--pairs: 0 is not allowed"):
        verify_cost.main(["--pairs", "0"])
