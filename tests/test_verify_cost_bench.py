"""benchmarks.verify_cost: the interleaved series and its pooled ratios, train_large stood in for."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.bench


def _results(seconds: list[float], hashing: float) -> dict:
    """train_large's figures for a run whose steps took ``seconds`` and ``hashing`` seconds of checksum CPU."""
    steps = [{"batch": 1, "seconds": s, "hash_cpu_s": hashing} for s in seconds]
    return {"spec": {"batches": [1]}, "offload": {"steps": steps}}


def test_verify_cost_interleaves_three_sides_and_paces_the_floor_by_the_latest_runs(monkeypatch, capsys):
    from benchmarks import train_large, verify_cost

    calls = []

    def run(argv):
        calls.append(argv)
        if "--hash-cpu-rate" in argv:
            return _results([99.0, 99.0, 9.0, 9.0], 0.0)
        if "--no-verify" in argv:
            return _results([99.0, 99.0, 8.0, 8.0], 0.0)
        return _results([99.0, 99.0, 9.5, 9.5], 0.4 * len(calls))

    monkeypatch.setattr(train_large, "main", run)
    result = verify_cost.main(["--rounds", "2", "--", "--layers", "4"])
    out = capsys.readouterr().out
    assert verify_cost.order(2) == ["on", "off", "floor", "floor", "off", "on"]
    assert all(argv[:2] == ["--layers", "4"] for argv in calls)
    rates = [argv[argv.index("--hash-cpu-rate") + 1] for argv in calls if "--hash-cpu-rate" in argv]
    assert rates == ["0.050000", "0.050000"]  # the first on run's 0.4 s over the first off run's 8 s, both times
    assert all("--no-verify" in argv for argv in calls if "--hash-cpu-rate" in argv)
    assert result["ratio"] == pytest.approx(9.5 / 8)  # the first two steps of each run left out
    assert result["floor"] == pytest.approx(9 / 8) and result["over_floor"] == pytest.approx(9.5 / 9)
    assert len(result["steps"]["on"]) == 4
    assert "on / off 9.50 / 8.00 s = 1.188 (target <= 1.03: NOT met)" in out


def test_verify_cost_refuses_what_it_decides_itself():
    from benchmarks import verify_cost

    with pytest.raises(SystemExit, match="--no-verify: not among"):
        verify_cost.main(["--", "--no-verify"])
    with pytest.raises(SystemExit, match="--hash-cpu-rate: not among"):
        verify_cost.main(["--", "--hash-cpu-rate", "0.1"])
    with pytest.raises(SystemExit, match="--rounds: 0 is not allowed"):
        verify_cost.main(["--rounds", "0"])
