"""Exercises from solutions: ``solutions/NN_*.ipynb`` is the single source of ``exercises/NN_*.ipynb``.

    python -m labkit.course.exercises            # generate(solutions_dir, exercises_dir)
    python -m labkit.course.exercises --check    # check_sync: missing, stale, orphaned, leaked

An exercise cell (tag ``exercise``) holds its answer between ``### BEGIN SOLUTION`` and
``### END SOLUTION``; a check cell (tag ``check``) calls labkit.course.grading. The authoring
rules: `layout`; what a generated file holds: `render`; why a learner's answers never make a
file "out of sync": `check_sync` (labkit.course.committed). docs/runtime.md has them together.
"""
from __future__ import annotations

import argparse
import copy
import re
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import nbformat

from labkit.course import committed
from labkit.course.forbid import valid_name

BEGIN = "### BEGIN SOLUTION"
END = "### END SOLUTION"
EXERCISE_TAG = "exercise"
CHECK_TAG = "check"
HEADER_ID = "labkit-header"
_ID_RE = re.compile(r"^[A-Za-z0-9_.-]{1,40}$")
_KEEP_CELL_METADATA = ("tags", "labkit", "jupyter", "editable", "deletable", "slideshow")

REPO_ROOT = Path(__file__).resolve().parents[2]

# The notebook metadata of every committed notebook (notebooks/, solutions/, exercises/), in the
# form JupyterLab leaves untouched: once its kernel starts, JupyterLab writes the kernel's
# language_info (and kernelspec) into the notebook and, if that changed anything, marks the tab
# modified (and autosaves it). A bare {"name": "python"} did. This is what ipykernel reports for
# the course's Python (3.11.7); under another Python JupyterLab still rewrites "version".
KERNELSPEC = {"display_name": "Python 3 (ipykernel)", "language": "python", "name": "python3"}
LANGUAGE_INFO = {
    "codemirror_mode": {"name": "ipython", "version": 3},
    "file_extension": ".py",
    "mimetype": "text/x-python",
    "name": "python",
    "nbconvert_exporter": "python",
    "pygments_lexer": "ipython3",
    "version": "3.11.7",
}
NOTEBOOK_METADATA = {"kernelspec": KERNELSPEC, "language_info": LANGUAGE_INFO}


class NotebookFormatError(ValueError):
    """A solutions notebook breaks the authoring rules (the message says which cell and why)."""


@dataclass(frozen=True)
class Exercise:
    id: str
    index: int  # cell index in the solutions notebook
    forbid: tuple[str, ...] = ()  # metadata.labkit.forbid: what the answer may not call


@dataclass(frozen=True)
class Check:
    name: str
    exercise: str | None
    index: int


@dataclass
class Layout:
    exercises: list[Exercise] = field(default_factory=list)
    checks: list[Check] = field(default_factory=list)

    def exercise(self, id_: str) -> Exercise:
        return next(e for e in self.exercises if e.id == id_)


def source_text(cell) -> str:
    src = cell.get("source", "") if isinstance(cell, dict) else cell.source
    return "".join(src) if isinstance(src, list) else str(src or "")


def cell_tags(cell) -> list[str]:
    tags = (cell.get("metadata") or {}).get("tags") or []
    return [t for t in tags if isinstance(t, str)] if isinstance(tags, list) else []


def labkit_meta(cell) -> dict:
    meta = (cell.get("metadata") or {}).get("labkit") or {}
    return meta if isinstance(meta, dict) else {}


def layout(nb, where: str = "notebook") -> Layout:
    """Exercise and check cells of a trusted (solutions) notebook, validated.

    The authoring rules (what this module and the grader read):

    - An **exercise cell** is a code cell tagged ``exercise``. Its answer sits between a line
      ``### BEGIN SOLUTION`` and a line ``### END SOLUTION`` (alone on their lines, any
      indentation; several regions per cell are allowed). Its id is
      ``metadata.labkit.exercise`` when set (letters, digits, ``_ . -``), else ``ex1``, ``ex2``,
      ... by order among the exercise cells. Its ``metadata.labkit.forbid`` lists, by dotted
      name, what the answer may not call (the labkit function it asks the learner to write,
      ...): the grader refuses an answer that does (labkit.course.forbid).
    - A **check cell** is a code cell tagged ``check``; it calls ``labkit.course.grading`` and
      belongs to ``metadata.labkit.checks`` when set, else to the nearest exercise cell above
      it. Its name is ``metadata.labkit.check`` when set, else the exercise id (``ex3.1``,
      ``ex3.2``, ... when an exercise has several unnamed checks). Every exercise needs at
      least one check.
    - Every other cell (prose, setup code, run cells) is copied as is. A marker anywhere else,
      a malformed marker (``## BEGIN SOLUTION``), nested or unclosed regions are errors: they
      would leak an answer.
    """
    out = Layout()
    pending: list[tuple[int, str | None, str | None]] = []  # (index, exercise, explicit name)
    current: str | None = None
    for i, cell in enumerate(nb.cells):
        tags = cell_tags(cell)
        meta = labkit_meta(cell)
        here = f"{where}, cell {i}"
        if EXERCISE_TAG in tags and CHECK_TAG in tags:
            raise NotebookFormatError(f"{here}: tagged both {EXERCISE_TAG!r} and {CHECK_TAG!r}")
        if EXERCISE_TAG in tags:
            if cell.cell_type != "code":
                raise NotebookFormatError(f"{here}: only code cells can be tagged {EXERCISE_TAG!r}")
            id_ = meta.get("exercise") or f"ex{len(out.exercises) + 1}"
            if not isinstance(id_, str) or not _ID_RE.match(id_):
                raise NotebookFormatError(f"{here}: exercise id {id_!r} must be 1-40 letters, "
                                          "digits, '_', '.' or '-'")
            if any(e.id == id_ for e in out.exercises):
                raise NotebookFormatError(f"{here}: exercise id {id_!r} is used twice")
            forbid = meta.get("forbid", [])
            if not isinstance(forbid, list) or not all(valid_name(f) for f in forbid):
                raise NotebookFormatError(f"{here}: metadata labkit.forbid={forbid!r} must be a "
                                          "list of dotted names, e.g. ['labkit.memory.bytes_per_param']")
            out.exercises.append(Exercise(id_, i, tuple(forbid)))
            current = id_
        elif CHECK_TAG in tags:
            if cell.cell_type != "code":
                raise NotebookFormatError(f"{here}: only code cells can be tagged {CHECK_TAG!r}")
            pending.append((i, meta.get("checks") or current, meta.get("check")))
    known = {e.id for e in out.exercises}
    for index, ex, _ in pending:
        if ex is not None and ex not in known:
            raise NotebookFormatError(f"{where}, cell {index}: check belongs to unknown exercise "
                                      f"{ex!r}; exercises: {', '.join(sorted(known)) or 'none'}")
    for e in out.exercises:
        if not any(ex == e.id for _, ex, _ in pending):
            raise NotebookFormatError(f"{where}: exercise {e.id} (cell {e.index}) has no check "
                                      f"cell; add a code cell tagged {CHECK_TAG!r} after it")
    names: set[str] = set()
    for index, ex, explicit in pending:
        siblings = [i for i, x, named in pending if x == ex and not named]
        if explicit:
            name = str(explicit)
        elif ex is None:
            name = f"check{pending.index((index, ex, explicit)) + 1}"
        else:
            name = ex if len(siblings) == 1 else f"{ex}.{siblings.index(index) + 1}"
        if name in names:
            raise NotebookFormatError(f"{where}, cell {index}: check name {name!r} is used twice")
        names.add(name)
        out.checks.append(Check(name, ex, index))
    return out


def stub_source(source: str, exercise_id: str, where: str = "cell") -> str:
    """`source` with every BEGIN/END SOLUTION region replaced by a NotImplementedError stub."""
    out: list[str] = []
    inside = False
    regions = 0
    indent = ""
    count = 0
    for lineno, line in enumerate(source.split("\n"), 1):
        stripped = line.strip()
        if stripped == BEGIN:
            if inside:
                raise NotebookFormatError(f"{where}, line {lineno}: nested {BEGIN!r}")
            inside, indent, count = True, line[: len(line) - len(line.lstrip())], 0
            continue
        if stripped == END:
            if not inside:
                raise NotebookFormatError(f"{where}, line {lineno}: {END!r} without {BEGIN!r}")
            inside = False
            regions += 1
            out.append(f'{indent}raise NotImplementedError("Exercise {exercise_id}: write '
                       f'~{count} line{"" if count == 1 else "s"}")')
            continue
        if "BEGIN SOLUTION" in line or "END SOLUTION" in line:
            raise NotebookFormatError(f"{where}, line {lineno}: malformed marker {stripped!r}; "
                                      f"write exactly {BEGIN!r} / {END!r} alone on the line")
        if inside:
            if stripped and not stripped.startswith("#"):
                count += 1
            continue
        out.append(line)
    if inside:
        raise NotebookFormatError(f"{where}: {BEGIN!r} is never closed by {END!r}")
    if not regions:
        raise NotebookFormatError(f"{where}: exercise cell has no {BEGIN!r} ... {END!r} region")
    return "\n".join(out)


def header_markdown(name: str) -> str:
    return (
        f"> **Exercises: `{name}`** (generated from `solutions/{name}`; "
        "the answers were taken out).\n>\n"
        "> Write your answers in the cells tagged `exercise`: replace each "
        "`raise NotImplementedError(...)` with your code, then run the `check` cell below it.\n"
        "> Keep everything an answer needs inside its exercise cell: the grader takes only the code "
        "of your exercise cells, puts it into the original notebook and runs that in a fresh "
        "kernel (your outputs and other cells are not used). Write it yourself: an answer that "
        "calls the labkit function it asks for, or reads `solutions/`, is refused.\n>\n"
        "> Grade this notebook from a terminal in the course directory:\n>\n"
        f"> ```\n> labkit grade exercises/{name}\n> ```\n>\n"
        f"> (or `make grade NB=exercises/{name}` from any shell, if `labkit` is not found).\n"
    )


def _clean_metadata(meta: dict) -> dict:
    return {k: copy.deepcopy(meta[k]) for k in _KEEP_CELL_METADATA if k in meta}


def render(solution_nb, name: str) -> nbformat.NotebookNode:
    """The exercise notebook for `solution_nb` (file name `name`), built in memory.

    It holds: a header cell saying how to grade; each region replaced by ``raise
    NotImplementedError("Exercise ex1: write ~N lines")`` at the marker's indentation (N counts
    the region's code lines); outputs and execution counts cleared; cell metadata reduced to
    ``tags``, ``labkit`` and Jupyter's display keys, with the exercise id written into each
    exercise cell and check cells marked not editable/deletable; the notebook's metadata
    NOTEBOOK_METADATA (what JupyterLab leaves untouched). With positional cell ids
    (``cell-000``, ...) and JSON with sorted keys (`dumps`), the same solutions always give the
    same bytes."""
    lay = layout(solution_nb, where=name)
    ex_by_index = {e.index: e for e in lay.exercises}
    check_indices = {c.index for c in lay.checks}
    v4 = nbformat.v4
    cells = [v4.new_markdown_cell(header_markdown(name), id=HEADER_ID)]
    for i, cell in enumerate(solution_nb.cells):
        src = source_text(cell)
        meta = _clean_metadata(cell.get("metadata") or {})
        where = f"{name}, cell {i}"
        if i in ex_by_index:
            ex = ex_by_index[i]
            src = stub_source(src, ex.id, where)
            meta.setdefault("labkit", {})
            meta["labkit"] = {**meta["labkit"], "exercise": ex.id}
        elif BEGIN in src or END in src or "BEGIN SOLUTION" in src or "END SOLUTION" in src:
            raise NotebookFormatError(f"{where}: solution markers outside a cell tagged "
                                      f"{EXERCISE_TAG!r} (they would leak the answer)")
        if i in check_indices:
            meta["editable"] = False
            meta["deletable"] = False
        cid = f"cell-{i:03d}"
        if cell.cell_type == "code":
            new = v4.new_code_cell(src, metadata=meta, id=cid)
        elif cell.cell_type == "markdown":
            new = v4.new_markdown_cell(src, metadata=meta, id=cid)
            if cell.get("attachments"):
                new["attachments"] = copy.deepcopy(cell["attachments"])
        else:
            new = v4.new_raw_cell(src, metadata=meta, id=cid)
        cells.append(new)
    nb = v4.new_notebook(cells=cells, metadata=copy.deepcopy(NOTEBOOK_METADATA))
    nbformat.validate(nb)
    return nb


def dumps(nb) -> str:
    """Deterministic notebook text: sorted keys, one-space indent, trailing newline."""
    text = nbformat.writes(nb, version=4)
    return text if text.endswith("\n") else text + "\n"


def parse_notebook(text: str) -> nbformat.NotebookNode:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # e.g. MissingIDFieldWarning on nbformat 4.4 files
        return nbformat.reads(text, as_version=4)


def read_notebook(path: Path | str) -> nbformat.NotebookNode:
    return parse_notebook(Path(path).read_text(encoding="utf-8"))


def render_path(solution_path: Path | str) -> str:
    path = Path(solution_path)
    return dumps(render(read_notebook(path), path.name))


def solution_files(solutions_dir: Path | str) -> list[Path]:
    return sorted(p for p in Path(solutions_dir).glob("*.ipynb") if not p.name.startswith("."))


@dataclass(frozen=True)
class Written:
    path: Path
    backup: Path | None = None   # the copy kept of the file it replaced, when that had edits


def generate(solutions_dir: Path | str, exercises_dir: Path | str) -> list[Written]:
    """Write exercises_dir/NN_name.ipynb for every solutions_dir/NN_name.ipynb; return what it
    wrote (unchanged files are not rewritten). A file that differs from both what it would write
    and what git has committed of it holds edits (a learner's answers): a copy is kept in
    exercises_dir/.backup/ before it is replaced (labkit.course.committed)."""
    out_dir = Path(exercises_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for sol in solution_files(solutions_dir):
        text = render_path(sol)
        target = out_dir / sol.name
        backup = None
        if target.exists():
            current = target.read_text(encoding="utf-8")
            if current == text:
                continue
            if current not in committed.committed_versions(target, sol):
                backup = committed.keep_copy(target)
        target.write_text(text, encoding="utf-8")
        written.append(Written(target, backup))
    return written


def leaked_lines(solution_nb, exercise_nb) -> list[str]:
    """Solution lines (inside BEGIN/END regions) found in the exercise notebook's code or text,
    except lines that also appear outside every region in the solutions notebook."""
    inside_lines: set[str] = set()
    outside_lines: set[str] = set()
    for cell in solution_nb.cells:
        inside = False
        for line in source_text(cell).split("\n"):
            s = line.strip()
            if s == BEGIN:
                inside = True
            elif s == END:
                inside = False
            elif s and not s.startswith("#"):
                (inside_lines if inside else outside_lines).add(s)
    secret = inside_lines - outside_lines
    found = []
    for cell in exercise_nb.cells:
        for line in source_text(cell).split("\n"):
            if line.strip() in secret:
                found.append(line.strip())
    return found


def check_sync(solutions_dir: Path | str, exercises_dir: Path | str) -> list[str]:
    """Problems keeping exercises_dir from being what generate() would write.

    An exercise file is in sync when what generate() would write equals its working copy (just
    regenerated), its copy committed at HEAD, or its copy in the last commit that changed its
    solution: a learner's answers, in the working tree or committed, are never a problem. Only
    files committed with the solutions can be orphans (a learner's own notebooks are theirs)."""
    problems = []
    sols = solution_files(solutions_dir)
    names = {p.name for p in sols}
    fix = "run `python -m labkit.course.exercises` (it keeps a copy of an edited file)"
    for sol in sols:
        target = Path(exercises_dir) / sol.name
        try:
            text = render_path(sol)
        except NotebookFormatError as exc:
            problems.append(f"{sol}: {exc}")
            continue
        versions = committed.committed_versions(target, sol)
        if target.exists():
            versions.append(target.read_text(encoding="utf-8"))
        if not versions:
            problems.append(f"{target} is missing; {fix}")
            continue
        if text not in versions:
            problems.append(f"{target} is out of date with {sol}; {fix}")
        leaks = leaked_lines(read_notebook(sol), nbformat.reads(
            text if text in versions else versions[0], as_version=4))
        if leaks:
            problems.append(f"{target} contains solution lines: {leaks[:3]}")
    tracked = (committed.tracked_names(exercises_dir, solutions_dir)
               if Path(exercises_dir).is_dir() else set())
    for ex in sorted(Path(exercises_dir).glob("*.ipynb")) if Path(exercises_dir).is_dir() else []:
        if ex.name not in names and (tracked is None or ex.name in tracked):
            problems.append(f"{ex} has no solutions notebook {Path(solutions_dir) / ex.name}")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m labkit.course.exercises",
        description="Write exercises/NN_*.ipynb from solutions/NN_*.ipynb (answers stubbed out).")
    parser.add_argument("--solutions", type=Path, default=REPO_ROOT / "solutions")
    parser.add_argument("--exercises", type=Path, default=REPO_ROOT / "exercises")
    parser.add_argument("--check", action="store_true",
                        help="write nothing; exit 1 if exercises/ is not in sync with solutions/")
    args = parser.parse_args(argv)
    try:
        if args.check:
            problems = check_sync(args.solutions, args.exercises)
            for p in problems:
                print(p, file=sys.stderr)
            if not problems:
                print(f"{args.exercises} is in sync with {args.solutions}")
            return 1 if problems else 0
        for w in generate(args.solutions, args.exercises):
            if w.backup:
                print(f"{w.path} had edits of yours (answers?): kept them in {w.backup}, "
                      f"then wrote {w.path} afresh")
            else:
                print(f"wrote {w.path}")
        return 0
    except NotebookFormatError as exc:
        print(f"labkit.course.exercises: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
