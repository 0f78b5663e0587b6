"""The memory calculator: training memory per GPU for a model, a precision policy, an optimizer,
a batch, ZeRO and dp/tp/pp degrees, and whether it fits on a GPU.

    >>> from labkit.widgets.memory import MemoryCalculator
    >>> calc = MemoryCalculator()          # in a notebook, the last line `calc` displays it
    >>> calc.controls["zero_stage"].value = 3          # what a test does instead of clicking
    >>> calc.controls["dp"].value = "8"                # typed fields hold text
    >>> calc.verdict.value, calc.breakdown.value, calc.figure.value    # HTML, HTML, PNG bytes

A thin view over `labkit.memory.estimate_memory`.
"""
from __future__ import annotations

import html

import ipywidgets as widgets

from labkit import validate
from labkit.hardware import GPUS
from labkit.memory import (OPTIMIZERS, PRECISIONS, RECOMPUTE, ZERO_STAGES, estimate_memory,
                           tp_degrees, tp_splits)
from labkit.models import PRESETS, ModelSpec, get_model
from labkit.plots import GB, fmt_bytes, fmt_count, png_bytes
from labkit.plots.memory import memory_bars
from labkit.widgets import (Calculator, Dropdown, ToggleButtons, error_html, int_field, row,
                            table_html)

CUSTOM = "custom"
SEQ_LENS = [2**k for k in range(7, 18)]          # 128 ... 131072 tokens
MAX_PP_CHOICES = 128                             # pp offered: 1 to min(layers, this)
# Custom shape fields -> (ModelSpec field, default: Llama-2-7B's shape).
CUSTOM_FIELDS = {
    "layers": ("num_layers", 32), "hidden": ("hidden_size", 4096), "heads": ("num_heads", 32),
    "kv_heads": ("num_kv_heads", 32), "ffn": ("ffn_size", 11008), "vocab": ("vocab_size", 32000),
}
TYPED = ("batch_size", "microbatches", "dp")     # typed whole numbers besides the custom shape
_TERM_NAMES = {"params": "weights", "grads": "gradients", "optimizer_states": "optimizer states",
               "activations": "activations", "unsharded_peak": "unsharded weights at the peak"}
_SPLIT_NAMES = {"num_heads": "{:,} attention heads", "num_kv_heads": "{:,} KV heads",
                "ffn_size": "an MLP width of {:,}"}


def _or(values) -> str:
    values = [str(v) for v in values]
    return values[0] if len(values) == 1 else f"{', '.join(values[:-1])} or {values[-1]}"


def _pick(description, options, value, width="250px", **style):
    """A dropdown (options: values or (label, value)) or, with button_width, toggle buttons."""
    style = {"description_width": "100px", **style}
    if "button_width" in style:
        # ipywidgets 8 puts a ToggleButtons' label on a line of its own; laid out as the other
        # labelled controls are (a row, the label right-aligned), it sits beside its buttons.
        toggles = ToggleButtons(options=options, value=value, description=description,
                                style=style, layout=widgets.Layout(width=width))
        toggles.add_class("widget-inline-hbox")
        return toggles
    return Dropdown(options=options, value=value, description=description, style=style,
                    layout=widgets.Layout(width=width))


def fit_verdict(memory, gpu, where: str = "") -> str:
    """'Fits on one H100 SXM: 60 GB per GPU, 75% of its 80 GB.' or 'Does not fit ...: needs
    ..., and the largest term', as HTML: the verdict every calculator that prices a setting
    shows. memory: a MemoryEstimate or FSDPMemory (its `total` and the terms it has of
    params, grads, optimizer_states, activations, unsharded_peak), in bytes per GPU."""
    share = memory.total / gpu.memory
    if memory.total <= gpu.memory:
        return (f'<b style="color:#1b7f3b">Fits</b> on one {html.escape(gpu.name)}: '
                f"{fmt_bytes(memory.total)} per GPU{where}, {share:.0%} of its "
                f"{fmt_bytes(gpu.memory)}.")
    terms = {k: getattr(memory, k) for k in _TERM_NAMES if hasattr(memory, k)}
    big = max(terms, key=terms.get)
    return (f'<b style="color:#b00020">Does not fit</b> on one {html.escape(gpu.name)}: '
            f"needs {fmt_bytes(memory.total)} per GPU{where}, {share:.0%} of its "
            f"{fmt_bytes(gpu.memory)}. The largest term is {_TERM_NAMES[big]} "
            f"({fmt_bytes(terms[big])}).")


class MemoryCalculator(Calculator):
    """Per-GPU training memory, with a stacked-bar figure and a "fits on this GPU?" verdict.

    Keyword arguments set the controls' starting values (names as in `controls`), e.g.
    `MemoryCalculator(model="llama3-70b", zero_stage=3, dp=64, gpu="h100-sxm")`.

    A thin view over `labkit.memory.estimate_memory`: it holds no formula, recomputes when any
    control changes, and keeps every result in a widget trait (`verdict.value`,
    `breakdown.value`, `figure.value`, `note.value`), never in printed output. `estimate` is the
    last `MemoryEstimate` (None while the input is invalid) and `error` the message shown
    instead (None when valid).

    Whole numbers that can be anything (micro-batch, micro-batches, dp, the custom shape) are
    typed into text fields, and anything but digits gets a message; the degrees with few valid
    values are picked: tp from the divisors of the model's heads (and KV heads and MLP width),
    pp from 1 to its layers, the ZeRO stage from 0-3. When a new model cannot take the tp, pp or
    sequence length chosen, the calculator moves it to the nearest value that works and says so
    in `note`.
    """

    # the custom shape's fields are labelled by their control names (`hidden`, not hidden_size)
    arguments = {field: name for name, (field, _) in CUSTOM_FIELDS.items()}

    def __init__(self, **initial):
        presets = [(f"{k} ({fmt_count(PRESETS[k].num_params())} params)", k) for k in PRESETS]
        c = {
            "model": _pick("model", presets + [("custom shape (Llama-style)", CUSTOM)],
                           "llama2-7b", width="420px"),
            "gpu": _pick("GPU", [(g.name, k) for k, g in GPUS.items()], "h100-sxm",
                         width="380px"),
            "precision": _pick("precision", list(PRECISIONS), "bf16-mixed"),
            "optimizer": _pick("optimizer", list(OPTIMIZERS), "adamw"),
            "recompute": _pick("recompute", list(RECOMPUTE), "none", width="380px",
                               button_width="78px"),
            "batch_size": int_field("micro-batch", 1),
            "seq_len": _pick("seq length", [(f"{s:,}", s) for s in SEQ_LENS], 4096),
            "microbatches": int_field("micro-batches", 1),
            "dp": int_field("dp", 1),
            "tp": _pick("tp", tp_degrees("llama2-7b"), 1),
            "pp": _pick("pp", self._pp_choices(get_model("llama2-7b")), 1),
            "zero_stage": _pick("ZeRO stage", list(ZERO_STAGES), 0, width="340px",
                                button_width="48px"),
            "sequence_parallel": widgets.Checkbox(value=False, description="sequence parallel",
                                                  indent=False,
                                                  layout=widgets.Layout(width="180px")),
        }
        for name, (_, default) in CUSTOM_FIELDS.items():
            c[name] = int_field(name, default, width="190px", description_width="62px")
        self.controls: dict[str, widgets.Widget] = c
        self._holding = False
        self.note = widgets.HTML()
        self.verdict = widgets.HTML()
        self.breakdown = widgets.HTML()
        self.figure = widgets.Image(format="png", layout=widgets.Layout(width="640px"))
        self.estimate = None
        self.error: str | None = None

        # The model (and a custom shape) first: they decide which tp and pp are offered.
        shape = {k: v for k, v in initial.items() if k == "model" or k in CUSTOM_FIELDS}
        self._set_initial(shape)
        self._fit_to_model(keep_seq="seq_len" in initial)
        self._set_initial({k: v for k, v in initial.items() if k not in shape})
        self.note.value = ""

        self._custom_box = row([c[n] for n in CUSTOM_FIELDS])
        controls = widgets.VBox([
            row([c["model"], c["gpu"]]), self._custom_box,
            row([c["precision"], c["optimizer"], c["recompute"]]),
            row([c["batch_size"], c["seq_len"], c["microbatches"]]),
            row([c["dp"], c["tp"], c["pp"]]),
            row([c["zero_stage"], c["sequence_parallel"]]),
        ])
        self.widget = widgets.VBox([controls, self.note, self.verdict, self.figure,
                                    self.breakdown])
        self._watch()
        self.update()

    # ---- what the controls say ---------------------------------------------------------
    def _typed(self) -> dict[str, int]:
        names = list(TYPED)
        if self.controls["model"].value == CUSTOM:
            names += list(CUSTOM_FIELDS)
        return self.read_ints(names)

    def model(self, typed: dict | None = None):
        """The model the controls describe: a preset name, or a Llama-style ModelSpec built from
        the custom fields (ValueError if they do not make a model)."""
        c = self.controls
        if c["model"].value != CUSTOM:
            return c["model"].value
        typed = self._typed() if typed is None else typed
        fields = {field: typed[name] for name, (field, _) in CUSTOM_FIELDS.items()}
        return ModelSpec(name="custom", arch="llama", max_seq_len=max(SEQ_LENS), **fields)

    def inputs(self) -> dict:
        """The keyword arguments this calculator passes to `estimate_memory` (ValueError naming
        every typed field that is not a whole number)."""
        c = self.controls
        typed = self._typed()
        return dict(model=self.model(typed), batch_size=typed["batch_size"],
                    seq_len=c["seq_len"].value, precision=c["precision"].value,
                    optimizer=c["optimizer"].value, zero_stage=c["zero_stage"].value,
                    dp=typed["dp"], tp=c["tp"].value, pp=c["pp"].value,
                    sequence_parallel=c["sequence_parallel"].value,
                    recompute=c["recompute"].value, microbatches=typed["microbatches"])

    # ---- following the model -------------------------------------------------------------
    def _fit_to_model(self, keep_seq: bool = False) -> None:
        """Offer the tp and pp that work for the chosen model, and move a choice it cannot take
        (tp not dividing its heads, pp above its layers, a sequence longer than GPT-2's learned
        positions) to the nearest one that works, saying so in `note`: the learner is not
        greeted with an error for a choice they did not make."""
        try:
            spec = get_model(self.model())
        except ValueError:
            return                       # a custom shape that is no model: update() says why
        notes = []
        self._holding = True             # one recompute afterwards, not one per change
        try:
            notes += self._offer("tp", tp_degrees(spec),
                                 lambda old: self._tp_message(spec, old))
            notes += self._offer("pp", self._pp_choices(spec),
                                 lambda old: self._pp_message(spec, old))
            seq = self.controls["seq_len"]
            if not keep_seq and spec.learned_positions and seq.value > spec.max_seq_len:
                seq.value = max(s for s in SEQ_LENS if s <= spec.max_seq_len)
                notes.append(f"{spec.name} has {spec.max_seq_len:,} learned positions; "
                             f"seq length is now {seq.value:,}")
        finally:
            self._holding = False
        self.note.value = "".join(f'<div class="labkit-note">{html.escape(n)}.</div>'
                                  for n in notes)

    def _offer(self, name: str, allowed: list, why) -> list[str]:
        w = self.controls[name]
        old = w.value
        if tuple(w.options) != tuple(allowed):
            w.options = allowed          # ipywidgets selects the first option; put `old` back
        w.value = old if old in allowed else max(v for v in allowed if v <= old)
        return [] if w.value == old else [f"{why(old)}; {name} is now {w.value}"]

    @staticmethod
    def _tp_message(spec, tp) -> str:
        """'tp=3 does not divide 32 attention heads; try 1, 2, 4, 8, 16 or 32'."""
        what, count = next((k, n) for k, n in tp_splits(spec).items() if n % tp)
        return (f"tp={validate.describe(tp)} does not divide "
                f"{_SPLIT_NAMES[what].format(count)}; try {_or(tp_degrees(spec))}")

    @staticmethod
    def _pp_choices(spec) -> list[int]:
        return list(range(1, min(spec.num_layers, MAX_PP_CHOICES) + 1))

    @classmethod
    def _pp_message(cls, spec, pp) -> str:
        most = cls._pp_choices(spec)[-1]
        why = (f"is more than the {most} layers of {spec.name}" if most == spec.num_layers
               else f"is more than the {most} stages this calculator offers")
        return f"pp={validate.describe(pp)} {why}; try 1 to {most}"

    def _not_offered(self, name, value) -> str:
        if name in ("tp", "pp") and isinstance(value, int) and value >= 1:
            spec = get_model(self.model())
            return (self._tp_message if name == "tp" else self._pp_message)(spec, value)
        return super()._not_offered(name, value)

    def _on_change(self, change) -> None:
        if self._holding:
            return
        if change["owner"] is self.controls["model"] or change["owner"] in [
                self.controls[n] for n in CUSTOM_FIELDS]:
            self._fit_to_model()
        else:
            self.note.value = ""
        self.update()

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
            self.estimate, self.error = None, self.error_text(exc)
            self.verdict.value = error_html(self.error)
            self.breakdown.value = ""
            self.show_figure(None)
            return
        gpu = GPUS[c["gpu"].value]
        self.estimate, self.error = est, None
        self.verdict.value = self._verdict_html(est, gpu)
        self.breakdown.value = self._breakdown_html(est, kwargs)
        fig = memory_bars(by_stage, capacity=gpu.memory,
                          capacity_label=f"{gpu.name}: {gpu.memory / GB:,.0f} GB",
                          highlight=f"ZeRO-{kwargs['zero_stage']}",
                          title=self._title(kwargs))
        self.show_figure(png_bytes(fig))

    # ---- views ---------------------------------------------------------------------------
    @staticmethod
    def _title(kw) -> str:
        name = kw["model"] if isinstance(kw["model"], str) else "custom"
        return (f"{name}, {kw['precision']} + {kw['optimizer']}, dp={kw['dp']} tp={kw['tp']} "
                f"pp={kw['pp']}, micro-batch {kw['batch_size']} x {kw['seq_len']} tokens")

    @staticmethod
    def _verdict_html(est, gpu) -> str:
        where = f" (pipeline stage {est.stage}, the fullest)" if len(est.per_stage) > 1 else ""
        return f'<div class="labkit-verdict">{fit_verdict(est, gpu, where)}</div>'

    @staticmethod
    def _breakdown_html(est, kw) -> str:
        rows = [(_TERM_NAMES.get(k, k), f"{getattr(est, k) / GB:,.2f}",
                 f"{getattr(est, k) / 2**30:,.2f}", est.explain.get(k, ""))
                for k in ("params", "grads", "optimizer_states", "activations")]
        rows.append(("total", f"{est.total / GB:,.2f}", f"{est.total / 2**30:,.2f}",
                     est.explain.get("total", "")))
        spec = get_model(kw["model"])
        gpus = kw["dp"] * kw["tp"] * kw["pp"]
        head = (f"<p>{html.escape(spec.name)}: {fmt_count(spec.num_params())} parameters. Per "
                f"GPU, {gpus:,} GPU(s) in all (dp={kw['dp']} x tp={kw['tp']} x pp={kw['pp']}). "
                "GB = 10<sup>9</sup> bytes, GiB = 2<sup>30</sup> bytes.</p>")
        return head + table_html(rows, header=("term", "GB", "GiB", "where it comes from"))
