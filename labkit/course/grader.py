"""Grade a learner's exercise notebook against the trusted solutions notebook.

``grade_notebook(path)`` (and ``labkit grade path``) trusts nothing in the learner's file but the
source of its exercise cells:

1. The template is the solutions notebook of the same name: ``--template PATH``, else
   ``solutions/<name>`` in the repository that holds this labkit package, else in a directory
   above the learner's file (``exercises/../solutions/``); a file renamed by the learner is
   matched by its ``NN_`` prefix when exactly one solutions notebook has it.
2. The learner's exercise cells are the code cells tagged ``exercise`` or carrying
   ``metadata.labkit.exercise``. Each template exercise takes the source of the learner cell with
   the same id; exercises left unmatched take, in order, the learner's exercise cells that have
   no known id. The learner's outputs, check cells, tags of other cells, markers and extra cells
   are never used. An exercise missing from the file gets the stub and fails ("missing").
3. The template with those sources swapped in is executed top to bottom in a fresh kernel of
   this interpreter (nbclient, errors allowed so every check runs, a per-cell timeout after which
   the cell is interrupted), with the learner's notebook directory as working directory.
4. A check passes when its cell ran without error and its exercise cell ran without error.
   Otherwise its message is the exercise's problem ("not attempted yet", the exception it
   raised, a timeout) or the check's own error (a ``labkit.course.grading.GradingError`` explains
   expected vs received).

Not a sandbox: the learner's code runs in the kernel next to the checks and could, with intent,
tamper with them. Grading is there to catch wrong answers, edited outputs and accidentally
deleted or re-tagged cells, not a determined cheater.
"""
from __future__ import annotations

import copy
import json
import os
import re
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from labkit.course import exercises as ex_mod
from labkit.course.exercises import NotebookFormatError

DEFAULT_TIMEOUT = 300  # seconds per cell
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


class GradeInputError(Exception):
    """The notebook or template cannot be graded (missing, not a notebook, no template)."""


@dataclass
class CheckResult:
    name: str
    exercise: str | None
    passed: bool
    message: str = ""


@dataclass
class ExerciseResult:
    id: str
    status: str  # "ran" | "not attempted" | "missing" | "error" | "timeout" | "not run"
    message: str = ""
    traceback: str = ""


@dataclass
class GradeReport:
    notebook: str
    template: str
    checks: list[CheckResult] = field(default_factory=list)
    exercises: list[ExerciseResult] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def passed(self) -> int:
        return sum(c.passed for c in self.checks)

    @property
    def total(self) -> int:
        return len(self.checks)

    @property
    def ok(self) -> bool:
        return self.total > 0 and self.passed == self.total

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(passed=self.passed, total=self.total, ok=self.ok)
        return d

    def format(self) -> str:
        lines = [f"Grading {self.notebook}", f"  against {self.template} (fresh kernel, "
                                                f"{self.seconds:.1f} s)", ""]
        width = max([len(c.name) for c in self.checks] + [5])
        for c in self.checks:
            status = "PASS" if c.passed else "FAIL"
            msg = c.message.split("\n") if c.message else [""]
            lines.append(f"  {c.name:<{width}}  {status}  {msg[0]}".rstrip())
            lines += [f"  {'':<{width}}        {m}" for m in msg[1:]]
        shown = [e for e in self.exercises if e.traceback]
        if shown:
            lines += ["", "Errors in your exercise cells:"]
            for e in shown:
                lines.append(f"  {e.id}: {e.message}")
                lines += [f"      {t}" for t in e.traceback.split("\n")]
        if self.notes:
            lines += ["", "Notes:"] + [f"  - {n}" for n in self.notes]
        lines += ["", f"{self.passed}/{self.total} checks passed"
                      + ("" if self.ok else f"; {self.total - self.passed} failed")]
        return "\n".join(lines)


# ------------------------------------------------------------------------------- locating files

def _solutions_dirs(notebook: Path) -> list[Path]:
    dirs = [ex_mod.REPO_ROOT / "solutions"]
    for parent in notebook.resolve().parents:
        dirs.append(parent / "solutions")
    seen, out = set(), []
    for d in dirs:
        if d not in seen and d.is_dir():
            seen.add(d)
            out.append(d)
    return out


def find_template(notebook: Path | str) -> Path:
    """The solutions notebook for `notebook` (see the module docstring for the search order)."""
    notebook = Path(notebook)
    dirs = _solutions_dirs(notebook)
    for d in dirs:
        if (d / notebook.name).is_file():
            return d / notebook.name
    prefix = re.match(r"^(\d+)_", notebook.name)
    if prefix:
        for d in dirs:
            hits = sorted(d.glob(f"{prefix.group(1)}_*.ipynb"))
            if len(hits) == 1:
                return hits[0]
    searched = ", ".join(str(d) for d in dirs) or "no solutions/ directory found"
    available = sorted({p.name for d in dirs for p in d.glob("*.ipynb")})
    raise GradeInputError(
        f"no solutions notebook matches {notebook.name!r} (searched: {searched}); "
        + (f"available: {', '.join(available)}; " if available else "")
        + "name the file like its module (e.g. 01_memory_math.ipynb) or pass --template PATH")


def _read_learner(path: Path) -> list[dict]:
    """The learner's cells as plain JSON dicts (no validation: only exercise sources are used)."""
    if not path.exists():
        raise GradeInputError(f"{path}: no such file")
    if path.is_dir():
        raise GradeInputError(f"{path} is a directory; give an exercise notebook (.ipynb)")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise GradeInputError(f"{path} is not a Jupyter notebook (not JSON: {exc})") from None
    cells = data.get("cells") if isinstance(data, dict) else None
    if not isinstance(cells, list):
        raise GradeInputError(f"{path} is not a Jupyter notebook (no list of cells; "
                              "nbformat 4 is required)")
    return [c for c in cells if isinstance(c, dict)]


def _read_template(path: Path):
    if not path.is_file():
        raise GradeInputError(f"template {path}: no such file")
    try:
        nb = ex_mod.read_notebook(path)
        ex_mod.render(nb, path.name)  # all authoring rules: markers, ids, a check per exercise
        return nb, ex_mod.layout(nb, where=str(path))
    except NotebookFormatError as exc:
        raise GradeInputError(f"the template is not a valid solutions notebook: {exc}") from None
    except Exception as exc:  # noqa: BLE001 - nbformat raises several kinds
        raise GradeInputError(f"template {path} is not a Jupyter notebook ({exc})") from None


# ---------------------------------------------------------------------------------------- merge

def learner_sources(cells: list[dict], lay: ex_mod.Layout) -> tuple[dict[str, str], list[str]]:
    """Map template exercise ids to the learner's cell sources; notes on what was ignored."""
    known = [e.id for e in lay.exercises]
    found: dict[str, str] = {}
    unnamed: list[tuple[int, str]] = []
    notes: list[str] = []
    count = 0
    for cell in cells:
        if cell.get("cell_type") != "code":
            continue
        id_ = ex_mod.labkit_meta(cell).get("exercise")
        if ex_mod.EXERCISE_TAG not in ex_mod.cell_tags(cell) and not isinstance(id_, str):
            continue
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


def build_graded_notebook(template_nb, lay: ex_mod.Layout, sources: dict[str, str]):
    """The template with each exercise cell's source replaced by the learner's (or the stub)."""
    nb = copy.deepcopy(template_nb)
    for e in lay.exercises:
        cell = nb.cells[e.index]
        if e.id in sources:
            cell.source = sources[e.id]
        else:
            cell.source = ex_mod.stub_source(ex_mod.source_text(cell), e.id)
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs = []
            cell.execution_count = None
    return nb


# ------------------------------------------------------------------------------------ execution

@dataclass
class _CellRun:
    ran: bool = False
    error: dict | None = None  # {"ename", "evalue", "traceback"}
    timed_out: bool = False
    died: bool = False


def _kernel_env() -> dict:
    env = dict(os.environ)
    # The kernel imports the same labkit as the grader, whatever its working directory.
    root = str(Path(ex_mod.__file__).resolve().parents[2])   # the folder that holds labkit/
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    if env.get("MPLBACKEND", "").lower() == "agg":  # DESIGN: never Agg in kernels (no figures)
        del env["MPLBACKEND"]
    return env


def execute(nb, *, timeout: float, cwd: Path) -> list[_CellRun]:
    """Run every code cell of `nb` in a fresh kernel of this interpreter; outputs land in `nb`."""
    from nbclient import NotebookClient
    from nbclient.exceptions import DeadKernelError
    from traitlets.config import Config

    runs = [_CellRun() for _ in nb.cells]
    with tempfile.TemporaryDirectory(prefix="labkit-grade-") as tmp:
        config = Config()
        if os.name == "posix":  # unix sockets: no "running over TCP without encryption" warning
            config.KernelManager.transport = "ipc"
            config.KernelManager.ip = os.path.join(tmp, "kernel")
        client = NotebookClient(
            nb, config=config, kernel_name="python3", timeout=int(timeout), allow_errors=True,
            interrupt_on_timeout=True, record_timing=False,
            resources={"metadata": {"path": str(cwd)}})
        try:
            client.create_kernel_manager()
            client.start_new_kernel(env=_kernel_env())
            client.start_new_kernel_client()
        except Exception as exc:  # noqa: BLE001 - no ipykernel, a broken environment, ...
            raise GradeInputError(f"could not start a Python kernel for {sys.executable} ({exc}); "
                                  "run `labkit doctor`") from exc
        with client.setup_kernel():
            for i, cell in enumerate(nb.cells):
                if cell.cell_type != "code":
                    continue
                start = time.monotonic()
                try:
                    client.execute_cell(cell, i)
                except DeadKernelError:
                    runs[i].died = True
                    break
                runs[i].ran = True
                for out in cell.get("outputs", []):
                    if out.get("output_type") == "error":
                        runs[i].error = {"ename": out.get("ename", ""),
                                         "evalue": out.get("evalue", ""),
                                         "traceback": _clean_traceback(out.get("traceback", []))}
                if (runs[i].error and runs[i].error["ename"] == "KeyboardInterrupt"
                        and time.monotonic() - start >= timeout * 0.99):
                    runs[i].timed_out = True
    return runs


def _clean_traceback(lines: list[str], keep: int = 25) -> str:
    text = _ANSI.sub("", "\n".join(lines))
    rows = [r for r in text.split("\n") if r.strip() and not set(r.strip()) <= {"-"}]
    return "\n".join(rows[-keep:])


# -------------------------------------------------------------------------------------- grading

def _exercise_result(e, run: _CellRun, missing: bool, timeout: float) -> ExerciseResult:
    if missing:
        return ExerciseResult(e.id, "missing", f"exercise {e.id} is missing from your file (no "
                              f"cell tagged 'exercise' for it); graded as failed")
    if run.died:
        return ExerciseResult(e.id, "error", f"the kernel died while running exercise {e.id} "
                              "(a crash, os._exit or running out of memory in your code?)")
    if not run.ran:
        return ExerciseResult(e.id, "not run", f"exercise {e.id} did not run: the kernel died "
                              "earlier")
    if run.timed_out:
        return ExerciseResult(e.id, "timeout", f"exercise {e.id} ran longer than {timeout:g} s "
                              "and was interrupted (an endless loop, or a lab that hangs?)")
    if run.error:
        ename, evalue = run.error["ename"], run.error["evalue"]
        if ename == "NotImplementedError":
            return ExerciseResult(e.id, "not attempted", f"exercise {e.id} not attempted yet: its "
                                  f"cell still raises NotImplementedError({evalue})")
        return ExerciseResult(e.id, "error", f"exercise {e.id} raised {ename}: {evalue}",
                              traceback=run.error["traceback"])
    return ExerciseResult(e.id, "ran")


def _check_result(c, run: _CellRun, exercise: ExerciseResult | None, timeout: float) -> CheckResult:
    if exercise is not None and exercise.status != "ran":
        why = exercise.message
        if exercise.status == "not attempted":
            why += "; replace the `raise NotImplementedError(...)` line with your code"
        return CheckResult(c.name, c.exercise, False, why)
    if run.died:
        return CheckResult(c.name, c.exercise, False, "the kernel died while running this check")
    if not run.ran:
        return CheckResult(c.name, c.exercise, False, "not run: the kernel died earlier")
    if run.timed_out:
        return CheckResult(c.name, c.exercise, False, f"the check ran longer than {timeout:g} s "
                           "and was interrupted")
    if run.error:
        ename, evalue = run.error["ename"], run.error["evalue"]
        if ename == "GradingError":
            return CheckResult(c.name, c.exercise, False, evalue)
        if ename == "NotImplementedError":
            return CheckResult(c.name, c.exercise, False, f"exercise {c.exercise} not attempted "
                               f"yet: it still raises NotImplementedError({evalue})")
        msg = f"the check raised {ename}: {evalue}"
        if ename == "NameError":
            msg += f" (does your exercise {c.exercise} define the name the check uses?)"
        elif ename == "AssertionError" and not evalue:
            msg = "the check's assertion failed:\n" + run.error["traceback"]
        return CheckResult(c.name, c.exercise, False, msg)
    return CheckResult(c.name, c.exercise, True)


def grade_notebook(path: Path | str, template: Path | str | None = None, *,
                   timeout: float = DEFAULT_TIMEOUT, cwd: Path | str | None = None) -> GradeReport:
    """Grade the learner notebook at `path`; raises GradeInputError for input it cannot grade."""
    path = Path(path)
    cells = _read_learner(path)
    template_path = Path(template) if template is not None else find_template(path)
    template_nb, lay = _read_template(template_path)
    if not lay.checks:
        raise GradeInputError(f"the template {template_path} has no check cells")
    sources, notes = learner_sources(cells, lay)
    graded = build_graded_notebook(template_nb, lay, sources)
    start = time.monotonic()
    runs = execute(graded, timeout=timeout, cwd=Path(cwd) if cwd else path.resolve().parent)
    report = GradeReport(notebook=str(path), template=str(template_path), notes=notes)
    results = {e.id: _exercise_result(e, runs[e.index], e.id not in sources, timeout)
               for e in lay.exercises}
    report.exercises = list(results.values())
    special = {e.index for e in lay.exercises} | {c.index for c in lay.checks}
    for i, run in enumerate(runs):
        if i not in special and run.error:
            notes.append(f"cell {i} of the template (not an exercise) raised "
                         f"{run.error['ename']}: {run.error['evalue']}; an earlier exercise may "
                         "have left a wrong value behind")
    report.checks = [_check_result(c, runs[c.index], results.get(c.exercise), timeout)
                     for c in lay.checks]
    report.seconds = time.monotonic() - start
    return report
