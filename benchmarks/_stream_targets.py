"""The target lines `benchmarks.infer_stream` prints under its table: each a verdict, "met" or "NOT met",
with the figures it was judged on (docs/benchmarks.md states the targets)."""

from __future__ import annotations

from benchmarks._cgroup import UNBOUNDED
from benchmarks._peers import floor_line
from offload.infer.plan.host import format_bytes

__all__ = ["stream_targets"]


def stream_targets(results: list[dict], fio_bps: float | None, budgets: list[int], big_budget: int, big_batch: int,
                   acc_budget: int, big_batch_target: float = 12.0, floor: dict | None = None) -> list[str]:
    """`benchmarks.infer_stream`'s target lines for ``results`` (its runs' figures): ours against the disk
    bound and its own floor at each budget, the first token's time, ours against Accelerate at
    ``acc_budget``, the page cache, and batch ``big_batch`` against batch 1 at ``big_budget``."""

    def find(kind: str, budget: int, batch: int) -> dict | None:
        return next((r for r in measured if r["kind"] == kind and r["budget"] == budget and r["batch"] == batch), None)

    def verdict(ok: bool) -> str:
        return "met" if ok else "NOT met"

    measured = [r for r in results if "error" not in r]
    lines = [f"{r['kind']} at {format_bytes(r['budget'])} batch {r['batch']}: not measured ({r['error']}); the targets that "
             f"need it are not checked" for r in results if "error" in r]
    for budget in budgets:
        r = find("ours", budget, 1)
        if r and fio_bps and r["s_per_token"] and r["read_bytes_per_forward"]:
            bound = r["read_bytes_per_forward"] / fio_bps
            ratio = r["s_per_token"] / bound
            lines.append(f"batch 1 at {format_bytes(budget)}: {r['s_per_token']:.3f} s/token = {ratio:.2f}x the disk bound "
                         f"{bound:.3f} s ({r['read_bytes_per_forward'] / 1e9:.2f} GB per token at fio's "
                         f"{fio_bps / 1e9:.2f} GB/s); target <= 1.1x: {verdict(ratio <= 1.1)}")
        if r and fio_bps and "first_forward_loaded_s" in r:
            load_bound = 1.2 * r["resident_bytes"] / fio_bps
            allowed, strict = load_bound + r["first_forward_loaded_s"], load_bound + r["loaded_first_token_s"]
            lines.append(f"time to first token at {format_bytes(budget)}: {r['ttft_s']:.2f} s (ready {r['load_s']:.2f} s + first "
                         f"token {r['first_token_s']:.2f} s, every resident weight in at {r['full_load_s']:.2f} s); target "
                         f"<= 1.2 x resident {r['resident_bytes'] / 1e9:.2f} GB / fio + the first forward of a process "
                         f"whose weights are in {r['first_forward_loaded_s']:.2f} s = {allowed:.2f} s: "
                         f"{verdict(r['ttft_s'] <= allowed)}; with a second forward instead ({r['loaded_first_token_s']:.2f} "
                         f"s) {strict:.2f} s: {verdict(r['ttft_s'] <= strict)}")
    lines += [floor_line(r, f"ours at {format_bytes(r['budget'])} batch {r['batch']}") for r in measured
              if r["kind"] == "ours" and r.get("compute_alone_s")]
    ours = find("ours", acc_budget, 1)
    for kind, factor in (("accelerate-dispatch", 1.6), ("accelerate-auto", 1.2)):
        other = find(kind, acc_budget, 1)
        if ours and other and ours["tokens_per_s"] and other["tokens_per_s"]:
            ratio = ours["tokens_per_s"] / other["tokens_per_s"]
            lines.append(f"at {format_bytes(acc_budget)}, {UNBOUNDED} for Accelerate: ours {ratio:.2f}x {kind}'s tokens/s; "
                         f"target >= {factor}x: {verdict(ratio >= factor)}")
    for r in measured:
        if r["kind"] == "ours":
            growth = max(r["cached_growth"], r["checkpoint_cache_growth"])
            lines.append(f"page cache, ours at {format_bytes(r['budget'])} batch {r['batch']}: +{growth / 1e6:.0f} MB (system "
                         f"Cached {r['cached_growth'] / 1e6:+.0f} MB, the checkpoint's pages "
                         f"{r['checkpoint_cache_growth'] / 1e6:+.0f} MB); target < 256 MB: {verdict(growth < 256e6)}")
    small, big = find("ours", big_budget, 1), find("ours", big_budget, big_batch)
    if small and big and small["tokens_per_s"] and big["tokens_per_s"]:
        ratio = big["tokens_per_s"] / small["tokens_per_s"]
        lines.append(f"batch {big_batch} at {format_bytes(big_budget)}: {ratio:.1f}x the tokens/s of batch 1; target >= "
                     f"{big_batch_target:g}x: {verdict(ratio >= big_batch_target)}")
        if floor:
            disk = big["read_bytes_per_forward"] / fio_bps if fio_bps else 0.0
            bound = max(floor["floor_s"], disk)
            lines.append(f"batch {big_batch}: {big['s_per_token']:.3f} s/step = {big['s_per_token'] / bound:.2f}x max(compute "
                         f"floor {floor['floor_s']:.3f} s, disk {disk:.3f} s); at that bound batch {big_batch} would be "
                         f"{big_batch / bound / small['tokens_per_s']:.1f}x batch 1's tokens/s")
    return lines
