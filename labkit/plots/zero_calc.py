"""The ZeRO calculator's communication figure: bytes each GPU sends per step under DDP and ZeRO
stages 1-3, stacked by collective, with the time on the chosen link and the ratio to DDP written
above each bar. (Its memory figure is `labkit.plots.memory.memory_bars`.)

    >>> comms = {s: step_communication(s, num_params=7e9, dp=8) for s in STRATEGY_LABELS}
    >>> fig = comm_bars(comms, bandwidth=50e9, latency=2e-6, link_name="InfiniBand NDR")
"""
from __future__ import annotations

from labkit.plots import GB, new_figure
from labkit.plots.comm import fmt_time

# step_communication strategy -> bar label, in the order drawn
STRATEGY_LABELS = {"ddp": "DDP (ZeRO-0)", "zero1": "ZeRO-1", "zero2": "ZeRO-2", "zero3": "ZeRO-3"}
OP_COLOURS = {"all_reduce": "#4c72b0", "reduce_scatter": "#dd8452", "all_gather": "#55a868"}


def comm_bars(comms: dict, bandwidth: float, latency: float = 0.0, link_name: str = "",
              highlight: str | None = None, title: str = ""):
    """A Figure of stacked bars in GB (1e9 bytes) sent per GPU per step, one bar per
    (strategy -> labkit.comm.StepComm), split by collective; above each bar, its time on a link
    of `bandwidth` bytes/s and `latency` s (`StepComm.time`) and its bytes over DDP's.
    highlight: the strategy drawn opaque (others faded); None: all opaque."""
    from matplotlib.patches import Patch

    fig = new_figure(6.4, 3.6)
    ax = fig.add_subplot()
    names = list(comms)
    base = comms["ddp"].total_bytes if "ddp" in comms else 0.0
    bottoms = [0.0] * len(names)
    used = []
    for op, colour in OP_COLOURS.items():
        heights = [comms[n].by_op.get(op, (0, 0.0))[1] / GB for n in names]
        if not any(heights):
            continue
        used.append(Patch(color=colour, label=op.replace("_", "-")))
        for x, (n, h, b) in enumerate(zip(names, heights, bottoms)):
            ax.bar(x, h, bottom=b, color=colour, width=0.6,
                   alpha=1.0 if highlight in (None, n) else 0.35)
        bottoms = [b + h for b, h in zip(bottoms, heights)]
    for x, (n, total) in enumerate(zip(names, bottoms)):
        ratio = f"\n{comms[n].total_bytes / base:.2f}x DDP" if base > 0 else ""
        ax.annotate(f"{fmt_time(comms[n].time(bandwidth, latency))}{ratio}", xy=(x, total),
                    xytext=(0, 2), textcoords="offset points", ha="center", va="bottom",
                    fontsize=8)
    top = max(bottoms, default=0.0)
    ax.set_ylim(0, top * 1.3 if top > 0 else 1.0)
    ax.set_xticks(range(len(names)), [STRATEGY_LABELS.get(n, n) for n in names])
    ax.set_ylabel("GB sent per GPU per step (ring)")
    if link_name:
        ax.set_title(f"time on {link_name} if not overlapped", fontsize=9)
    if title:
        fig.suptitle(title, fontsize=9)
    if used:
        ax.legend(handles=used, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8,
                  frameon=False)
    return fig
