"""Soak test: training killed and failed at random moments must end exactly where an uninterrupted run
ends, leaving nothing behind.

    python -m benchmarks.soak --minutes 20
    python -m benchmarks.soak --minutes 0 --kills 2 --faults 1 --model mlp --steps 6 --save-every 2   # tiny

A tiny model (GPT-2 of two layers, or a small MLP) trains with its parameters and optimizer state on
NVMe in a child process, on data keyed by the step number, saving a checkpoint every --save-every
steps. The child prints a marker on its stdout pipe before each phase ("init start", "load start",
"step N start", "save N start", ...); the parent picks one of them at random and sends SIGKILL at a
random delay after it (up to 1.2 times that phase's mean duration), so kills land inside
initialisation, loading, steps and saves. In some runs the child injects an I/O failure
(tensorio.testing ``FailNth`` at a random request, ENOSPC or EIO, reads, writes or both; the number
and kind are passed in SOAK_FAULT) and, after the failure, resumes from the last checkpoint as a user
would. Each new child resumes from the last checkpoint. Once a child reaches the last step, that
campaign is checked against an uninterrupted reference run of the same config:

- every loss any child reported, and the final parameters, bit for bit;
- swap files left by each kill are listed as stale (`stale_swap_files`) and removed by the next
  child's first swap file; after the last child closes, the swap directory is empty;
- no staging folder, ``.latest-*`` or lock file is left in the checkpoint folder;
- the last child, after ``engine.close()``: open descriptors (/proc/self/fd) and Python threads as
  before ``initialize``, VmLck (/proc/self/status) 0 kB; the parent's own descriptors as at its start.

Campaigns alternate between the two step paths (updates during backward, and the chunked step with
gradient clipping) and repeat until --minutes have passed and at least --kills kills and --faults
faults have happened. The summary (and a JSON line) gives kills survived, faults injected,
mismatches and leftovers; the exit status is 1 if anything mismatched or was left.
"""

from __future__ import annotations

import argparse
import collections
import errno
import json
import os
import queue
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks._common import REPO

MODELS = ("gpt2", "mlp")
FAULT_ENV = "SOAK_FAULT"
"""Set in a child's environment as "<n> <errno> <op or any>": fail the n-th tensorio request."""

_ERRNOS = {"ENOSPC": errno.ENOSPC, "EIO": errno.EIO}

_END_OF_PHASE = {"init": "init", "resumed": "load", "step": "step", "save": "save"}
"""First word of the marker that ends a phase (``init end``, ``resumed N``, ``step N end``, ``save N end``)."""

_REMOVED = "removed the stale swap file "


# ---- the child: one training process ------------------------------------------------------------


def _emit(line: str) -> None:
    print(line, flush=True)


def _build(kind: str):
    import torch
    from torch import nn

    torch.manual_seed(0)
    if kind == "mlp":
        return nn.Sequential(nn.Linear(16, 33), nn.GELU(), nn.LayerNorm(33), nn.Linear(33, 8))
    import transformers

    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=256, n_positions=32, bos_token_id=0,
                                     eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(config)


def _loss(kind: str, engine, step: int, seed: int):
    """The loss of training step ``step`` (from 1): its batch depends on the step number alone."""
    import torch

    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    if kind == "mlp":
        x, y = torch.randn(4, 16, generator=g), torch.randn(4, 8, generator=g)
        return torch.nn.functional.mse_loss(engine(x), y)
    tokens = torch.randint(0, 256, (2, 16), generator=g)
    return engine(tokens, labels=tokens).loss


def _engine_config(nvme: str, clipping: float) -> dict:
    zero = {"stage": 3, "stage3_param_persistence_threshold": 0, "sub_group_size": 4096,
            "offload_param": {"device": "nvme", "nvme_path": nvme, "max_in_cpu": 0, "buffer_size": 16384,
                              "buffer_count": 2, "pin_memory": True},
            "offload_optimizer": {"device": "nvme", "nvme_path": nvme, "pipeline_read": True,
                                  "pipeline_write": True, "pin_memory": True}}
    return {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": clipping, "zero_optimization": zero,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}}}


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _vmlck_kb() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmLck:"):
                return int(line.split()[1])
    return 0


def _child(spec: dict) -> None:
    """One training process: resume from the checkpoint (if any), train to the last step, saving on
    the way; print a marker before and after each phase and a JSON report at the end."""
    import gc

    import torch  # noqa: F401  (imported before the descriptor count: torch opens its own)
    from safetensors.torch import save_file

    from offload import initialize
    from tensorio import TensorIOError
    from tensorio.testing import FailNth, inject_faults

    _emit(f"start {os.getpid()}")
    model = _build(spec["model"])
    gc.collect()
    fds, threads, locked = _fds(), threading.active_count(), _vmlck_kb()
    _emit("init start")
    # the caller keeps the optimizer, as most do: close() must release what it holds too
    engine, optimizer, _, _ = initialize(model=model, config=_engine_config(spec["nvme"], spec["clipping"]))
    _emit("init end")
    ckpt, steps, every = spec["ckpt"], spec["steps"], spec["save_every"]
    fault = os.environ.get(FAULT_ENV)
    rules = []
    if fault:
        n, name, op = fault.split()
        rules.append(FailNth(int(n), _ERRNOS[name], op=None if op == "any" else op))
    failures = (TensorIOError, OSError)

    def resume() -> int:
        for _ in range(3):  # an injected fault fails one request; a real error fails every attempt
            _emit("load start")
            try:
                engine.load_checkpoint(ckpt)
            except failures as error:
                _emit(f"fault load: {type(error).__name__}: {error}".replace("\n", " "))
                continue
            _emit(f"resumed {engine.global_steps}")
            return engine.global_steps
        raise RuntimeError(f"could not load {ckpt} three times in a row")

    with inject_faults(*rules) as injected:
        if ckpt is None:
            step = 0  # the reference: no checkpoints
        elif os.path.exists(os.path.join(ckpt, "latest")):
            step = resume()
        else:
            _emit("fresh")
            step = 0
            _emit("save 0 start")
            engine.save_checkpoint(ckpt)  # something to resume from after a fault in the first steps
            _emit("save 0 end")
        while step < steps:
            phase = "step"
            try:
                _emit(f"step {step + 1} start")
                loss = _loss(spec["model"], engine, step + 1, spec["seed"])
                engine.backward(loss)
                engine.step()
                step += 1
                _emit(f"step {step} end {loss.item().hex()}")
                if ckpt is not None and (step % every == 0 or step == steps):
                    phase = "save"
                    _emit(f"save {step} start")
                    engine.save_checkpoint(ckpt)
                    _emit(f"save {step} end")
            except failures as error:
                _emit(f"fault {phase}: {type(error).__name__}: {error}".replace("\n", " "))
                step = resume()
    requests = injected.count
    save_file({name: tensor.clone() for name, tensor in engine.full_parameters()}, spec["final"])  # tied: one copy each
    engine.close()
    gc.collect()
    closed = {"fds": _fds() - fds, "threads": threading.active_count() - threads, "vmlck_kb": _vmlck_kb() - locked}
    del engine, optimizer, model
    gc.collect()
    dropped = {"fds": _fds() - fds, "threads": threading.active_count() - threads, "vmlck_kb": _vmlck_kb() - locked}
    _emit("done " + json.dumps({"requests": requests, "after_close": closed, "after_drop": dropped}))


# ---- the parent: kills, faults and checks -------------------------------------------------------


class Run:
    """One child process: its marker lines as they arrive, and a SIGKILL at a chosen moment."""

    def __init__(self, spec: dict, log: Path, fault: str | None) -> None:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
        env.pop(FAULT_ENV, None)
        if fault:
            env[FAULT_ENV] = fault
        self.log = log
        with open(log, "w") as err:
            self.process = subprocess.Popen([sys.executable, "-m", "benchmarks.soak", "--child", json.dumps(spec)],
                                            stdout=subprocess.PIPE, stderr=err, text=True, env=env)
        self.lines: queue.Queue = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.process.stdout:
            self.lines.put((time.monotonic(), line.rstrip("\n")))
        self.lines.put(None)

    def kill(self) -> None:
        self.process.send_signal(signal.SIGKILL)

    def finish(self) -> int:
        """Wait for the exit; return the exit status (negative: killed by that signal)."""
        status = self.process.wait()
        self._reader.join()
        self.process.stdout.close()
        return status

    def stderr_tail(self) -> str:
        return self.log.read_text()[-3000:]


class Soak:
    def __init__(self, args: argparse.Namespace, workdir: Path) -> None:
        self.args = args
        self.rng = random.Random(args.seed)
        self.workdir = workdir
        self.nvme = workdir / "swap"
        self.nvme.mkdir()
        (workdir / "logs").mkdir()
        self.runs = 0
        self.durations: dict[str, list[float]] = collections.defaultdict(list)
        self.kills: collections.Counter = collections.Counter()
        self.faults: collections.Counter = collections.Counter()
        self.faults_not_reached = 0
        self.stale_after_kills: set[str] = set()
        self.reclaimed: set[str] = set()
        self.losses_checked = 0
        self.loss_mismatches = 0
        self.param_mismatches = 0
        self.campaigns = 0
        self.leftover_swap_files = 0
        self.leftover_staging = 0
        self.growth = {when: {"fds": 0, "threads": 0, "vmlck_kb": 0} for when in ("after_close", "after_drop")}
        """The most a child held at its end beyond what it held before initialize: after engine.close()
        (the caller still holding the optimizer), and after dropping the engine and optimizer."""
        self.hangs = 0
        self.crashes: list[str] = []
        self.requests_per_step: dict[float, float] = {}
        self.references: dict[float, tuple[dict[int, str], dict]] = {}

    # -- one child ---------------------------------------------------------------------------------

    def _spec(self, ckpt: Path | None, clipping: float, final: Path) -> dict:
        return {"model": self.args.model, "steps": self.args.steps, "save_every": self.args.save_every,
                "seed": self.args.seed, "nvme": str(self.nvme), "ckpt": None if ckpt is None else str(ckpt),
                "clipping": clipping, "final": str(final)}

    def _mean(self, kind: str) -> float:
        seen = self.durations[kind][-20:]
        return sum(seen) / len(seen) if seen else 0.05

    def _target(self, kind: str, resumed: int, fresh: bool) -> str | None:
        steps, every = self.args.steps, self.args.save_every
        if kind == "step" and resumed < steps:
            return f"step {self.rng.randint(resumed + 1, steps)} start"
        if kind == "save":
            saves = [s for s in range(resumed + 1, steps + 1) if s % every == 0 or s == steps] + ([0] if fresh else [])
            return f"save {self.rng.choice(saves)} start" if saves else None
        return None

    def run_child(self, spec: dict, *, kill: bool, fault: str | None) -> dict:
        """Run one child; kill it after a random marker when ``kill``; return what it reported."""
        self.runs += 1
        run = Run(spec, self.workdir / "logs" / f"run{self.runs:04d}.err", fault)
        kind = self.rng.choices(["init", "load", "step", "save"], weights=[1, 1, 5, 4])[0] if kill else None
        if kind == "load" and not os.path.exists(os.path.join(spec["ckpt"] or "", "latest")):
            kind = "init"
        target = f"{kind} start" if kind in ("init", "load") else None
        kill_at = killed = None
        resumed, delay = "", 0.0
        losses: list[tuple[int, str]] = []
        faults: list[str] = []
        started: dict[str, float] = {}
        done = None
        while True:
            wait = self.args.hang_seconds if kill_at is None else max(0.0, kill_at - time.monotonic())
            try:
                item = run.lines.get(timeout=wait)
            except queue.Empty:
                if kill_at is not None:
                    run.kill()
                    killed, kill_at = kind, None
                    continue
                self.hangs += 1  # no marker for --hang-seconds
                run.kill()
                self.crashes.append(f"run {self.runs}: no output for {self.args.hang_seconds} s; killed")
                killed = "hang"
                continue
            if item is None:
                break
            now, line = item
            words = line.split()
            if words[-1] == "start":
                started[words[0]] = now
            elif words[0] == "fault":
                faults.append(line)
                started.clear()
            elif words[0] in _END_OF_PHASE and _END_OF_PHASE[words[0]] in started:
                phase = _END_OF_PHASE[words[0]]
                self.durations[phase].append(now - started.pop(phase))
            if words[0] == "step" and words[2] == "end":
                losses.append((int(words[1]), words[3]))
            elif words[0] == "done":
                done = json.loads(line[len("done "):])
            elif words[0] in ("resumed", "fresh"):
                resumed = resumed or line
                if kind in ("step", "save") and target is None:
                    target = self._target(kind, int(words[1]) if words[0] == "resumed" else 0, words[0] == "fresh")
            if line == target and kill_at is None and killed is None:
                delay = self.rng.uniform(0, 1.2 * self._mean(kind))
                kill_at = now + delay
        status = run.finish()
        if killed in ("init", "load", "step", "save") and status == -signal.SIGKILL and done is None:
            self.kills[killed] += 1
        elif status not in (0, -signal.SIGKILL) and killed != "hang":
            self.crashes.append(f"run {self.runs} exited with status {status}:\n{run.stderr_tail()}")
        if fault and faults:
            self.faults[faults[0].split()[1].rstrip(":")] += 1
        elif fault and done is not None:
            self.faults_not_reached += 1
        reclaimed = 0
        for line in run.log.read_text().splitlines():
            if _REMOVED in line:
                self.reclaimed.add(line.split(_REMOVED, 1)[1].split(" (")[0])
                reclaimed += 1
        outcome = ("completed" if done is not None else f"killed {delay * 1000:.0f} ms after {target!r}"
                   if status == -signal.SIGKILL and killed != "hang" else f"exit status {status}")
        injected = f"; fault {fault!r}: {faults[0][:110] if faults else 'not reached'}" if fault else ""
        print(f"  run {self.runs}: {resumed or 'before resuming'}; {outcome}{injected}; "
              f"{reclaimed} stale swap files reclaimed", flush=True)
        return {"status": status, "losses": losses, "done": done, "faults": faults}

    # -- campaigns ---------------------------------------------------------------------------------

    def reference(self, clipping: float) -> tuple[dict[int, str], dict]:
        if clipping not in self.references:
            final = self.workdir / f"reference-{clipping}.safetensors"
            result = self.run_child(self._spec(None, clipping, final), kill=False, fault=None)
            if result["done"] is None:
                raise RuntimeError(f"the reference run failed:\n{self.crashes[-1] if self.crashes else ''}")
            from safetensors.torch import load_file

            self.requests_per_step[clipping] = result["done"]["requests"] / self.args.steps
            self.references[clipping] = (dict(result["losses"]), load_file(final))
            self._check_end_of_child(result["done"])
        return self.references[clipping]

    def campaign(self, clipping: float) -> bool:
        """Train from scratch to the last step through as many killed and failing children as it takes;
        check the result. False when a child failed in a way a user could not resume from."""
        from safetensors.torch import load_file

        from offload.storage.swapfile import is_swap_file_name, stale_swap_files

        ref_losses, ref_params = self.reference(clipping)
        self.campaigns += 1
        ckpt = self.workdir / f"ckpt{self.campaigns}"
        final = self.workdir / f"final{self.campaigns}.safetensors"
        spec = self._spec(ckpt, clipping, final)
        while True:
            kill = sum(self.kills.values()) < self.args.kills or self.rng.random() < self.args.kill_probability
            fault = None
            if sum(self.faults.values()) < self.args.faults or self.rng.random() < self.args.fault_probability:
                last = max(1, round(self.requests_per_step[clipping] * (self.args.save_every + 2)))
                fault = (f"{self.rng.randint(1, last)} {self.rng.choice(sorted(_ERRNOS))} "
                         f"{self.rng.choice(['read', 'write', 'any'])}")
            result = self.run_child(spec, kill=kill, fault=fault)
            for step, loss in result["losses"]:
                self.losses_checked += 1
                if ref_losses.get(step) != loss:
                    self.loss_mismatches += 1
                    self.crashes.append(f"campaign {self.campaigns} step {step}: loss {loss} (reference "
                                        f"{ref_losses.get(step)})")
            if result["done"] is not None:
                self._check_end_of_child(result["done"])
                break
            if result["status"] != -signal.SIGKILL:
                return False
            # nothing runs now: every swap file in the directory is a dead process's
            stale = {entry.path for entry in stale_swap_files(self.nvme)}
            present = {str(self.nvme / name) for name in os.listdir(self.nvme) if is_swap_file_name(name)}
            if stale != present:
                self.crashes.append(f"run {self.runs}: swap files of dead processes not seen as stale: "
                                    f"{sorted(present - stale)}")
            self.stale_after_kills |= stale
        params = load_file(final)
        if params.keys() != ref_params.keys() or any(not params[k].equal(ref_params[k]) for k in params):
            self.param_mismatches += 1
            self.crashes.append(f"campaign {self.campaigns}: final parameters differ from the reference")
        left = [name for name in os.listdir(self.nvme) if is_swap_file_name(name)]
        self.leftover_swap_files += len(left)
        staging = [name for name in os.listdir(ckpt) if name.startswith(".")]
        self.leftover_staging += len(staging)
        if left or staging:
            self.crashes.append(f"campaign {self.campaigns}: left {left + staging}")
        shutil.rmtree(ckpt)
        final.unlink()
        return True

    def _check_end_of_child(self, done: dict) -> None:
        for when, growth in self.growth.items():
            for key in growth:
                growth[key] = max(growth[key], done[when][key])


def _figures(growth: dict) -> str:
    return f"descriptors +{growth['fds']}, threads +{growth['threads']}, VmLck +{growth['vmlck_kb']} kB"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the soak test; print the configuration, progress and a summary; return the summary."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=20.0, help="start campaigns until this much time has passed")
    ap.add_argument("--kills", type=int, default=0, help="at least this many kills (the first runs are all killed)")
    ap.add_argument("--faults", type=int, default=0, help="at least this many injected faults hit")
    ap.add_argument("--model", choices=MODELS, default="gpt2")
    ap.add_argument("--steps", type=int, default=24, help="training steps of a campaign")
    ap.add_argument("--save-every", type=int, default=4, help="steps between checkpoints")
    ap.add_argument("--kill-probability", type=float, default=0.7, help="of each child run")
    ap.add_argument("--fault-probability", type=float, default=0.3, help="of each child run")
    ap.add_argument("--clipping", choices=("both", "0", "1"), default="both",
                    help="gradient_clipping of the campaigns: 0 (updates during backward), 1 (chunked step), both "
                         "(alternating)")
    ap.add_argument("--hang-seconds", type=float, default=600.0, help="a child silent this long counts as hung")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dir", default=None, help="where to make the working directory (default: the system's temp)")
    ap.add_argument("--keep", action="store_true", help="keep the working directory (kept anyway on failure)")
    ap.add_argument("--child", type=json.loads, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        _child(args.child)
        return {}
    if args.steps < 1 or args.save_every < 1:
        raise SystemExit("--steps and --save-every: use integers >= 1")
    fds_before = len(os.listdir("/proc/self/fd"))
    workdir = Path(tempfile.mkdtemp(prefix="tio-soak-", dir=args.dir)).resolve()
    print(f"soak: model={args.model} steps={args.steps} save_every={args.save_every} minutes={args.minutes} "
          f"kills>={args.kills} faults>={args.faults} kill_probability={args.kill_probability} "
          f"fault_probability={args.fault_probability} clipping={args.clipping} seed={args.seed} dir={workdir}",
          flush=True)
    soak = Soak(args, workdir)
    clippings = {"both": [0.0, 1.0], "0": [0.0], "1": [1.0]}[args.clipping]
    start = time.monotonic()
    while True:
        completed = soak.campaign(clippings[soak.campaigns % len(clippings)])
        elapsed = time.monotonic() - start
        if not completed:
            print(f"[{elapsed / 60:5.1f} min] campaign {soak.campaigns}: a child failed; stopping", flush=True)
            break
        print(f"[{elapsed / 60:5.1f} min] campaign {soak.campaigns}: {soak.runs} runs, kills "
              f"{sum(soak.kills.values())}, faults {sum(soak.faults.values())}, loss mismatches "
              f"{soak.loss_mismatches}, parameter mismatches {soak.param_mismatches}", flush=True)
        if (elapsed >= args.minutes * 60 and sum(soak.kills.values()) >= args.kills
                and sum(soak.faults.values()) >= args.faults):
            break
    fd_growth_parent = len(os.listdir("/proc/self/fd")) - fds_before
    still_there = {path for path in soak.stale_after_kills if os.path.lexists(path)}
    summary = {
        "minutes": round((time.monotonic() - start) / 60, 2), "model": args.model, "campaigns": soak.campaigns,
        "child_runs": soak.runs, "kills": sum(soak.kills.values()), "kills_by_phase": dict(soak.kills),
        "faults": sum(soak.faults.values()), "faults_by_phase": dict(soak.faults),
        "faults_not_reached": soak.faults_not_reached, "losses_checked": soak.losses_checked,
        "loss_mismatches": soak.loss_mismatches, "param_mismatches": soak.param_mismatches,
        "stale_swap_files_after_kills": len(soak.stale_after_kills),
        "stale_swap_files_reclaimed": len(soak.reclaimed & soak.stale_after_kills),
        # removed by a child that was killed between the unlink and its log line (kills in "init" aim there)
        "stale_swap_files_removed_unlogged": len(soak.stale_after_kills - soak.reclaimed - still_there),
        "stale_swap_files_never_removed": len(soak.stale_after_kills & still_there),
        "leftover_swap_files": soak.leftover_swap_files, "leftover_staging": soak.leftover_staging,
        "child_after_close": soak.growth["after_close"], "child_after_drop": soak.growth["after_drop"],
        "parent_fd_growth": fd_growth_parent, "hangs": soak.hangs,
        "crashes": len([c for c in soak.crashes if "exited with status" in c]), "completed": completed,
    }
    leaked = [f"{when} {key} +{value}" for when, growth in soak.growth.items() for key, value in growth.items() if value]
    ok = (summary["loss_mismatches"] == summary["param_mismatches"] == summary["leftover_swap_files"]
          == summary["leftover_staging"] == summary["parent_fd_growth"] == summary["hangs"]
          == summary["crashes"] == summary["stale_swap_files_never_removed"] == 0 and not leaked and completed
          and len(soak.crashes) == 0)
    summary["ok"] = ok
    print(f"{summary['campaigns']} campaigns of {args.steps} steps ({args.model}), {summary['child_runs']} child "
          f"runs in {summary['minutes']} min")
    print(f"kills survived: {summary['kills']} {summary['kills_by_phase']}")
    print(f"faults injected: {summary['faults']} {summary['faults_by_phase']} "
          f"({summary['faults_not_reached']} more runs ended before their fault)")
    print(f"mismatches: {summary['loss_mismatches']} of {summary['losses_checked']} losses, "
          f"{summary['param_mismatches']} of {summary['campaigns']} final parameter sets")
    print(f"swap files: {summary['stale_swap_files_after_kills']} stale after kills, "
          f"{summary['stale_swap_files_reclaimed']} reclaimed by the next start with a log line, "
          f"{summary['stale_swap_files_removed_unlogged']} removed by a child killed before its log line, "
          f"{summary['stale_swap_files_never_removed']} never removed; {summary['leftover_swap_files']} swap files "
          f"left at the end of campaigns")
    print(f"leftovers: staging {summary['leftover_staging']}; child at its end, beyond before initialize: after "
          f"engine.close() {_figures(soak.growth['after_close'])}, after dropping engine and optimizer "
          f"{_figures(soak.growth['after_drop'])}; parent descriptors +{summary['parent_fd_growth']}; hangs "
          f"{summary['hangs']}, crashes {summary['crashes']}")
    for problem in soak.crashes[:10]:
        print(f"PROBLEM: {problem}")
    print("RESULT:", "PASS" if ok else f"FAIL (working directory kept: {workdir})")
    if ok and not args.keep:
        shutil.rmtree(workdir)
    print(json.dumps(summary), flush=True)
    return summary


if __name__ == "__main__":
    sys.exit(0 if main().get("ok", True) else 1)
