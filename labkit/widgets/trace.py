"""The trace viewer (module 11): the ranks' profiler traces as lanes (compute, communication,
exposed communication highlighted), zoomed to one ProfilerStep and to a time range, with each
rank's figures from `labkit.trace.summarize` and `labkit.trace_drills.overlap` beside them.

    >>> from labkit.widgets.trace import TraceViewer
    >>> v = TraceViewer(["ddp-torch-rank0.json", "ddp-torch-rank1.json"])
    >>> v.controls["step"].value = 3                 # a test's way of choosing
    >>> v.controls["zoom"].value = (1.0, 4.0)        # ms from the earliest start
    >>> v.summaries[1].exposed_comm_s                # what the table shows
"""
from __future__ import annotations

import ipywidgets as widgets

from labkit.plots import png_bytes
from labkit.plots.trace import lanes_of, trace_timeline
from labkit.trace import _read, steps, summarize
from labkit.widgets import error_html, row, table_html

WHOLE = "whole trace"


class TraceViewer:
    """Controls: step (the whole trace or one ProfilerStep#N), zoom ((start, end) ms from the
    earliest start in the chosen window), exposed (highlight exposed communication). `summaries`
    (one TraceSummary per rank) and `lanes` are the last results; `error` the message shown
    instead when a trace cannot be read."""

    def __init__(self, traces, *, names: list[str] | None = None):
        if isinstance(traces, (str, dict)) or not hasattr(traces, "__iter__"):
            traces = [traces]
        self.traces = []
        for i, t in enumerate(traces):     # read each file once; refuse unreadable ones here
            try:
                self.traces.append(_read(t)[0])
            except ValueError as err:
                raise ValueError(f"trace {i}: {err}") from None
        if not self.traces:
            raise ValueError("no traces given; allowed: one trace or a list of them, one per rank")
        self.names = names or [f"rank {i}" for i in range(len(self.traces))]
        common = sorted(set.intersection(*(set(steps(t)) for t in self.traces)))
        c = {"step": widgets.Dropdown(description="step", options=[(WHOLE, None)] +
                                      [(f"ProfilerStep#{n}", n) for n in common], value=None),
             "zoom": widgets.FloatRangeSlider(description="zoom (ms)", min=0.0, max=1.0,
                                              value=(0.0, 1.0), step=0.01, readout_format=".2f",
                                              continuous_update=False,
                                              layout=widgets.Layout(width="560px")),
             "exposed": widgets.Checkbox(description="highlight exposed communication", value=True)}
        self.controls = c
        self.summaries = self.lanes = None
        self.error: str | None = None
        self.result = widgets.HTML()
        self.figure = widgets.Image(format="png", layout=widgets.Layout(width="900px"))
        self.widget = widgets.VBox([row([c["step"], c["exposed"]]), c["zoom"], self.result, self.figure])
        c["step"].observe(self._new_step, "value")
        c["zoom"].observe(lambda _: self.update(), "value")
        c["exposed"].observe(lambda _: self.update(), "value")
        self._new_step()

    def _new_step(self, _=None) -> None:
        """A new window: the zoom spans it whole."""
        step = self.controls["step"].value
        self.lanes = lanes_of(self.traces, step)
        span = (max(l.hi for l in self.lanes) - min(l.lo for l in self.lanes)) / 1e3
        zoom = self.controls["zoom"]
        with zoom.hold_trait_notifications():
            zoom.max = max(span, 0.01)
            zoom.min = 0.0
            zoom.step = max(zoom.max / 500, 1e-3)
            zoom.value = (0.0, zoom.max)
        self.update()

    def update(self) -> None:
        from labkit.trace_drills import overlap

        c = self.controls
        step = c["step"].value
        try:
            self.summaries = [summarize(t, step=step) for t in self.traces]
            rows = []
            for name, s, t in zip(self.names, self.summaries, self.traces):
                share = f"{overlap(t, step=step):.0%}" if s.comm_s > 0 else "-"
                rows.append([name, *(f"{v * 1e3:,.2f}" for v in
                                     (s.span_s, s.compute_s, s.comm_s, s.exposed_comm_s, s.idle_s)), share])
            self.result.value = table_html(rows, ["rank", "span ms", "compute ms", "comm ms",
                                                  "exposed ms", "idle ms", "comm hidden"])
            lo, hi = c["zoom"].value
            fig = trace_timeline(self.traces, step, window_ms=(lo, max(hi, lo + 1e-3)),
                                 exposed=c["exposed"].value)
            self.figure.value = png_bytes(fig)
            self.figure.layout.display = ""
            self.error = None
        except ValueError as err:
            self.error = str(err)
            self.result.value = error_html(err)
            self.figure.layout.display = "none"

    def _repr_mimebundle_(self, **kwargs):
        """The last line `viewer` of a cell displays it."""
        return self.widget._repr_mimebundle_(**kwargs)
