"""The MoE calculator: for a mixture-of-experts preset, tp, dp, ep, a ZeRO stage, a micro-batch and
a capacity factor, its total and active parameters, the memory per GPU (`estimate_memory`, against
the GPU's usable memory, and the same at ep=1), FLOPs per token against a dense model of the same
size, and one micro-batch's expert-parallel all-to-alls (`step_communication("ep")`), timed on
the GPU's NVLink when ep divides the GPUs of a node, on InfiniBand otherwise (as the planner).

    >>> from labkit.widgets.moe import MoECalculator
    >>> calc = MoECalculator(model="deepseek-v3", dp=32, ep=32)   # the last line `calc` shows it
    >>> calc.controls["ep"].value = "16"                          # a test's way of typing
    >>> calc.memory.total, calc.dense_memory.total, calc.comm_time  # bytes per GPU, seconds
    >>> calc.result.value, calc.figure.value                      # HTML, PNG
"""
from __future__ import annotations

import html
import math

import ipywidgets as widgets

from labkit import validate
from labkit.comm import collective_time, step_communication
from labkit.flops import flops_per_token
from labkit.hardware import GPUS, get_gpu, get_link
from labkit.memory import estimate_memory
from labkit.models import PRESETS, get_model
from labkit.planner import INTER, INTRA, usable_memory
from labkit.plots import GB, fmt_bytes, fmt_count, png_bytes
from labkit.plots.comm import fmt_time
from labkit.plots.moe import moe_memory_figure
from labkit.widgets import Calculator, error_html, int_field, pick, row, table_html
from labkit.widgets.memory import fit_verdict

MODELS = [k for k, spec in PRESETS.items() if spec.is_moe]
TYPED = ("gpus_per_node", "tp", "dp", "ep", "seq_len", "batch_size")
STAGES = {0: "0: none", 1: "1: optimizer", 2: "2: + gradients", 3: "3: + weights"}
_TERMS = (("params", "weights"), ("grads", "gradients"),
          ("optimizer_states", "optimizer states"), ("activations", "activations"),
          ("total", "total"))


def ep_degrees(num_experts: int, ranks: int, ep: int) -> list[int]:
    """The ep the figure compares: 1, 2, 4, ... up to the largest ep that divides both the
    experts and the tp x dp ranks, and the ep chosen."""
    most = math.gcd(num_experts, ranks)
    return sorted({2**k for k in range(most.bit_length()) if most % 2**k == 0} | {most, ep})


class MoECalculator(Calculator):
    """Memory, compute and all-to-all traffic of a mixture of experts under expert parallelism.

    Controls (names as in `controls`): model (the MoE presets), gpus_per_node, tp, dp, ep,
    zero_stage, seq_len, batch_size (sequences per micro-batch), capacity_factor (blank: none)
    and gpu. Keyword arguments set their starting values, e.g. `MoECalculator(ep=4)`.

    A thin view: no formula of its own, recomputes when any control changes, keeps its results
    in widget traits. The last results (None while the input is invalid, `error` the message
    shown instead): `params` ({"total", "active", "experts"}), `memory` and `dense_memory`
    (MemoryEstimate at ep and at ep=1), `sweep` ({ep: MemoryEstimate}, the figure's bars),
    `capacity` and `usable` (bytes of the GPU), `flops` and `dense_flops` (per token), `comm`
    (StepComm of one micro-batch), `link` (the Link it runs on) and `comm_time` (seconds).
    """

    def __init__(self, **initial):
        models = [(f"{k} ({fmt_count(PRESETS[k].num_params())} params, "
                   f"{fmt_count(PRESETS[k].active_params())} active)", k) for k in MODELS]
        c = {
            "model": pick("model", models, "mixtral-8x7b", "440px"),
            "gpus_per_node": int_field("GPUs/node", 8, description_width="110px"),
            "tp": int_field("tp", 2, description_width="110px"),
            "dp": int_field("dp", 16, description_width="110px"),
            "ep": int_field("ep", 8, description_width="110px"),
            "zero_stage": pick("ZeRO stage", [(v, k) for k, v in STAGES.items()], 1),
            "seq_len": int_field("seq length", 4096, description_width="110px"),
            "batch_size": int_field("micro-batch", 1, description_width="110px"),
            "capacity_factor": widgets.Text(
                value="", placeholder="none", description="capacity factor",
                continuous_update=False, style={"description_width": "110px"},
                layout=widgets.Layout(width="250px")),
            "gpu": pick("GPU", [(g.name, k) for k, g in GPUS.items()], "h100-sxm", "380px"),
        }
        self.controls: dict[str, widgets.Widget] = c
        self._set_initial(initial)
        self.result = widgets.HTML()
        self.figure = widgets.Image(format="png", layout=widgets.Layout(width="700px"))
        self._clear()
        self.widget = widgets.VBox([
            row([c["model"], c["gpu"]]),
            row([c["gpus_per_node"], c["tp"], c["dp"], c["ep"]]),
            row([c["zero_stage"], c["seq_len"], c["batch_size"], c["capacity_factor"]]),
            self.result, self.figure])
        self._watch()
        self.update()

    # ---- what the controls say -----------------------------------------------------------
    def capacity_factor(self) -> float | None:
        """The capacity factor typed (blank or 'none': None, no capacity limit); ValueError
        naming the field when it is not a number. Its range is the cost model's to check."""
        w = self.controls["capacity_factor"]
        text = str(w.value).strip()
        if text.lower() in ("", "none"):
            return None
        try:
            return float(text.replace(",", "").replace("_", ""))
        except ValueError:
            raise ValueError(f"{w.description}={validate.describe(w.value)} is not a number; "
                             "type e.g. 1.25, or leave it blank for no capacity limit") from None

    def inputs(self) -> dict:
        """The controls as the cost models take them; ValueError naming the field when one is
        not a whole number (or the capacity factor not a number)."""
        c = self.controls
        kw = self.read_ints(TYPED)
        validate.positive_int("gpus_per_node", kw["gpus_per_node"], validate.MAX_RANKS)
        return dict(kw, model=c["model"].value, zero_stage=c["zero_stage"].value,
                    capacity_factor=self.capacity_factor(), gpu=c["gpu"].value)

    def _clear(self) -> None:
        self.params = self.memory = self.dense_memory = self.sweep = None
        self.capacity = self.usable = self.flops = self.dense_flops = None
        self.comm = self.link = self.comm_time = None

    # ---- recomputing ---------------------------------------------------------------------
    def update(self) -> None:
        try:
            kw = self.inputs()
            self._compute(kw)
        except ValueError as exc:
            self._clear()
            self.error = self.error_text(exc)
            self.result.value = error_html(self.error)
            self.show_figure(None)
            return
        self.error = None
        gpu = get_gpu(kw["gpu"])
        self.result.value = self._verdict(kw, gpu) + self._tables(kw)
        self.show_figure(png_bytes(moe_memory_figure(
            self.sweep, self.capacity, self.usable, current=kw["ep"],
            capacity_label=f"{gpu.name}: {gpu.memory / GB:,.0f} GB", title=self._title(kw))))

    def _compute(self, kw: dict) -> None:
        spec = get_model(kw["model"])
        tp, ep, s, b, cf = kw["tp"], kw["ep"], kw["seq_len"], kw["batch_size"], \
            kw["capacity_factor"]
        common = dict(seq_len=s, batch_size=b, tp=tp, dp=kw["dp"], zero_stage=kw["zero_stage"],
                      capacity_factor=cf, sequence_parallel=tp > 1)
        memory = estimate_memory(spec, ep=ep, **common)
        dense = estimate_memory(spec, ep=1, **common)
        sweep = {e: estimate_memory(spec, ep=e, **common)
                 for e in ep_degrees(spec.num_experts, tp * kw["dp"], ep)}
        comm = step_communication("ep", spec, ep=ep, seq_len=s, batch_size=b,
                                  capacity_factor=cf, tp=tp, sequence_parallel=tp > 1)
        key = kw["gpu"]
        link = get_link(INTRA.get(key, "pcie4") if kw["gpus_per_node"] % ep == 0
                        else INTER.get(key, "ib-ndr"))
        comm_time = sum(c.count * collective_time(c.op, c.nbytes, ep, link.bandwidth,
                                                  link.latency) for c in comm.collectives)
        capacity = get_gpu(key).memory
        self.params = {"total": spec.num_params(), "active": spec.active_params(),
                       "experts": spec.param_breakdown()["experts"]}
        self.memory, self.dense_memory, self.sweep = memory, dense, sweep
        self.capacity, self.usable = capacity, usable_memory(get_gpu(key).device_bytes)
        self.flops, self.dense_flops = flops_per_token(spec, s), 6 * spec.num_params()
        self.comm, self.link, self.comm_time = comm, link, comm_time

    # ---- views ---------------------------------------------------------------------------
    @staticmethod
    def _title(kw) -> str:
        return (f"{kw['model']}, tp={kw['tp']} dp={kw['dp']}, ZeRO-{kw['zero_stage']}, "
                f"micro-batch {kw['batch_size']:,} x {kw['seq_len']:,} tokens")

    def _verdict(self, kw, gpu) -> str:
        mem, dense, ep = self.memory, self.dense_memory, kw["ep"]
        usable = ("within" if mem.total <= self.usable else
                  '<b style="color:#b00020">over</b>')
        saved = (f"ep={ep} saves {fmt_bytes(dense.total - mem.total)} per GPU against ep=1 "
                 f"({fmt_bytes(dense.total)}: every GPU holding all the experts)"
                 if ep > 1 else "ep=1: every GPU holds all the experts")
        p = self.params
        return (f'<div class="labkit-verdict">{fit_verdict(mem, gpu, f" at ep={ep}")} That is '
                f"{usable} the {fmt_bytes(self.usable)} a run may fill (the rest is CUDA "
                f"context, NCCL buffers, fragmentation). {saved}. Each token uses "
                f"{fmt_count(p['active'])} of {fmt_count(p['total'])} parameters "
                f"({p['active'] / p['total']:.1%}).</div>")

    def _tables(self, kw) -> str:
        p, ep, gpus = self.params, kw["ep"], kw["tp"] * kw["dp"]
        spec = get_model(kw["model"])
        params = table_html([
            ("total", fmt_count(p["total"]), "100%"),
            ("active per token", fmt_count(p["active"]), f"{p['active'] / p['total']:.1%}"),
            (f"routed experts ({spec.num_experts} per MoE layer, {spec.experts_per_token} "
             "per token)", fmt_count(p["experts"]), f"{p['experts'] / p['total']:.1%}"),
        ], header=["parameters", "count", "share"])
        memory = table_html([(name, f"{getattr(self.memory, k) / GB:,.2f}",
                              f"{getattr(self.dense_memory, k) / GB:,.2f}")
                             for k, name in _TERMS], header=["per GPU", f"ep={ep} GB", "ep=1 GB"])
        ratio = self.flops / self.dense_flops
        compute = (f"<p>Training FLOPs per token at {kw['seq_len']:,} tokens: "
                   f"<b>{fmt_count(self.flops)}</b> (6 x active parameters + attention), "
                   f"against {fmt_count(self.dense_flops)} (6 x {fmt_count(p['total'])}) for a "
                   f"dense model of the same size: {ratio:.1%} of it.</p>")
        return (f"<p>{html.escape(spec.name)} on tp x dp = {gpus:,} GPUs, routed experts split "
                f"over ep={ep} of them. GB = 10<sup>9</sup> bytes.</p>" + params + memory
                + compute + self._comm_html(ep))

    def _comm_html(self, ep) -> str:
        if not self.comm.collectives or ep == 1:
            return "<p>Expert-parallel communication: none (ep=1, every expert is local).</p>"
        rows = [(f"{c.count:,} {c.op.replace('_', '-')}", f"{c.nbytes / 1e6:,.2f} MB",
                 f"{c.sent / GB:,.3f} GB", fmt_time(c.count * collective_time(
                     c.op, c.nbytes, ep, self.link.bandwidth, self.link.latency)))
                for c in self.comm.collectives]
        where = ("inside a node" if self.link.scope == "intra-node" else
                 "across nodes (ep does not divide the GPUs of a node)")
        return (f"<p>Expert-parallel all-to-alls of one micro-batch (dispatch and combine, "
                f"forward and backward, every MoE layer) on {html.escape(self.link.name)}, "
                f"{where}: <b>{fmt_time(self.comm_time)}</b>, back to back.</p>"
                + table_html(rows, header=["collectives", "each (payload)", "sent per GPU",
                                           "time"]))
