"""The learner's-eye tier: a lesson notebook run top to bottom in a fresh kernel, as Run All does,
with a CPU burner beside it, and its outputs read as a learner reads them. It fails on a cell
that raises; a cell that draws a labkit figure and shows none, or shows `<Figure size ...>` text;
warning text in stderr that the lesson's markdown does not discuss; a cell silent for more than
SILENCE_S seconds. Each lesson has its own test file (tests/lessons/test_NN_*.py), so the two
test workers share the lessons out; this is `make test`'s one execution of each lesson.
"""
from __future__ import annotations

import ast
import multiprocessing
import os
import re
import time
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parents[2]
SILENCE_S = 20.0          # a learner cannot tell a running lab from a hang after this
CELL_TIMEOUT_S = 900      # a cell past this is stuck, whatever the load
# CPU burners beside the run (the course must survive a busy laptop); LABKIT_TIER_BURNERS=0
# turns them off, e.g. to time the lessons alone.
BURNERS = int(os.environ.get("LABKIT_TIER_BURNERS", "1"))

WARNING = re.compile(r"\b(\w*Warning): (.+)")


def _burn(seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        sum(i * i for i in range(10_000))


def drawing_functions() -> set[str]:
    """Qualified names (labkit.plots.MODULE.NAME) of labkit.plots' functions that make a figure:
    those that call new_figure or Figure(...), directly or through another function of
    labkit.plots (read from the source, so a new figure function needs no list kept here)."""
    root = ROOT / "labkit" / "plots"
    calls: dict[str, set[str]] = {}
    for path in root.glob("*.py"):
        module = "labkit.plots" + ("" if path.stem == "__init__" else f".{path.stem}")
        tree = ast.parse(path.read_text())
        imported = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("labkit.plots"):
                for a in node.names:
                    imported[a.asname or a.name] = f"{node.module}.{a.name}"
        for fn in tree.body:
            if not isinstance(fn, ast.FunctionDef):
                continue
            found = set()
            for node in ast.walk(fn):
                if isinstance(node, ast.Call):
                    f = node.func
                    name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
                    if name in ("new_figure", "Figure", "subplots"):
                        found.add("<figure>")
                    elif isinstance(f, ast.Name):
                        found.add(imported.get(name, f"{module}.{name}"))
            calls[f"{module}.{fn.name}"] = found
    drawing = {q for q, c in calls.items() if "<figure>" in c}
    while True:
        more = {q for q, c in calls.items() if q not in drawing and c & drawing}
        if not more:
            return drawing
        drawing |= more


DRAWING = None


def figure_calls(source: str, plot_names: dict, plot_modules: dict) -> list[str]:
    """The calls in a cell that draw a labkit figure: functions of labkit.plots that make one
    (drawing_functions), called by an imported name or through an alias of their module, and
    `.figure()` methods (a diagnosis case's). plot_names and plot_modules carry the notebook's
    imports from cell to cell."""
    global DRAWING
    if DRAWING is None:
        DRAWING = drawing_functions()
    try:
        tree = ast.parse(source)
    except SyntaxError:           # IPython syntax (magics): nothing to read
        return []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("labkit.plots"):
            for a in node.names:
                full = f"{node.module}.{a.name}"
                if (ROOT / Path(*full.split("."))).with_suffix(".py").exists():
                    plot_modules[a.asname or a.name] = full
                else:
                    plot_names[a.asname or a.name] = full
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("labkit.plots") and a.asname:
                    plot_modules[a.asname] = a.name
    calls = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        if isinstance(f, ast.Name) and plot_names.get(f.id) in DRAWING:
            calls.append(f.id)
        elif isinstance(f, ast.Attribute):
            if isinstance(f.value, ast.Name) and f"{plot_modules.get(f.value.id)}.{f.attr}" in DRAWING:
                calls.append(f"{f.value.id}.{f.attr}")
            elif f.attr == "figure" and not node.args:
                calls.append(".figure()")
    return calls


def _client_class():
    from nbclient import NotebookClient

    class Timed(NotebookClient):
        """Records when each output message of a cell arrived (display updates included)."""

        def process_message(self, msg, cell, cell_index):
            if msg["msg_type"] in ("stream", "display_data", "update_display_data",
                                   "execute_result", "error", "clear_output"):
                self.arrivals.setdefault(cell_index, []).append(time.monotonic())
            return super().process_message(msg, cell, cell_index)

        async def async_execute_cell(self, cell, cell_index, execution_count=None,
                                     store_history=True):
            self.started[cell_index] = time.monotonic()
            try:
                return await super().async_execute_cell(cell, cell_index, execution_count,
                                                        store_history)
            finally:
                self.ended[cell_index] = time.monotonic()

    return Timed


def run_lesson(name, silence_s: float = SILENCE_S, burners: int = BURNERS) -> list[str]:
    """Run notebooks/<name> (or the notebook at a Path) as Run All would, with `burners` CPU
    burners beside it; return what a learner would see go wrong, one line each (empty when the
    lesson is fine)."""
    from nbclient.exceptions import CellExecutionError

    path = name if isinstance(name, Path) else ROOT / "notebooks" / name
    nb = nbformat.read(path, as_version=4)
    client = _client_class()(nb, timeout=CELL_TIMEOUT_S, kernel_name="python3",
                             resources={"metadata": {"path": str(path.parent)}},
                             allow_errors=False)
    client.arrivals, client.started, client.ended = {}, {}, {}
    burners = [multiprocessing.Process(target=_burn, args=(3600,), daemon=True)
               for _ in range(burners)]
    for b in burners:
        b.start()
    problems = []
    try:
        client.execute()
    except CellExecutionError as exc:
        problems.append(f"a cell raised: {str(exc)[-1500:]}")
    finally:
        for b in burners:
            b.kill()
    markdown = " ".join(" ".join(c.source.split()) for c in nb.cells if c.cell_type == "markdown")
    plot_names, plot_modules = {}, {}
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        where = f"cell {i} ({cell.source.strip().splitlines()[0][:60] if cell.source.strip() else 'empty'})"
        texts, images = [], 0
        for out in cell.get("outputs", []):
            data = out.get("data", {})
            images += "image/png" in data
            texts.append(out.get("text", "") + data.get("text/plain", "") + data.get("text/html", ""))
            if out.get("output_type") == "stream" and out.get("name") == "stderr":
                for m in WARNING.finditer(out.get("text", "")):
                    key = " ".join(m.group(2).split()[:5])
                    if key.lower() not in markdown.lower():
                        problems.append(f"{where}: shows a {m.group(1)} the lesson does not "
                                        f"discuss: {m.group(0)[:200]!r}")
        if any("<Figure size" in t for t in texts):
            problems.append(f"{where}: shows '<Figure size ...>' text instead of the figure")
        drawn = figure_calls(cell.source, plot_names, plot_modules)
        if drawn and not images and i in client.ended:
            problems.append(f"{where}: draws {', '.join(sorted(set(drawn)))} but shows no image")
        if i in client.started and i in client.ended:
            marks = [client.started[i], *client.arrivals.get(i, []), client.ended[i]]
            gap = max(b - a for a, b in zip(marks, marks[1:]))
            if gap > silence_s:
                problems.append(f"{where}: silent for {gap:.0f} s (limit {silence_s:.0f} s): "
                                "show progress while it runs")
    return problems
