"""The course's calculators as one standalone web app (`labkit calculators`, served by Voila from
`calculators.ipynb` beside this file: a title and `CalculatorsApp()`, a tab per calculator).

    >>> from labkit.app import CalculatorsApp
    >>> app = CalculatorsApp()              # in a notebook, `app.widget` displays it
    >>> app.tabs.selected_index = 7          # what clicking the "Pipeline" tab does
    >>> app.calculator("pipeline").controls["microbatches"].value = "16"

May import: layer 1 (cost models), plots/ and widgets/ (a view made of views). Nothing imports
it but cli/ (which starts the server on the notebook).
"""
from __future__ import annotations

import html
import importlib
from dataclasses import dataclass
from pathlib import Path

import ipywidgets as widgets

NOTEBOOK = Path(__file__).with_name("calculators.ipynb")
TITLE = "The Distributed Training Lab: calculators"


@dataclass(frozen=True)
class Entry:
    key: str          # the name tests and `CalculatorsApp.calculator` use
    title: str        # the tab's title
    module: str       # under labkit.widgets
    cls: str
    question: str     # the one line under the tab: what the calculator answers


CALCULATORS = [
    Entry("memory", "Memory", "memory", "MemoryCalculator",
          "How much memory does training take per GPU (weights, gradients, optimizer states, "
          "activations), and does it fit?"),
    Entry("comm", "Collectives", "comm", "CommCalculator",
          "How long does an all-reduce, all-gather or reduce-scatter take on a given link and "
          "number of ranks (alpha-beta model, ring or tree)?"),
    Entry("ddp", "DDP step", "ddp", "DDPCalculator",
          "How long is a data-parallel step once gradients are all-reduced in buckets, and how "
          "much of that communication hides behind backward?"),
    Entry("zero", "ZeRO", "zero", "ZeROCalculator",
          "What does each ZeRO stage (and offload) save in memory per GPU, and what does it cost "
          "in communication?"),
    Entry("fsdp", "FSDP", "fsdp", "FSDPCalculator",
          "What does FSDP2 hold per rank, and what does it send, for a wrapping, resharding and "
          "mixed-precision policy?"),
    Entry("checkpoint", "Checkpoints", "fsdp", "CheckpointCalculator",
          "How often should a run this size checkpoint, and how much time do failures cost?"),
    Entry("tp", "Tensor parallel", "tp", "TPCalculator",
          "How much time does one layer spend in tensor-parallel communication compared with "
          "its compute?"),
    Entry("pipeline", "Pipeline", "pipeline", "PipelineCalculator",
          "How big is the bubble of a pipeline schedule (GPipe, 1F1B, interleaved, zero-bubble, "
          "ZB-V, DualPipeV), and how many micro-batches are in flight?"),
    Entry("moe", "MoE", "moe", "MoECalculator",
          "How much memory per GPU does a mixture of experts take under expert parallelism, "
          "how few of its parameters does a token use, and what do its all-to-alls cost?"),
    Entry("planner", "Planner", "planner", "PlannerCalculator",
          "Which layout (dp, tp, pp, cp, ZeRO stage, micro-batch, recomputation) trains a model "
          "fastest on a cluster, and why are the others rejected?"),
    Entry("quiz", "Quiz", "quiz", "QuizWidget",
          "Can you answer interview questions on distributed training with numbers, fast?"),
]
KEYS = [e.key for e in CALCULATORS]
# JupyterLab pads the cells of rendered tables; Voila's page does not, so the calculators'
# tables (labkit-table) would run their columns together.
STYLE = ("<style>.labkit-table th, .labkit-table td { padding: 0.15em 0.9em; }"
         ".labkit-table th { text-align: left; }</style>")


def _question_html(entry: Entry) -> str:
    return f'<p class="labkit-app-question"><b>{html.escape(entry.question)}</b></p>'


class CalculatorsApp:
    """One tab per calculator in `CALCULATORS`, each headed by the one question it answers;
    `widget` is what the page shows. A tab's calculator is built the first time the tab is
    selected (`calculator(key)` builds it too; the first tab's at start-up), so the page comes
    up in the time one calculator takes, not all eleven (about 14 s on 2 cores). One that fails to
    build shows the message in its tab, never a traceback."""

    def __init__(self, selected: str = KEYS[0]):
        if selected not in KEYS:
            raise ValueError(f"selected={selected!r} is not a calculator; allowed: "
                             f"{', '.join(KEYS)}")
        self.built: dict[str, object] = {}
        # overflow: a calculator wider than the window (the planner's table) scrolls sideways
        # in its tab instead of being cut off at the tab's edge
        self.pages = {e.key: widgets.VBox([widgets.HTML(_question_html(e))],
                                          layout=widgets.Layout(width="100%", overflow="auto"))
                      for e in CALCULATORS}
        for e in CALCULATORS:
            self.pages[e.key].add_class(f"labkit-app-{e.key}")
        self.tabs = widgets.Tab(children=[self.pages[k] for k in KEYS],
                                titles=[e.title for e in CALCULATORS])
        self.tabs.add_class("labkit-app-tabs")
        self.tabs.observe(self._on_select, names="selected_index")
        self.header = widgets.HTML(
            STYLE + f'<h2 class="labkit-app-title" style="margin:0.2em 0">{html.escape(TITLE)}</h2>'
            "<p>Every calculator of the course, live: change a control and the figure and "
            "verdict follow. Numbers come from labkit's cost models (bytes, seconds; GB = 1e9, "
            "GiB = 2<sup>30</sup>).</p>")
        self.widget = widgets.VBox([self.header, self.tabs])
        self.tabs.selected_index = KEYS.index(selected)
        self.calculator(selected)       # observers do not fire when the index does not change

    def calculator(self, key: str):
        """The calculator of tab `key`, built (and put in its tab) on first use; None when it
        could not be built (its tab then says why)."""
        if key not in KEYS:
            raise ValueError(f"{key!r} is not a calculator; allowed: {', '.join(KEYS)}")
        if key not in self.built:
            entry = CALCULATORS[KEYS.index(key)]
            page = self.pages[key]
            page.children = [*page.children[:1], widgets.HTML("<i>Loading…</i>")]
            try:
                cls = getattr(importlib.import_module(f"labkit.widgets.{entry.module}"), entry.cls)
                calc = cls()
            except Exception as exc:    # a view must not break the whole page: say what failed
                message = (f'<div class="labkit-error" style="color:#b00020"><b>The '
                           f"{html.escape(entry.title)} calculator could not start:</b> "
                           f"{html.escape(type(exc).__name__)}: {html.escape(str(exc))}</div>")
                page.children = [*page.children[:1], widgets.HTML(message)]
                self.built[key] = None
                return None
            page.children = [*page.children[:1], calc.widget]
            self.built[key] = calc
        return self.built[key]

    def _on_select(self, change) -> None:
        index = change["new"]
        if index is not None and 0 <= index < len(KEYS):
            self.calculator(KEYS[index])

    def _repr_mimebundle_(self, **kwargs):
        return self.widget._repr_mimebundle_(**kwargs)
