"""The sweep chart: GB/s by block size and queue depth, one panel per thread count, read and write rows,
fio's figure at each block size beside ours and the chosen configuration marked."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from matplotlib.figure import Figure  # no pyplot: renders with Agg, no display or global state

from ._units import format_size
from .measure import PointResult
from .sweep import config_key

_STYLES = {"io_uring": "-", "threads": "--"}
_HEADROOM = 1.12
"""The top of each row's axis, as a multiple of the highest figure drawn in it (room for the labels)."""


def plot_sweep(points: Sequence[PointResult], path: Path | None, title: str, *, chosen: Any = None,
               fio_curve: Sequence[Any] = ()) -> Figure:
    """Draw (and save as a PNG at ``path`` unless None) the sweep; return the figure.

    Rows write and read, a column per thread count, x block size, a line per queue depth and backend
    (colour the queue depth, solid io_uring, dashed the thread backend; each value the best over
    single_submit and overlap_events). ``fio_curve`` (`FioCurvePoint`s) adds fio's line in black in its
    thread count's panels; ``chosen`` (an ``AioConfig``) is marked with a star where it was measured.
    Each row's y axis runs from 0 to above its highest figure, so that no point is outside its panel.
    Raises ValueError for no points.
    """
    if not points:
        raise ValueError("no points to plot")
    threads = sorted({p.config.thread_count for p in points})
    depths = sorted({p.config.queue_depth for p in points})
    blocks = sorted({p.config.block_size for p in points})
    backends = [b for b in _STYLES if any(p.backend == b for p in points)]
    colours = {qd: f"C{i}" for i, qd in enumerate(depths)}
    chosen_point = _measured(points, chosen)

    fig = Figure(figsize=(3.6 * len(threads) + 1.4, 6.6), dpi=100, layout="constrained")
    axes = fig.subplots(2, len(threads), sharex=True, sharey="row", squeeze=False)
    for row, rw in enumerate(("write", "read")):
        highest = 0.0
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
                        highest = max(highest, *ys)
            fio = sorted((f.block_size, f.bw_bytes / 1e9, f.queue_depth) for f in fio_curve
                         if f.rw == rw and f.thread_count == tc)
            if fio:
                ax.plot([f[0] for f in fio], [f[1] for f in fio], ":", color="black", marker="x", markersize=5,
                        label=f"fio qd {fio[0][2]}")
                highest = max(highest, *(f[1] for f in fio))
            if chosen_point is not None and chosen_point.config.thread_count == tc:
                value = getattr(chosen_point, rw).gb_per_s
                ax.plot([chosen_point.config.block_size], [value], "*", color="gold", markeredgecolor="black",
                        markersize=14, zorder=5, label="chosen")
                ax.annotate(f"chosen {value:.2f}", (chosen_point.config.block_size, value), fontsize=8,
                            textcoords="offset points", xytext=(-8, 8), ha="right")
                highest = max(highest, value)
            ax.set_xscale("log", base=2)
            ax.set_xticks(blocks, [format_size(b) for b in blocks])
            ax.minorticks_off()
            ax.grid(True, alpha=0.3)
            ax.set_title(f"{rw}, {tc} thread{'s' if tc > 1 else ''}", fontsize=10)
            if col == 0:
                ax.set_ylabel("GB/s")
            if row == 1:
                ax.set_xlabel("block size")
        for ax in axes[row]:  # after every panel of the row is drawn: the shared range holds them all
            ax.set_ylim(0, highest * _HEADROOM if highest > 0 else 1)
    handles: dict[str, Any] = {}
    for ax in axes.flat:  # one legend entry per label, from whichever panel has it
        for handle, label in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(label, handle)
    fig.legend(list(handles.values()), list(handles), fontsize=8, loc="outside right upper")
    if chosen_point is not None:
        title += f"\nchosen (star): {chosen_point.backend} {format_size(chosen_point.config.block_size)} " \
                 f"qd {chosen_point.config.queue_depth}, {chosen_point.config.thread_count} thread" \
                 f"{'s' if chosen_point.config.thread_count > 1 else ''}"
    fig.suptitle(title, fontsize=10)
    if path is not None:
        fig.savefig(path, format="png")
    return fig


def _measured(points: Sequence[PointResult], chosen: Any) -> PointResult | None:
    """The point measured with the settings of ``chosen`` (an AioConfig), or None."""
    if chosen is None:
        return None
    key = config_key(chosen)
    return next((p for p in points if config_key(p.config) == key), None)
