"""Profiler traces as a per-rank timeline (module 11): for each rank a lane of compute and one of
communication, the exposed communication (no compute running) marked in red, from
`labkit.trace.intervals` over the Chrome traces `torch.profiler` writes.

    fig = trace_timeline(["ddp-torch-rank0.json", "ddp-torch-rank1.json"], step=3)
    fig = trace_timeline(traces, window_ms=(2.0, 6.5))      # zoomed, ms from the common start

Times are drawn from the earliest window start over the ranks (one machine: one clock).
"""
from __future__ import annotations

from labkit.plots import new_figure
from labkit.plots.timeline import COMM, COMPUTE

EXPOSED = "#C00000"


def lanes_of(traces, step: int | None = None) -> list:
    """labkit.trace.Lanes of each trace (a path, a loaded dict or a list of events), in order;
    ValueError naming the trace that cannot be read."""
    from labkit.trace import intervals

    if isinstance(traces, (str, dict)) or not hasattr(traces, "__iter__"):
        traces = [traces]
    out = []
    for i, t in enumerate(traces):
        try:
            out.append(intervals(t, step=step))
        except ValueError as err:
            raise ValueError(f"trace {i}: {err}") from None
    if not out:
        raise ValueError("no traces given; allowed: one trace or a list of them, one per rank")
    return out


def trace_timeline(traces, step: int | None = None, *, window_ms: tuple | None = None,
                   exposed: bool = True, title: str | None = None, ax=None):
    """A Figure: one pair of lanes per rank (compute above, communication below), exposed
    communication highlighted (`exposed`), optionally limited to `window_ms` = (start, end) in
    ms from the earliest start."""
    lanes = lanes_of(traces, step)
    t0 = min(l.lo for l in lanes)
    end = max(l.hi for l in lanes)
    if window_ms is not None:
        a, b = window_ms
        if not (0 <= a < b):
            raise ValueError(f"window_ms={window_ms!r}: allowed: (start, end) in ms with 0 <= start < end")
    fig = None
    if ax is None:
        fig = new_figure(9.0, 0.9 + 0.75 * len(lanes))
        ax = fig.add_subplot()
    ms = lambda iv: [((x - t0) / 1e3, (y - x) / 1e3) for x, y in iv]  # noqa: E731
    ticks, labels = [], []
    for i, l in enumerate(lanes):
        y = (len(lanes) - 1 - i) * 2.0
        rank = l.rank if l.rank is not None else i
        ax.broken_barh(ms(l.compute), (y + 0.95, 0.8), facecolors=COMPUTE, label="compute" if i == 0 else None)
        ax.broken_barh(ms(l.comm), (y + 0.05, 0.8), facecolors=COMM,
                       label="communication" if i == 0 else None)
        if exposed and l.exposed:
            ax.broken_barh(ms(l.exposed), (y + 0.05, 0.8), facecolors="none", edgecolors=EXPOSED,
                           hatch="////", linewidth=0.6, label="exposed" if i == 0 else None)
        ticks += [y + 1.35, y + 0.45]
        labels += [f"rank {rank} compute", f"rank {rank} comm"]
    ax.set_yticks(ticks, labels, fontsize=8)
    ax.set_xlabel("ms from the earliest start")
    ax.set_xlim(*(window_ms if window_ms is not None else (0, (end - t0) / 1e3)))
    ax.set_ylim(-0.2, 2.0 * len(lanes))
    where = f"ProfilerStep#{step}" if step is not None else "whole trace"
    ax.set_title(title or f"{where}: compute, communication and exposed communication per rank",
                 fontsize=10)
    ax.legend(loc="upper right", fontsize=8, ncols=3, framealpha=0.9)
    return fig if fig is not None else ax.figure
