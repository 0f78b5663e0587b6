"""The TP calculator: for a model, a tensor-parallel degree, a link and a GPU, one layer's
communication time against its compute time, the efficiency with and without overlap, the
memory per rank, and the same against every tp on NVLink and InfiniBand (`labkit.tp`).

    >>> from labkit.widgets.tp import TPCalculator
    >>> calc = TPCalculator(model="llama2-7b", tp=8, link="ib-ndr")
    >>> calc.controls["tp"].value = "4"                 # a test's way of typing
    >>> calc.cost.comm_time, calc.cost.compute_time     # seconds per layer and micro-batch
    >>> calc.sweeps["ib-ndr"][4] is not None            # {link: {tp: TPCost}} in the figure

A thin view: no formula of its own; results in widget traits; bad input shown as a message.
"""
from __future__ import annotations

import ipywidgets as widgets

from labkit.hardware import GPUS, LINKS
from labkit.memory import PRECISIONS
from labkit.models import PRESETS
from labkit.plots import GB, png_bytes
from labkit.plots.comm import fmt_time
from labkit.plots.tp_calc import tp_time_figure
from labkit.tp import GPUS_PER_NODE, first_crossing, sweep_degrees, tp_cost, tp_sweep
from labkit.widgets import (MFU_RANGE, Calculator, error_html, int_field, mfu_field, pick, row,
                            table_html)
from labkit.widgets.memory import fit_verdict

COMPARED = ("nvlink4", "ib-ndr")        # drawn beside the link chosen
RANGES = {"mfu": MFU_RANGE}


class TPCalculator(Calculator):
    """Controls: model, tp, batch_size (sequences per micro-batch), seq_len, precision,
    sequence_parallel, link, gpu, mfu (percent of the GPU's dense peak). `cost` (TPCost for the
    setting; its memory says whether a rank fits on the GPU: `fits`), `sweeps` ({link key:
    {tp: TPCost}}) and `crossings` ({link key: first tp with comm >= compute, or None}) are the
    last results (None while the input is invalid), `error` the message shown instead."""

    ranges = RANGES

    def __init__(self, **initial):
        c = {
            "model": pick("model", [(k, k) for k in PRESETS], "llama2-7b", "380px"),
            "tp": int_field("tp", 8, description_width="110px"),
            "batch_size": int_field("micro-batch", 1, description_width="110px"),
            "seq_len": int_field("seq length", 4096, description_width="110px"),
            "precision": pick("precision", list(PRECISIONS), "bf16-mixed"),
            "sequence_parallel": pick("sequence par.", [("off", False), ("on", True)], False),
            "link": pick("TP link", [(f"{v.name}: {v.bandwidth / 1e9:,.1f} GB/s per direction",
                                      k) for k, v in LINKS.items()], "nvlink4", "420px"),
            "gpu": pick("GPU", [(g.name, k) for k, g in GPUS.items()], "h100-sxm", "380px"),
            "mfu": mfu_field(50.0),
        }
        self.controls: dict[str, widgets.Widget] = c
        self._set_initial(initial)
        self.result = widgets.HTML()
        self.figure = widgets.Image(format="png", layout=widgets.Layout(width="860px"))
        self.cost = self.sweeps = self.crossings = self.fits = None
        self.error: str | None = None
        self.widget = widgets.VBox([
            row([c["model"], c["tp"], c["batch_size"], c["seq_len"]]),
            row([c["precision"], c["sequence_parallel"], c["gpu"], c["mfu"]]),
            row([c["link"]]), self.result, self.figure])
        self._watch()
        self.update()

    def inputs(self) -> dict:
        """The keyword arguments of `labkit.tp.tp_cost`; ValueError naming the field when one
        is not a whole number."""
        c = self.controls
        typed = self.read_ints(["tp", "batch_size", "seq_len"])
        return dict(model=c["model"].value, tp=typed["tp"], link=c["link"].value,
                    gpu=c["gpu"].value, mfu=self._mfu(),
                    batch_size=typed["batch_size"], seq_len=typed["seq_len"],
                    precision=c["precision"].value,
                    sequence_parallel=c["sequence_parallel"].value)

    def update(self) -> None:
        try:
            kw = self.inputs()
            cost = tp_cost(**kw)
            degrees = sweep_degrees(kw["model"], kw["seq_len"], kw["sequence_parallel"])
            rest = {k: v for k, v in kw.items() if k not in ("tp", "link")}
            sweeps = {k: tp_sweep(degrees=degrees, link=k, **rest)
                      for k in dict.fromkeys((kw["link"],) + COMPARED)}
        except ValueError as exc:
            self.cost = self.sweeps = self.crossings = self.fits = None
            self.error = self.error_text(exc)
            self.result.value = error_html(self.error)
            self.show_figure(None)
            return
        self.cost, self.sweeps, self.error = cost, sweeps, None
        self.crossings = {k: first_crossing(v) for k, v in sweeps.items()}
        self.fits = cost.memory.total <= cost.gpu.memory
        self.result.value = self._verdict(cost) + self._fit(cost) + self._table(cost)
        self.show_figure(png_bytes(tp_time_figure(
            sweeps, current=kw["tp"], title=f"{kw['model']}, micro-batch {kw['batch_size']:,} "
            f"x {kw['seq_len']:,} tokens, {cost.gpu.name} at {100 * kw['mfu']:.3g} % MFU")))

    def _verdict(self, cost) -> str:
        t = cost.inputs["tp"]
        more = "more" if cost.ratio >= 1 else "less"
        where = {k: (f"no tp up to {max(self.sweeps[k])}" if x is None else f"tp={x}" + (
            f" (beyond {GPUS_PER_NODE} GPUs: not one node)" if self.sweeps[k][x].leaves_node
            else "")) for k, x in self.crossings.items()}
        crossed = "; ".join(f"{LINKS[k].name}: {v}" for k, v in where.items())
        node = (f" <b>tp={t} &gt; {GPUS_PER_NODE}: an intra-node link cannot connect a group "
                "larger than one node.</b>" if cost.leaves_node else "")
        return (f'<div class="labkit-verdict">At tp={t} on {cost.link.name}, one layer spends '
                f"<b>{fmt_time(cost.comm_time)}</b> communicating vs <b>"
                f"{fmt_time(cost.compute_time)}</b> computing ({cost.ratio:,.2f}x: {more} "
                f"time in collectives than in matmuls). Efficiency "
                f"{100 * cost.efficiency_no_overlap:,.1f} % without overlap, at most "
                f"{100 * cost.efficiency_full_overlap:,.1f} % with full overlap. "
                f"Communication exceeds compute from: {crossed}.{node}</div>")

    @staticmethod
    def _fit(cost) -> str:
        """The memory verdict for one rank: the whole model split over tp (no dp sharding)."""
        verdict = fit_verdict(cost.memory, cost.gpu)
        return (f'<div class="labkit-verdict labkit-fit">Memory: {verdict} '
                "(weights split over tp, their gradients and AdamW states, and the activations "
                "of one micro-batch; no pipeline or ZeRO sharding.)</div>")

    @staticmethod
    def _table(cost) -> str:
        ops = ", ".join(f"{n} {op.replace('_', '-')} of {_payload_mb(cost, op)}"
                        for op, (n, _) in cost.comm.payload.items()) or "none (tp=1)"
        m = cost.memory
        rows = [("collectives per layer (fwd + bwd)", ops),
                ("bytes sent per rank per layer", f"{cost.comm.total_bytes / 1e6:,.2f} MB"),
                ("communication per layer", fmt_time(cost.comm_time)),
                ("compute per layer", f"{fmt_time(cost.compute_time)} "
                 f"({cost.flops / 1e12:,.3f} TFLOPs on this rank)"),
                ("weights per rank", f"{m.params / GB:,.3f} GB"),
                ("activations per rank", f"{m.activations / GB:,.3f} GB"),
                ("model states + activations", f"{m.total / GB:,.3f} GB")]
        return table_html(rows, header=["per rank", "value"])


def _payload_mb(cost, op) -> str:
    """Each collective's payload S of `op` in MB (they all carry the same b s h activations)."""
    size = next(c.nbytes for c in cost.comm.collectives if c.op == op)
    return f"{size / 1e6:,.2f} MB"
