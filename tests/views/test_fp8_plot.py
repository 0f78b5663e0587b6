"""labkit.plots.fp8: one panel per tensor kind, each bar the error labkit.fp8 measured; bad rows
give a message."""
from __future__ import annotations

import pytest

from labkit.plots.fp8 import error_by_scaling

ROWS = [{"kind": k, "dtype": d, "scaling": s, "rel_error": e}
        for k, base in (("activation", 0.02), ("weight_grad", 0.05))
        for d, f in (("e4m3", 1.0), ("e5m2", 2.0))
        for s, g in (("tensor", 1.0), ("block1x128", 0.5))
        for e in [base * f * g]]


def test_each_bar_is_a_measured_error():
    fig = error_by_scaling(ROWS)
    axes = fig.axes
    assert [a.get_title() for a in axes] == ["activation", "weight_grad"]
    for ax, kind in zip(axes, ("activation", "weight_grad")):
        heights = sorted(round(p.get_height(), 12) for p in ax.patches)
        want = sorted(round(r["rel_error"], 12) for r in ROWS if r["kind"] == kind)
        assert heights == want
    assert [t.get_text() for t in axes[0].get_xticklabels()] == ["tensor", "1x128"]


@pytest.mark.parametrize("rows, message", [([], "no rows"), ([{"kind": "a"}], "row 0 must be a dict with keys")])
def test_bad_rows_are_refused(rows, message):
    with pytest.raises(ValueError, match=message):
        error_by_scaling(rows)
