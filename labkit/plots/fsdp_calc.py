"""The FSDP calculators' figures: per-rank memory terms of FSDP2 (`labkit.fsdp.FSDPMemory`) as
stacked bars, and the checkpoint overhead against the interval (`labkit.resilience.overhead`)
with Young's optimum marked.

    >>> fig = fsdp_bars({"per block": fsdp_memory("llama2-7b", 8)})
    >>> fig = overhead_curve(mtbf=54_000, write_time=60)
"""
from __future__ import annotations

from labkit.plots import GB, new_figure
from labkit.resilience import overhead, young_daly_interval

TERMS = {"params": "#4c72b0", "grads": "#dd8452", "optimizer_states": "#55a868",
         "unsharded_peak": "#c44e52"}


def fsdp_bars(memories: dict, title: str = ""):
    """Stacked bars (GB per rank), one per {label: FSDPMemory}: sharded params, grads,
    optimizer states, and the unsharded-parameter peak (their sum is FSDPMemory.total)."""
    fig = new_figure(6.4, 3.4)
    ax = fig.add_subplot()
    names = list(memories)
    bottoms = [0.0] * len(names)
    for term, colour in TERMS.items():
        heights = [getattr(m, term) / GB for m in memories.values()]
        ax.bar(range(len(names)), heights, bottom=bottoms, color=colour, width=0.6,
               label=term.replace("_", " "))
        bottoms = [b + h for b, h in zip(bottoms, heights)]
    ax.set_xticks(range(len(names)), names)
    ax.set_ylabel("GB per rank (no activations, no buffers)")
    ax.set_ylim(0, max(bottoms, default=0) * 1.2 or 1.0)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    if title:
        fig.suptitle(title, fontsize=9)
    return fig


def overhead_curve(mtbf: float, write_time: float, title: str = ""):
    """Overhead fraction against the checkpoint interval (hours, log axis), Young's optimum
    marked."""
    best = young_daly_interval(mtbf, write_time)
    xs = [best * 2 ** (k / 8) for k in range(-40, 41)]
    fig = new_figure(6.0, 3.2)
    ax = fig.add_subplot()
    ax.plot([x / 3600 for x in xs], [100 * overhead(x, write_time, mtbf) for x in xs])
    ax.axvline(best / 3600, color="#c44e52", linestyle="--",
               label=f"Young: {best / 3600:,.2f} h, {100 * overhead(best, write_time, mtbf):.2f} %")
    ax.set_xscale("log")
    ax.set_xlabel("checkpoint interval (hours)")
    ax.set_ylabel("time lost (%)")
    ax.legend(fontsize=8, frameon=False)
    if title:
        fig.suptitle(title, fontsize=9)
    return fig
