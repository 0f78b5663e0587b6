"""Figures for the course (layer 2: views). Each plot function returns a matplotlib Figure built
with the object API (no pyplot state), so it works the same in a notebook, a widget and a test.
In a notebook it shows itself once as a PNG, whether it is the cell's value, assigned or ends in
`;` (labkit.plots.inline). `png_bytes(fig)` renders one for an `ipywidgets.Image` (not shown).

May import: layer 1 (cost models), matplotlib, IPython (in a kernel). Never runtime/, parallel/,
labs/, course/, cli/.
"""
from __future__ import annotations

GB = 1e9
GiB = 2**30


def new_figure(width: float = 7.0, height: float = 3.5):
    """A Figure not registered with pyplot (so widgets never leak open figures), that shows
    itself in a notebook (labkit.plots.inline)."""
    from labkit.plots.inline import CourseFigure, track

    fig = CourseFigure(figsize=(width, height), layout="constrained")
    track(fig)
    return fig


def png_bytes(fig, dpi: int = 100) -> bytes:
    """Render a Figure to PNG bytes (for `widgets.Image.value`); the figure is then not shown
    again at the end of the cell (show the bytes with `Image(png_bytes(fig))`)."""
    from labkit.plots.inline import mark_handled, render_png

    mark_handled(fig)
    return render_png(fig, dpi)


def fmt_bytes(n: float) -> str:
    """'80.00 GB (74.51 GiB)': both units, as the course shows every size a person reads."""
    return f"{n / GB:,.2f} GB ({n / GiB:,.2f} GiB)"


def fmt_count(n: float) -> str:
    """A count (parameters, tokens) as a person reads it, about 3 significant digits: 950, 853K,
    1.18M, 124M, 6.74B, 69.0B, 406B, 1.20T."""
    units = (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3))
    for i, (unit, scale) in enumerate(units):
        v = n / scale
        if abs(v) >= 1:
            text = f"{v:.{2 if abs(v) < 10 else 1 if abs(v) < 100 else 0}f}"
            if abs(float(text)) >= 1000 and i > 0:          # 999.95K rounds to 1.00M
                return f"{n / units[i - 1][1]:.2f}{units[i - 1][0]}"
            return text + unit
    return f"{n:,.0f}"
