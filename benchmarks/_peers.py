"""Ours beside a peer (Accelerate) at equal memory, and each side as a user runs it by default.

Rows (each configuration in a fresh child process, in a memory cgroup of its own, `benchmarks._cgroup`):

- ``equal``: each side in a cgroup of the budget + its own overhead, measured once per side with
  nothing loaded (a child that imports and warms up, its cgroup's peak: page cache included). Ours
  takes ``max_in_cpu: "auto"``, which reads that cgroup's room; the peer its ``max_memory`` = budget.
- ``defaults``: ours "auto", the peer without ``max_memory``; cgroups without a limit (their peak is
  reported: page cache included).
- ``bound``: ours at the budget in a cgroup of its own bound (plan memory + activations + overhead)
  + 10%, beside the same run without a limit: nothing of ours needs a free page cache.

Where no cgroup can be made, that is said once and every peer figure is labelled `UNBOUNDED`; ours
then runs at the budget as a number in the ``equal`` row.
"""

from __future__ import annotations

from typing import Callable

from benchmarks._cgroup import UNBOUNDED, MemoryCgroup
from benchmarks._common import ChildError

ROWS = ("equal", "defaults", "bound")
TARGET_EQUAL = 1.6
TARGET_DEFAULTS = 1.5
TARGET_DISK = 1.1
BOUND_SLACK = 1.10


def _gib(nbytes: float) -> str:
    return f"{nbytes / (1 << 30):.2f} GiB"


class PeerRunner:
    """Runs configurations in memory cgroups (or says once why it cannot). ``run_child(payload, cgroup)``
    runs one configuration in a child process in ``cgroup`` (None: none) and returns its figures."""

    def __init__(self, run_child: Callable[[dict, MemoryCgroup | None], dict], *, use_cgroups: bool = True,
                 before_each: Callable[[], None] = lambda: None) -> None:
        self._run_child = run_child
        self._before_each = before_each
        self.overheads: dict[str, int] = {}
        probe = MemoryCgroup.create("offload-bench") if use_cgroups else "--no-cgroups was given"
        self.reason = probe if isinstance(probe, str) else None
        if self.reason is None:
            probe.close()
        else:
            print(f"memory cgroups: not used ({self.reason}); each side runs without one, and every peer figure is "
                  f"labelled \"{UNBOUNDED}\"")

    @property
    def bounded(self) -> bool:
        return self.reason is None

    def overhead(self, payload: dict) -> int | None:
        """The peak of ``payload["kind"]``'s child with nothing loaded (imports and warm-up), page cache
        included: measured once per kind. None without cgroups."""
        kind = payload["kind"]
        if self.bounded and kind not in self.overheads:
            result = self.run({**payload, "idle": True}, None, "overhead")
            self.overheads[kind] = result.get("cgroup_peak", 0)
            print(f"overhead of {kind} with nothing loaded: {_gib(self.overheads[kind])} (its cgroup's peak, page "
                  f"cache included)")
        return self.overheads.get(kind)

    def run(self, payload: dict, limit: int | None, row: str) -> dict:
        """One configuration in a cgroup of ``limit`` bytes (None: no limit), labelled ``row``; its figures
        with the cgroup's (limit, peak, limit hits, OOM kills), or ``error`` where it failed."""
        self._before_each()
        group = MemoryCgroup.create("offload-bench") if self.bounded else None
        if isinstance(group, str):  # it could be made a moment ago: say it, run without
            print(f"memory cgroup: not used for this run ({group}); {UNBOUNDED}")
            group = None
        figures: dict = {"row": row, "setting": payload.get("setting")}
        if group is not None:
            try:
                group.set_limit(limit)
            except OSError as exc:
                print(f"memory cgroup: the limit of {limit} bytes cannot be set on {group.path} ({exc.strerror or exc}); "
                      f"this run goes without it, labelled \"{UNBOUNDED}\"")
                group.close()
                group = None
        try:
            try:
                figures.update(self._run_child(payload, group))
            except ChildError as exc:
                figures.update(kind=payload["kind"], budget=payload.get("budget"), batch=payload.get("batch"),
                               error=exc.one_line())
            if group is not None:
                figures.update(cgroup_limit=limit, cgroup_peak=group.peak(), cgroup_limit_hits=group.limit_hits(),
                               cgroup_oom_kills=group.oom_kills(), cgroup=group.describe())
            else:
                figures["memory_label"] = UNBOUNDED
        finally:
            if group is not None:
                group.close()
        return figures

    def rows(self, rows: list[str], sides: list[str], payload: dict, budget: int) -> list[dict]:
        """The ``rows`` (of `ROWS`) for ``sides`` ("ours" and the peer kinds), each from ``payload`` with
        its kind, row and setting ("auto": ours takes "auto", the peer no ``max_memory``; None: the
        budget); ``budget`` is the equal memory's host budget in bytes."""
        results = []
        for row in rows:
            for kind in sides:
                if row == "bound" and kind != "ours":
                    continue
                base = {**payload, "kind": kind, "budget": budget, "setting": None, "row": row}
                if row == "equal":
                    overhead = self.overhead(base)
                    if overhead is not None and kind == "ours":
                        base["setting"] = "auto"  # it reads the cgroup's room: budget + overhead - what it uses
                    results.append(self.run(base, None if overhead is None else budget + overhead, row))
                elif row == "defaults":
                    results.append(self.run({**base, "setting": "auto"}, None, row))
                else:
                    results += self._bound_rows(base)
                _print(results[-1])
        return results

    def _bound_rows(self, payload: dict) -> list[dict]:
        """Ours at the budget without a limit, then in a cgroup of its own bound + 10%."""
        free = self.run(payload, None, "bound-free")
        overhead = self.overhead(payload)
        if overhead is None or "error" in free:
            return [free]
        _print(free)
        bound = free["plan_memory_bytes"] + free["activation_bytes"] + overhead
        limited = self.run(payload, int(BOUND_SLACK * bound), "bound")
        limited["bound_bytes"] = bound
        return [free, limited]


def memory_note(r: dict) -> str:
    """ "cgroup limit 9.00 GiB, peak 8.95 GiB, 1234 limit hits, 0 OOM kills", or the unbounded label."""
    if "cgroup" not in r:
        return UNBOUNDED
    limit = "no limit" if r["cgroup_limit"] is None else f"limit {_gib(r['cgroup_limit'])}"
    return (f"cgroup {limit}, peak {_gib(r['cgroup_peak'])}, {r['cgroup_limit_hits']} limit hits, "
            f"{r['cgroup_oom_kills']} OOM kills")


def _print(r: dict) -> None:
    name = f"{r['row']}: {r.get('kind')}" + (" (its default)" if r.get("setting") == "auto" and r["row"] == "defaults"
                                            else " (\"auto\")" if r.get("setting") == "auto" else "")
    if "error" in r:
        print(f"{name}: FAILED, {r['error']} ({memory_note(r)})")
        return
    s = r.get("s_per_token")
    budget = f", budget {_gib(r['plan_budget'])}" if r.get("plan_budget") else ""
    print(f"{name}: {s if s is None else round(s, 3)} s/token, {r.get('tokens_per_s') or 0:.3f} tokens/s{budget}, "
          f"peak RSS {_gib(r.get('peak_rss', 0))}, read {r.get('read_bytes', 0) / 1e9:.2f} GB ({memory_note(r)})")
    if r.get("budget_source"):
        print(f"  ours' budget: {_gib(r['plan_budget'])} = {r['budget_source']}")


def floor_line(r: dict, name: str) -> str:
    """How far ``r``'s decode steps (once loaded) are from the floor measured beside them in its process
    (benchmarks/_floor.py): max(the ring's reads alone, the compute alone)."""
    steps = r.get("loaded_s_per_token") or r["s_per_token"]
    floor = max(r["reads_alone_s"], r["compute_alone_s"])
    return (f"{name}: {steps:.3f} s/token once loaded = {steps / floor:.2f}x max(its ring's reads alone "
            f"{r['reads_alone_s']:.3f} s ({r['read_bytes_per_forward'] / 1e9:.2f} GB at {r['reads_alone_bps'] / 1e9:.2f} "
            f"GB/s), its compute alone {r['compute_alone_s']:.3f} s), both measured in its process after the run")


def peer_targets(results: list[dict], fio_bps: float | None, budget: int) -> list[str]:
    """The targets of the rows in ``results`` (this run's and earlier ones')."""
    def find(row: str, kind: str) -> dict | None:
        return next((r for r in results if r.get("row") == row and r.get("kind") == kind and "error" not in r
                     and r.get("s_per_token")), None)

    def verdict(ok: bool) -> str:
        return "met" if ok else "NOT met"

    lines = [f"{r['row']}: {r.get('kind')} not measured ({r['error']})" for r in results
             if r.get("row") in ROWS + ("bound-free",) and "error" in r]
    peers = sorted({r["kind"] for r in results if r.get("row") in ("equal", "defaults") and r.get("kind") != "ours"})
    ours = find("equal", "ours")
    if ours and fio_bps and ours.get("read_bytes_per_forward"):
        bound = ours["read_bytes_per_forward"] / fio_bps
        ratio = ours["s_per_token"] / bound
        lines.append(f"equal memory ({_gib(budget)} + overhead): ours {ours['s_per_token']:.3f} s/token = {ratio:.2f}x "
                     f"its own bound {bound:.3f} s ({ours['read_bytes_per_forward'] / 1e9:.2f} GB per token at fio's "
                     f"{fio_bps / 1e9:.2f} GB/s); target <= {TARGET_DISK}x: {verdict(ratio <= TARGET_DISK)}")
    for kind in peers:
        other = find("equal", kind)
        if ours and other:
            ratio = ours["tokens_per_s"] / other["tokens_per_s"]
            label = "" if "cgroup" in other else f" [{UNBOUNDED}]"
            lines.append(f"equal memory: ours {ratio:.2f}x {kind}'s tokens/s{label}; target >= {TARGET_EQUAL}x: "
                         f"{verdict(ratio >= TARGET_EQUAL)}")
    ours_default = find("defaults", "ours")
    for kind in peers:
        other = find("defaults", kind)
        if ours_default and other:
            ratio = ours_default["tokens_per_s"] / other["tokens_per_s"]
            lines.append(f"each side's default: ours {ratio:.2f}x {kind}'s tokens/s (peaks: ours "
                         f"{_gib(ours_default.get('cgroup_peak', ours_default['peak_rss']))}, {kind} "
                         f"{_gib(other.get('cgroup_peak', other['peak_rss']))}); target >= {TARGET_DEFAULTS}x: "
                         f"{verdict(ratio >= TARGET_DEFAULTS)}")
    at_budget = find("bound-free", "ours") or ours
    if ours_default and at_budget and at_budget.get("read_bytes_per_forward"):
        expected = ours_default["read_bytes_per_forward"] / at_budget["read_bytes_per_forward"]
        loaded = ours_default.get("loaded_s_per_token") and at_budget.get("loaded_s_per_token")
        key = "loaded_s_per_token" if loaded else "s_per_token"  # once each has loaded: the first steps read more
        ratio = ours_default[key] / at_budget[key]
        lines.append(f"ours by default ({_gib(ours_default['plan_budget'])}) against ours at "
                     f"{_gib(at_budget['plan_budget'])}: {ratio:.2f}x the s/token{' once loaded' if loaded else ''} "
                     f"({ours_default[key]:.3f} / {at_budget[key]:.3f} s), bytes read per token {expected:.2f}x; "
                     f"target: faster by at least the bytes it no longer reads (<= {expected:.2f}x, 10% noise): "
                     f"{verdict(ratio < 1 and ratio <= expected * 1.1)}")
    lines += [floor_line(r, f"{r['row']}: ours") for r in results
              if r.get("kind") == "ours" and "error" not in r and r.get("compute_alone_s")]
    free, limited = find("bound-free", "ours"), next((r for r in results if r.get("row") == "bound"), None)
    if free and limited:
        if "error" in limited:
            lines.append(f"ours in a cgroup of its bound + 10%: FAILED ({limited['error']}); target NOT met")
        else:
            ratio = limited["s_per_token"] / free["s_per_token"]
            lines.append(f"ours in a cgroup of its bound {_gib(limited['bound_bytes'])} + 10% "
                         f"({memory_note(limited)}): {ratio:.2f}x the s/token without a limit; target: within 10%, no "
                         f"OOM: {verdict(abs(ratio - 1) <= 0.1 and not limited['cgroup_oom_kills'])}")
    return lines
