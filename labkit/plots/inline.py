"""Figures that show themselves in a notebook, as matplotlib's inline backend shows pyplot's.

`CourseFigure` (what `labkit.plots.new_figure` makes) displays itself as a PNG when it is a
cell's value or passed to `display()`. In a Jupyter kernel each one made during a cell is also
tracked, and an IPython `post_run_cell` hook shows, once, those the cell neither displayed nor
rendered to bytes (`png_bytes`, for a widget's Image): `fig = gantt(...)` and `gantt(...);` show
their figure too, and a calculator's own renders never pop up beside it. Nothing here uses pyplot,
so no figure stays open. Outside a kernel nothing is tracked (terminal IPython prints the repr).
"""
from __future__ import annotations

import io
import sys

from matplotlib.figure import Figure

_HANDLED = "_labkit_handled"     # set on a figure once shown or rendered to bytes
_pending: list = []              # figures made during the running cell (strong references)
_state = {"in_cell": False}      # between pre_run_cell and post_run_cell


def render_png(fig, dpi: int = 100) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    return buf.getvalue()


def mark_handled(fig) -> None:
    """The figure was shown or rendered for a widget: the end of the cell leaves it alone."""
    setattr(fig, _HANDLED, True)


class CourseFigure(Figure):
    """A matplotlib Figure that displays itself in a notebook as a PNG."""

    def _ipython_display_(self):
        mark_handled(self)
        if _kernel_shell() is None:          # terminal IPython: no image to show
            print(repr(self))
            return
        from IPython.display import display

        w, h = (round(v) for v in self.get_size_inches() * 100)
        display({"image/png": render_png(self), "text/plain": f"[figure, {w}x{h} px]"}, raw=True)


def _kernel_shell():
    """The IPython shell if this process is a Jupyter kernel, else None. IPython is never
    imported here: a process that has not loaded it is not a kernel."""
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    return shell if getattr(shell, "kernel", None) is not None else None


def track(fig) -> None:
    """In a kernel, remember a figure made during a cell, to show it at the cell's end unless
    the cell shows or renders it first. Figures made between cells (a widget's callback) are
    rendered by their widget and not tracked."""
    shell = _kernel_shell()
    if shell is None:
        return
    if _post_run_cell not in shell.events.callbacks["post_run_cell"]:    # once per kernel
        shell.events.register("pre_run_cell", _pre_run_cell)
        shell.events.register("post_run_cell", _post_run_cell)
        _state["in_cell"] = True             # the first figure is made by a running cell
    if _state["in_cell"]:
        _pending.append(fig)


def _pre_run_cell(*_info) -> None:
    _pending.clear()
    _state["in_cell"] = True


def _post_run_cell(*_result) -> None:
    """Show what the cell made and left unshown: each figure once, in the order made."""
    _state["in_cell"] = False
    figures, _pending[:] = list(_pending), []
    for fig in figures:
        if not getattr(fig, _HANDLED, False):
            fig._ipython_display_()
