"""labkit.widgets.table_html(rows, header=None): a header passed first (module 05 did it four
times, each header rendered as rows of single letters) is refused, and no notebook calls it so."""
from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from labkit.widgets import table_html

ROOT = Path(__file__).resolve().parents[2]
ROWS = [["fsdp", 1, "2.0"], ["zero3", 3, "4.0"]]
HEADER = ["impl", "calls", "GB"]


@pytest.mark.parametrize("args, says", [
    ((HEADER, ROWS), "row 0 is 'impl', not a sequence of cells"),      # the swap
    ((HEADER,), "row 0 is 'impl'"),
    (("impl",), "rows is a string"),
    ((ROWS, "impl calls GB"), "is not a sequence of labels"),
    ((ROWS, [HEADER]), "header holds ['impl', 'calls', 'GB'], not a label"),
    ((ROWS, HEADER[:2]), "row 0 has 3 cells, the header 2 labels"),
    (([1, 2],), "row 0 is 1, not a sequence of cells"),
])
def test_a_swapped_or_malformed_table_is_refused_saying_what_is_allowed(args, says):
    with pytest.raises(ValueError, match="table_html") as err:
        table_html(*args)
    assert says in str(err.value)


def test_rows_under_a_header_render_one_cell_per_label_and_a_short_row_ends_empty():
    out = table_html(ROWS + [["total"]], header=HEADER)
    assert out.count("<th>") == 3 and out.count("<td>") == 9
    assert "<td>total</td><td></td><td></td>" in out
    assert table_html(ROWS) == table_html(ROWS, header=None)
    assert table_html([("a", "b")], header=("", "")).count("<td>") == 2


def _calls(path: Path):
    """(cell index, ast.Call) of every table_html call in a notebook's code cells."""
    for i, cell in enumerate(json.loads(path.read_text())["cells"]):
        if cell["cell_type"] != "code":
            continue
        code = "".join(l for l in "".join(cell["source"]).splitlines(True)
                       if not l.lstrip().startswith(("%", "!")))
        for node in ast.walk(ast.parse(code)):
            f = getattr(node, "func", None)
            if isinstance(node, ast.Call) and getattr(f, "id", getattr(f, "attr", "")) == \
                    "table_html":
                yield i, node


def _labels(node) -> bool:
    """A list or tuple literal of strings: a header, wherever it stands."""
    return isinstance(node, (ast.List, ast.Tuple)) and bool(node.elts) and all(
        isinstance(e, ast.JoinedStr) or (isinstance(e, ast.Constant) and isinstance(e.value, str))
        for e in node.elts)


def test_no_notebook_passes_a_header_as_rows():
    books = sorted(p for d in ("notebooks", "exercises", "solutions")
                   for p in (ROOT / d).glob("*.ipynb"))
    found, wrong = 0, []
    for path in books:
        for i, call in _calls(path):
            found += 1
            if call.args and _labels(call.args[0]):
                first = ast.unparse(call.args[0])[:60]
                wrong.append(f"{path.relative_to(ROOT)} cell {i}: table_html({first}, ...)")
    assert found >= 4, f"expected table_html calls in the notebooks, found {found}"
    assert not wrong, ("a header passed as rows; the signature is table_html(rows, header=None):\n"
                       + "\n".join(wrong))
