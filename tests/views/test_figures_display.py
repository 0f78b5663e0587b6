"""A figure from labkit.plots shows itself in a notebook, once, as a PNG (labkit.plots.inline).

A small notebook runs in a real kernel (nbclient) with each way the lessons draw: the cell's last
value, assigned (`fig = ...`), a line ending in `;`, `display(Image(png_bytes(fig)))`, two
figures in one cell, `display(fig)` of an earlier one, and a calculator (whose own renders, at
creation and when a control changes, must not pop up beside it). Counted: image/png outputs
per cell, exactly; no `<Figure size ...>` text anywhere; no pyplot figure left open. Outside a
kernel nothing is tracked. What the learner saw before: issue 28, item 1.
"""
from __future__ import annotations

import json

import nbformat
import pytest

CELLS = [  # (source, image/png outputs expected)
    ("import matplotlib.pyplot as plt   # a learner's own pyplot import changes nothing\n"
     "from IPython.display import Image, display\n"
     "from labkit.pipeline import simulate\n"
     "from labkit.plots import png_bytes\n"
     "from labkit.plots import pipeline as pipe_plots", 0),
    ('pipe_plots.gantt(simulate("gpipe", 4, 8))', 1),
    ('fig = pipe_plots.gantt(simulate("1f1b", 4, 8))', 1),
    ('pipe_plots.gantt(simulate("gpipe", 2, 4));', 1),
    ('display(Image(png_bytes(pipe_plots.gantt(simulate("1f1b", 2, 4)))))', 1),
    ('kept = pipe_plots.gantt(simulate("gpipe", 2, 2))\n'
     'pipe_plots.gantt(simulate("1f1b", 2, 2))', 2),
    ("display(fig)", 1),
    ("x = 1 + 1", 0),
    ("from labkit.widgets.pipeline import PipelineCalculator\n"
     'calc = PipelineCalculator(schedule="gpipe", stages=4, microbatches=8)\n'
     'calc.controls["microbatches"].value = "16"\n'
     "assert calc.error is None and calc.figure.value\n"
     "calc", 0),
    ("print(plt.get_fignums())", 0),
]


def run_notebook(sources: list[str], tmp_path):
    """Execute the cells in a fresh kernel; the executed notebook."""
    from nbclient import NotebookClient

    from labkit.course.kernel import kernel_env

    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(s) for s in sources])
    NotebookClient(nb, kernel_name="python3", timeout=240, allow_errors=False,
                   resources={"metadata": {"path": str(tmp_path)}}).execute(env=kernel_env())
    return nb


def pngs(cell) -> int:
    return sum("image/png" in out.get("data", {}) for out in cell.outputs)


@pytest.mark.notebook
def test_each_figure_shows_once_as_a_png_and_a_calculator_adds_none(tmp_path):
    nb = run_notebook([src for src, _ in CELLS], tmp_path)
    got = [pngs(cell) for cell in nb.cells]
    assert got == [n for _, n in CELLS], "image/png outputs per cell:\n" + "\n".join(
        f"  {n} (expected {want}): {src.splitlines()[-1]}"
        for n, (src, want) in zip(got, CELLS) if n != want)
    text = json.dumps([cell.outputs for cell in nb.cells])
    assert "<Figure size" not in text, "a figure was shown as its repr, not drawn"
    widget = nb.cells[-2].outputs
    assert any("application/vnd.jupyter.widget-view+json" in o.get("data", {}) for o in widget)
    assert nb.cells[-1].outputs[0]["text"].strip() == "[]", "pyplot figures left open"


def test_outside_a_kernel_figures_are_not_tracked_and_png_bytes_marks_them():
    from labkit.pipeline import simulate
    from labkit.plots import inline, png_bytes
    from labkit.plots.pipeline import gantt

    fig = gantt(simulate("gpipe", 2, 2))
    assert isinstance(fig, inline.CourseFigure) and inline._pending == []
    assert png_bytes(fig).startswith(b"\x89PNG") and getattr(fig, inline._HANDLED)
