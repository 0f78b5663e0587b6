"""The DDP step-time calculator: one GPU's step = compute + the communication its backward could
not hide, and a plot of time and throughput against GPU count that shows where DDP stops scaling.

    >>> from labkit.widgets.ddp import DDPCalculator
    >>> calc = DDPCalculator(model="llama2-7b", link="ib-ndr")   # the last line `calc` shows it
    >>> calc.controls["gpus"].value = "64"                        # a test's way of typing
    >>> calc.step.total, calc.curve.stops_scaling                 # seconds; GPUs (or None)
    >>> calc.result.value, calc.figure.value                      # HTML, PNG bytes

A thin view over `labkit.scaling`, `labkit.flops.flops_per_step` and, for the memory verdict,
`labkit.memory.estimate_memory`.
"""
from __future__ import annotations

import html

import ipywidgets as widgets

from labkit import validate
from labkit.comm import ALGORITHMS
from labkit.flops import flops_per_step
from labkit.hardware import GPUS, LINKS
from labkit.memory import estimate_memory
from labkit.models import PRESETS
from labkit.plots import fmt_count, png_bytes
from labkit.plots.comm import fmt_size
from labkit.plots.ddp import scaling_figure
from labkit.scaling import SCALING, compute_time, ddp_step_time, gpu_counts, scaling_curve
from labkit.widgets import (MFU_RANGE, Calculator, error_html, float_field, int_field,
                            mfu_field, pick, row, table_html)
from labkit.plots.comm import fmt_time as _fmt_time
from labkit.widgets.comm import CUSTOM, RANGES as LINK_RANGES
from labkit.widgets.memory import fit_verdict

PLOT_UP_TO = [2**k for k in range(3, 15)]                 # 8 ... 16,384 GPUs
# The values each number field takes (what its message names, smallest, largest).
RANGES = {"params_b": ("custom size (billion parameters)", 1e-6, validate.MAX_PARAMS / 1e9),
          "bucket_mb": ("bucket size (MiB)", 1e-3, 1e6),
          "compute_ms": ("compute per step (ms)", 1e-3, 1e9), "mfu": MFU_RANGE,
          **{k: LINK_RANGES[k] for k in ("bandwidth_gbs", "latency_us")}}
TYPED = ("gpus", "batch_size", "seq_len")
# The memory verdict's precision for each gradient dtype: DDP keeps gradients in the weights'
# dtype, and AdamW's states beside them (16 bytes per parameter in each case).
PRECISION = {"fp32": "fp32", "bf16": "bf16-mixed", "fp16": "fp16-mixed"}


def _ratio(x: float) -> str:
    """'1.06', '12,345.68', then '1.23e+07' (never 20 digits)."""
    return f"{x:,.2f}" if x < 1e6 else f"{x:.3g}"


class DDPCalculator(Calculator):
    """DDP step time (compute + exposed communication) and scaling over GPU counts.

    Controls (names as in `controls`): model (a preset or "custom" with params_b, billions of
    parameters), gpus, max_gpus (the plot's range), scaling ("weak" | "strong"), link (a LINKS
    key or "custom" with bandwidth_gbs and latency_us), algorithm (of the all-reduce),
    grad_dtype, bucket_mb (MiB, as torch's bucket_cap_mb), overlap (the share of the backward
    communication may run beside), compute
    ("time": compute_ms; "flops": mfu in percent of the gpu's dense peak, batch_size sequences
    of seq_len tokens per GPU), gpu (also the memory verdict's).
    Keyword arguments set their starting values, e.g. `DDPCalculator(gpus=64, link="ib-ndr")`.

    A thin view over `labkit.scaling` (`ddp_step_time`, `scaling_curve`, `compute_time`) and
    `labkit.flops.flops_per_step`: it holds no formula, recomputes when any control changes, and
    keeps its results in widget traits. `step` is the last `DDPStepTime` (None while the input
    is invalid), `curve` the `ScalingCurve` plotted, `memory` the `MemoryEstimate` of one GPU
    (DDP replicates the model: AdamW, weights in the gradients' dtype; activations of the
    sequences per GPU with compute from FLOPs and a preset model) and `fits` whether it fits on
    the GPU chosen, `error` the message shown instead.

    The compute of one GPU's step is typed in milliseconds (measure yours), or comes from FLOPs:
    the model's training FLOPs for that GPU's sequences (`flops_per_step`; a custom size counts
    6N per token) at an MFU of a GPU's dense peak. It is the work of one GPU at the GPU count
    chosen; under "strong" scaling the plot spreads that global batch (N times it) over every
    GPU count.
    """

    ranges = RANGES

    def __init__(self, **initial):
        models = [(f"{k} ({fmt_count(s.num_params())} params)", k) for k, s in PRESETS.items()]
        links = [(f"{v.name}: {v.bandwidth / 1e9:,.1f} GB/s per direction", k)
                 for k, v in LINKS.items()]
        c = {
            "model": pick("model", models + [("custom size", CUSTOM)], "llama2-7b", "380px"),
            "params_b": float_field("billion params", 7.0),
            "gpus": int_field("GPUs", 8, description_width="110px"),
            "max_gpus": pick("plot up to", [(f"{n:,} GPUs", n) for n in PLOT_UP_TO], 1024),
            "scaling": pick("scaling", list(SCALING), "weak", "300px", toggles=True),
            "link": pick("link", links + [("custom bandwidth and latency", CUSTOM)],
                          "ib-ndr", "420px"),
            "bandwidth_gbs": float_field("GB/s (per dir.)", 25.0),
            "latency_us": float_field("latency (µs)", 5.0),
            "algorithm": pick("algorithm", list(ALGORITHMS), "ring", "300px", toggles=True),
            "grad_dtype": pick("gradients", ["fp32", "bf16", "fp16"], "fp32"),
            "bucket_mb": float_field("bucket (MiB)", 25.0),
            "overlap": pick("overlap", [(f"{p}% of backward", p / 100) for p in range(0, 101, 10)],
                             1.0),
            "compute": pick("compute from", [("time", "time"), ("FLOPs", "flops")], "time",
                             "300px", toggles=True),
            "compute_ms": float_field("compute (ms)", 500.0),
            "gpu": pick("GPU", [(g.name, k) for k, g in GPUS.items()], "h100-sxm", "380px"),
            "mfu": mfu_field(40.0),
            "batch_size": int_field("sequences/GPU", 4, description_width="110px"),
            "seq_len": int_field("seq length", 4096, description_width="110px"),
        }
        self.controls: dict[str, widgets.Widget] = c
        self._set_initial(initial)
        self.result = widgets.HTML()
        self.figure = widgets.Image(format="png", layout=widgets.Layout(width="860px"))
        self.step = self.curve = self.memory = self.fits = None
        self.error: str | None = None
        self._custom_model = row([c["params_b"]])
        self._custom_link = row([c["bandwidth_gbs"], c["latency_us"]])
        self._by_time = row([c["compute_ms"]])
        self._by_flops = row([c["mfu"], c["batch_size"], c["seq_len"]])
        self.widget = widgets.VBox([
            row([c["model"], c["gpus"], c["gpu"]]), self._custom_model,
            row([c["link"], c["algorithm"]]), self._custom_link,
            row([c["max_gpus"], c["scaling"]]),
            row([c["grad_dtype"], c["bucket_mb"], c["overlap"]]),
            c["compute"], self._by_time, self._by_flops, self.result, self.figure])
        self._watch()
        self.update()

    # ---- what the controls say -----------------------------------------------------------
    def inputs(self) -> dict:
        """The keyword arguments this calculator passes to `ddp_step_time` (ValueError naming
        the control when one is out of range)."""
        c = self.controls
        typed = self.read_ints(TYPED if c["compute"].value == "flops" else ["gpus"])
        gpus = typed["gpus"]
        if gpus < 2:
            raise ValueError(f"GPUs={validate.describe(gpus)}: one GPU has nothing to "
                             "all-reduce; allowed: a whole number from 2 to "
                             f"{validate.show(validate.MAX_RANKS)}")
        model = self._number("params_b") * 1e9 if c["model"].value == CUSTOM else c["model"].value
        if c["link"].value == CUSTOM:
            link = dict(link=None, bandwidth=self._number("bandwidth_gbs") * 1e9,
                        latency=self._number("latency_us") * 1e-6)
        else:
            link = dict(link=c["link"].value)
        if c["compute"].value == "time":
            seconds = self._number("compute_ms") * 1e-3
        else:
            seconds = compute_time(flops=flops_per_step(model, typed["batch_size"],
                                                        typed["seq_len"]),
                                   gpu=c["gpu"].value, mfu=self._mfu())
        return dict(model=model, gpus=gpus, compute_seconds=seconds,
                    grad_bytes=c["grad_dtype"].value, bucket_size_mb=self._number("bucket_mb"),
                    overlap=c["overlap"].value, algorithm=c["algorithm"].value, **link)

    def memory_inputs(self, kw: dict) -> dict:
        """The keyword arguments of `estimate_memory` for one GPU of this DDP run (`kw`: those
        of `ddp_step_time`): a full replica on each of `gpus` ranks."""
        c = self.controls
        out = dict(dp=kw["gpus"], zero_stage=0, optimizer="adamw",
                   precision=PRECISION[c["grad_dtype"].value])
        if c["compute"].value == "flops" and c["model"].value != CUSTOM:
            typed = self.read_ints(["batch_size", "seq_len"])
            return out | dict(model=kw["model"], batch_size=typed["batch_size"],
                              seq_len=typed["seq_len"])
        # no sequences given: the model states alone (a parameter count has no activations)
        size = kw["model"] if c["model"].value == CUSTOM else PRESETS[kw["model"]].num_params()
        return out | dict(model=float(size))

    # ---- recomputing ---------------------------------------------------------------------
    def update(self) -> None:
        c = self.controls
        self._custom_model.layout.display = "" if c["model"].value == CUSTOM else "none"
        self._custom_link.layout.display = "" if c["link"].value == CUSTOM else "none"
        by_flops = c["compute"].value == "flops"
        self._by_time.layout.display = "none" if by_flops else ""
        self._by_flops.layout.display = "" if by_flops else "none"
        try:
            kw = self.inputs()
            step = ddp_step_time(**kw)
            memory = estimate_memory(**self.memory_inputs(kw))
            # the step above is one point of the curve: under strong scaling the global batch
            # is the one these GPUs share (n batches of one GPU), computed at n GPUs
            n, strong = kw["gpus"], c["scaling"].value == "strong"
            counts = sorted(set(gpu_counts(c["max_gpus"].value)) | {n})
            curve = scaling_curve(**kw | dict(gpus=counts, scaling=c["scaling"].value,
                                              batch=n if strong else 1, at_gpus=n))
            fig = scaling_figure(curve, mark=n, title=self._title(kw))
        except ValueError as exc:
            self.step = self.curve = self.memory = self.fits = None
            self.error = self.error_text(exc)
            self.result.value = error_html(self.error)
            self.show_figure(None)
            return
        gpu = GPUS[c["gpu"].value]
        self.step, self.curve, self.memory, self.error = step, curve, memory, None
        self.fits = memory.total <= gpu.memory
        self.result.value = self._result_html(step, curve) + self._memory_html(memory, gpu)
        self.show_figure(png_bytes(fig))

    # ---- views ---------------------------------------------------------------------------
    def _title(self, kw) -> str:
        c = self.controls
        model = (c["model"].value if c["model"].value != CUSTOM
                 else f"{fmt_count(kw['model'])} params")
        link = "custom link" if kw["link"] is None else LINKS[kw["link"]].name
        return (f"{model}, {c['grad_dtype'].value} gradients, {link}, buckets of "
                f"{kw['bucket_size_mb']:g} MiB, overlap {kw['overlap']:.0%}")

    def _result_html(self, s, curve) -> str:
        point = next(p for p in curve.points if p.gpus == s.gpus)
        stop = curve.stops_scaling
        scaling = (f"DDP stops scaling at <b>{stop:,} GPUs</b> (efficiency below "
                   f"{curve.threshold:.0%})" if stop is not None else
                   f"efficiency stays at or above {curve.threshold:.0%} up to "
                   f"{curve.gpus[-1]:,} GPUs")
        head = (f'<div class="labkit-verdict">On {s.gpus:,} GPUs a step takes '
                f"<b>{_fmt_time(s.total)}</b> = compute {_fmt_time(s.compute)} + exposed "
                f"communication {_fmt_time(s.exposed)} (of {_fmt_time(s.communication)} of "
                f"all-reduces, {s.hidden / s.communication:.0%} hidden behind the backward). "
                f"Compute-to-communication ratio <b>{_ratio(s.ratio)}</b>; efficiency "
                f"{point.efficiency:.0%} ({curve.scaling} scaling); {scaling}.</div>")
        last = s.gradient_bytes - (s.buckets - 1) * s.bucket_bytes
        rows = [
            ("gradients all-reduced per backward", fmt_size(s.gradient_bytes)),
            ("buckets (all-reduces per backward)",
             f"{s.buckets:,} of {fmt_size(s.bucket_bytes)}" + ("" if s.buckets == 1 else
                                                             f", the last {fmt_size(last)}")),
            ("bytes each GPU sends (ring)", fmt_size(s.bytes_sent)),
            ("compute (forward + backward)", _fmt_time(s.compute)),
            ("backward (communication may overlap it)", _fmt_time(s.backward)),
            ("all-reduces back to back", _fmt_time(s.communication)),
            ("of which latency (α terms, paid per bucket)", _fmt_time(s.latency_time)),
            ("hidden behind the backward", _fmt_time(s.hidden)),
            ("exposed (after the backward)", _fmt_time(s.exposed)),
            ("step", _fmt_time(s.total)),
            ("throughput (batches of one GPU per s)", f"{point.throughput:,.4g}"),
            ("speedup over one GPU", f"{point.speedup:,.2f} x"),
        ]
        return head + table_html(rows, header=("", ""))

    def _memory_html(self, memory, gpu) -> str:
        """The memory verdict: DDP keeps the whole model on every GPU."""
        counted = ("weights, gradients, AdamW states and the activations of "
                   f"{memory.inputs.get('batch_size', 1):,} sequence(s)" if memory.activations
                   else "weights, gradients and AdamW states; activations not counted")
        more = ("" if self.fits else " DDP keeps a full replica on every GPU, whatever their "
                "number: shard it with ZeRO or FSDP (modules 04 and 05).")
        return (f'<div class="labkit-verdict labkit-fit">Memory: {fit_verdict(memory, gpu)} '
                f"({counted}.){more}</div>")
