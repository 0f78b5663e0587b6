"""FP8 round-trip error by scaling (module 11): for each tensor kind a panel of bars, one per
scaling and format, from the rows `labkit.fp8.compare` measures.

    fig = error_by_scaling(fp8.compare(fp8.capture()))
"""
from __future__ import annotations

from labkit.plots import new_figure

COLOURS = {"e4m3": "#0072B2", "e5m2": "#D55E00"}
KEYS = ("kind", "dtype", "scaling", "rel_error")


def error_by_scaling(rows, *, title: str = "FP8 round-trip error by scaling, measured"):
    """A Figure: one panel per tensor kind (in the rows' order), log-scale relative error
    ‖x - dq(q(x))‖ / ‖x‖ per scaling, a bar per format."""
    rows = list(rows)
    for i, r in enumerate(rows):
        if not isinstance(r, dict) or any(k not in r for k in KEYS):
            raise ValueError(f"row {i} must be a dict with keys {', '.join(KEYS)} (what "
                             f"labkit.fp8.compare returns); got {r!r:.120}")
    if not rows:
        raise ValueError("no rows to draw; allowed: the rows labkit.fp8.compare returns")
    kinds = list(dict.fromkeys(r["kind"] for r in rows))
    scalings = list(dict.fromkeys(r["scaling"] for r in rows))
    dtypes = list(dict.fromkeys(r["dtype"] for r in rows))
    err = {(r["kind"], r["dtype"], r["scaling"]): r["rel_error"] for r in rows}
    fig = new_figure(3.6 * len(kinds), 3.4)
    axes = fig.subplots(1, len(kinds), sharey=True, squeeze=False)[0]
    width = 0.8 / len(dtypes)
    for ax, kind in zip(axes, kinds):
        for i, d in enumerate(dtypes):
            xs = [j + (i - (len(dtypes) - 1) / 2) * width for j in range(len(scalings))]
            ys = [err.get((kind, d, s), float("nan")) for s in scalings]
            ax.bar(xs, ys, width, label=d, color=COLOURS.get(d))
        ax.set_title(kind, fontsize=10)
        ax.set_xticks(range(len(scalings)), [s.replace("block", "") for s in scalings],
                      rotation=30, fontsize=8)
        ax.set_yscale("log")
    axes[0].set_ylabel("relative error")
    axes[0].legend(fontsize=8)
    fig.suptitle(title, fontsize=11)
    return fig
