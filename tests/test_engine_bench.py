"""The engine benchmark runs end to end at a tiny size, so that it never rots (no timing asserted)."""

from __future__ import annotations

import contextlib
import json

import pytest

pytestmark = pytest.mark.bench


@pytest.mark.fio
def test_engine_step_benchmark_tiny(tmp_path, capsys):
    """Every mode in its child process once, with --clip and --gas (both modes get the same work): the
    engine's update runs in the next forward and the clipped steps are counted (what a speculative
    update would redo); plain PyTorch again beside fio moving nvme's bytes. The repeats' bookkeeping is
    test_engine_step_repeats_interleave_and_compare_within_each_repeat's."""
    pytest.importorskip("transformers")
    from benchmarks import engine_step

    tiny = json.dumps({"n_layer": 1, "n_embd": 32, "n_head": 2, "vocab_size": 128, "n_positions": 16})
    result = engine_step.main(["--model-config", tiny, "--modes", "torch+fio,torch,nvme", "--batch", "1", "--seq", "8",
                               "--warmup", "1", "--steps", "2", "--persistence", "0", "--sub-group-size", "4096",
                               "--fio-size", str(4 << 20), "--clip", "0.5", "--gas", "2", "--dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert "GB/s achieved" in out and "nvme" in out
    # plain PyTorch again beside fio moving nvme's bytes (run last in each repeat, whatever --modes' order)
    assert "beside plain PyTorch" in out and len(result["ratio"]["beside_io_per_repeat"]) == 1
    assert result["torch+fio"]["fio_read_rate"] > 0 and result["torch+fio"]["fio_write_rate"] > 0
    assert result["nvme"]["step_s"] > 0 and result["nvme"]["read_per_step"] > 0
    assert len(result["ratio"]["per_repeat"]) == 1 and len(result["nvme"]["times"]) == 2  # the timed steps
    assert "nvme: the update ran in the next forward" in out
    assert result["nvme"]["path"] == "in the next forward"
    assert len(result["nvme"]["norms"]) == len(result["torch"]["norms"]) == 3  # warm-up and timed steps
    assert result["nvme"]["norms"] == pytest.approx(result["torch"]["norms"], rel=1e-5)
    assert result["nvme"]["clipped"] == sum(norm > 0.5 for norm in result["nvme"]["norms"])
    assert result["torch"]["hashed_per_step"] == 0  # only tensorio's checksums are counted
    assert result["nvme"]["hashed_per_step"] > 0 and result["nvme"]["hash_cpu_per_step"] > 0
    assert "nvme: checksums hashed" in out
    assert list(tmp_path.iterdir()) == []  # swap and fio files removed


def _main_stubbed(monkeypatch, child, argv: list[str], **patches) -> dict:
    """engine_step.main(argv) with ``child`` standing in for its children, fio measuring 1 GB/s, and
    ``patches`` (more of the module's names) in place."""
    from benchmarks import engine_step

    monkeypatch.setattr(engine_step, "run_child", child)
    monkeypatch.setattr(engine_step, "run_fio", lambda job: type("Result", (), {"bw_bytes": 1e9})())
    for name, value in patches.items():
        monkeypatch.setattr(engine_step, name, value)
    return engine_step.main(argv)


def _child_figures(payload: dict, step_s: float, **figures) -> dict:
    """What a child of the mode in ``payload`` prints, its steps taking ``step_s``; ``figures`` override."""
    return {"mode": payload["mode"], "params": payload["params"], "step_s": step_s, "times": [step_s] * payload["steps"],
            "peak_rss": 100e6, "baseline_rss": 50e6, "norms": [], "path": None, "clipped": 0,
            "cpu_user_per_step": 1.0, "cpu_kernel_per_step": 0.1, "read_per_step": 8e6, "written_per_step": 4e6,
            **figures}


def test_engine_step_repeats_interleave_and_compare_within_each_repeat(tmp_path, monkeypatch, capsys):
    """--repeats 2 with the children and fio stood in for (each child's figures made from its payload and
    its place in the run): every mode once per repeat, torch+fio last in each whatever --modes' order,
    fio's traffic paced by that repeat's runs, ratios within each repeat, medians over the repeats."""
    calls, loads = [], []
    beside = {"on": False}

    def child(module, args, mmap_threshold=None):
        payload = json.loads(args[1])
        mode = "torch+fio" if beside["on"] else payload["mode"]
        calls.append(mode)
        repeat = calls.count(mode)
        step_s = {"torch": 1.0, "nvme": 1.5, "torch+fio": 1.25}[mode] * repeat
        return _child_figures(payload, step_s, peak_rss=100e6 * repeat)

    class Run:
        read = write = type("Result", (), {"bw_bytes": 2e9})()

    @contextlib.contextmanager
    def fio_load(load):
        loads.append(load)
        beside["on"] = True
        try:
            yield Run()
        finally:
            beside["on"] = False

    result = _main_stubbed(monkeypatch, child, ["--modes", "torch+fio,torch,nvme", "--steps", "3", "--repeats", "2",
                                                "--dir", str(tmp_path)], fio_load=fio_load)
    out = capsys.readouterr().out
    assert calls == ["torch", "nvme", "torch+fio"] * 2
    # fio moved nvme's bytes per step at that repeat's plain PyTorch pace (1 s, then 2 s a step)
    assert [(load.read_rate, load.write_rate) for load in loads] == [(8e6, 4e6), (4e6, 2e6)]
    assert result["ratio"]["per_repeat"] == [1.5, 1.5] and result["ratio"]["beside_io_per_repeat"] == [1.25, 1.25]
    assert result["nvme"]["step_s"] == 2.25 and result["torch"]["peak_rss"] == 150e6  # medians over the repeats
    assert result["nvme"]["times"] == [1.5] * 3 + [3.0] * 3  # every timed step of every repeat
    assert "repeat 1: torch 1.000 s, nvme 1.500 s, torch+fio 1.250 s" in out
    assert "repeat 2: torch 2.000 s, nvme 3.000 s, torch+fio 2.500 s" in out
    assert "per repeat: 1.50 1.50" in out and "per repeat: 1.25 1.25" in out
    assert list(tmp_path.iterdir()) == []


def test_engine_dist_benchmark_tiny(tmp_path, monkeypatch, capsys):
    """World size 1 and world size 2 with buckets each in its processes (two ranks over gloo); world size 2
    with one call per parameter is the same ranks' code with another setting (tests/test_engine_dist.py
    trains it), stood in for by figures of its own, which the headline must carry."""
    pytest.importorskip("transformers")
    from benchmarks import engine_dist

    real, ran = engine_dist.run_config, []

    def run_config(name, args, directory):
        ran.append(name)
        if name == "world 2, per parameter":
            return {"step_s": 4.0, "comm_s": 0.75, "times": [4.0], "calls": 0}
        return real(name, args, directory)

    monkeypatch.setattr(engine_dist, "run_config", run_config)
    tiny = json.dumps({"n_layer": 1, "n_embd": 32, "n_head": 2, "vocab_size": 128, "n_positions": 16})
    result = engine_dist.main(["--model-config", tiny, "--batch", "2", "--seq", "8", "--warmup", "1", "--steps", "1",
                               "--dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert ran == list(engine_dist.CONFIGS) and set(result) == set(engine_dist.CONFIGS)
    assert result["world 1"]["comm_s"] == 0 and result["world 2, buckets"]["step_s"] > 0
    assert result["world 2, buckets"]["comm_s"] >= 0
    assert "with buckets against 0.750 s with one call per parameter" in out
    one = result["world 1"]["step_s"]
    assert f"({4.0 / one:.2f}x per parameter)" in out
    assert list(tmp_path.iterdir()) == []


def test_clip_redo_benchmark_tiny(capsys):
    pytest.importorskip("transformers")
    from benchmarks import clip_redo

    tiny = json.dumps({"n_layer": 1, "n_embd": 16, "n_head": 2, "n_positions": 16})
    result = clip_redo.main(["--model-config", tiny, "--batch", "2", "--seq", "16", "--warmup-steps", "3",
                             "--min-warmup-steps", "1", "--finetune-steps", "2", "--window", "2"])
    out = capsys.readouterr().out
    assert "fine-tune: 2 steps" in out
    assert 1 <= result["warmup"]["steps"] <= 3 and 0 <= result["finetune"]["above"] <= 2


def test_engine_step_beside_io_needs_the_modes_it_compares():
    from benchmarks import engine_step

    with pytest.raises(SystemExit, match="torch\\+fio needs torch and nvme"):
        engine_step.main(["--modes", "torch,torch+fio"])


def test_engine_step_hash_floor_runs_after_the_modes_it_paces_by(tmp_path, monkeypatch, capsys):
    """nvme-unverified+hash runs last in each repeat, paced by that repeat's nvme hashing CPU over its
    nvme-unverified step, and is reported as the checksums' floor with nvme against it (pooled steps)."""
    calls, rates = [], []

    def child(module, args, mmap_threshold=None):
        payload = json.loads(args[1])
        mode = payload["mode"]
        calls.append(mode)
        rates.append(payload["hash_rate"])
        repeat = calls.count(mode)
        step_s = {"nvme": 1.1, "nvme-unverified": 1.0, "nvme-unverified+hash": 1.05}[mode] * repeat
        extra = {"load_hashed_per_step": 2e9, "load_cpu_per_step": 0.1} if mode.endswith("+hash") else {}
        return _child_figures(payload, step_s, hashed_per_step=3e9 if mode == "nvme" else 0,
                              hash_cpu_per_step=0.2 if mode == "nvme" else 0, **extra)

    result = _main_stubbed(monkeypatch, child, ["--modes", "nvme-unverified+hash,nvme,nvme-unverified", "--steps", "2",
                                                "--repeats", "2", "--dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert calls == ["nvme", "nvme-unverified", "nvme-unverified+hash"] * 2
    assert rates == [0.0, 0.0, pytest.approx(0.2), 0.0, 0.0, pytest.approx(0.1)]  # 0.2 s over 1 s, then over 2 s
    assert result["ratio"]["hash_floor"] == pytest.approx(1.05 * 1.5 / 1.5)  # pooled: medians of both repeats' steps
    assert result["ratio"]["verify_over_floor"] == pytest.approx(1.1 / 1.05)
    assert "the floor under the checksums' cost 1.050 (per repeat: 1.050 1.050)" in out
    assert "nvme against it 1.048" in out
    assert result["ratio"]["verify_cost"] == pytest.approx(1.1)  # one figure for on / off: pooled, as the floor's
    assert "nvme-unverified (aio.verify false) step time = 1.100 (target <= 1.03; pooled" in out


def test_engine_step_hash_floor_needs_the_modes_it_compares():
    from benchmarks import engine_step

    with pytest.raises(SystemExit, match="nvme-unverified\\+hash needs nvme and nvme-unverified"):
        engine_step.main(["--modes", "nvme,nvme-unverified+hash"])


def test_hash_load_hashes_until_closed_and_refuses_a_rate_outside_a_core():
    """The load hashes (waited for by its own count, not by the clock) and says what it did once closed."""
    from benchmarks._hash_load import HashLoad

    with pytest.raises(ValueError, match="cpu_rate: 1.5 is not allowed"):
        HashLoad(1.5)
    load = HashLoad(0.5, buffer_bytes=4 << 20)
    with load:
        while load.hashed < 12 << 20:  # three 4 MiB slices: round the 4 MiB buffer and back
            pass
    assert load.hashed >= 12 << 20 and load.cpu_seconds > 0
