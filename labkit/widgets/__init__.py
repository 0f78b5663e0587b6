"""Calculators (layer 2: views). A calculator is a thin view over the pure cost models: it holds
no formula of its own, keeps its results in widget traits (`HTML.value`, `Image.value`, never
printed into an Output), shows bad input as a message in the widget (never a traceback), and can
be driven from a test by setting its controls' `.value`."""
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
