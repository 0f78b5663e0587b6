"""The memory calculator: training memory per GPU for a model, a precision policy, an optimizer,
a batch, ZeRO and dp/tp/pp degrees, and whether it fits on a GPU.

    >>> from labkit.widgets.memory import MemoryCalculator
    >>> calc = MemoryCalculator()          # in a notebook, the last line `calc` displays it
    >>> calc.controls["zero_stage"].value = 3          # what a test does instead of clicking
    >>> calc.verdict.value, calc.breakdown.value, calc.figure.value    # HTML, HTML, PNG bytes

It is a thin view over `labkit.memory.estimate_memory`: it holds no formula, recomputes when any
control changes, and keeps every result in a widget trait (`verdict.value`, `breakdown.value`,
`figure.value`), never in printed output. `calc.estimate` is the last `MemoryEstimate` (None
while the input is invalid) and `calc.error` the message shown instead (None when valid).
"""
from __future__ import annotations

import html

import ipywidgets as widgets

from labkit.hardware import GPUS
from labkit.memory import OPTIMIZERS, PRECISIONS, RECOMPUTE, ZERO_STAGES, estimate_memory
from labkit.models import PRESETS, ModelSpec
from labkit.plots import GB, fmt_bytes, png_bytes
from labkit.plots.memory import memory_bars
from labkit.widgets import Calculator, error_html, table_html

CUSTOM = "custom"
SEQ_LENS = [2**k for k in range(7, 18)]          # 128 ... 131072 tokens
# Custom shape fields -> (ModelSpec field, default: Llama-2-7B's shape).
CUSTOM_FIELDS = {
    "layers": ("num_layers", 32), "hidden": ("hidden_size", 4096), "heads": ("num_heads", 32),
    "kv_heads": ("num_kv_heads", 32), "ffn": ("ffn_size", 11008), "vocab": ("vocab_size", 32000),
}
_TERM_NAMES = {"params": "weights", "grads": "gradients", "optimizer_states": "optimizer states",
               "activations": "activations"}


class MemoryCalculator(Calculator):
    """Per-GPU training memory, with a stacked-bar figure and a "fits on this GPU?" verdict.

    Keyword arguments set the controls' starting values (names as in `controls`), e.g.
    `MemoryCalculator(model="llama3-70b", zero_stage=3, dp=64, gpu="h100-sxm")`.
    """

    def __init__(self, **initial):
        style = {"description_width": "110px"}
        wide = widgets.Layout(width="380px")
        presets = [(f"{k} ({PRESETS[k].num_params() / 1e9:.2f}B params)", k) for k in PRESETS]
        c = {
            "model": widgets.Dropdown(options=presets + [("custom shape (Llama-style)", CUSTOM)],
                                      value="llama2-7b", description="model", style=style,
                                      layout=wide),
            "precision": widgets.Dropdown(options=list(PRECISIONS), value="bf16-mixed",
                                          description="precision", style=style, layout=wide),
            "optimizer": widgets.Dropdown(options=list(OPTIMIZERS), value="adamw",
                                          description="optimizer", style=style, layout=wide),
            "batch_size": widgets.IntSlider(value=1, min=1, max=64, description="micro-batch",
                                            continuous_update=False, style=style, layout=wide),
            "seq_len": widgets.SelectionSlider(options=SEQ_LENS, value=4096,
                                               description="seq length",
                                               continuous_update=False, style=style, layout=wide),
            "recompute": widgets.ToggleButtons(options=list(RECOMPUTE), value="none",
                                               description="recompute", style=style),
            "zero_stage": widgets.ToggleButtons(options=list(ZERO_STAGES), value=0,
                                                description="ZeRO stage", style=style),
            # dp is typed (any whole number: 24, 96, 1536 are all common); tp and pp slide.
            "dp": widgets.IntText(value=1, description="dp", style=style, layout=wide),
            "tp": widgets.IntSlider(value=1, min=1, max=16, description="tp",
                                    continuous_update=False, style=style, layout=wide),
            "pp": widgets.IntSlider(value=1, min=1, max=32, description="pp",
                                    continuous_update=False, style=style, layout=wide),
            "microbatches": widgets.IntSlider(value=1, min=1, max=64,
                                              description="micro-batches",
                                              continuous_update=False, style=style,
                                              layout=wide),
            "sequence_parallel": widgets.Checkbox(value=False, description="sequence parallel",
                                                  indent=False),
            "gpu": widgets.Dropdown(options=[(g.name, k) for k, g in GPUS.items()],
                                    value="h100-sxm", description="GPU", style=style,
                                    layout=wide),
        }
        for name, (field, default) in CUSTOM_FIELDS.items():
            c[name] = widgets.IntText(value=default, description=name,
                                      style={"description_width": "60px"},
                                      layout=widgets.Layout(width="190px"))
        self.controls: dict[str, widgets.Widget] = c
        self._set_initial(initial)

        self.verdict = widgets.HTML()
        self.breakdown = widgets.HTML()
        self.figure = widgets.Image(format="png", layout=widgets.Layout(width="640px"))
        self.estimate = None
        self.error: str | None = None

        self._custom_box = widgets.HBox([c[n] for n in CUSTOM_FIELDS])
        left = widgets.VBox([c["model"], self._custom_box, c["precision"], c["optimizer"],
                             c["batch_size"], c["seq_len"], c["recompute"]])
        right = widgets.VBox([c["zero_stage"], c["dp"], c["tp"], c["pp"], c["microbatches"],
                              c["sequence_parallel"], c["gpu"]])
        self.widget = widgets.VBox([widgets.HBox([left, right]), self.verdict, self.figure,
                                    self.breakdown])
        # Registered first so it runs before the recompute: picking GPT-2 (1024 learned
        # positions) while 4096 tokens are selected moves the sequence to 1024 instead of
        # greeting the learner with an error for a choice they did not make.
        c["model"].observe(self._fit_seq_len, names="value")
        self._watch()
        if "seq_len" not in initial:
            self._fit_seq_len()
        self.update()

    def _fit_seq_len(self, change=None) -> None:
        """Lower the sequence length to the model's context when the model has learned
        positions (GPT-2); a typed-in or slid-to value stays checked by estimate_memory."""
        name = self.controls["model"].value
        spec = PRESETS.get(name)
        seq = self.controls["seq_len"]
        if spec is not None and spec.learned_positions and seq.value > spec.max_seq_len:
            seq.value = max(s for s in SEQ_LENS if s <= spec.max_seq_len)

    # ---- what the controls say ---------------------------------------------------------
    def model(self):
        """The model the controls describe: a preset name, or a Llama-style ModelSpec built from
        the custom fields (ValueError if they do not make a model)."""
        c = self.controls
        if c["model"].value != CUSTOM:
            return c["model"].value
        fields = {field: c[name].value for name, (field, _) in CUSTOM_FIELDS.items()}
        return ModelSpec(name="custom", arch="llama", max_seq_len=max(SEQ_LENS), **fields)

    def inputs(self) -> dict:
        """The keyword arguments this calculator passes to `estimate_memory`."""
        c = self.controls
        return dict(model=self.model(), batch_size=c["batch_size"].value,
                    seq_len=c["seq_len"].value, precision=c["precision"].value,
                    optimizer=c["optimizer"].value, zero_stage=c["zero_stage"].value,
                    dp=c["dp"].value, tp=c["tp"].value, pp=c["pp"].value,
                    sequence_parallel=c["sequence_parallel"].value,
                    recompute=c["recompute"].value, microbatches=c["microbatches"].value)

    # ---- recomputing -------------------------------------------------------------------
    def update(self) -> None:
        """Recompute from the controls and refresh the verdict, the figure and the breakdown."""
        c = self.controls
        self._custom_box.layout.display = "" if c["model"].value == CUSTOM else "none"
        try:
            kwargs = self.inputs()
            est = estimate_memory(**kwargs)
            # The same settings under each ZeRO stage, for the figure (the chosen one stands out).
            by_stage = {f"ZeRO-{z}": estimate_memory(**{**kwargs, "zero_stage": z})
                        for z in ZERO_STAGES}
        except ValueError as exc:
            self.estimate, self.error = None, str(exc)
            self.verdict.value = error_html(exc)
            self.breakdown.value = ""
            self.figure.value = b""
            return
        gpu = GPUS[c["gpu"].value]
        self.estimate, self.error = est, None
        self.verdict.value = self._verdict_html(est, gpu)
        self.breakdown.value = self._breakdown_html(est, kwargs)
        fig = memory_bars(by_stage, capacity=gpu.memory,
                          capacity_label=f"{gpu.name}: {gpu.memory / GB:,.0f} GB",
                          highlight=f"ZeRO-{kwargs['zero_stage']}",
                          title=self._title(kwargs))
        self.figure.value = png_bytes(fig)

    # ---- views ---------------------------------------------------------------------------
    @staticmethod
    def _title(kw) -> str:
        name = kw["model"] if isinstance(kw["model"], str) else "custom"
        return (f"{name}, {kw['precision']} + {kw['optimizer']}, dp={kw['dp']} tp={kw['tp']} "
                f"pp={kw['pp']}, micro-batch {kw['batch_size']} x {kw['seq_len']} tokens")

    @staticmethod
    def _verdict_html(est, gpu) -> str:
        share = est.total / gpu.memory
        where = f" (pipeline stage {est.stage}, the fullest)" if len(est.per_stage) > 1 else ""
        if est.fits(gpu):
            head = (f'<b style="color:#1b7f3b">Fits</b> on one {html.escape(gpu.name)}: '
                    f"{fmt_bytes(est.total)} per GPU{where}, {share:.0%} of its "
                    f"{fmt_bytes(gpu.memory)}.")
        else:
            terms = {k: getattr(est, k) for k in _TERM_NAMES}
            big = max(terms, key=terms.get)
            head = (f'<b style="color:#b00020">Does not fit</b> on one {html.escape(gpu.name)}: '
                    f"needs {fmt_bytes(est.total)} per GPU{where}, {share:.0%} of its "
                    f"{fmt_bytes(gpu.memory)}. The largest term is {_TERM_NAMES[big]} "
                    f"({fmt_bytes(terms[big])}).")
        return f'<div class="labkit-verdict">{head}</div>'

    @staticmethod
    def _breakdown_html(est, kw) -> str:
        rows = [(_TERM_NAMES.get(k, k), f"{getattr(est, k) / GB:,.2f}",
                 f"{getattr(est, k) / 2**30:,.2f}", est.explain.get(k, ""))
                for k in ("params", "grads", "optimizer_states", "activations")]
        rows.append(("total", f"{est.total / GB:,.2f}", f"{est.total / 2**30:,.2f}",
                     est.explain.get("total", "")))
        gpus = kw["dp"] * kw["tp"] * kw["pp"]
        head = (f"<p>Per GPU, {gpus:,} GPU(s) in all (dp={kw['dp']} x tp={kw['tp']} x "
                f"pp={kw['pp']}). GB = 10<sup>9</sup> bytes, GiB = 2<sup>30</sup> bytes.</p>")
        return head + table_html(rows, header=("term", "GB", "GiB", "where it comes from"))
