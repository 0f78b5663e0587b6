"""The planner's figures: the top layouts of a `labkit.planner.plan`, each one's step time
stacked by part (compute, exposed communication per axis, pipeline bubble), beside its memory
per GPU against the GPU's capacity; and the planner against a measured sweep (`field_figure`).

    >>> p = plan("llama3-70b", 64, gpu="h100-sxm", global_batch=512, seq_len=8192)
    >>> fig = plan_figure(p.ranked[:8], capacity=p.inputs["capacity"])
    >>> fig = field_figure(labkit.field.price_sweep())
"""
from __future__ import annotations

from labkit.plots import GB, new_figure

# the parts of Estimate.breakdown, in the order they are stacked, with their colours
PARTS = {"compute": "#4c72b0", "host": "#8c8c8c", "tp": "#dd8452", "cp": "#8172b3",
         "ep": "#ccb974", "pp": "#937860", "dp": "#55a868", "optimizer": "#da8bc3",
         "bubble": "#c44e52"}
LABELS = {"compute": "compute", "host": "host-bound wait", "tp": "TP comm",
          "cp": "CP comm (exposed)", "ep": "EP all-to-all", "pp": "PP sends",
          "dp": "DP comm (exposed)", "optimizer": "optimizer step", "bubble": "pipeline bubble"}


def layout_label(layout) -> str:
    """A short name for a layout on an axis: 'tp8+sp pp16 dp128 cp1 fsdp b1 full'."""
    sp = "+sp" if layout.sequence_parallel else ""
    v = f"v{layout.chunks}" if layout.chunks > 1 else ""
    sharding = ("fsdp-nr" if layout.sharding == "fsdp" and not layout.reshard_after_forward
                else layout.sharding)
    return (f"tp{layout.tp}{sp} pp{layout.pp}{v} dp{layout.dp} cp{layout.cp} {sharding} "
            f"b{layout.micro_batch} {layout.recompute}")


def plan_figure(estimates, capacity: float, title: str = "", order: str = "fastest"):
    """Left: seconds per step of each Estimate in `estimates` (the first at the top), stacked
    by part. Right: GB per GPU (worst stage) of each, red where it is over the GPU's `capacity`
    (bytes, dashed). `order`: how the list is sorted, said in the title ("fastest", "leanest")."""
    fig = new_figure(10.0, 1.4 + 0.3 * max(len(estimates), 3))
    grid = fig.add_gridspec(1, 2, width_ratios=(3, 2))
    ax, mem = fig.add_subplot(grid[0]), fig.add_subplot(grid[1])
    ys = list(range(len(estimates)))[::-1]          # the fastest on top
    labels = [f"#{k} {layout_label(e.layout)}" for k, e in enumerate(estimates, 1)]
    left = [0.0] * len(estimates)
    for part, colour in PARTS.items():
        widths = [e.breakdown[part] for e in estimates]
        if any(w > 0 for w in widths):
            ax.barh(ys, widths, left=left, color=colour, label=LABELS[part], height=0.7)
            left = [a + w for a, w in zip(left, widths)]
    ax.set_yticks(ys, labels, fontsize=7)
    ax.set_xlabel("seconds per step")
    ax.set_title(f"step time by part ({order} on top)", fontsize=9)
    ax.set_xlim(left=0)
    gb = [e.memory / GB for e in estimates]
    mem.barh(ys, gb, height=0.7, color=["#4c72b0" if e.fits else "#c44e52" for e in estimates])
    mem.axvline(capacity / GB, color="#c44e52", linestyle="--", linewidth=1.2,
                label=f"GPU memory, {capacity / GB:,.0f} GB")
    mem.set_yticks(ys, [f"#{k}" for k in range(1, len(estimates) + 1)], fontsize=7)
    mem.set_xlim(0, 1.08 * max([capacity / GB] + gb))
    mem.set_xlabel("GB per GPU (worst pipeline stage)")
    mem.set_title("memory per GPU against the GPU's capacity", fontsize=9)
    handles = [h for a in (ax, mem) for h in a.get_legend_handles_labels()[0]]
    fig.legend(handles=handles, fontsize=7, frameon=False, loc="outside lower center",
               ncols=len(handles))
    if title:
        fig.suptitle(title, fontsize=9)
    return fig


def field_figure(rows, title: str = ""):
    """Predicted against measured tokens/s per GPU for priced sweep rows (`labkit.field`), one
    colour per model, log scales, the diagonal and a +-25 % band; runs left out of the figures
    (more than labkit.field.BREAKDOWN slower than their group's best) drawn hollow."""
    from labkit.field import BREAKDOWN

    fig = new_figure(7.0, 5.0)
    ax = fig.add_subplot()
    best: dict = {}
    for r in rows:
        if r.estimate is not None and r.measured_tokens:
            key = (r.model, r.nodes)
            best[key] = max(best.get(key, 0.0), r.measured_tokens)
    colours = {}
    for r in rows:
        if r.estimate is None or not r.measured_tokens:
            continue
        c = colours.setdefault(r.model, ["#4c72b0", "#dd8452", "#55a868", "#8172b3"][
            len(colours) % 4])
        kept = r.measured_tokens >= best[(r.model, r.nodes)] / BREAKDOWN
        ax.scatter(r.measured_tokens, r.predicted_tokens, s=10, linewidths=0.6,
                   facecolors=c if kept else "none", edgecolors=c, alpha=0.7)
    values = [v for r in rows if r.estimate is not None and r.measured_tokens
              for v in (r.measured_tokens, r.predicted_tokens)]
    low, high = min(values) / 1.5, max(values) * 1.5
    ax.plot([low, high], [low, high], color="black", linewidth=1, label="predicted = measured")
    ax.fill_between([low, high], [0.75 * low, 0.75 * high], [1.25 * low, 1.25 * high],
                    color="grey", alpha=0.2, label="within 25 %")
    for model, c in colours.items():
        ax.scatter([], [], s=10, color=c, label=f"{model} model")
    ax.scatter([], [], s=10, facecolors="none", edgecolors="grey",
               label=f"> {BREAKDOWN:g}x slower than its group's best (left out)")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(low, high)
    ax.set_ylim(low, high)
    ax.set_xlabel("measured tokens/s per GPU")
    ax.set_ylabel("predicted tokens/s per GPU (labkit.planner.evaluate)")
    ax.legend(fontsize=7, frameon=False, loc="upper left")
    ax.set_title(title or "the planner against a measured sweep", fontsize=9)
    return fig


def bloom_search_figure(rows, title: str = ""):
    """Predicted against measured seconds per iteration for BigScience's priced layout search
    (`labkit.field_bloom`), one colour per TP degree, the diagonal and a +-10 % band."""
    fig = new_figure(6.0, 4.6)
    ax = fig.add_subplot()
    ran = [r for r in rows if r.ratio is not None]
    colours = {1: "#8172b3", 2: "#55a868", 4: "#dd8452", 8: "#4c72b0"}
    for tp in sorted({r.layout.tp for r in ran}):
        group = [r for r in ran if r.layout.tp == tp]
        ax.scatter([r.measured_s for r in group], [r.estimate.step_time for r in group], s=14,
                   color=colours.get(tp, "grey"), alpha=0.8, label=f"TP {tp}")
    values = [v for r in ran for v in (r.measured_s, r.estimate.step_time)]
    low, high = min(values) / 1.08, max(values) * 1.08
    ax.plot([low, high], [low, high], color="black", linewidth=1, label="predicted = measured")
    ax.fill_between([low, high], [0.9 * low, 0.9 * high], [1.1 * low, 1.1 * high],
                    color="grey", alpha=0.2, label="within 10 %")
    ax.set_xlim(low, high)
    ax.set_ylim(low, high)
    ax.set_xlabel("measured seconds per iteration (BigScience, 48 nodes of 8 A100)")
    ax.set_ylabel("predicted (labkit.planner.evaluate)")
    ax.legend(fontsize=7, frameon=False, loc="upper left")
    ax.set_title(title or "the planner against BigScience's layout search", fontsize=9)
    return fig
