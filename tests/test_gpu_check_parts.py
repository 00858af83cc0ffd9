"""The pieces of the GPU check that run without it: issue 51's verdicts in summary.md (benchmarks/gpu/_report.py),
the NVMe wait count of the training breakdown (benchmarks/gpu/_waits.py), the profiler's breakdown on the CPU
(benchmarks/gpu/_trace.py), and scripts/gpu_bundle.sh's and gpu_check.sh --bundle's arguments and refusals.
(The whole check end to end at a tiny size: tests/test_gpu_check.py.)"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from benchmarks.gpu import _report, _trace
from benchmarks.gpu._waits import NvmeWaits
from tensorio import AioHandle, IOFuture

REPO = Path(__file__).resolve().parents[1]
BUNDLE = REPO / "scripts" / "gpu_bundle.sh"


def _verdict(line: str) -> str:
    """The verdict a target's line ends with: met, not met or not measured (its reason dropped)."""
    return re.search(r": (met|not met|not measured)(?: \(.*\))?$", line).group(1)


def _side(label: str, s_per_token: float) -> dict:
    return {"label": label, "s_per_token": s_per_token, "tokens_per_s": 1 / s_per_token}


@pytest.mark.parametrize("ours, judged, label, verdict", [
    (0.05, True, "accelerate", "met"), (0.08, True, "accelerate", "not met"),
    (0.05, False, "accelerate", "not measured"), (0.05, True, "transformers", "not measured")])
def test_defaults_target_is_judged_only_on_cuda_against_accelerate(ours, judged, label, verdict):
    line = _report.defaults_target({"sides": {"ours": _side("ours", ours), "peer": _side(label, 0.064)}}, judged)
    assert line.startswith("generation defaults (ours >= 1.0x Accelerate's")
    assert _verdict(line) == verdict and f"{label} 0.0640" in line


def test_equal_memory_target_needs_twice_accelerate_and_no_oom():
    accelerate = {**_side("accelerate", 1.0), "cgroup": "v1", "cgroup_limit": 4 << 30, "cgroup_peak": 3 << 30,
                  "cgroup_limit_hits": 0, "cgroup_oom_kills": 0}
    fast = {**_side("ours", 0.4), "memory_label": "page cache unbounded"}
    assert _report.equal_target({"runs": {"ours": fast, "accelerate": accelerate}}, True).endswith(": met")
    slow = {**_side("ours", 0.6), "memory_label": "page cache unbounded"}
    assert _report.equal_target({"runs": {"ours": slow, "accelerate": accelerate}}, True).endswith(": not met")
    killed = {"kind": "ours", "error": "killed by SIGKILL", "cgroup": "v1", "cgroup_limit": 1, "cgroup_peak": 1,
              "cgroup_limit_hits": 9, "cgroup_oom_kills": 1}
    line = _report.equal_target({"runs": {"ours": killed, "accelerate": accelerate}}, True)
    assert "ours failed (killed by SIGKILL" in line and "1 OOM kills" in line and line.endswith(": not met")
    assert _report.equal_target({"runs": {"ours": fast}}, True).endswith("not measured (Accelerate: not run)")
    assert _report.equal_target(None, True).endswith("not measured (the infer part gave no result)")


def test_step_and_tier_targets():
    train = {"floors": {"disk_source": "fio"},
             "gpt2": {"step_s": 1.1, "bound_s": 1.0, "over_bound": 1.1, "breakdown": {}}}
    assert _report.step_target(train, True).endswith("1.10x its floor 1.000 s: met")
    train["gpt2"]["over_bound"] = 1.27
    assert _report.step_target(train, True).endswith(": not met")
    del train["gpt2"]["breakdown"]
    assert _report.step_target(train, True).endswith("not measured (the breakdown is missing)")
    assert "not measured (GPT-2 small was not trained)" in _report.step_target({"custom": {"over_bound": 2.0}}, True)
    counts = {"tests": 44, "passed": 44, "failed": 0, "errors": 0, "skipped": 0}
    assert _report.tier_target(counts, True).endswith(": met")
    assert _report.tier_target({**counts, "passed": 43, "failed": 1}, True).endswith(": not met")
    assert _report.tier_target({**counts, "passed": 0, "skipped": 44}, False).startswith("gpu test tier")
    assert "not measured (no CUDA" in _report.tier_target({**counts, "passed": 0, "skipped": 44}, False)


def test_nvme_waits_time_unfinished_futures_by_direction_and_put_everything_back(tmp_path):
    start, result, exception = AioHandle._start, IOFuture.result, IOFuture.exception
    data = torch.arange(4096 * 10 + 1, dtype=torch.uint8)
    back = torch.empty_like(data)
    with AioHandle() as handle, NvmeWaits() as waits:
        with pytest.raises(RuntimeError, match="one count at a time"):
            NvmeWaits().__enter__()
        assert handle.write(data, tmp_path / "f").result() == data.numel()
        assert handle.read(back, tmp_path / "f").result() == data.numel()
        assert waits.snapshot().keys() == {"read", "write", "other_read", "other_write"}
        assert all(v >= 0 for v in waits.snapshot().values())
    assert torch.equal(back, data)
    assert (AioHandle._start, IOFuture.result, IOFuture.exception) == (start, result, exception)


def test_breakdown_on_the_cpu_counts_operators_and_given_syncs():
    prof = _trace.profiler(cuda=False)
    with prof:
        a = torch.ones(64, 64)
        (a @ a).add_(1).clone()
    b = _trace.breakdown(prof, wall_s=0.5, units=2, cuda=False, host_syncs={"to host": 4})
    assert b["basis"].startswith("cpu:") and b["kernels_s"] > 0 and b["syncs"] == 2.0 and b["sync_s"] is None
    assert b["wall_s"] == 0.25 and b["host_s"] <= b["wall_s"]
    rows = _trace.top_rows(prof, 3)
    assert 0 < len(rows) <= 3 and any(r["name"] == "aten::mm" for r in _trace.top_rows(prof))
    table = _trace.table(rows, 2, "token")
    assert table.startswith("| operator or kernel | calls / token |") and len(table.splitlines()) == 2 + len(rows)
    with pytest.raises(ValueError, match="units must be at least 1"):
        _trace.breakdown(prof, wall_s=1.0, units=0, cuda=False)


def _run(command: list[str], env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(command, env={**os.environ, **(env or {})}, capture_output=True, text=True, check=False,
                          timeout=120)


@pytest.mark.parametrize("args, message", [
    ([], "gpu_bundle: OUTDIR is missing; usage: scripts/gpu_bundle.sh OUTDIR"),
    (["OUT", "--bogus"], "gpu_bundle: unknown option --bogus"),
    (["A", "B"], "gpu_bundle: one OUTDIR only (got A and B)"),
    (["OUT", "--fio-source"], "gpu_bundle: --fio-source needs a tarball"),
    (["OUT", "--fio-source", "/nonexistent/fio.tar.gz"], "--fio-source /nonexistent/fio.tar.gz: no such file"),
])
def test_the_bundle_script_refuses_bad_arguments(tmp_path, args, message):
    done = _run(["bash", str(BUNDLE), *args])
    assert done.returncode == 2 and message in done.stderr
    assert not (tmp_path / "OUT").exists()


def test_the_bundle_script_names_each_missing_tool(tmp_path):
    tools = tmp_path / "bin"
    tools.mkdir()
    (tools / "bash").symlink_to(shutil.which("bash"))
    done = _run([str(tools / "bash"), str(BUNDLE), str(tmp_path / "out")],
                env={"PATH": str(tools), "PYTHON": str(tmp_path / "no-python")})
    assert done.returncode == 2, done.stderr
    for tool in ("no-python with pip", "tar (to build fio", "gcc (to build fio", "make (to build fio", "apt-get"):
        assert f"gpu_bundle: missing: {tmp_path / tool if tool.startswith('no-python') else tool}" in done.stderr
    assert not (tmp_path / "out").exists()


def test_the_bundle_script_says_in_one_line_when_the_network_is_unreachable(tmp_path):
    fake = tmp_path / "python"  # a pip that finds no index, as without network
    fake.write_text("#!/bin/sh\n[ \"$3\" = download ] || exit 0\n"
                    "echo 'WARNING: Retrying after connection broken: Temporary failure in name resolution'\n"
                    "echo 'ERROR: No matching distribution found for liburing'\nexit 1\n")
    fake.chmod(0o755)
    done = _run(["bash", str(BUNDLE), str(tmp_path / "out"), "--no-fio"], env={"PYTHON": str(fake)})
    assert done.returncode == 3
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpu_bundle: no network: pip could not download liburing")
    assert "Temporary failure in name resolution" in lines[0]


def test_the_check_script_uses_a_bundle_and_says_what_is_in_it(tmp_path):
    bundle = tmp_path / "bundle"
    (bundle / "bin").mkdir(parents=True)
    (bundle / "bin" / "fio").write_text("#!/bin/sh\necho fio-3.33\n")
    (bundle / "bin" / "fio").chmod(0o755)
    script = str(REPO / "scripts" / "gpu_check.sh")
    done = _run(["bash", script, str(tmp_path / "out"), "--bundle", str(bundle)], env={"PYTHON": "/usr/bin/env"})
    assert f"gpu_check: bundle {bundle}: fio {bundle}/bin/fio, liburing not in it" in done.stdout
    assert done.returncode == 2 and "set PYTHON to the interpreter that has torch" in done.stderr  # then it goes on
    done = _run(["bash", script, str(tmp_path / "out")], env={"GPU_BUNDLE": str(tmp_path / "nowhere")})
    assert done.returncode == 2 and f"bundle {tmp_path / 'nowhere'}: no such folder" in done.stderr
    done = _run(["bash", script, "--bundle"])
    assert done.returncode == 2 and "--bundle needs the folder" in done.stderr


def test_the_profile_part_refuses_without_a_gpu_and_measures_nothing(tmp_path):
    from benchmarks.gpu import profile
    from offload.device import cuda_available

    if cuda_available():
        pytest.skip("CUDA is available: the benchmark would run")
    with pytest.raises(SystemExit, match=r"benchmarks.gpu profile: needs a GPU, and CUDA is not available here"):
        profile.main(["--dir", str(tmp_path), "--scale", "0.025", "--layers", "2", "--shards", "1"])
    with pytest.raises(SystemExit):  # argparse: at least the first token and one decode step
        profile.main(["--dir", str(tmp_path), "--device", "simulated", "--new-tokens", "2"])
    assert not any(tmp_path.iterdir())
