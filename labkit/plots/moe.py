"""The MoE calculator's figure: memory per GPU of a mixture-of-experts model as stacked bars, one
per expert-parallel degree ep (weights, gradients, optimizer states, activations), with the GPU's
capacity and the usable part of it (`labkit.planner.usable_memory`) as lines.

    >>> est = {ep: estimate_memory("mixtral-8x7b", seq_len=4096, dp=8, ep=ep)
    ...        for ep in (1, 2, 4, 8)}
    >>> fig = moe_memory_figure(est, capacity=80e9, usable=74.5e9, current=8)

The figure only draws numbers it is given (bytes, from `labkit.memory`); it computes none.
"""
from __future__ import annotations

from labkit.plots import GB, new_figure
from labkit.plots.memory import TERMS


def moe_memory_figure(estimates: dict, capacity: float, usable: float, current=None,
                      capacity_label: str = "", title: str = ""):
    """Stacked bars in GB (1e9 bytes), one per {ep: MemoryEstimate}; the bar of ep=`current`
    opaque with its total above it, the others faded. capacity: the GPU's memory in bytes (a
    dashed line, named by capacity_label); usable: what a run may fill of it (a dotted line)."""
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    fig = new_figure(7.0, 3.6)
    ax = fig.add_subplot()
    degrees = list(estimates)
    xs = range(len(degrees))
    bottoms = [0.0] * len(degrees)
    handles = []
    for attr, name, colour in TERMS:
        heights = [getattr(estimates[ep], attr) / GB for ep in degrees]
        for x, ep, hgt, bot in zip(xs, degrees, heights, bottoms):
            ax.bar(x, hgt, bottom=bot, color=colour, width=0.6,
                   alpha=1.0 if current in (None, ep) else 0.35)
        bottoms = [b + hgt for b, hgt in zip(bottoms, heights)]
        handles.append(Patch(color=colour, label=name))
    for x, ep, total in zip(xs, degrees, bottoms):
        if current in (None, ep):
            ax.annotate(f"{total:,.1f}", xy=(x, total), xytext=(0, 2), textcoords="offset points",
                        ha="center", va="bottom", fontsize=8)
    cap, use = capacity / GB, usable / GB
    ax.axhline(cap, color="black", linestyle="--", linewidth=1.2)
    ax.axhline(use, color="#b00020", linestyle=":", linewidth=1.4)
    handles += [Line2D([], [], color="black", linestyle="--",
                       label=capacity_label or f"GPU memory: {cap:,.0f} GB"),
                Line2D([], [], color="#b00020", linestyle=":",
                       label=f"usable: {use:,.1f} GB (headroom left)")]
    top = max([*bottoms, cap, use])
    ax.set_ylim(0, top * 1.15 if top > 0 else 1.0)
    ax.set_xticks(list(xs), [str(ep) for ep in degrees])
    ax.set_xlabel("expert-parallel degree ep (routed experts split over ep GPUs)")
    ax.set_ylabel("GB per GPU (1 GB = 1e9 bytes)")
    if title:
        fig.suptitle(title, fontsize=9)
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8,
              frameon=False)
    return fig
