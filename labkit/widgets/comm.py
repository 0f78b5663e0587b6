"""The communication calculator: how long one collective takes under the alpha-beta model, for an
operation, a message size, a number of ranks and a link, with a time-against-size plot that
shows where the operation is latency-bound and where it is bandwidth-bound.

    >>> from labkit.widgets.comm import CommCalculator
    >>> calc = CommCalculator()              # in a notebook, the last line `calc` displays it
    >>> calc.controls["ranks"].value = "16"  # what a test does instead of typing
    >>> calc.result.value, calc.figure.value  # HTML, PNG bytes

A thin view over `labkit.comm` (collective_time, bytes_sent_per_rank, bus_bandwidth).
"""
from __future__ import annotations

import html

import ipywidgets as widgets

from labkit import validate
from labkit.comm import ALGORITHMS, OPS, algbw, bus_bandwidth, bytes_sent_per_rank, collective_time
from labkit.hardware import LINKS
from labkit.plots import png_bytes
from labkit.plots.comm import crossover_bytes, fmt_size as _fmt_size, fmt_time as _fmt_time, time_vs_size_figure
from labkit.widgets import (Calculator, Dropdown, ToggleButtons, error_html, int_field,
                            table_html)

CUSTOM = "custom"
MB = 1e6
# The values each number field takes (what its message names, smallest, largest): S from one
# byte to the cost model's 1e18; a custom link from 1 MB/s (below any link in LINKS by 1e4) to
# 1 PB/s (1,000x NVLink 5), and a latency up to 1 s. Every time shown then stays readable.
RANGES = {"size_mb": ("message size S (MB)", 1 / MB, validate.MAX_BYTES / MB),
          "bandwidth_gbs": ("custom bandwidth (GB/s per direction)", 1e-3, 1e6),
          "latency_us": ("custom latency (µs)", 0.0, 1e6)}


class CommCalculator(Calculator):
    """Time of one collective under the alpha-beta model (ring or tree).

    Controls (names as in `controls`): op, algorithm, size_mb (message size S in MB = 1e6 bytes,
    nccl-tests' convention for S: the all_reduce buffer, the all_gather output, the
    reduce_scatter input), ranks, link (a LINKS key or "custom"), bandwidth_gbs (custom link:
    GB/s per direction) and latency_us (custom link: microseconds per message). Keyword
    arguments set their starting values, e.g. `CommCalculator(op="all_gather", link="ib-ndr")`.

    A thin view over `labkit.comm`: it holds no formula, recomputes when any control changes, and
    keeps its results in widget traits. `time` is the last predicted time in seconds (None while
    the input is invalid) and `error` the message shown instead (None when valid).
    """

    ranges = RANGES
    arguments = {"world_size": "ranks"}

    def __init__(self, **initial):
        style = {"description_width": "150px"}
        wide = widgets.Layout(width="420px")
        links = [(f"{v.name}: {v.bandwidth / 1e9:,.1f} GB/s per direction", k)
                 for k, v in LINKS.items()]
        c = {
            "op": Dropdown(options=list(OPS), value="all_reduce", description="operation",
                           style=style, layout=wide),
            "algorithm": ToggleButtons(options=list(ALGORITHMS), value="ring",
                                       description="algorithm", style=style),
            # typed, not slid: message sizes span 10 orders of magnitude
            "size_mb": widgets.FloatText(value=1000.0, description="message S (MB)",
                                         style=style, layout=wide),
            "ranks": int_field("ranks N", 8, width="420px", description_width="150px"),
            "link": Dropdown(options=links + [("custom bandwidth and latency", CUSTOM)],
                             value="nvlink4", description="link", style=style, layout=wide),
            "bandwidth_gbs": widgets.FloatText(value=25.0,
                                               description="custom GB/s (per dir.)",
                                               style=style, layout=wide),
            "latency_us": widgets.FloatText(value=5.0, description="custom latency (µs)",
                                            style=style, layout=wide),
        }
        self.controls: dict[str, widgets.Widget] = c
        self._set_initial(initial)

        self.result = widgets.HTML()
        self.figure = widgets.Image(format="png", layout=widgets.Layout(width="640px"))
        self.time: float | None = None
        self.error: str | None = None
        self._custom_box = widgets.VBox([c["bandwidth_gbs"], c["latency_us"]])
        self.widget = widgets.VBox([c["op"], c["algorithm"], c["size_mb"], c["ranks"], c["link"],
                                    self._custom_box, self.result, self.figure])
        self._watch()
        self.update()

    # ---- what the controls say -----------------------------------------------------------
    def inputs(self) -> dict:
        """The arguments passed to `collective_time` (bytes, ranks, bytes/s, seconds); raises
        ValueError naming the control when one is out of range."""
        c = self.controls
        nbytes = self._number("size_mb") * MB
        ranks = self.read_ints(["ranks"])["ranks"]
        if ranks < 2:
            raise ValueError(f"ranks N={validate.describe(ranks)}: a collective needs at least 2 "
                             "ranks; allowed: a whole number from 2 to "
                             f"{validate.show(validate.MAX_RANKS)}")
        if c["link"].value == CUSTOM:
            bw, lat = self._number("bandwidth_gbs") * 1e9, self._number("latency_us") * 1e-6
        else:
            link = LINKS[c["link"].value]
            bw, lat = link.bandwidth, link.latency
        return dict(op=c["op"].value, nbytes=nbytes, world_size=ranks, bandwidth=bw,
                    latency=lat, algorithm=c["algorithm"].value)

    # ---- recomputing ---------------------------------------------------------------------
    def update(self) -> None:
        c = self.controls
        self._custom_box.layout.display = "" if c["link"].value == CUSTOM else "none"
        try:
            kw = self.inputs()
            t = collective_time(**kw)
            t_lat = collective_time(**{**kw, "nbytes": 0.0})            # the alpha term alone
            t_bw = collective_time(**{**kw, "latency": 0.0})            # the beta term alone
            cross = crossover_bytes(kw["op"], kw["world_size"], kw["bandwidth"], kw["latency"],
                                    kw["algorithm"])
            fig = time_vs_size_figure(kw["op"], kw["world_size"], kw["bandwidth"],
                                      kw["latency"], algorithm=kw["algorithm"], mark=kw["nbytes"],
                                      title=self._title(kw))
        except ValueError as exc:
            self.time, self.error = None, self.error_text(exc)
            self.result.value = error_html(self.error)
            self.show_figure(None)
            return
        self.time, self.error = t, None
        self.result.value = self._result_html(kw, t, t_lat, t_bw, cross)
        self.show_figure(png_bytes(fig))

    # ---- views ---------------------------------------------------------------------------
    def _title(self, kw) -> str:
        link = self.controls["link"].value
        name = "custom link" if link == CUSTOM else LINKS[link].name
        return (f"{kw['op']} ({kw['algorithm']}) on {kw['world_size']} ranks, {name}: "
                f"{kw['bandwidth'] / 1e9:,.1f} GB/s per direction, α = "
                f"{kw['latency'] * 1e6:g} µs")

    @staticmethod
    def _crossover(cross: float) -> str:
        """Where the two terms are equal (nowhere with no latency: cross = 0)."""
        if cross == 0:
            return "; with no latency every size is bandwidth-bound"
        return f"; the two terms are equal at S = {_fmt_size(cross)}"

    def _result_html(self, kw, t, t_lat, t_bw, cross) -> str:
        op, n, S = kw["op"], kw["world_size"], kw["nbytes"]
        bound = "latency-bound" if t_lat > t_bw else "bandwidth-bound"
        head = (f'<div class="labkit-verdict"><b>{html.escape(op)}</b> of {_fmt_size(S)} on '
                f"{n} ranks ({kw['algorithm']}): <b>{_fmt_time(t)}</b>, {bound} (the latency "
                f"term is {t_lat / t:.0%} of it{self._crossover(cross)}).</div>")
        rows = [
            ("predicted time", _fmt_time(t)),
            ("latency term (α part)", _fmt_time(t_lat)),
            ("bandwidth term (β part)", _fmt_time(t_bw)),
            ("bytes each rank sends (ring)", _fmt_size(bytes_sent_per_rank(op, S, n))),
            ("algbw = S / t", f"{algbw(S, t) / 1e9:,.2f} GB/s"),
            ("busbw (nccl-tests)", f"{bus_bandwidth(op, S, t, n) / 1e9:,.2f} GB/s"),
        ]
        link = self.controls["link"].value
        if link == CUSTOM:
            rows.append(("link", f"custom: {kw['bandwidth'] / 1e9:,.2f} GB/s per direction "
                                 f"= {kw['bandwidth'] * 8 / 1e9:,.1f} Gb/s; α = "
                                 f"{kw['latency'] * 1e6:g} µs"))
        else:
            L = LINKS[link]
            rows += [("link", L.name),
                     ("per direction", f"{L.bandwidth / 1e9:,.2f} GB/s = "
                                       f"{L.bandwidth * 8 / 1e9:,.1f} Gb/s"),
                     ("both directions added", f"{L.bidirectional / 1e9:,.2f} GB/s"),
                     ("vendor's words", L.quoted), ("α (latency per message)",
                                                    f"{L.latency * 1e6:g} µs"),
                     ("source", L.source)]
        return head + table_html(rows, header=("", ""))
