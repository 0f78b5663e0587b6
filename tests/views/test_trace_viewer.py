"""The trace timeline (labkit.plots.trace) and the trace viewer (labkit.widgets.trace): what they
draw and show equals labkit.trace's figures for the same window; zoom and step change what is
drawn; unreadable traces and bad windows give messages."""
from __future__ import annotations

from pathlib import Path

import pytest

from labkit.plots.trace import lanes_of, trace_timeline
from labkit.trace import length, summarize
from labkit.widgets.trace import TraceViewer

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "traces"
RANKS = [str(FIXTURES / f"gloo-rank{r}.json") for r in (0, 1)]


def drawn(ax, colour) -> float:
    """Total width (ms) of the bars of one face colour drawn on the axes."""
    from matplotlib.colors import to_rgba

    total = 0.0
    for coll in ax.collections:
        faces = coll.get_facecolor()
        if len(faces) and tuple(faces[0]) == to_rgba(colour):
            total += sum(p.get_extents().width for p in coll.get_paths())
    return total


def test_timeline_draws_each_ranks_compute_and_comm_as_measured():
    from labkit.plots.timeline import COMM, COMPUTE

    fig = trace_timeline(RANKS, step=3)
    ax = fig.axes[0]
    lanes = lanes_of(RANKS, 3)
    assert drawn(ax, COMPUTE) == pytest.approx(sum(length(l.compute) for l in lanes) / 1e3, rel=1e-6)
    assert drawn(ax, COMM) == pytest.approx(sum(length(l.comm) for l in lanes) / 1e3, rel=1e-6)
    assert [t.get_text() for t in ax.get_yticklabels()][:2] == ["rank 0 compute", "rank 0 comm"]
    zoomed = trace_timeline(RANKS, step=3, window_ms=(1.0, 2.0)).axes[0]
    assert zoomed.get_xlim() == (1.0, 2.0)


@pytest.mark.parametrize("bad, message", [
    ([], "no traces"), (["/nonexistent/rank0.json"], "trace 0: .*not a readable JSON"),
    ([{"traceEvents": "x"}], "trace 0: .*'traceEvents' list"),
])
def test_timeline_refuses_bad_traces(bad, message):
    with pytest.raises(ValueError, match=message):
        trace_timeline(bad)


def test_timeline_refuses_a_bad_window_and_a_missing_step():
    with pytest.raises(ValueError, match="0 <= start < end"):
        trace_timeline(RANKS, window_ms=(3, 1))
    with pytest.raises(ValueError, match="no ProfilerStep#9.*steps: \\[2, 3\\]"):
        trace_timeline(RANKS, step=9)


def test_viewer_shows_the_summaries_of_the_chosen_step_and_zooms():
    v = TraceViewer(RANKS)
    assert [o[1] for o in v.controls["step"].options] == [None, 2, 3]
    whole = [s.span_s for s in v.summaries]
    v.controls["step"].value = 3
    for got, path in zip(v.summaries, RANKS):
        want = summarize(path, step=3)
        assert (got.exposed_comm_s, got.comm_s) == (want.exposed_comm_s, want.comm_s)
        assert f"{want.exposed_comm_s * 1e3:,.2f}" in v.result.value
    assert all(s.span_s < w for s, w in zip(v.summaries, whole))
    span = v.controls["zoom"].max
    assert v.controls["zoom"].value == (0.0, span) and v.error is None
    before = v.figure.value
    v.controls["zoom"].value = (span / 4, span / 2)
    assert v.figure.value and v.figure.value != before
    v.controls["exposed"].value = False
    assert v.error is None and v.figure.layout.display == ""


def test_viewer_refuses_unreadable_traces_with_the_trace_named():
    with pytest.raises(ValueError, match="trace 1: "):
        TraceViewer([RANKS[0], {"traceEvents": []}])
