"""summary.md's sections for issue 51: the breakdowns (generation per token with each side's default, at
equal memory, training per step) and each GPU target met / not met / not measured, with its figures; and
the mixture-of-experts part's (issue 48, `moe_section`).

Every target is judged only on CUDA (``judged``); elsewhere its figures are still shown, and the
verdict says why it is not measured.
"""

from __future__ import annotations

from benchmarks.gpu import _trace

TARGET_DEFAULTS = 1.0
TARGET_EQUAL = 2.0
TARGET_STEP = 1.2
TARGET_TIER = 44
"""Tests of the gpu tier that passed on the H200 of 2026-11-26: the tier must pass whole, at least these."""
VERDICTS = ("met", "not met", "not measured")
TARGETS = ("generation defaults", "generation at equal memory", "GPT-2 small training step", "gpu test tier")
"""Each target's name, the start of its line in summary.md."""

_NOT_GPU = "not measured (no GPU: the simulated device stood in, its times are not a GPU's)"


def _line(name: str, figures: str, verdict: str) -> str:
    return f"{name}: {figures}: {verdict}"


def defaults_target(profile: dict | None, judged: bool) -> str:
    """Ours against Accelerate with each side's default (every weight on the GPU): tokens/s >= 1.0x."""
    name = f"{TARGETS[0]} (ours >= {TARGET_DEFAULTS}x Accelerate's tokens/s, every weight on the GPU)"
    if profile is None:
        return _line(name, "no figure", "not measured (the profile part gave no result)")
    ours, peer = profile["sides"].get("ours", {}), profile["sides"].get("peer", {})
    for side, r in (("ours", ours), ("the peer", peer)):
        if not r.get("tokens_per_s"):
            return _line(name, f"{side} failed", f"not measured ({r.get('error', 'not run')})")
    ratio = ours["tokens_per_s"] / peer["tokens_per_s"]
    figures = f"ours {ours['s_per_token']:.4f} s/token, {peer['label']} {peer['s_per_token']:.4f}: {ratio:.2f}x"
    if not judged or peer.get("label") != "accelerate":
        return _line(name, figures, _NOT_GPU)
    return _line(name, figures, "met" if ratio >= TARGET_DEFAULTS else "not met")


def equal_target(infer: dict | None, judged: bool) -> str:
    """Ours against Accelerate at equal memory: tokens/s >= 2x, ours not OOM-killed."""
    from benchmarks._peers import memory_note

    name = f"{TARGETS[1]} (ours >= {TARGET_EQUAL}x Accelerate's tokens/s, no OOM)"
    if infer is None:
        return _line(name, "no figure", "not measured (the infer part gave no result)")
    ours, peer = infer.get("runs", {}).get("ours", {}), infer.get("runs", {}).get("accelerate")
    oom = ours.get("cgroup_oom_kills") or 0
    if "error" in ours or not ours.get("tokens_per_s"):
        why = f"ours failed ({ours.get('error', 'no figure')}; {memory_note(ours)})"
        return _line(name, why, "not met" if judged else _NOT_GPU)
    figures = f"ours {ours['s_per_token']:.4f} s/token ({memory_note(ours)})"
    if not peer or not peer.get("tokens_per_s"):
        why = peer.get("error", "no figure") if peer else "not run"
        return _line(name, figures, _NOT_GPU if not judged else f"not measured (Accelerate: {why})")
    ratio = ours["tokens_per_s"] / peer["tokens_per_s"]
    figures += f", Accelerate {peer['s_per_token']:.4f} s/token ({memory_note(peer)}): {ratio:.2f}x"
    if not judged:
        return _line(name, figures, _NOT_GPU)
    return _line(name, figures, "met" if ratio >= TARGET_EQUAL and not oom else "not met")


def step_target(train: dict | None, judged: bool) -> str:
    """GPT-2 small's training step within 1.2x its floor, with the breakdown."""
    name = f"{TARGETS[2]} (<= {TARGET_STEP}x its floor, with the breakdown)"
    r = (train or {}).get("gpt2")
    if not isinstance(r, dict) or "over_bound" not in r:
        others = {k: v for k, v in (train or {}).items() if isinstance(v, dict) and "over_bound" in v}
        seen = "; ".join(f"{k}: {v['over_bound']:.2f}x" for k, v in others.items()) or "no training figure"
        return _line(name, f"no GPT-2 small figure ({seen})", "not measured (GPT-2 small was not trained)")
    figures = f"{r['step_s']:.3f} s = {r['over_bound']:.2f}x its floor {r['bound_s']:.3f} s"
    floors = train.get("floors", {})
    if floors.get("disk_source") != "fio":
        figures += " (disk floor from tensorio, not fio)"
    if "breakdown" not in r:
        return _line(name, figures + ", no breakdown", "not measured (the breakdown is missing)")
    if not judged:
        return _line(name, figures, _NOT_GPU)
    return _line(name, figures, "met" if r["over_bound"] <= TARGET_STEP else "not met")


def tier_target(counts: dict | None, judged: bool) -> str:
    """The gpu test tier: passes whole, 44 tests or more."""
    name = f"{TARGETS[3]} (pytest -m gpu passes whole, {TARGET_TIER} or more)"
    if counts is None:
        return _line(name, "no result", "not measured (pytest did not run or left no report)")
    figures = (f"{counts['passed']} passed, {counts['failed']} failed, {counts['errors']} errors, "
               f"{counts['skipped']} skipped of {counts['tests']}")
    if counts["passed"] == 0 or not judged:
        return _line(name, figures, "not measured (no CUDA: the tier skips)")
    ok = counts["failed"] + counts["errors"] == 0 and counts["passed"] >= TARGET_TIER
    return _line(name, figures, "met" if ok else "not met")


def targets(counts: dict | None, train: dict | None, profile: dict | None, infer: dict | None,
            judged: bool) -> list[str]:
    """Issue 51's GPU targets, one line each, in `TARGETS`' order."""
    return [defaults_target(profile, judged), equal_target(infer, judged), step_target(train, judged),
            tier_target(counts, judged)]


def sections(train: dict | None, profile: dict | None, infer: dict | None) -> list[str]:
    """summary.md's breakdown sections (lines): what each part measured, the tables' files named."""
    out: list[str] = []
    done = {r["label"]: r["breakdown"] for r in (profile or {}).get("sides", {}).values() if "breakdown" in r}
    if done:
        files = ", ".join(f"profile-{n}.md" for n in done)
        out += ["", f"Generation with each side's default, per token (benchmarks.gpu profile, {profile['device']}; "
                f"top-20 tables: {files}, generation-breakdown.md):", "", _trace.side_by_side(done, "token")]
    for r in (profile or {}).get("sides", {}).values():
        if "error" in r:
            out += ["", f"Generation with each side's default: {r.get('label', r['kind'])} failed: {r['error']}"]
    runs = (infer or {}).get("runs", {})
    if runs:
        from benchmarks._peers import memory_note

        out += ["", "Generation at equal memory (benchmarks.gpu infer, each side in a memory cgroup where one can "
                "be made):", "", "| side | s/token | tokens/s | memory | result |", "|---|---|---|---|---|"]
        for kind, r in runs.items():
            s = f"{r['s_per_token']:.4f}" if r.get("s_per_token") else "-"
            t = f"{r['tokens_per_s']:.2f}" if r.get("tokens_per_s") else "-"
            result = f"FAILED: {r['error']}" if "error" in r else "ran"
            out.append(f"| {kind} | {s} | {t} | {memory_note(r)} | {result} |")
    models = {k: v for k, v in (train or {}).items() if isinstance(v, dict) and "breakdown" in v}
    if models:
        from benchmarks.gpu.train import breakdown_table

        files = ", ".join(f"train-{n}.md" for n in models)
        out += ["", f"Training, per step (benchmarks.gpu.train; top-20 tables of a profiled step: {files}; "
                "train-breakdown.md):", "", breakdown_table(models)]
    return out


def moe_section(moe: dict | None) -> list[str]:
    """summary.md's lines for the mixture-of-experts part (benchmarks.infer_moe with a device): each run's
    figures and its targets (issue 48's: the tokens equal transformers' on the device); none without it."""
    if moe is None:
        return []
    budget = f"{moe['device_budget'] / 2**30:.3f} GiB" if moe.get("device_budget") else "-"
    out = ["", f"Mixture of experts (benchmarks.infer_moe --device {moe.get('device')}, issue 48): "
           f"{moe['checkpoint_bytes'] / 1e9:.2f} GB, device budget {budget}, host {moe['budget'] / 2**30:.3f} GiB:", "",
           "| run | s/token | read per token | on the device / pinned / NVMe | tokens = transformers' |",
           "|---|---|---|---|---|"]
    for r in moe.get("runs", []):
        name = f"{r['experts']}, batch {r['batch']}"
        if "error" in r:
            out.append(f"| {name} | FAILED: {r['error']} | | | |")
            continue
        tiers = r.get("tiers")
        where = f"{tiers['on_device']} / {tiers['in_host_memory']} / {tiers['streamed']}" if tiers else "-"
        equal = {True: "yes", False: "NO"}.get(r.get("tokens_equal"), "-")
        out.append(f"| {name} | {r['s_per_token']:.4f} | {r['per_token']['io'] / 2**20:.1f} MiB | {where} | {equal} |")
    return out + [""] + [f"- {line}" for line in moe.get("targets", [])]
