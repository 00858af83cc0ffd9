"""torch.profiler for the GPU benchmarks: a breakdown of where the time went and small top-N tables, never
raw traces.

The profiler records the thread that starts it. On CUDA it adds the device's activity, so that

- kernels: the device time of every kernel (not the copies);
- copies: the device time of ``Memcpy HtoD`` / ``DtoH`` / ``DtoD`` and ``Memset``;
- synchronisations: the host's calls that wait for the device (``cudaStreamSynchronize``,
  ``cudaDeviceSynchronize``, ``cudaEventSynchronize``), counted and timed;
- host overhead: the rest of the wall time, where the device waited for the host (Python, the
  framework, launches).

On the simulated device (and the CPU) there is no device activity: compute and copies run on the CPU,
so "kernels" is the self CPU time of the operators that compute, "copies" that of the copy operators
(direction unknown there), synchronisations are counted by the simulated device
(`offload.device._simtorch.count_host_syncs`, passed in) and not timed, and the host overhead is the
wall time outside those operators. The ``basis`` of a breakdown says which it is.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")
"""CUDA runtime calls in which the host waits for the device."""
COPY_OPS = ("aten::copy_", "aten::_copy_from", "aten::_copy_from_and_resize", "aten::_to_copy")
"""Operators that copy (on the simulated device: between host and device, or within either)."""
_NOT_COMPUTE = ("empty", "view", "as_strided", "reshape", "expand", "slice", "select", "transpose", "unsqueeze",
                "squeeze", "permute", "detach", "alias", "resize", "set_", "lift", "to", "t", "split", "unbind",
                "narrow", "chunk", "contiguous", "clone", "item", "_local_scalar_dense", "is_nonzero")
"""Operator names (after ``aten::``) that allocate, reshape or wrap rather than compute."""


def profiler(cuda: bool):
    """A ``torch.profiler.profile`` of the CPU, and of CUDA where ``cuda`` (start it with ``with`` or
    ``.start()``)."""
    from torch.profiler import ProfilerActivity, profile

    return profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else []))


def _is_device(event: Any) -> bool:
    return getattr(getattr(event, "device_type", None), "name", "CPU") != "CPU"


def _compute_op(name: str) -> bool:
    if not name.startswith("aten::") or name in COPY_OPS:
        return False
    return name[len("aten::"):] not in _NOT_COMPUTE and not name.startswith("aten::empty")


def breakdown(prof: Any, *, wall_s: float, units: int, cuda: bool, host_syncs: dict[str, int] | None = None) -> dict:
    """Per unit (a token, a step) of ``units`` in the profiled ``wall_s`` seconds: kernels, copies,
    synchronisations and host overhead (seconds; see the module docstring), with ``basis``. Raises
    ValueError for ``units`` < 1."""
    if units < 1:
        raise ValueError(f"breakdown: units must be at least 1, got {units}")
    kernels = copies = to_device = to_host = sync_us = 0.0
    syncs = 0
    if cuda:
        for event in prof.events():
            elapsed = event.time_range.elapsed_us()
            if _is_device(event):
                if event.name.startswith(("Memcpy", "Memset")):
                    copies += elapsed
                    to_device += elapsed if "HtoD" in event.name else 0.0
                    to_host += elapsed if "DtoH" in event.name else 0.0
                else:
                    kernels += elapsed
            elif event.name in SYNC_CALLS:
                syncs += 1
                sync_us += elapsed
        by_cause = {name: sum(1 for e in prof.events() if e.name == name) for name in SYNC_CALLS}
        basis = "cuda: device time of kernels and copies, host time of synchronising calls"
    else:
        for event in prof.events():
            if event.name in COPY_OPS:
                copies += event.self_cpu_time_total
            elif _compute_op(event.name):
                kernels += event.self_cpu_time_total
        by_cause = dict(host_syncs or {})
        syncs = sum(by_cause.values())
        sync_us = None
        basis = "cpu: self CPU time of the operators (the simulated device computes and copies on the CPU)"
    seconds = 1e-6 / units
    wall = wall_s / units
    spent = (kernels + copies + (sync_us or 0.0)) * seconds
    return {"basis": basis, "units": units, "wall_s": wall, "kernels_s": kernels * seconds,
            "copies_s": copies * seconds,
            "to_device_s": to_device * seconds if cuda else None, "to_host_s": to_host * seconds if cuda else None,
            "syncs": syncs / units, "syncs_by_cause": {k: v / units for k, v in by_cause.items() if v},
            "sync_s": sync_us * seconds if sync_us is not None else None, "host_s": max(0.0, wall - spent)}


def top_rows(prof: Any, n: int = 20, *, by: str = "cpu") -> list[dict]:
    """The ``n`` operators (or kernels) with the most self time ``by`` "cpu" or "device", from the
    profiler's averages: name, calls, self CPU and self device microseconds."""
    if by not in ("cpu", "device"):
        raise ValueError(f"top_rows: by={by!r}; use 'cpu' or 'device'")
    rows = [{"name": e.key, "calls": e.count, "self_cpu_us": float(e.self_cpu_time_total),
             "self_device_us": float(getattr(e, "self_device_time_total", 0.0) or 0.0)} for e in prof.key_averages()]
    key = "self_cpu_us" if by == "cpu" else "self_device_us"
    return [r for r in sorted(rows, key=lambda r: -r[key]) if r[key] > 0][:n]


def table(rows: list[dict], units: int, unit: str) -> str:
    """A markdown table of `top_rows`' rows, per ``unit`` (token, step) over ``units`` of them."""
    out = [f"| operator or kernel | calls / {unit} | self CPU ms / {unit} | self device ms / {unit} |",
           "|---|---|---|---|"]
    for r in rows:
        name = r["name"].replace("|", "\\|")
        name = name if len(name) <= 90 else name[:87] + "..."
        out.append(f"| {name} | {r['calls'] / units:.1f} | {r['self_cpu_us'] / 1e3 / units:.3f} "
                   f"| {r['self_device_us'] / 1e3 / units:.3f} |")
    return "\n".join(out)


def write_tables(path: Path, title: str, sections: dict[str, list[dict]], units: int, unit: str) -> Path:
    """Write ``sections`` (heading -> `top_rows`) as one small markdown file at ``path``; return it."""
    text = [f"# {title}", ""]
    for heading, rows in sections.items():
        text += [f"## {heading}", "", table(rows, units, unit) if rows else "(no rows: nothing recorded)", ""]
    path.write_text("\n".join(text))
    return path


def _ms(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{seconds * 1e3:.3f}"


def side_by_side(sides: dict[str, dict], unit: str) -> str:
    """A markdown table of `breakdown` figures for each side (name -> breakdown), per ``unit``."""
    names = list(sides)
    rows = [("wall", "wall_s"), ("kernels", "kernels_s"), ("copies (all)", "copies_s"),
            ("copies host->device", "to_device_s"), ("copies device->host", "to_host_s"),
            ("synchronisations (time)", "sync_s"), ("host overhead (the rest: Python, framework, launches)", "host_s")]
    out = [f"| per {unit} (ms) | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    for label, key in rows:
        out.append(f"| {label} | " + " | ".join(_ms(sides[n].get(key)) for n in names) + " |")
    out.append("| synchronisations (count) | " + " | ".join(f"{sides[n]['syncs']:.1f}" for n in names) + " |")
    causes = " | ".join(", ".join(f"{k} {v:.1f}" for k, v in sides[n].get("syncs_by_cause", {}).items()) or "-"
                        for n in names)
    out.append(f"| synchronisations by cause | {causes} |")
    out.append("")
    out += [f"- {n}: {sides[n]['basis']}" for n in names]
    return "\n".join(out)
