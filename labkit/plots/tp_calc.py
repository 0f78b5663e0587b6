"""The TP calculator's figure: per-layer communication and compute time against the tensor-
parallel degree for several links (the first tp where communication takes longer than compute
marked on each; tp beyond one node's GPUs shaded), and the weights and activations each rank
holds against tp.

    >>> sweeps = {k: tp_sweep("llama2-7b", link=k) for k in ("nvlink4", "ib-ndr")}
    >>> fig = tp_time_figure(sweeps, current=8)
"""
from __future__ import annotations

from labkit.plots import GB, new_figure
from labkit.tp import GPUS_PER_NODE, first_crossing

COLOURS = ("#4c72b0", "#c44e52", "#8172b3", "#937860", "#55a868")


def tp_time_figure(sweeps: dict, current: int | None = None, title: str = ""):
    """Left: ms per layer and micro-batch against tp (log-log): compute (one line: it does not
    depend on the link) and the communication on each link of {link key: {tp: TPCost}}, each
    link's crossing (`labkit.tp.first_crossing`) circled. Right: GB per rank of weights and
    activations against tp. `current`: the tp chosen, a dotted line."""
    fig = new_figure(9.0, 3.4)
    ax, mem = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    first = next(iter(sweeps.values()), {})
    degrees = sorted(first)
    ax.plot(degrees, [first[t].compute_time * 1e3 for t in degrees], color="black",
            marker="o", markersize=3, label="compute")
    for colour, costs in zip(COLOURS, sweeps.values()):
        ts = [t for t in sorted(costs) if t > 1]         # tp = 1 sends nothing (log axis)
        if not ts:
            continue
        name = costs[ts[0]].link.name
        ax.plot(ts, [costs[t].comm_time * 1e3 for t in ts], color=colour, marker="o",
                markersize=3, label=f"comm, {name}")
        cross = first_crossing(costs)
        if cross is not None:
            ax.plot([cross], [costs[cross].comm_time * 1e3], marker="o", markersize=11,
                    markerfacecolor="none", markeredgecolor=colour, linestyle="none")
            ax.annotate(f"tp={cross}", xy=(cross, costs[cross].comm_time * 1e3),
                        xytext=(6, -12), textcoords="offset points", fontsize=8, color=colour)
    for a in (ax, mem):
        if degrees and degrees[-1] > GPUS_PER_NODE:
            a.axvspan(GPUS_PER_NODE * 2 ** 0.5, degrees[-1] * 2 ** 0.5, color="#eeeeee",
                      zorder=0, label=f"tp > {GPUS_PER_NODE}: beyond one node's NVLink"
                      if a is ax else None)
        if current is not None:
            a.axvline(current, color="grey", linestyle=":", linewidth=1)
        a.set_xscale("log", base=2)
        a.set_xlabel("tensor-parallel degree tp")
        if degrees:
            a.set_xticks(degrees, [str(t) for t in degrees])
    ax.set_yscale("log")
    ax.set_ylabel("ms per layer and micro-batch")
    ax.set_title("communication vs compute (circled: comm >= compute)", fontsize=9)
    ax.legend(fontsize=7, frameon=False)
    for key, label, colour in (("params", "weights", "#4c72b0"),
                               ("activations", "activations", "#dd8452")):
        mem.plot(degrees, [getattr(first[t].memory, key) / GB for t in degrees], color=colour,
                 marker="o", markersize=3, label=label)
    mem.set_ylabel("GB per rank")
    mem.set_ylim(bottom=0)
    mem.set_title("memory per rank (estimate_memory)", fontsize=9)
    mem.legend(fontsize=7, frameon=False)
    if title:
        fig.suptitle(title, fontsize=9)
    return fig
