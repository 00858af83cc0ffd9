"""One memory budget for a node of several ranks (issue 50): ``torchrun --nproc_per_node N`` with
``max_in_cpu: "auto"``, all N ranks inside one memory cgroup whose limit is the one-rank run's peak x 1.2.

    python -m benchmarks.node_memory --dir /work/tmp/node --model gpt2-medium --ranks 2,4 --steps 3
    python -m benchmarks.node_memory --dir /tmp/x --model tiny --ranks 2 --steps 2     # what the test runs

1. One rank alone (``torchrun --nproc_per_node 1``: world size 1, ``LOCAL_WORLD_SIZE`` 1) in a memory cgroup
   without a limit: a GPT-2 of random weights (seed 0) built under `offload.zero.Init`, parameters and
   optimizer state on NVMe under ``--dir``, ``max_in_cpu: "auto"``, trains ``--steps`` steps of a global batch
   of ``--batch`` sequences of ``--seq`` tokens (gradient clipping 0: the updates run during backward). Its
   peak: the cgroup's (page cache and torchrun's own process included), beside the rank's kernel
   high-water mark (VmHWM).
2. For each N of ``--ranks``: a new cgroup limited to ``--slack`` (1.2) x that peak, and torchrun with N ranks
   inside it, the same global batch split over the ranks. Reported: each rank's VmHWM and their sum, the
   cgroup's peak, limit hits (v1 ``memory.failcnt``, v2 ``memory.events`` max: charges that met the
   limit) and OOM kills, the node's memory as rank 0's plan found it (its share x ``LOCAL_WORLD_SIZE``), and
   the losses (the ranks' mean each step) against world size 1's: fp32 within ``LOSS_RTOL``, bf16 within
   ``LOSS_RTOL_BF16`` (its reductions round differently).
3. Targets per N: no OOM kill, no limit hit, the sum of the ranks' peaks within the plan's node total,
   losses equal world size 1's.

Where no memory cgroup can be made (no root, no memory controller), that is said and every run goes
without one (the limit targets are then "not measured").
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks._cgroup import UNBOUNDED, MemoryCgroup
from benchmarks._common import RANK_VARIABLES, REPO, child_env, free_port

MODELS = {  # GPT2Config keywords
    "gpt2-medium": {"n_layer": 24, "n_embd": 1024, "n_head": 16, "vocab_size": 50257, "n_positions": 1024},
    "gpt2": {"n_layer": 12, "n_embd": 768, "n_head": 12, "vocab_size": 50257, "n_positions": 1024},
    "tiny": {"n_layer": 2, "n_embd": 64, "n_head": 2, "vocab_size": 512, "n_positions": 64},
}
SLACK = 1.2
"""The node's cgroup limit: the one-rank run's peak times this."""
LOSS_RTOL = 1e-4
"""fp32: the ranks' mean loss within this (relative) of world size 1's: only the reductions' order differs."""
LOSS_RTOL_BF16 = 2e-3
"""bf16: the gradients are reduced in bf16 (``communication_data_type``), so the sums round differently."""
LAUNCH_TIMEOUT_S = 3600
"""A torchrun launch that takes longer is killed (a rank stuck in a collective after its partner died)."""


def _gib(nbytes: float) -> str:
    return f"{nbytes / (1 << 30):.2f} GiB"


# ---------------------------------------------------------------- the rank (in torchrun's child processes)

def _rss_now() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def _engine_config(payload: dict, world: int) -> dict:
    swap = {"device": "nvme", "nvme_path": payload["swap_dir"]}
    config = {"train_batch_size": payload["batch"], "train_micro_batch_size_per_gpu": payload["batch"] // world,
              "gradient_clipping": 0.0,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01, "eps": 1e-6}},
              "zero_optimization": {"stage": 3, "offload_param": {**swap, "max_in_cpu": "auto"},
                                    "offload_optimizer": dict(swap)}}
    if payload["dtype"] == "bf16":
        config["bf16"] = {"enabled": True}
    return config


def rank_main(payload: dict) -> dict:
    """One rank of a run (``RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE`` from torchrun): builds the model under
    `offload.zero.Init`, trains ``payload["steps"]`` steps of its share of each global batch and returns its
    figures (losses: the ranks' mean; peak RSS: VmHWM; RSS after each phase; rank 0: the plan and the
    memory it found)."""
    import torch
    import transformers

    import offload
    from offload.device import host_memory
    from benchmarks._common import high_water_mark

    logging.basicConfig(level=logging.WARNING, format=f"[rank {os.environ.get('RANK', '0')}] %(message)s")
    logging.getLogger("offload").setLevel(logging.INFO)  # "auto"'s figures in torchrun's log, kept on failure
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    phase_file = Path(payload["out"], f"rank{rank}.phase")

    def phase(name: str) -> None:  # where a rank the OOM killer stops was: the launcher reads it
        phase_file.write_text(name)

    rss = {"imported": _rss_now()}
    phase("build")
    config = _engine_config(payload, world)
    memory = host_memory()  # what this rank's share is before it takes any: the plan reads it again
    torch.manual_seed(0)
    gpt2 = transformers.GPT2Config(**payload["model"], resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    with offload.zero.Init(config_dict_or_path=config):
        model = transformers.GPT2LMHeadModel(gpt2)
    rss["built"] = _rss_now()
    phase("initialize")
    engine, *_ = offload.initialize(model=model, config=config)
    rss["initialized"] = _rss_now()
    gen = torch.Generator().manual_seed(1)
    losses = []
    for step in range(payload["steps"]):
        phase(f"step {step + 1}")
        batch = torch.randint(0, gpt2.vocab_size, (payload["batch"], payload["seq"]), generator=gen)
        share = batch.chunk(world)[rank]
        loss = engine(share, labels=share).loss
        engine.backward(loss)
        engine.step()
        mean = loss.detach().float().clone()
        if world > 1:
            torch.distributed.all_reduce(mean)
            mean /= world
        losses.append(mean.item())
    rss["trained"] = _rss_now()
    phase("close")
    plan = engine.plan
    figures = {"rank": rank, "world": world, "local_world": memory.ranks, "losses": losses,
               "peak_rss": high_water_mark(), "rss": rss, "cgroup": _own_memory_cgroup(),
               "share_available": memory.available, "share_total": memory.total, "memory_source": memory.source,
               "max_in_cpu": plan.max_in_cpu, "in_memory_bytes": plan.in_memory[1], "on_disk_bytes": plan.on_disk[1],
               "plan": plan.describe()}
    engine.close()
    if world > 1:
        torch.distributed.barrier()  # no rank tears its connections down while another still uses them
        torch.distributed.destroy_process_group()
    return figures


def _own_memory_cgroup() -> str:
    """The memory cgroup this process is in (/proc/self/cgroup), "" where none is named."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(",") or controllers == "":
            return path
    return ""


# ---------------------------------------------------------------- the launcher

def launch(ranks: int, payload: dict, out_dir: Path, group: MemoryCgroup | None) -> dict:
    """``torchrun --nproc_per_node ranks`` of `rank_main` inside ``group`` (torchrun's own process too); the
    ranks' figures by rank, and ``error`` (the end of torchrun's output) where it failed."""
    out_dir.mkdir(parents=True, exist_ok=True)
    payload_file = out_dir / "payload.json"
    payload_file.write_text(json.dumps({**payload, "out": str(out_dir)}))
    # torchrun's and the engine's defaults, as a user's plain launch gets them
    env = child_env(drop=(*RANK_VARIABLES, "OMP_NUM_THREADS", "MALLOC_MMAP_THRESHOLD_"))
    if payload.get("mmap_threshold") is not None:
        env["MALLOC_MMAP_THRESHOLD_"] = str(payload["mmap_threshold"])
    torchrun = Path(sys.executable).with_name("torchrun")
    command = ([str(torchrun)] if torchrun.exists() else [sys.executable, "-m", "torch.distributed.run"]) + [
        "--nnodes", "1", "--nproc_per_node", str(ranks), "--master_addr", "127.0.0.1",
        "--master_port", str(free_port()), "-m", "benchmarks.node_memory", "--worker", str(payload_file)]
    start = time.perf_counter()
    log = out_dir / "torchrun.log"
    with open(log, "w") as output:
        agent = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT, env=env,
                                 preexec_fn=group.enter if group is not None else None)
        agent_peak, rank_peaks = 0, {}
        while True:  # VmHWM only grows: the last read before a process exits is its peak, or nearly
            agent_peak = max(agent_peak, _high_water_mark_of(agent.pid))
            rank_peaks.update(_ranks_high_water_marks(agent.pid))
            try:
                returncode = agent.wait(timeout=0.5)
                break
            except subprocess.TimeoutExpired:
                if time.perf_counter() - start > LAUNCH_TIMEOUT_S:
                    agent.kill()
    result: dict[str, Any] = {"ranks": ranks, "seconds": time.perf_counter() - start, "returncode": returncode,
                              "agent_peak_rss": agent_peak, "per_rank": []}
    for r in range(ranks):
        path = out_dir / f"rank{r}.json"
        if path.exists():
            result["per_rank"].append(json.loads(path.read_text()))
    if returncode or len(result["per_rank"]) != ranks:
        result["error"] = f"torchrun exit status {returncode}: " + _failure(log.read_text())
        result["log"] = str(shutil.copy(log, out_dir.parent.parent / f"node-memory-{ranks}-ranks.log"))
        phases = {r: (out_dir / f"rank{r}.phase").read_text() for r in range(ranks)
                  if (out_dir / f"rank{r}.phase").exists()}
        result["stopped"] = [{"rank": r, "phase": phases.get(r, "import"), "peak_rss_sampled": rank_peaks.get(r, 0)}
                             for r in range(ranks)]
    return result


def _ranks_high_water_marks(agent_pid: int) -> dict[int, int]:
    """{RANK: VmHWM} of torchrun's child processes now (those gone or without RANK left out)."""
    import psutil

    found = {}
    try:
        children = psutil.Process(agent_pid).children(recursive=True)
    except psutil.Error:
        return found
    for child in children:
        try:
            rank = child.environ().get("RANK")
        except psutil.Error:
            continue
        hwm = _high_water_mark_of(child.pid)
        if rank is not None and rank.isdigit() and hwm:
            found[int(rank)] = hwm
    return found


def _high_water_mark_of(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _failure(log: str) -> str:
    """The lines of torchrun's output that say why: each failed rank's exit code, and the last error line."""
    lines = [line.strip() for line in log.splitlines()]
    codes = [f"{rank.split(':')[1].split('(')[0].strip()} exit code {code.split(':')[1].split('(')[0].strip()}"
             for rank, code in zip(
        (l for l in lines if l.startswith("rank ")), (l for l in lines if l.startswith("exitcode")))]
    errors = [l for l in lines if re.match(r"\w*(Error|Exception)\b", l)]
    return "; ".join([f"rank {c}" for c in codes] + errors[-1:]) or " | ".join(lines[-5:])


def _run_in_group(ranks: int, payload: dict, out_dir: Path, limit: int | None, use_cgroups: bool) -> dict:
    group = MemoryCgroup.create("offload-node") if use_cgroups else "cgroups not used"
    if isinstance(group, str):
        result = launch(ranks, payload, out_dir, None)
        result["memory_label"] = UNBOUNDED
        return result
    try:
        group.set_limit(limit)
        result = launch(ranks, payload, out_dir, group)
        result.update(cgroup=str(group.path), cgroup_limit=limit, cgroup_peak=group.peak(),
                      cgroup_limit_hits=group.limit_hits(), cgroup_oom_kills=group.oom_kills())
    finally:
        group.close()
    return result


# ---------------------------------------------------------------- figures and targets

def node_total(run: dict) -> int:
    """The node's memory as rank 0's plan found it: its share (``HostMemory.total``, 1/``LOCAL_WORLD_SIZE`` of
    the cgroup's limit or MemTotal) x ``LOCAL_WORLD_SIZE``."""
    rank0 = run["per_rank"][0]
    return rank0["share_total"] * rank0["local_world"]


def plan_budget_line(plan: str) -> str:
    """The plan's line saying how "auto" found ``max_in_cpu`` (this rank's share of the node), "" if none."""
    found = re.search(r"max_in_cpu [\d,]+ elements = (.*)", plan)
    return found.group(1) if found else ""


def targets(one: dict, run: dict, dtype: str) -> list[tuple[str, bool | None, str]]:
    """(target, met: True/False, None where not measured, the figures) for a run of several ranks."""
    if "error" in run:
        return [("the run", False, run["error"])]
    rtol = LOSS_RTOL if dtype == "fp32" else LOSS_RTOL_BF16
    ref, got = one["per_rank"][0]["losses"], run["per_rank"][0]["losses"]
    worst = max(abs(a - b) / abs(a) for a, b in zip(ref, got))
    rows = [("losses equal world size 1's", len(ref) == len(got) and worst <= rtol,
             f"largest relative difference {worst:.1e} (tolerance {rtol:g}, {dtype})")]
    total, peaks = node_total(run), sum(r["peak_rss"] for r in run["per_rank"])
    rows.append(("the sum of the ranks' peaks within the plan's node total", peaks <= total,
                 f"{_gib(peaks)} against {_gib(total)}"))
    if "cgroup" not in run:
        rows += [("no OOM kill", None, UNBOUNDED), ("no limit hit", None, UNBOUNDED)]
    else:
        rows.append(("no OOM kill", run["cgroup_oom_kills"] == 0, f"{run['cgroup_oom_kills']} OOM kills"))
        rows.append(("no limit hit (no failed charge)", run["cgroup_limit_hits"] == 0,
                     f"{run['cgroup_limit_hits']} charges met the limit"))
    inside = [r["cgroup"] for r in run["per_rank"]]
    if "cgroup" in run:
        rows.append(("every rank inside the node's cgroup", all(run["cgroup"].endswith(c) and c for c in inside),
                     ", ".join(inside)))
    return rows


def _print_run(name: str, run: dict) -> None:
    if "error" in run:
        cgroup = (f"cgroup peak {_gib(run['cgroup_peak'])}, {run['cgroup_limit_hits']} limit hits, "
                  f"{run['cgroup_oom_kills']} OOM kills" if "cgroup" in run else UNBOUNDED)
        print(f"{name}: FAILED after {run['seconds']:.0f} s: {run['error']} ({cgroup})")
        print(f"  torchrun's output: {run['log']}")
        for r in run.get("stopped", []):
            print(f"  rank {r['rank']}: stopped in {r['phase']}, peak RSS {_gib(r['peak_rss_sampled'])} at the last "
                  f"sample (every 0.5 s)")
        return
    ranks = run["per_rank"]
    cgroup = (f"cgroup limit {'none' if run['cgroup_limit'] is None else _gib(run['cgroup_limit'])}, peak "
              f"{_gib(run['cgroup_peak'])}, {run['cgroup_limit_hits']} limit hits, {run['cgroup_oom_kills']} OOM kills"
              if "cgroup" in run else UNBOUNDED)
    print(f"{name}: {run['seconds']:.0f} s; {cgroup}; plan's node total {_gib(node_total(run))}; torchrun's own "
          f"peak RSS {_gib(run['agent_peak_rss'])}")
    for r in ranks:
        phases = ", ".join(f"{k} {_gib(v)}" for k, v in r["rss"].items())
        print(f"  rank {r['rank']}: peak RSS {_gib(r['peak_rss'])} (RSS {phases}); max_in_cpu {r['max_in_cpu']:,} "
              f"elements ({r['in_memory_bytes'] / 1e9:.3f} GB in memory, {r['on_disk_bytes'] / 1e9:.3f} GB on NVMe)")
    print(f"  sum of the ranks' peaks {_gib(sum(r['peak_rss'] for r in ranks))}; losses "
          + ", ".join(f"{x:.6f}" for x in ranks[0]["losses"]))
    print(f"  rank 0's \"auto\": {plan_budget_line(ranks[0]['plan']) or '(no auto line in the plan)'}")


def main(argv: list[str] | None = None) -> dict:
    """Run the benchmark (see the module docstring); returns its figures and targets."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", help="directory for the swap files and the ranks' results (a temporary one inside it)")
    ap.add_argument("--model", choices=sorted(MODELS), default="gpt2-medium")
    ap.add_argument("--ranks", default="2,4", help="comma-separated numbers of ranks on the node")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--batch", type=int, default=4, help="global batch (split over the ranks; divisible by each)")
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    ap.add_argument("--slack", type=float, default=SLACK, help="the node's limit: the one-rank peak x this")
    ap.add_argument("--no-cgroups", action="store_true", help="run without memory cgroups")
    ap.add_argument("--mmap-threshold", type=int, default=None,
                    help="glibc's MALLOC_MMAP_THRESHOLD_ for every process (default: glibc's own, which keeps freed "
                         "blocks in the heap)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)  # a rank under torchrun: the payload's JSON file
    args = ap.parse_args(argv)
    if args.worker:
        payload = json.loads(Path(args.worker).read_text())
        figures = rank_main(payload)
        Path(payload["out"], f"rank{figures['rank']}.json").write_text(json.dumps(figures))
        return figures
    if args.dir is None:
        ap.error("--dir is required")
    ranks = [int(n) for n in args.ranks.split(",")]
    bad = [n for n in ranks if n < 2 or args.batch % n]
    if bad:
        ap.error(f"--ranks {args.ranks}: each must be at least 2 and divide --batch {args.batch} (not {bad})")
    Path(args.dir).mkdir(parents=True, exist_ok=True)
    print(f"config: model {args.model} {json.dumps(MODELS[args.model])}, {args.dtype}, global batch {args.batch} x "
          f"{args.seq} tokens, {args.steps} steps, ranks 1 then {ranks}, limit {args.slack} x the one-rank peak, "
          f"MALLOC_MMAP_THRESHOLD_ {args.mmap_threshold or 'glibc default'}, cpus {os.cpu_count()}, dir {args.dir}",
          flush=True)
    work = Path(tempfile.mkdtemp(dir=args.dir, prefix="node-memory-"))
    results: dict[str, Any] = {"model": args.model, "dtype": args.dtype, "steps": args.steps, "batch": args.batch,
                               "seq": args.seq, "slack": args.slack, "runs": {}, "targets": {}}
    try:
        def run(n: int, limit: int | None) -> dict:
            swap = work / f"swap-{n}"
            swap.mkdir()
            payload = {"model": MODELS[args.model], "dtype": args.dtype, "batch": args.batch, "seq": args.seq,
                       "steps": args.steps, "swap_dir": str(swap), "mmap_threshold": args.mmap_threshold}
            result = _run_in_group(n, payload, work / f"out-{n}", limit, not args.no_cgroups)
            shutil.rmtree(swap, ignore_errors=True)
            _print_run(f"{n} rank{'s' if n > 1 else ''}", result)
            return result

        one = results["runs"][1] = run(1, None)
        if "error" in one:
            raise RuntimeError(f"the one-rank run failed: {one['error']}")
        peak = one.get("cgroup_peak") or one["per_rank"][0]["peak_rss"]
        limit = None if "cgroup" not in one else int(args.slack * peak)
        results["limit"] = limit
        print(f"one rank's peak {_gib(peak)} ({'its cgroup' if 'cgroup' in one else 'its VmHWM'}); the node's limit "
              + ("none (" + UNBOUNDED + ")" if limit is None else f"{args.slack} x = {_gib(limit)}"), flush=True)
        for n in ranks:
            results["runs"][n] = run(n, limit)
        print("targets:")
        for n in ranks:
            rows = targets(one, results["runs"][n], args.dtype)
            results["targets"][n] = [{"target": t, "met": m, "figures": f} for t, m, f in rows]
            for t, met, figures in rows:
                verdict = "not measured" if met is None else "met" if met else "NOT met"
                print(f"  {n} ranks: {t}: {verdict} ({figures})")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return results


if __name__ == "__main__":
    main()
