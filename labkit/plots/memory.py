"""Training memory per GPU as stacked bars: one bar per configuration, one colour per term
(weights, gradients, optimizer states, activations), a dashed line at the GPU's capacity.

    >>> from labkit.memory import estimate_memory
    >>> fig = memory_bars({f"ZeRO-{z}": estimate_memory("llama2-7b", seq_len=4096, zero_stage=z,
    ...                                                 dp=8) for z in range(4)},
    ...                   capacity=80e9, capacity_label="H100 80 GB", highlight="ZeRO-3")

The figure only draws numbers it is given (bytes, from `labkit.memory`); it computes none.
"""
from __future__ import annotations

from labkit.plots import GB, new_figure

# (attribute of MemoryEstimate, legend label, colour): the order they stack, bottom to top.
TERMS = (
    ("params", "weights", "#4c72b0"),
    ("grads", "gradients", "#55a868"),
    ("optimizer_states", "optimizer states (incl. fp32 master)", "#c44e52"),
    ("activations", "activations", "#dd8452"),
)


def memory_bars(estimates: dict, capacity: float | None = None, capacity_label: str = "",
                highlight: str | None = None, title: str = "", usable: float | None = None,
                xlabel: str = ""):
    """A Figure of stacked bars in GB (1e9 bytes), one bar per (label -> MemoryEstimate).

    capacity: a GPU's memory in bytes, drawn as a dashed line (None: no line), named in the
        legend by capacity_label.
    highlight: the label whose bar is drawn opaque with its total written above it; the others
        are drawn faded (None: all opaque). usable: what a run may fill, a dotted line.
    """
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    fig = new_figure(7.0, 3.6)
    ax = fig.add_subplot()
    labels = list(estimates)
    xs = range(len(labels))
    bottoms = [0.0] * len(labels)
    handles = []
    for attr, name, colour in TERMS:
        heights = [getattr(estimates[k], attr) / GB for k in labels]
        for x, k, hgt, bot in zip(xs, labels, heights, bottoms):
            ax.bar(x, hgt, bottom=bot, color=colour, width=0.6,
                   alpha=1.0 if highlight in (None, k) else 0.35)
        bottoms = [b + hgt for b, hgt in zip(bottoms, heights)]
        handles.append(Patch(color=colour, label=name))
    top = max(bottoms) if bottoms else 0.0
    if capacity is not None:
        cap = capacity / GB
        ax.axhline(cap, color="black", linestyle="--", linewidth=1.2)
        handles.append(Line2D([], [], color="black", linestyle="--",
                              label=capacity_label or f"GPU memory: {cap:,.0f} GB"))
        top = max(top, cap)
    if usable is not None:                    # what a run may fill (labkit.planner.usable_memory)
        use = usable / GB
        ax.axhline(use, color="#b00020", linestyle=":", linewidth=1.4)
        handles.append(Line2D([], [], color="#b00020", linestyle=":",
                              label=f"usable: {use:,.1f} GB (headroom left)"))
        top = max(top, use)
    for x, k, total in zip(xs, labels, bottoms):
        if highlight in (None, k):
            ax.annotate(f"{total:,.1f}", xy=(x, total), xytext=(0, 2), textcoords="offset points",
                        ha="center", va="bottom", fontsize=8)
    ax.set_ylim(0, top * 1.15 if top > 0 else 1.0)
    ax.set_xticks(list(xs), labels)
    ax.set_ylabel("GB per GPU (1 GB = 1e9 bytes)")
    if xlabel:
        ax.set_xlabel(xlabel)
    if title:
        fig.suptitle(title, fontsize=9)
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8,
              frameon=False)
    return fig
