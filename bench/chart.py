"""The sweep chart: GB/s by block size and queue depth, one panel per thread count, read and write rows."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from matplotlib.figure import Figure  # no pyplot: renders with Agg, no display or global state

from ._units import format_size
from .measure import PointResult

_STYLES = {"io_uring": "-", "threads": "--"}


def plot_sweep(points: Sequence[PointResult], path: Path, title: str) -> None:
    """Save a PNG: rows write and read, a column per thread count, x block size, a line per queue depth.

    Colour is the queue depth, solid lines io_uring and dashed the thread backend; each value is the
    best over single_submit and overlap_events. Raises ValueError for no points.
    """
    if not points:
        raise ValueError("no points to plot")
    threads = sorted({p.config.thread_count for p in points})
    depths = sorted({p.config.queue_depth for p in points})
    blocks = sorted({p.config.block_size for p in points})
    backends = [b for b in _STYLES if any(p.backend == b for p in points)]
    colours = {qd: f"C{i}" for i, qd in enumerate(depths)}

    fig = Figure(figsize=(3.6 * len(threads) + 1, 6.4), dpi=100, layout="constrained")
    axes = fig.subplots(2, len(threads), sharex=True, sharey="row", squeeze=False)
    for row, rw in enumerate(("write", "read")):
        for col, tc in enumerate(threads):
            ax = axes[row][col]
            for backend in backends:
                for qd in depths:
                    xs, ys = [], []
                    for bs in blocks:
                        rates = [getattr(p, rw).gb_per_s for p in points if p.backend == backend and
                                 p.config.thread_count == tc and p.config.queue_depth == qd and p.config.block_size == bs]
                        if rates:
                            xs.append(bs)
                            ys.append(max(rates))
                    if xs:
                        ax.plot(xs, ys, _STYLES[backend], color=colours[qd], marker="o", markersize=3,
                                label=f"{backend} qd {qd}")
            ax.set_xscale("log", base=2)
            ax.set_xticks(blocks, [format_size(b) for b in blocks])
            ax.minorticks_off()
            ax.set_ylim(bottom=0)
            ax.grid(True, alpha=0.3)
            ax.set_title(f"{rw}, {tc} thread{'s' if tc > 1 else ''}", fontsize=10)
            if col == 0:
                ax.set_ylabel("GB/s")
            if row == 1:
                ax.set_xlabel("block size")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, fontsize=8, loc="outside right upper")
    fig.suptitle(title, fontsize=10)
    fig.savefig(path, format="png")
