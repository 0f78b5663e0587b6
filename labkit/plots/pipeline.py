"""Pipeline schedules as Gantt charts (module 07): one row per stage, forwards, backwards and
weight-gradient passes coloured, a rank's later chunks lighter and hatched (interleaved, ZB-V,
DualPipeV), each bar numbered with its micro-batch, from a simulated
`labkit.pipeline.PipelineResult` or a measured run's event list (dicts with stage, kind,
microbatch, chunk, start, end).

    >>> fig = gantt(simulate("1f1b", 4, 8))
    >>> fig = side_by_side(simulate("gpipe", 4, 8), measured_events)
"""
from __future__ import annotations

from matplotlib.collections import PolyCollection

from labkit.pipeline import V_SCHEDULES, PipelineResult, as_events, idle_share
from labkit.plots import new_figure

COLOURS = {"F": "#4c72b0", "B": "#dd8452", "W": "#55a868"}
NAMES = {"F": "forward", "B": "backward", "W": "weight grad"}
LABELLED = 400          # bars numbered up to this many events (text is slow and unreadable)


def _height(stages: int) -> float:
    """Inches: 0.45 a stage, between 2 and 8 in all."""
    return min(8.0, 0.5 + 0.45 * max(2, stages))


def _title(data, rows) -> str:
    share = idle_share(rows, data.stages if isinstance(data, PipelineResult) else None)
    if not isinstance(data, PipelineResult):
        return f"{100 * share:.1f} % of the step idle"
    v = f", v={data.chunks}" if data.chunks > 1 else ""
    if data.schedule in V_SCHEDULES:
        v = f" ranks ({2 * data.stages} stages in a V)"
    return (f"{data.schedule}, p={data.stages}{v}, m={data.microbatches}: "
            f"{100 * share:.1f} % of the step idle")


def gantt(data, ax=None, title: str | None = None, unit: str = "time"):
    """Draw `data` (a PipelineResult or events) on `ax` (or a new figure, returned); stage 0
    on top. A rank's chunks (interleaved, zbv, dualpipev) are told apart by shade and hatching
    (chunk 0 plain), the micro-batch number written on each bar while there are at most
    LABELLED events; rows are "rank r" for the V schedules (each holds stages r and 2p-1-r).
    title: default the schedule, p, m (v) and the idle share; unit: the x-axis label."""
    rows = as_events(data)
    fig = None
    if ax is None:
        fig = new_figure(9.0, _height(len({e.stage for e in rows})))
        ax = fig.add_subplot()
    start = min(e.start for e in rows)
    span = max(e.end for e in rows) - start
    chunks = max(e.chunk for e in rows) + 1
    groups: dict = {}                  # (kind, chunk) -> bar corners: one collection each
    for e in rows:
        x0, x1, y0, y1 = e.start, e.end, e.stage - 0.4, e.stage + 0.4
        groups.setdefault((e.kind, e.chunk), []).append(
            [(x0, y0), (x1, y0), (x1, y1), (x0, y1)])
    order = {k: i for i, k in enumerate(COLOURS)}
    for kind, chunk in sorted(groups, key=lambda g: (order.get(g[0], 9), g[1])):
        alpha = 1.0 - 0.45 * chunk / max(1, chunks - 1)
        ax.add_collection(PolyCollection(
            groups[(kind, chunk)], facecolors=COLOURS.get(kind, "grey"), edgecolors="white",
            linewidths=0.5 if len(rows) <= 2000 else 0.0, alpha=alpha,
            hatch="////" if chunk and len(rows) <= 2000 else None,
            label=f"_chunk {chunk}" if chunk else NAMES.get(kind, kind)))
    if len(rows) <= LABELLED:
        for e in rows:
            if span > 0 and (e.end - e.start) / span > 0.012:
                ax.text((e.start + e.end) / 2, e.stage, str(e.microbatch), ha="center",
                        va="center", fontsize=7, color="white")
    stages = sorted({e.stage for e in rows})
    ticks = stages[::-(-len(stages) // 16)]          # at most 16 labels
    row = "rank" if getattr(data, "schedule", None) in V_SCHEDULES else "stage"
    ax.set_yticks(ticks, [f"{row} {s}" for s in ticks])
    ax.set_ylim(max(stages) + 0.6, min(stages) - 0.6)
    ax.set_xlim(start, start + (span if span > 0 else 1.0))
    ax.set_xlabel(unit)
    ax.set_title(_title(data, rows) if title is None else title, fontsize=9)
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7, frameon=False,
              title="lighter, hatched: later chunk" if chunks > 1 else None, title_fontsize=7)
    return fig if fig is not None else ax.figure


def side_by_side(simulated, measured, labels=("simulated", "measured"), unit: str = "s"):
    """Two Gantt charts, one above the other: a simulation and a measured run of the same
    schedule (each titled with its idle share), on their own time axes."""
    n = max(len({e.stage for e in as_events(d)}) for d in (simulated, measured))
    fig = new_figure(9.0, 2 * _height(n))
    for i, (data, label) in enumerate(zip((simulated, measured), labels)):
        ax = fig.add_subplot(2, 1, i + 1)
        gantt(data, ax=ax, unit=unit)
        ax.set_title(f"{label}: {ax.get_title()}", fontsize=9)
    return fig
