"""Calculators (layer 2: views). A calculator is a thin view over the pure cost models: it holds
no formula of its own, keeps its results in widget traits (`HTML.value`, `Image.value`, never
printed into an Output), shows bad input as a message in the widget (never a traceback), and can
be driven from a test by setting its controls' `.value`.

May import: layer 1 (cost models), plots/ and ipywidgets. Never runtime/, parallel/, labs/,
course/, cli/.
"""
from __future__ import annotations

import html


def error_html(exc: Exception) -> str:
    """The message a calculator shows instead of a result when its input is invalid."""
    return (f'<div class="labkit-error" style="color:#b00020"><b>Cannot compute:</b> '
            f"{html.escape(str(exc))}</div>")


def table_html(rows, header=None) -> str:
    """A small HTML table from rows of cells (strings or numbers)."""
    out = ['<table class="labkit-table">']
    if header:
        out.append("<tr>" + "".join(f"<th>{html.escape(str(h))}</th>" for h in header) + "</tr>")
    for row in rows:
        out.append("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in row) + "</tr>")
    out.append("</table>")
    return "".join(out)


class Calculator:
    """What every calculator shares. A subclass builds `self.controls` (name -> widget), calls
    `self._set_initial(initial)`, builds its outputs and `self.widget`, then `self._watch()`;
    it implements `update()`, which reads the controls and refreshes the outputs."""

    controls: dict
    widget: object

    def _set_initial(self, initial: dict) -> None:
        """Starting values by control name; an unknown name is a ValueError listing the names."""
        unknown = set(initial) - set(self.controls)
        if unknown:
            raise ValueError(f"unknown control(s) {sorted(unknown)}; allowed: {', '.join(self.controls)}")
        for name, value in initial.items():
            self.controls[name].value = value

    def _watch(self) -> None:
        """Recompute whenever any control changes (observers fire synchronously on `.value`)."""
        for w in self.controls.values():
            w.observe(self._on_change, names="value")

    def _on_change(self, change) -> None:
        self.update()

    def update(self) -> None:  # pragma: no cover - every calculator defines it
        raise NotImplementedError

    def _repr_mimebundle_(self, **kwargs):
        """The last line `calc` of a cell displays the calculator."""
        return self.widget._repr_mimebundle_(**kwargs)
