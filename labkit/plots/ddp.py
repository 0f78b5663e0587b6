"""Pictures for module 03 (data parallelism): a DDP step's time and throughput against the number
of GPUs, from a `labkit.scaling.ScalingCurve`.

    >>> from labkit.scaling import scaling_curve
    >>> fig = scaling_figure(scaling_curve("llama2-7b", 1024, "ib-ndr", compute_seconds=1.0),
    ...                      mark=64)

The figure draws the numbers of the curve it is given; it computes none.
"""
from __future__ import annotations

from labkit.plots import new_figure

COLOURS = {"compute": "#0072B2", "exposed": "#D55E00", "communication": "#999999",
           "total": "#000000", "throughput": "#009E73", "ideal": "#555555", "mark": "#B00020",
           "stop": "#E69F00"}


def _positive(xs, ys):
    """The (x, y) pairs a log axis can draw (a step on one GPU has no communication: 0 s)."""
    pairs = [(x, y) for x, y in zip(xs, ys) if y > 0]
    return [x for x, _ in pairs], [y for _, y in pairs]


def scaling_figure(curve, mark: int | None = None, title: str | None = None):
    """Two panels over the curve's GPU counts (log scales). Left: seconds per step, compute,
    exposed communication and their sum (the step), with all the communication dashed (what
    the backward hides is the gap between it and the exposed part). Right: throughput against
    the ideal (N x one GPU's), with the first count whose efficiency is below the curve's
    threshold marked. `mark`: a GPU count drawn as a vertical line on both."""
    from matplotlib.ticker import FuncFormatter

    gpus = curve.gpus
    steps = [p.step for p in curve.points]
    fig = new_figure(9.0, 3.6)
    ax_t, ax_x = fig.subplots(1, 2)
    for key, label, values, style in (
            ("total", "step = compute + exposed", [s.total for s in steps], "-"),
            ("compute", "compute (forward + backward)", [s.compute for s in steps], "-"),
            ("communication", "all-reduces back to back", [s.communication for s in steps], "--"),
            ("exposed", "exposed communication", [s.exposed for s in steps], "-")):
        xs, ys = _positive(gpus, values)
        if xs:
            ax_t.plot(xs, ys, style, marker="o", ms=3, color=COLOURS[key], label=label,
                      lw=2 if key == "total" else 1.2)
    ax_t.set_ylabel("seconds per step")

    ax_x.plot(gpus, [p.throughput for p in curve.points], "-o", ms=3,
              color=COLOURS["throughput"], label="throughput (model)")
    ax_x.plot(gpus, [curve.ideal(n) for n in gpus], ":", color=COLOURS["ideal"],
              label="ideal: N x one GPU")
    stop = curve.stops_scaling
    if stop is not None:
        ax_x.axvline(stop, color=COLOURS["stop"], lw=1.2,
                     label=f"efficiency < {curve.threshold:.0%} from {stop:,} GPUs")
    ax_x.set_ylabel(f"throughput (batches/s, {curve.scaling} scaling)")

    for ax in (ax_t, ax_x):
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:,.0f}"))
        ax.set_yscale("log")
        ax.set_xlabel("GPUs (data-parallel ranks)")
        ax.grid(True, which="major", alpha=0.3)
        if mark is not None:
            ax.axvline(mark, color=COLOURS["mark"], lw=1, ls="-.", label=f"{mark:,} GPUs")
        ax.legend(fontsize=7)
    if title:
        fig.suptitle(title, fontsize=9)
    return fig
