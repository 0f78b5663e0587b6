"""Pipeline timelines (module 07): a Gantt chart of one step's operations per stage, and a
measured step drawn beside its simulation on the same time scale.

    from labkit.pipeline import simulate
    from labkit.plots import pp
    fig = pp.gantt(simulate("1f1b", 4, 8))                    # one panel
    fig = pp.beside(measured_events, simulate("1f1b", 4, 8))  # two panels, same scale

Events: `labkit.pipeline.Event`s, a PipelineResult, or the dicts a lab reports ({stage, kind,
microbatch, chunk, start, end}); how each is drawn: `draw`.
"""
from __future__ import annotations

from labkit.pipeline import as_events, idle_share
from labkit.plots import new_figure

# BW: a full backward measured as one pass beside split ones (DualPipeV, a hand-written
# schedule: labkit.labs.pp); the simulator draws it as a B and a W
COLORS = {"F": "#0072B2", "B": "#D55E00", "W": "#009E73", "BW": "#CC79A7"}
HATCHES = ("", "//", "\\\\", "xx", "..", "++")


def _rows(events, name: str) -> list:
    """Events checked: Event-like, with a known kind and end >= start; ValueError naming
    `name` otherwise."""
    try:
        rows = as_events(events)
    except ValueError as exc:
        raise ValueError(f"{name}: {exc}") from None
    for e in rows:
        if e.kind not in COLORS:
            raise ValueError(f"{name}: an event has kind={e.kind!r}; allowed: "
                             f"{', '.join(COLORS)}")
        if e.end < e.start or e.stage < 0:
            raise ValueError(f"{name}: event {e} has end before start or a negative stage; "
                             "allowed: stage >= 0 and end >= start")
    return rows


def draw(ax, rows: list, title: str, stages: int | None = None, span: float | None = None,
         row: str = "stage"):
    """One step's operations as bars on `ax`, one row per stage; `span` fixes the x range;
    `row` names the rows ("rank" where a rank holds several stages, as in a V).

    Each bar is one operation: F forward, B backward (the input gradient for split schedules),
    W weight gradient, BW a measured full backward beside split ones, labelled with its
    micro-batch; a later model chunk (interleaved, V) is drawn hatched. Stage 0 is the top row; the idle share of the step (labkit.pipeline.idle_share) is
    in the title."""
    n = stages or 1 + max(e.stage for e in rows)
    t0 = min(e.start for e in rows)
    width = span or max(e.end for e in rows) - t0
    for e in rows:
        ax.barh(e.stage, e.end - e.start, left=e.start - t0, height=0.8,
                color=COLORS[e.kind], edgecolor="white", linewidth=0.5,
                hatch=HATCHES[e.chunk % len(HATCHES)])
        if e.end - e.start > width / 60:
            ax.text((e.start + e.end) / 2 - t0, e.stage, str(e.microbatch), ha="center",
                    va="center", fontsize=7, color="white")
    ax.set_ylim(n - 0.5, -0.5)
    ax.set_yticks(range(n), [f"{row} {i}" for i in range(n)])
    ax.set_xlim(0, width)
    ax.set_title(f"{title}: idle {100 * idle_share(rows, n):.1f}% of the step", fontsize=10)
    return ax


def _legend(fig, rows) -> None:
    from matplotlib.patches import Patch

    kinds = [k for k in COLORS if any(e.kind == k for e in rows)]
    names = {"F": "forward", "B": "backward", "W": "weight gradient",
             "BW": "full backward (B + W)"}
    handles = [Patch(color=COLORS[k], label=names[k]) for k in kinds]
    chunks = sorted({e.chunk for e in rows} - {0})
    handles += [Patch(facecolor="white", edgecolor="grey", hatch=HATCHES[c % len(HATCHES)],
                      label=f"chunk {c}") for c in chunks]
    fig.legend(handles=handles, loc="outside lower center", ncol=len(handles), fontsize=8,
               frameon=False)


def gantt(events, title: str = "pipeline step", stages: int | None = None, row: str = "stage"):
    """A Figure: one step's events as a Gantt chart (x: seconds from the first start)."""
    rows = _rows(events, "events")
    n = stages or 1 + max(e.stage for e in rows)
    fig = new_figure(8, 0.5 * n + 1.4)
    draw(fig.add_subplot(), rows, title, n, row=row)
    fig.axes[0].set_xlabel("time (s)")
    _legend(fig, rows)
    return fig


def beside(measured, simulated, titles=("measured", "simulated"), row: str = "stage"):
    """A Figure of two Gantt charts, measured above simulated, on the same time scale (the
    longer step's), each with its idle share in the title; `row` names the rows (`draw`)."""
    got, want = _rows(measured, "measured"), _rows(simulated, "simulated")
    n = 1 + max(e.stage for e in got + want)
    span = max(max(e.end for e in r) - min(e.start for e in r) for r in (got, want))
    fig = new_figure(8, 1.0 * n + 2.0)
    axes = fig.subplots(2, 1, sharex=True)
    for ax, rows, title in zip(axes, (got, want), titles):
        draw(ax, rows, title, n, span, row)
    axes[1].set_xlabel("time (s)")
    _legend(fig, got + want)
    return fig
