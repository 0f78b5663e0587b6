"""The FSDP calculators: FSDP2's per-rank memory and per-step collectives for a model and its
options (`labkit.fsdp`), and the cost of checkpointing a job at scale (`labkit.resilience`).

    >>> from labkit.widgets.fsdp import FSDPCalculator, CheckpointCalculator
    >>> calc = FSDPCalculator(model="llama2-7b", dp=8, param_dtype="bf16")
    >>> calc.controls["dp"].value = "64"           # a test's way of typing
    >>> calc.memory.total, calc.comm.total_bytes    # bytes per rank (per step)
    >>> ckpt = CheckpointCalculator(model="llama3-70b", gpus=16000)
    >>> ckpt.mtbf, ckpt.interval, ckpt.overhead

Thin views: no formula of their own; results in widget traits; bad input shown as a message.
"""
from __future__ import annotations

import ipywidgets as widgets

from labkit.fsdp import DTYPE_BYTES, OPTIMIZERS, fsdp_communication, fsdp_memory
from labkit.hardware import GPUS, LINKS
from labkit.models import PRESETS
from labkit.plots import GB, png_bytes
from labkit.plots.comm import fmt_time
from labkit.plots.fsdp_calc import fsdp_bars, overhead_curve
from labkit.resilience import (KINDS, checkpoint_bytes, job_mtbf, overhead, write_seconds,
                               young_daly_interval)
from labkit.widgets import Calculator, error_html, float_field, int_field, pick, row, table_html
from labkit.widgets.memory import fit_verdict

RESHARD = [("True (ZeRO-3)", "true"), ("False (ZeRO-2-like)", "false"), ("int k", "int")]


def _models():
    return [(k, k) for k in PRESETS]


class FSDPCalculator(Calculator):
    """Controls: model, dp, per_block, reshard ("true", "false", "int" with reshard_k),
    param_dtype, reduce_dtype ("same" = param_dtype), prefetch, optimizer, offload, link, gpu.
    `memory` (FSDPMemory of the busiest rank) and `comm` are the last results, `fits` whether
    that memory (a lower bound) fits on the GPU chosen; None while the input is invalid."""

    ranges: dict = {}
    arguments = {"reshard_after_forward": "reshard_k"}

    def __init__(self, **initial):
        dtypes = list(DTYPE_BYTES)
        c = {
            "model": pick("model", _models(), "llama2-7b", "380px"),
            "dp": int_field("dp (ranks)", 8, description_width="110px"),
            "per_block": pick("wrapping", [("per block", True), ("whole model", False)], True),
            "reshard": pick("reshard", RESHARD, "true"),
            "reshard_k": int_field("reshard k", 2, description_width="110px"),
            "param_dtype": pick("param dtype", dtypes, "bf16"),
            "reduce_dtype": pick("reduce dtype", ["same"] + dtypes, "fp32"),
            "prefetch": int_field("prefetch", 0, description_width="110px"),
            "optimizer": pick("optimizer", list(OPTIMIZERS), "adamw"),
            "offload": pick("CPU offload", [("off", False), ("on", True)], False),
            "link": pick("link", [(v.name, k) for k, v in LINKS.items()], "ib-ndr", "380px"),
            "gpu": pick("GPU", [(g.name, k) for k, g in GPUS.items()], "h100-sxm", "380px"),
        }
        self.controls: dict[str, widgets.Widget] = c
        self._set_initial(initial)
        self.result = widgets.HTML()
        self.figure = widgets.Image(format="png", layout=widgets.Layout(width="640px"))
        self.memory = self.comm = self.fits = None
        self.error: str | None = None
        self.widget = widgets.VBox([
            row([c["model"], c["dp"], c["per_block"]]), row([c["reshard"], c["reshard_k"],
                                                             c["prefetch"]]),
            row([c["param_dtype"], c["reduce_dtype"], c["optimizer"], c["offload"]]),
            row([c["link"], c["gpu"]]), self.result, self.figure])
        self._watch()
        self.update()

    def inputs(self) -> dict:
        c = self.controls
        typed = self.read_ints(["dp", "prefetch"] + (["reshard_k"] if c["reshard"].value == "int"
                                                     else []))
        reshard = {"true": True, "false": False}.get(c["reshard"].value, typed.get("reshard_k"))
        reduce = c["reduce_dtype"].value
        return dict(model=c["model"].value, dp=typed["dp"], per_block=c["per_block"].value,
                    reshard_after_forward=reshard, param_dtype=c["param_dtype"].value,
                    reduce_dtype=None if reduce == "same" else reduce)

    def update(self) -> None:
        c = self.controls
        self.controls["reshard_k"].layout.display = "" if c["reshard"].value == "int" else "none"
        try:
            kw = self.inputs()
            prefetch = self.read_ints(["prefetch"])["prefetch"]
            memory = fsdp_memory(**kw, prefetch=prefetch, optimizer=c["optimizer"].value,
                                 offload=c["offload"].value)
            comm = fsdp_communication(**kw)
        except ValueError as exc:
            self.memory = self.comm = self.fits = None
            self.error = self.error_text(exc)
            self.result.value = error_html(self.error)
            self.show_figure(None)
            return
        self.memory, self.comm, self.error = memory, comm, None
        link, gpu = LINKS[c["link"].value], GPUS[c["gpu"].value]
        self.fits = memory.total <= gpu.memory
        rows = [(k, f"{v / GB:,.3f}", memory.explain.get(k, "")) for k, v in (
            ("params", memory.params), ("grads", memory.grads),
            ("optimizer_states", memory.optimizer_states),
            ("unsharded_held", memory.unsharded_held),
            ("unsharded_peak", memory.unsharded_peak), ("total", memory.total),
            ("host", memory.host))]
        ops = ", ".join(f"{n} {op.replace('_', '-')} ({b / GB:,.3f} GB sent)"
                        for op, (n, b) in comm.by_op.items()) or "none"
        self.result.value = (
            f'<div class="labkit-verdict">{fit_verdict(memory, gpu, " (the busiest rank)")} '
            "That is a lower bound: activations, unsharded gradients and the collectives' "
            f"buffers are not counted. Per step: {ops}; "
            f"{fmt_time(comm.time(link.bandwidth, link.latency))} on {link.name} if not "
            "overlapped.</div>" + table_html(rows, header=["term", "GB", "what it is"]))
        self.show_figure(png_bytes(fsdp_bars({"this setting": memory},
                                             title=f"{kw['model']}, dp={kw['dp']:,}")))


class CheckpointCalculator(Calculator):
    """Controls: model, kind ("training" / "export"), gpus, rate_pct (per-GPU daily failure
    rate, %), bandwidth_gbs (storage, GB/s), per_node (bandwidth per node) with gpus_per_node."""

    ranges = {"rate_pct": ("failures %/GPU/day", 1e-9, 100.0),
              "bandwidth_gbs": ("storage GB/s", 1e-9, 1e9)}

    def __init__(self, **initial):
        c = {
            "model": pick("model", _models(), "llama3-70b", "380px"),
            "kind": pick("checkpoint", list(KINDS), "training"),
            "gpus": int_field("GPUs", 1000, description_width="110px"),
            "rate_pct": float_field("failures %/GPU/day", 0.01),
            "bandwidth_gbs": float_field("storage GB/s", 100.0),
            "per_node": pick("bandwidth is", [("aggregate", False), ("per node", True)], False),
            "gpus_per_node": int_field("GPUs per node", 8, description_width="110px"),
        }
        self.controls: dict[str, widgets.Widget] = c
        self._set_initial(initial)
        self.result = widgets.HTML()
        self.figure = widgets.Image(format="png", layout=widgets.Layout(width="600px"))
        self.size = self.write_time = self.mtbf = self.interval = self.overhead = None
        self.error: str | None = None
        self.widget = widgets.VBox([row([c["model"], c["kind"], c["gpus"]]),
                                    row([c["rate_pct"], c["bandwidth_gbs"], c["per_node"],
                                         c["gpus_per_node"]]), self.result, self.figure])
        self._watch()
        self.update()

    def update(self) -> None:
        c = self.controls
        try:
            ints = self.read_ints(["gpus", "gpus_per_node"])
            mtbf = job_mtbf(ints["gpus"], self._number("rate_pct") / 100)   # checks gpus
            if ints["gpus_per_node"] < 1:
                raise ValueError(f"GPUs per node={ints['gpus_per_node']} must be a whole number "
                                 ">= 1")
            nodes = -(-ints["gpus"] // ints["gpus_per_node"])
            size = checkpoint_bytes(c["model"].value, c["kind"].value)
            t = write_seconds(size, self._number("bandwidth_gbs") * 1e9, nodes=nodes,
                              per_node=c["per_node"].value)
            tau = young_daly_interval(mtbf, t)
            lost = overhead(tau, t, mtbf)
        except ValueError as exc:
            self.size = self.write_time = self.mtbf = self.interval = self.overhead = None
            self.error = self.error_text(exc)
            self.result.value = error_html(self.error)
            self.show_figure(None)
            return
        self.size, self.write_time, self.mtbf, self.interval, self.overhead = \
            size, t, mtbf, tau, lost
        self.error = None
        rows = [("checkpoint size", f"{size / GB:,.1f} GB"), ("write time", fmt_time(t)),
                ("job MTBF", f"{mtbf / 3600:,.2f} h ({mtbf / 86400:,.2f} days)"),
                ("Young's interval", f"{tau / 3600:,.3f} h"),
                ("time lost at it", f"{100 * lost:,.3f} %")]
        self.result.value = table_html(rows, header=["quantity", "value"])
        self.show_figure(png_bytes(overhead_curve(mtbf, t, title=c["model"].value)))
