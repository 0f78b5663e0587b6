"""The ZeRO calculator: for a model, a dp degree, a precision, an optimizer and an offload choice,
the per-GPU memory of ZeRO stages 0-3 side by side (`estimate_memory`), what each GPU sends per
step under DDP and ZeRO-1, -2, -3 (`step_communication`) and, with offload, the host-link (PCIe)
time per step (`labkit.offload.offload_cost`).

    >>> from labkit.widgets.zero import ZeROCalculator
    >>> calc = ZeROCalculator(model="custom", params_b=7, dp=4)   # the last line `calc` shows it
    >>> calc.controls["dp"].value = "8"                           # a test's way of typing
    >>> calc.estimates[3].total, calc.comms["zero3"].total_bytes  # bytes per GPU (per step)
    >>> calc.result.value, calc.figure.value, calc.comm_figure.value   # HTML, PNG, PNG
"""
from __future__ import annotations

import html

import ipywidgets as widgets

from labkit.comm import step_communication
from labkit.hardware import GPUS, LINKS
from labkit.memory import (OPTIMIZERS, PRECISIONS, ZERO_STAGES, estimate_memory,
                           state_bytes)
from labkit.models import PRESETS
from labkit.offload import offload_cost
from labkit.placement import OFFLOAD, check_placement
from labkit.plots import GB, fmt_count, png_bytes
from labkit.plots.comm import fmt_time
from labkit.plots.memory import memory_bars
from labkit.plots.zero_calc import STRATEGY_LABELS, comm_bars
from labkit.widgets import Calculator, error_html, float_field, int_field, pick, row, table_html
from labkit.widgets.ddp import RANGES as DDP_RANGES
from labkit.widgets.memory import CUSTOM, SEQ_LENS

RANGES = {"params_b": DDP_RANGES["params_b"], "compute_ms": DDP_RANGES["compute_ms"]}
TYPED = ("dp", "microbatches", "batch_size")
STRATEGY = {0: "ddp", 1: "zero1", 2: "zero2", 3: "zero3"}
HOST_LINKS = ("pcie4", "pcie5")
_NEEDS = {"optimizer": "needs ZeRO >= 1", "params": "needs ZeRO-3"}


class ZeROCalculator(Calculator):
    """ZeRO stages 0-3 side by side: memory per GPU and communication per step.

    Controls (names as in `controls`): model (a preset, or "custom" with params_b, billions of
    parameters: model states only), dp, microbatches (per step), batch_size (sequences per
    micro-batch) and seq_len (activations, presets only), precision, optimizer, offload ("none",
    "optimizer", "params"), gpu (its memory drawn as a line), link (of the dp collectives),
    host_link and compute_ms (with offload: the PCIe link and one GPU's forward + backward).
    Keyword arguments set their starting values, e.g. `ZeROCalculator(dp=64, offload="optimizer")`.

    A thin view: no formula of its own, recomputes when any control changes, keeps its results
    in widget traits. `estimates` ({stage: MemoryEstimate}), `comms` ({strategy: StepComm}) and
    `offload` ({stage: OffloadCost}, empty without offload) are the last results (None while
    the input is invalid), `error` the message shown instead. Gradients and the all-gathered
    weights cross the wire in the weights' dtype (bf16-mixed: 2 bytes, fp32: 4), as
    `estimate_memory` counts them. A stage that cannot take the offload chosen
    (offload="optimizer" needs ZeRO >= 1, "params" ZeRO-3) is left out and named.
    """

    ranges = RANGES

    def __init__(self, **initial):
        models = [(f"{k} ({fmt_count(s.num_params())} params)", k) for k, s in PRESETS.items()]
        c = {
            "model": pick("model", models + [("custom size", CUSTOM)], "llama2-7b", "380px"),
            "params_b": float_field("billion params", 7.0),
            "dp": int_field("dp (GPUs)", 8, description_width="110px"),
            "microbatches": int_field("micro-batches", 1, description_width="110px"),
            "batch_size": int_field("micro-batch", 1, description_width="110px"),
            "seq_len": pick("seq length", [(f"{s:,}", s) for s in SEQ_LENS], 4096),
            "precision": pick("precision", list(PRECISIONS), "bf16-mixed"),
            "optimizer": pick("optimizer", list(OPTIMIZERS), "adamw"),
            "offload": pick("offload", list(OFFLOAD), "none", "380px", toggles=True),
            "gpu": pick("GPU", [(g.name, k) for k, g in GPUS.items()], "h100-sxm", "380px"),
            "link": pick("dp link", [(f"{v.name}: {v.bandwidth / 1e9:,.1f} GB/s per direction",
                                       k) for k, v in LINKS.items()], "ib-ndr", "420px"),
            "host_link": pick("host link", [(LINKS[k].name, k) for k in HOST_LINKS], "pcie5"),
            "compute_ms": float_field("compute (ms)", 500.0),
        }
        self.controls: dict[str, widgets.Widget] = c
        self._set_initial(initial)
        self.result = widgets.HTML()
        self.figure = widgets.Image(format="png", layout=widgets.Layout(width="640px"))
        self.comm_figure = widgets.Image(format="png", layout=widgets.Layout(width="580px"))
        self.estimates = self.comms = self.offload = None
        self.error: str | None = None
        self._custom = row([c["params_b"]])
        self._shape = row([c["batch_size"], c["seq_len"]])
        self._host = row([c["host_link"], c["compute_ms"]])
        self.widget = widgets.VBox([
            row([c["model"], c["dp"], c["microbatches"]]), self._custom, self._shape,
            row([c["precision"], c["optimizer"], c["gpu"]]),
            row([c["link"], c["offload"]]), self._host,
            self.result, row([self.figure, self.comm_figure])])
        self._watch()
        self.update()

    # ---- what the controls say -----------------------------------------------------------
    def inputs(self) -> dict:
        """The keyword arguments this calculator passes to `estimate_memory` for every stage
        (all but zero_stage); ValueError naming the control when one is invalid."""
        c = self.controls
        custom = c["model"].value == CUSTOM
        typed = self.read_ints(TYPED if not custom else TYPED[:2])
        kw = dict(model=self._number("params_b") * 1e9 if custom else c["model"].value,
                  dp=typed["dp"], microbatches=typed["microbatches"],
                  precision=c["precision"].value, optimizer=c["optimizer"].value,
                  offload=c["offload"].value)
        if not custom:
            kw.update(batch_size=typed["batch_size"], seq_len=c["seq_len"].value)
        return kw

    def stages(self) -> list[int]:
        """The ZeRO stages that can take the offload chosen."""
        offload = self.controls["offload"].value
        out = []
        for z in ZERO_STAGES:
            try:
                check_placement(z, offload, None)
            except ValueError:
                continue
            out.append(z)
        return out

    def communication(self, kw: dict) -> dict:
        """{strategy: StepComm} for DDP and ZeRO-1/2/3 with the controls' model and dp."""
        w = state_bytes(kw["precision"], kw["optimizer"])[0]
        size = (dict(num_params=kw["model"]) if isinstance(kw["model"], float)
                else dict(model=kw["model"]))
        return {s: step_communication(s, dp=kw["dp"], microbatches=kw["microbatches"],
                                      param_bytes=w, grad_bytes=w, **size)
                for s in STRATEGY.values()}

    # ---- recomputing ---------------------------------------------------------------------
    def update(self) -> None:
        c = self.controls
        custom = c["model"].value == CUSTOM
        self._custom.layout.display = "" if custom else "none"
        self._shape.layout.display = "none" if custom else ""
        offload = c["offload"].value
        self._host.layout.display = "none" if offload == "none" else ""
        try:
            kw = self.inputs()
            stages = self.stages()
            estimates = {z: estimate_memory(**kw, zero_stage=z) for z in stages}
            comms = self.communication(kw)
            costs = {} if offload == "none" else {
                z: offload_cost(kw["model"], offload, zero_stage=z, dp=kw["dp"],
                                precision=kw["precision"], microbatches=kw["microbatches"],
                                link=c["host_link"].value,
                                compute_seconds=self._number("compute_ms") * 1e-3)
                for z in stages}
        except ValueError as exc:
            self.estimates = self.comms = self.offload = None
            self.error = self.error_text(exc)
            self.result.value = error_html(self.error)
            self._show(None, None)
            return
        self.estimates, self.comms, self.offload, self.error = estimates, comms, costs, None
        gpu, link = GPUS[c["gpu"].value], LINKS[c["link"].value]
        self.result.value = self._result_html(kw, gpu, link)
        title = self._title(kw)
        mem = memory_bars({f"ZeRO-{z}": e for z, e in estimates.items()}, capacity=gpu.memory,
                          capacity_label=f"{gpu.name}: {gpu.memory / GB:,.0f} GB", title=title)
        com = comm_bars(comms, link.bandwidth, link.latency, link.name, title=title)
        self._show(png_bytes(mem), png_bytes(com))

    def _show(self, mem: bytes | None, com: bytes | None) -> None:
        self.show_figure(mem)
        self.show_figure(com, self.comm_figure)

    # ---- views ---------------------------------------------------------------------------
    def _title(self, kw) -> str:
        model = (f"{fmt_count(kw['model'])} params" if isinstance(kw["model"], float)
                 else kw["model"])
        return f"{model}, {kw['precision']} + {kw['optimizer']}, dp={kw['dp']:,}"

    def _result_html(self, kw, gpu, link) -> str:
        est, comms, offload = self.estimates, self.comms, kw["offload"]
        fits = [f"ZeRO-{z}" for z, e in est.items() if e.fits(gpu)]
        verdict = (f"fits on one {html.escape(gpu.name)} with {', '.join(fits)}" if fits else
                   f"fits on one {html.escape(gpu.name)} with no stage at dp={kw['dp']:,}")
        per_gpu = ", ".join(f"ZeRO-{z} <b>{e.total / GB:,.2f} GB</b>" for z, e in est.items())
        left = [f"ZeRO-{z}" for z in ZERO_STAGES if z not in est]
        skipped = (f" {', '.join(left)} left out: offload={offload!r} {_NEEDS[offload]}."
                   if left else "")
        ddp = comms["ddp"].total_bytes
        head = (f'<div class="labkit-verdict">Per GPU: {per_gpu}. The model {verdict}.'
                f"{skipped} Sent per GPU per step: DDP and ZeRO-1/2 the same bytes, ZeRO-3 "
                + (f"{comms['zero3'].total_bytes / ddp:.2f}x." if ddp else "nothing at dp=1.")
                + "</div>")
        header = ["ZeRO stage", "weights GB", "gradients GB", "optimizer GB", "activations GB",
                  "total GB", "collectives per step", "GB sent", f"time on {link.name}",
                  "x DDP"]
        if offload != "none":
            header += ["host GB", "host link per step", "exposed"]
        rows = []
        for z in ZERO_STAGES:
            comm = comms[STRATEGY[z]]
            ops = ", ".join(f"{n} {op.replace('_', '-')}" for op, (n, _) in comm.by_op.items())
            cells = ([f"{getattr(est[z], k) / GB:,.2f}" for k in
                      ("params", "grads", "optimizer_states", "activations", "total")]
                     if z in est else ["(left out)"] + [""] * 4)
            row_ = [STRATEGY_LABELS[STRATEGY[z]], *cells, ops or "none",
                    f"{comm.total_bytes / GB:,.2f}",
                    fmt_time(comm.time(link.bandwidth, link.latency)),
                    f"{comm.total_bytes / ddp:.2f}" if ddp else "-"]
            if offload != "none":
                cost = self.offload.get(z)
                row_ += ([f"{est[z].host_bytes / GB:,.2f}", fmt_time(cost.transfer),
                          fmt_time(cost.exposed)] if cost else ["", "", ""])
            rows.append(row_)
        note = ("<p>GB = 10<sup>9</sup> bytes. Communication: ring collectives, back to back, "
                "not overlapped with compute. ZeRO-2 reduce-scatters after every micro-batch; "
                "ZeRO-3 all-gathers the weights for each micro-batch's forward and backward.</p>")
        return head + table_html(rows, header=header) + note
