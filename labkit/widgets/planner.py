"""The planner calculator: a model, a cluster (GPUs, GPU type, GPUs per node), a global batch, a
sequence length and an assumed MFU -> the best layout, the K fastest with their step-time
breakdown, memory per GPU and throughput, and why the others were rejected (`labkit.planner`).

    >>> from labkit.widgets.planner import PlannerCalculator
    >>> calc = PlannerCalculator(model="llama3-70b", gpus=64)
    >>> calc.controls["gpus"].value = "128"              # a test's way of typing
    >>> calc.plan.best.layout, calc.plan.rejection_counts()
    >>> calc.shown                                       # the Estimates in the figure
    >>> calc.load_published("llama 3 405b"); print(calc.comparison.text())   # as it ran
"""
from __future__ import annotations

import functools
import html

import ipywidgets as widgets

from labkit import field, validate
from labkit.hardware import GPUS
from labkit.models import PRESETS
from labkit.kernels import matmul_efficiency
from labkit.planner import _sharding, decide, evaluate, plan
from labkit.planner_cost import PARTS
from labkit.plots import GB, png_bytes
from labkit.plots.planner import plan_figure
from labkit.widgets import (MFU_RANGE, Calculator, error_html, int_field, mfu_field, pick, row,
                            table_html)

# GPUs planned at each change: about 1.4 s for 65,536 and up to 4 s for counts with many
# divisors (27,720) on a loaded laptop core; the planner itself takes up to validate.MAX_RANKS.
MAX_GPUS = 131072
MAX_TOP = 30                    # layouts listed and drawn


def published_choices() -> list[str]:
    """The published runs (labkit.field) whose model is a preset of the model list."""
    return [n for n, r in field.published_runs().items()
            if isinstance(r.model, str) and r.model in PRESETS]
RANGES = {"mfu": MFU_RANGE}
HEADER = ["#", "dp", "tp", "pp", "v", "cp", "ep", "sharding", "b", "m", "recompute", "step s",
          "compute", "host", "tp comm", "cp comm", "ep all-to-all", "pp sends", "dp comm",
          "optimizer", "bubble", "GB/GPU", "tokens/s", "MFU %"]


@functools.lru_cache(maxsize=16)
def cached_plan(model, gpus, gpu, gpus_per_node, global_batch, seq_len, mfu):
    """`labkit.planner.plan` of these inputs, remembered (a Plan is not changed by its views)."""
    return plan(model, gpus, gpu=gpu, gpus_per_node=gpus_per_node, global_batch=global_batch,
                seq_len=seq_len, mfu=mfu)


class PlannerCalculator(Calculator):
    """Controls: model, gpus, gpu, gpus_per_node, global_batch (sequences per step), seq_len,
    mfu (percent of the GPU's dense peak), top (layouts listed and drawn), published (a run
    of `labkit.field.published_runs()` to start from: `load_published`). `plan` (the Plan),
    `shown` (the Estimates drawn: the `top` fastest, or when nothing fits the `top` leanest,
    over the capacity) and `decision` (`labkit.planner.decide` of the plan: the lever to turn
    on first) are the last results (None while the input is invalid), `error` the message shown
    instead.

    A thin view: no formula of its own; results in widget traits; bad input shown as a message.
    When nothing fits it shows the reason and the `top` leanest layouts, priced by
    `labkit.planner.evaluate`, all over the capacity. A plan takes up to about 0.7 s for 16,384
    GPUs; the last plans are cached (`cached_plan`), so changing only `top` or going back to an
    earlier setting redraws without planning again."""

    ranges = RANGES

    def __init__(self, **initial):
        w = "110px"
        c = {
            "model": pick("model", [(k, k) for k in PRESETS], "llama3-70b", "380px"),
            "gpus": int_field("GPUs", 64, description_width=w),
            "gpu": pick("GPU", [(g.name, k) for k, g in GPUS.items()], "h100-sxm", "380px"),
            "gpus_per_node": int_field("GPUs per node", 8, description_width=w),
            "global_batch": int_field("global batch", 512, description_width=w),
            "seq_len": int_field("seq length", 8192, description_width=w),
            # the matmuls' share of peak: default what labkit.kernels prices for an H100
            "mfu": mfu_field(round(100 * matmul_efficiency("h100-sxm"), 1)),
            "top": int_field("top K", 8, description_width=w),
            # a published run as the starting point (labkit.field), those on a preset model
            "published": pick("published run",
                              [("(none)", "")] + [(n, n) for n in published_choices()], "",
                              "520px"),
        }
        self.controls: dict[str, widgets.Widget] = c
        self._set_initial(initial)
        # as wide as the calculator: the verdict wraps, the wide table scrolls sideways
        self.result = widgets.HTML(layout=widgets.Layout(width="100%"))
        self.rejections = widgets.HTML()
        self.ladder = widgets.HTML()
        self.published = widgets.HTML()           # the published layout against the best
        self.comparison = None                    # its labkit.planner.Comparison, or None
        self._loading = False
        self.figure = widgets.Image(format="png", layout=widgets.Layout(width="1000px"))
        self.plan = self.shown = self.decision = None
        self.error: str | None = None
        self.widget = widgets.VBox([
            row([c["model"], c["gpus"], c["gpu"], c["gpus_per_node"]]),
            row([c["global_batch"], c["seq_len"], c["mfu"], c["top"]]),
            row([c["published"]]),
            self.result, self.published, self.figure, self.ladder, self.rejections])
        self._watch()
        self.update()

    def inputs(self) -> dict:
        """The keyword arguments of `labkit.planner.plan`; ValueError naming the field when one
        is not a whole number, or `gpus` is more than this calculator plans at each change."""
        c = self.controls
        typed = self.read_ints(["gpus", "gpus_per_node", "global_batch", "seq_len"])
        if typed["gpus"] > MAX_GPUS:
            raise ValueError(f"gpus={typed['gpus']:,} is more than this calculator plans at each "
                             f"change; allowed: 1 to {MAX_GPUS:,} (labkit.planner.plan takes "
                             "more)")
        return dict(model=c["model"].value, gpu=c["gpu"].value, mfu=self._mfu(), **typed)

    def _on_change(self, change) -> None:
        if self._loading:
            return                                # one plan once every control is set
        if change["owner"] is self.controls["published"] and change["new"]:
            self.load_published(change["new"])
            return
        self.update()

    def load_published(self, name: str) -> None:
        """Start from the published run `name` (`published_choices()`): its model, GPUs, GPU,
        batch and sequence in the controls, then one plan; `comparison` shows where its layout
        ranks (`labkit.planner.Plan.compare`), as this calculator prices it."""
        run = field.published_runs()[validate.choice("published run", name,
                                                     published_choices())]
        values = dict(model=run.model, gpus=str(run.gpus), gpu=run.inputs["gpu"],
                      gpus_per_node="8", global_batch=str(run.inputs["global_batch"]),
                      seq_len=str(run.inputs["seq_len"]), published=name,
                      mfu=round(100 * matmul_efficiency(run.inputs["gpu"]), 1))
        self._loading = True
        try:
            for key, value in values.items():
                self.controls[key].value = value
        finally:
            self._loading = False
        self.update()

    def top(self) -> int:
        return validate.positive_int("top K", self.read_ints(["top"])["top"], MAX_TOP)

    def update(self) -> None:
        try:
            kw, k = self.inputs(), self.top()
            p = cached_plan(**kw)
            rest = {n: v for n, v in kw.items() if n not in ("model", "gpus")}
            shown = p.ranked[:k] or [evaluate(kw["model"], r.layout, **rest)
                                     for r in p.leanest(k)]
        except ValueError as exc:
            self.plan = self.shown = self.decision = self.comparison = None
            self.error = self.error_text(exc)
            self.result.value = error_html(self.error)
            self.rejections.value = self.ladder.value = self.published.value = ""
            self.show_figure(None)
            return
        self.plan, self.shown, self.decision, self.error = p, shown, decide(p), None
        self.result.value = self._verdict() + (self._table() if p.ranked else "")
        self.rejections.value = self._rejected()
        self.ladder.value = self._ladder()
        self.published.value = self._published(kw)
        i, order = p.inputs, "fastest" if p.ranked else "leanest"
        title = (f"{i['model']} on {i['gpus']:,} x {i['gpu']}, batch {i['global_batch']:,} x "
                 f"{i['seq_len']:,} tokens, matmuls at {100 * i['mfu']:.3g} % of peak: the "
                 f"{len(shown)} {order} of " + (f"{len(p.ranked):,} layouts" if p.ranked else
                                                "the layouts, none of which fits"))
        self.show_figure(png_bytes(plan_figure(shown, i["capacity"], title, order))
                         if shown else None)     # nothing to draw: every layout was refused

    def _verdict(self) -> str:
        p = self.plan
        i = p.inputs
        where = (f"{i['gpus_per_node']} per node; TP on {i['intra_link']}, across nodes "
                 f"{i['inter_link']}")
        return (f'<div class="labkit-verdict"><b>{"Best" if p.ranked else "Nothing fits"}</b> '
                f"({where}): {p.why()}</div>")

    def _table(self) -> str:
        rows = []
        for k, e in enumerate(self.shown, 1):
            lay, bd = e.layout, e.breakdown
            rows.append([k, f"{lay.dp:,}", f"{lay.tp}{'+sp' if lay.sequence_parallel else ''}",
                         f"{lay.pp}{'u' if lay.uneven and lay.pp > 1 else ''}", lay.chunks,
                         lay.cp, lay.ep, _sharding(lay), lay.micro_batch,
                         f"{e.microbatches:,}", lay.recompute, f"{e.step_time:,.3f}"]
                        + [f"{bd[part]:,.3f}" for part in PARTS]
                        + [f"{e.memory / GB:,.1f}", f"{e.tokens_per_second:,.0f}",
                           f"{100 * e.mfu:.1f}"])
        return ('<div style="overflow-x:auto; max-width:100%">'
                + table_html(rows, header=HEADER) + "</div>")

    def _published(self, kw) -> str:
        """The chosen published run's layout against this plan's best, or ""."""
        self.comparison = None
        name = self.controls["published"].value
        if not name:
            return ""
        run = field.published_runs()[name]
        as_run = evaluate(run.model, run.layout, **run.inputs)
        predicted = getattr(as_run, f"{run.count}_tflops_per_gpu")
        head = (f"<b>Published: {name}</b> ({run.layout}, {run.tflops} TFLOP/s per GPU "
                f"reported, {run.count} FLOPs; {run.source})<br>priced as it ran (its "
                f"framework, kernels and network: {run.inputs.get('framework', 'megatron')}): "
                f"{predicted:,.0f} TFLOP/s per GPU, {predicted / run.tflops:.2f} x the reported; "
                f"{as_run.memory / GB:,.1f} GB per GPU. Below, as this calculator prices it:")
        if run.layout.gpus != kw["gpus"]:
            return (f"{head}<br>its layout needs {run.layout.gpus:,} GPUs; set GPUs to "
                    f"{run.layout.gpus:,} to compare it")
        try:
            self.comparison = self.plan.compare(run.layout)
        except ValueError as exc:                 # cannot run with these inputs
            return f"{head}<br>{error_html(exc)}"
        return f"{head}<pre>{html.escape(self.comparison.text())}</pre>"

    def _ladder(self) -> str:
        d = self.decision
        rows = []
        for k, r in enumerate(d.rungs, 1):
            mark = "turn on first" if r is d.first else "worth it" if r in d.worth else ""
            rows.append([k, ("+ " if k > 1 else "") + r.lever, mark,
                         str(r.best.layout) if r.best else r.reason,
                         f"{r.best.step_time:,.3f}" if r.best else "",
                         f"{r.best.memory / GB:,.1f}" if r.best else "", r.buys])
        return ("<b>What to turn on first</b> (each rung allows its lever and those above it)"
                + table_html(rows, header=["", "lever", "", "fastest layout with these levers",
                                           "step s", "GB/GPU", "what it buys"]))

    def _rejected(self) -> str:
        p = self.plan
        rows = []
        for kind, count in p.rejection_counts().most_common():
            example = next(r for r in p.rejected if r.kind == kind)
            rows.append([kind, f"{count:,}", str(example.layout),
                         example.reason.split(": ", 1)[1]])
        head = f"<b>Rejected: {len(p.rejected):,} layouts</b>"
        return head + (table_html(rows, header=["reason", "layouts", "e.g.", "why"])
                       if rows else "")
