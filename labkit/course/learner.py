"""The learner's notebook as the grader reads it: the sources of its exercise cells, and nothing
else (labkit.course.grader).

The file is checked only as far as those sources need: JSON with a list of cells, each cell an
object whose ``cell_type`` is text, ``metadata`` an object and ``source`` text (a string or a
list of strings). A file that breaks this is refused with the cell and what is wrong
(``GradeInputError``; `labkit grade` exits 2), never a traceback.
"""
from __future__ import annotations

import json
from pathlib import Path

from labkit.course import exercises as ex_mod


class GradeInputError(Exception):
    """The notebook or template cannot be graded (missing, not a notebook, no template)."""


def _kind(value) -> str:
    return {dict: "an object", list: "a list", str: "text", type(None): "null", bool: "a boolean",
            int: "a number", float: "a number"}.get(type(value), type(value).__name__)


def _cell_problem(cell) -> str | None:
    """What is wrong with one cell of the learner's file, or None."""
    if not isinstance(cell, dict):
        return f"is {_kind(cell)}, not a cell (an object with cell_type, metadata and source)"
    if not isinstance(cell.get("cell_type"), str):
        return f"has cell_type {_kind(cell.get('cell_type'))}; it must be text ('code', 'markdown')"
    if not isinstance(cell.get("metadata", {}), dict):
        return f"has metadata {_kind(cell['metadata'])}; it must be an object ({{}} at least)"
    source = cell.get("source", "")
    if isinstance(source, list):
        bad = [s for s in source if not isinstance(s, str)]
        if bad:
            return (f"has a source list holding {_kind(bad[0])} ({str(bad[0])[:40]}); the "
                    "source must be text or a list of lines of text")
    elif not isinstance(source, str):
        return f"has source {_kind(source)}; it must be text or a list of lines of text"
    size = len(source) if isinstance(source, str) else sum(map(len, source))
    if size > MAX_SOURCE_CHARS and cell["cell_type"] == "code":
        return (f"holds {size / 2**20:.0f} MiB of code, more than an answer needs (at most "
                f"{MAX_SOURCE_CHARS // 2**20} MiB a cell)")
    return None


MAX_NOTEBOOK_BYTES = 64 * 2**20   # an exercise file with its figures is a few MB
MAX_SOURCE_CHARS = 2**20          # one exercise cell's code: 1 MiB is ~20,000 lines


def _read_bounded(path: Path) -> str:
    """The text of a regular file of at most MAX_NOTEBOOK_BYTES (a FIFO, a device or /dev/zero
    would block or never end: refused before it is opened)."""
    if not path.exists():
        raise GradeInputError(f"{path}: no such file")
    if path.is_dir():
        raise GradeInputError(f"{path} is a directory; give an exercise notebook (.ipynb)")
    if not path.is_file():
        raise GradeInputError(f"{path} is not a regular file (a pipe, a device or a socket); "
                              "give an exercise notebook (.ipynb)")
    limit = MAX_NOTEBOOK_BYTES
    with open(path, "rb") as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise GradeInputError(f"{path} is larger than {limit // 2**20} MiB, more than an exercise "
                              "notebook holds; clear its outputs (Edit > Clear Outputs of All "
                              "Cells), save it, and grade it again")
    return data.decode("utf-8")


def read_learner(path: Path) -> list[dict]:
    """The learner's cells as plain JSON dicts, checked as the module docstring says."""
    try:
        data = json.loads(_read_bounded(path))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise GradeInputError(f"{path} is not a Jupyter notebook (not JSON: {exc})") from None
    cells = data.get("cells") if isinstance(data, dict) else None
    if not isinstance(cells, list):
        raise GradeInputError(f"{path} is not a Jupyter notebook (no list of cells; "
                              "nbformat 4 is required)")
    problems = [(i, why) for i, why in ((i, _cell_problem(c)) for i, c in enumerate(cells)) if why]
    if problems:
        shown = "; ".join(f"cell {i} {why}" for i, why in problems[:3])
        more = f" (and {len(problems) - 3} more cells)" if len(problems) > 3 else ""
        raise GradeInputError(f"{path} is damaged: {shown}{more}. Open it in JupyterLab and "
                              "save it again, or start over from a fresh copy of the exercise")
    return cells


def is_exercise_cell(cell: dict) -> bool:
    return cell.get("cell_type") == "code" and (
        ex_mod.EXERCISE_TAG in ex_mod.cell_tags(cell)
        or isinstance(ex_mod.labkit_meta(cell).get("exercise"), str))


def learner_sources(cells: list[dict], lay: ex_mod.Layout) -> tuple[dict[str, str], list[str]]:
    """Map template exercise ids to the learner's cell sources; notes on what was ignored."""
    known = [e.id for e in lay.exercises]
    found: dict[str, str] = {}
    unnamed: list[tuple[int, str]] = []
    notes: list[str] = []
    count = 0
    for cell in cells:
        if not is_exercise_cell(cell):
            continue
        id_ = ex_mod.labkit_meta(cell).get("exercise")
        count += 1
        src = ex_mod.source_text(cell)
        if isinstance(id_, str) and id_ in known:
            if id_ in found:
                notes.append(f"exercise {id_} appears more than once in your file; "
                             "the first one was graded")
            else:
                found[id_] = src
        else:
            unnamed.append((count, src))
    for id_ in known:
        if id_ not in found and unnamed:
            _, found[id_] = unnamed.pop(0)
    for n, _ in unnamed:
        notes.append(f"exercise cell #{n} of your file matches no exercise of the template "
                     "and was ignored")
    return found, notes
