"""The pipeline calculator: a schedule, p stages, m micro-batches (v chunks for interleaving) and
one micro-batch's forward and backward (and weight-gradient) times on a stage -> the simulated
step as a Gantt chart, its bubble beside the closed form, each stage's peak micro-batches and,
for a model, their activation memory (`labkit.pipeline`).

    >>> from labkit.widgets.pipeline import PipelineCalculator
    >>> calc = PipelineCalculator(schedule="gpipe", stages=4, microbatches=8)
    >>> calc.controls["microbatches"].value = "16"         # a test's way of typing
    >>> calc.pipeline.bubble_fraction, calc.formula         # simulated; closed form
    >>> calc.in_flight, calc.activations                    # per stage (bytes: with a model)
"""
from __future__ import annotations

import ipywidgets as widgets

from labkit.models import PRESETS
from labkit.pipeline import (SCHEDULES, V_SCHEDULES, activation_memory, bubble_formula,
                             check_shape, p2p_messages, paper_bubble, simulate)
from labkit.plots import GB, png_bytes
from labkit.plots.pipeline import gantt
from labkit.widgets import Calculator, error_html, float_field, int_field, pick, row, table_html

# Operations (stages x micro-batches x chunks) simulated and drawn at each change: ~2 s at
# the limit on a loaded laptop core (the simulator itself takes up to pipeline.MAX_OPS).
MAX_OPS = 4096
ZB_MAX_STAGES = 64      # zero-bubble's greedy simulation scans every stage at each op
SPLIT = ("zero-bubble",) + V_SCHEDULES      # backward split into B (input grad) and W
NO_MODEL = "none"
TABLE_ROWS = 32         # stages listed in the table (the chart shows all)
RANGES = {"fwd": ("forward (ms)", 1e-6, 1e6), "bwd": ("backward (ms)", 1e-6, 1e6),
          "wgrad": ("weight grad W (ms)", 1e-6, 1e6), "p2p": ("p2p send (ms)", 0.0, 1e6)}


def _ms(x: float) -> str:
    return f"{x:,.3f} ms" if x < 1e9 else f"{x:.4g} ms"


class PipelineCalculator(Calculator):
    """Controls: schedule, stages, microbatches, chunks (interleaved-1f1b only; zbv and dualpipev
    hold 2 per rank), fwd, bwd (for zero-bubble, zbv and dualpipev the input-gradient pass B
    alone), wgrad (those three only), p2p (ms per send),
    model ("none" or a preset: activation memory per stage) with batch_size and seq_len.
    `pipeline` (the PipelineResult), `formula` ((idle share, relative bubble) in closed form),
    `in_flight` (peak micro-batches per stage), `activations` (bytes per stage, None without a
    model) and `messages` (P2PMessages) are the last results (None while the input is
    invalid), `error` the message shown instead. A thin view: no formula of its own; results in
    widget traits; bad input shown as a message."""

    ranges = RANGES
    arguments = {"pp": "stages"}            # activation_memory's name for the stages

    def __init__(self, **initial):
        w = "110px"
        c = {
            "schedule": pick("schedule", list(SCHEDULES), "1f1b"),
            "stages": int_field("stages p", 4, description_width=w),
            "microbatches": int_field("micro-batches m", 8, description_width=w),
            "chunks": int_field("chunks v", 2, description_width=w),
            "fwd": float_field("forward (ms)", 1.0),
            "bwd": float_field("backward (ms)", 2.0),
            "wgrad": float_field("weight grad W (ms)", 1.0),
            "p2p": float_field("p2p send (ms)", 0.0),
            "model": pick("model", [(NO_MODEL, NO_MODEL)] + [(k, k) for k in PRESETS],
                          NO_MODEL, "380px"),
            "batch_size": int_field("micro-batch", 1, description_width=w),
            "seq_len": int_field("seq length", 1024, description_width=w),
        }
        self.controls: dict[str, widgets.Widget] = c
        self._set_initial(initial)
        self.result = widgets.HTML()
        self.figure = widgets.Image(format="png", layout=widgets.Layout(width="900px"))
        self.pipeline = self.formula = self.in_flight = self.activations = None
        self.messages = None
        self.error: str | None = None
        self.widget = widgets.VBox([
            row([c["schedule"], c["stages"], c["microbatches"], c["chunks"]]),
            row([c["fwd"], c["bwd"], c["wgrad"], c["p2p"]]),
            row([c["model"], c["batch_size"], c["seq_len"]]), self.result, self.figure])
        self._watch()
        self.update()

    def inputs(self) -> dict:
        """The keyword arguments of `labkit.pipeline.simulate`; ValueError naming the field
        when one is not a whole number."""
        schedule = self.controls["schedule"].value
        typed = self.read_ints(["stages", "microbatches"]
                               + (["chunks"] if schedule == "interleaved-1f1b" else []))
        kw = dict(schedule=schedule, stages=typed["stages"], microbatches=typed["microbatches"],
                  chunks=typed.get("chunks", 1), fwd=self._number("fwd"),
                  bwd=self._number("bwd"), p2p=self._number("p2p"))
        if schedule in SPLIT:
            kw["wgrad"] = self._number("wgrad")
        return kw

    def _memory(self, kw) -> list | None:
        model = self.controls["model"].value
        if model == NO_MODEL:
            return None
        typed = self.read_ints(["batch_size", "seq_len"])
        return activation_memory(model, kw["schedule"], kw["stages"], kw["microbatches"],
                                 kw["chunks"], batch_size=typed["batch_size"],
                                 seq_len=typed["seq_len"])

    def update(self) -> None:
        c = self.controls
        schedule = c["schedule"].value
        c["chunks"].layout.display = "" if schedule == "interleaved-1f1b" else "none"
        c["wgrad"].layout.display = "" if schedule in SPLIT else "none"
        for name in ("batch_size", "seq_len"):
            c[name].layout.display = "none" if c["model"].value == NO_MODEL else ""
        try:
            kw = self.inputs()
            p, m, v = check_shape(schedule, kw["stages"], kw["microbatches"], kw["chunks"])
            if p * m * v > MAX_OPS:
                raise ValueError(
                    f"stages x micro-batches x chunks = {p * m * v:,} is more than this "
                    f"calculator simulates and draws at each change ({MAX_OPS:,}); allowed: a "
                    "product up to that (labkit.pipeline.simulate takes larger ones)")
            if schedule == "zero-bubble" and p > ZB_MAX_STAGES:
                raise ValueError(f"stages={p} is more than this calculator simulates for "
                                 f"zero-bubble at each change; allowed: 1 to {ZB_MAX_STAGES}")
            result = simulate(**kw)
            formula = bubble_formula(schedule, p, m, v)
            memory = self._memory(kw)
            messages = p2p_messages(p, m, v, v_shape=schedule in V_SCHEDULES)
        except ValueError as exc:
            self.pipeline = self.formula = self.in_flight = self.activations = None
            self.messages = None
            self.error = self.error_text(exc)
            self.result.value = error_html(self.error)
            self.show_figure(None)
            return
        self.pipeline, self.formula, self.activations = result, formula, memory
        self.in_flight, self.messages, self.error = result.peak_in_flight, messages, None
        self.result.value = self._verdict(kw) + self._table()
        self.show_figure(png_bytes(gantt(result, unit="time (ms)")))

    def _verdict(self, kw) -> str:
        r, (share, rel) = self.pipeline, self.formula
        zb = kw["schedule"] in SPLIT
        assumed = "equal times on every stage, free sends" + (", F = B = W" if zb else "")
        same = abs(r.bubble_fraction - share) < 1e-9
        note = ("equal to the simulation" if same else "the simulation differs: "
                + ("sends take time" if kw["p2p"] > 0 else "F, B, W are not equal"))
        msg = self.messages
        split = (f" For {kw['schedule']}, backward is the input-gradient pass B alone and W the "
                 "weight-gradient pass." if zb else "") + self._paper(kw)
        return (f'<div class="labkit-verdict"><b>{100 * r.bubble_fraction:,.1f} %</b> of the '
                f"step idle ({100 * r.bubble_ratio:,.1f} % relative to the ideal "
                f"{_ms(r.ideal)}): the step takes {_ms(r.makespan)}. Closed form ({assumed}): "
                f"{100 * share:,.1f} % of the step, {100 * rel:,.1f} % relative; {note}. "
                f"Point-to-point: {msg.busiest_rank:,} sends on the busiest rank per step, "
                f"{msg.total:,} over all ranks.{split}</div>")

    def _paper(self, kw) -> str:
        """ZB-V and DualPipeV: the papers' bubble (idle inside a rank's own span) beside the
        simulated one."""
        schedule = kw["schedule"]
        if schedule not in V_SCHEDULES:
            return ""
        r = self.pipeline
        said = paper_bubble(schedule, r.stages, kw["fwd"], kw["bwd"], kw["wgrad"])
        source = ("Qi et al. 2024, §6: (p - 1)(T_F + T_B - 2 T_W) per chunk" if schedule == "zbv"
                  else "DeepSeek DualPipe: (PP/2 - 1)(F&B + B - 3W) per chunk")
        return (f" Paper ({source}): {_ms(said)} idle inside the busiest rank's span; simulated: "
                f"{_ms(max(r.span_idle))}; peak {max(r.peak_chunks)} micro-batch chunks on a "
                "rank (half a rank's layers each).")

    def _table(self) -> str:
        r = self.pipeline
        busy = r.busy
        rows = []
        for i in range(min(r.stages, TABLE_ROWS)):
            cells = [f"stage {i}", _ms(busy[i]), f"{100 * (1 - busy[i] / r.makespan):,.1f} %",
                     f"{self.in_flight[i]:g}"]
            if self.activations is not None:
                cells.append(f"{self.activations[i] / GB:,.3f} GB")
            rows.append(cells)
        header = ["stage", "busy", "idle", "peak in flight (micro-batches)"]
        header += ["activations"] if self.activations is not None else []
        if r.stages > TABLE_ROWS:
            rows.append([f"stages {TABLE_ROWS} to {r.stages - 1}"] + [""] * (len(header) - 1))
        return table_html(rows, header)

