"""Grade a learner's exercise notebook against the trusted solutions notebook.

    grade_notebook(path)               # or `labkit grade path`: a GradeReport

Only the source of the learner's exercise cells is used: it is swapped into the solutions
notebook of the same name (`find_template`), refused if it uses what it must write
(labkit.course.forbid), and run top to bottom in a fresh kernel (labkit.course.kernel) with
every other cell sealed (labkit.course.seal). The steps in full: `grade_notebook`.
Not a sandbox: it catches wrong answers, edited outputs and the tricks that work on any
notebook, not a determined cheater (docs/runtime.md says what it does not stop).
"""
from __future__ import annotations

import ast
import copy
import hashlib
import json
import re
import tempfile
import time
from pathlib import Path

from labkit.course import exercises as ex_mod
from labkit.course import forbid, judge as judge_mod, seal
from labkit.course.exercises import NotebookFormatError
from labkit.course.kernel import CELL_OUTPUT_LIMIT, KILL_GRACE, CellRun, KernelStartError, execute
from labkit.course.learner import (GradeInputError, is_exercise_cell, learner_sources,  # noqa: F401
                                   read_learner)
from labkit.course.report import CheckResult, ExerciseResult, GradeReport  # noqa: F401 (API)

# Seconds a cell may run: twice the limit of the labs the exercises start (run_user_collective's
# 45 s), so a hung lab is reported by the lab itself (where each rank waits), not by the grader.
DEFAULT_TIMEOUT = 90
_FORBID = "__import__('labkit.course.forbid', fromlist=['forbid'])"
_SEAL = "__import__('labkit.course.seal', fromlist=['seal'])"


# ------------------------------------------------------------------------------- locating files

# What `labkit workshop handout` writes: HANDOUT.md at the root of a learner handout, and a
# stand-in labkit/course/reference.py whose first line starts with HANDOUT_MARK.
HANDOUT_FILE = "HANDOUT.md"
HANDOUT_MARK = "# labkit workshop handout:"
_PACKAGE = Path(__file__).resolve().parents[1]     # the labkit/ running this grader (its kernel's)


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


def is_handout_labkit(package: Path) -> bool:
    """Whether the labkit/ folder `package` is a learner handout's (its reference answers are a
    stand-in, or missing): it cannot grade."""
    try:
        with open(package / "course" / "reference.py", encoding="utf-8") as f:
            return f.readline().startswith(HANDOUT_MARK)
    except OSError:
        return True


def _handout_root(notebook: Path) -> Path | None:
    """The learner handout this labkit or `notebook` belongs to, if any."""
    if is_handout_labkit(_PACKAGE):
        return _PACKAGE.parent
    for d in (ex_mod.REPO_ROOT, *notebook.resolve().parents):
        if (d / HANDOUT_FILE).is_file():
            return d
    return None


def _reference_dirs(reference: Path) -> list[Path]:
    """[reference/solutions], or GradeInputError saying why `reference` is not a course copy."""
    if not reference.is_dir():
        raise GradeInputError(f"--reference {reference}: no such folder; name the instructor's "
                              "copy of the course (the folder that holds solutions/ and labkit/)")
    if not (reference / "solutions").is_dir():
        what = (f"{reference} is a learner handout ({HANDOUT_FILE}): it holds no solutions"
                if (reference / HANDOUT_FILE).is_file() else
                f"{reference} has no solutions/ folder")
        raise GradeInputError(f"--reference {reference}: {what}; name the instructor's copy of "
                              "the course (the folder that holds solutions/ and labkit/, e.g. "
                              "~/course)")
    return [reference / "solutions"]


def find_template(notebook: Path | str, reference: Path | str | None = None) -> Path:
    """The solutions notebook for `notebook` (used unless ``--template PATH`` names one):
    ``solutions/<name>`` in the repository that holds this labkit package, else in a directory
    above the learner's file (``exercises/../solutions/``); with `reference` (``--reference
    DIR``, the instructor's copy of the course) only in ``DIR/solutions/``. A file renamed by
    the learner is matched by its ``NN_`` prefix when exactly one solutions notebook has it. In
    a learner handout (`labkit workshop handout`), which has no solutions, the error says that
    grading happens on the instructor's copy."""
    notebook = Path(notebook)
    dirs = _reference_dirs(Path(reference)) if reference is not None else \
        _solutions_dirs(notebook)
    for d in dirs:
        if (d / notebook.name).is_file():
            return d / notebook.name
    prefix = re.match(r"^(\d+)_", notebook.name)
    if prefix:
        for d in dirs:
            hits = sorted(d.glob(f"{prefix.group(1)}_*.ipynb"))
            if len(hits) == 1:
                return hits[0]
    available = sorted({p.name for d in dirs for p in d.glob("*.ipynb")})
    handout = _handout_root(notebook) if reference is None else None
    if handout is not None:
        shown = _shown(notebook)
        raise GradeInputError(
            f"{shown} is not graded here: this is a learner handout of the course "
            f"({handout / HANDOUT_FILE}), which holds no solutions. Grading happens on your "
            f"instructor's copy of the course: hand in {shown}; your instructor runs "
            f"`labkit grade --reference COURSE {shown}`. Here, run the notebook's cells: a check "
            "cell shows what your code raises, then says its reference answer is not in the "
            "handout")
    if reference is not None:
        raise GradeInputError(
            f"--reference {reference}: no solutions notebook matches {notebook.name!r} in "
            f"{dirs[0]}; " + (f"available: {', '.join(available)}; name the learner's file "
                              "like its module (e.g. 03_ddp.ipynb)" if available else
                              "it holds no notebook"))
    searched = ", ".join(str(d) for d in dirs) or "no solutions/ directory found"
    raise GradeInputError(
        f"no solutions notebook matches {notebook.name!r} (searched: {searched}); "
        + (f"available: {', '.join(available)}; " if available else "")
        + "name the file like its module (e.g. 01_memory_math.ipynb) or pass --template PATH")


def _python_files(package: Path) -> dict[str, bytes]:
    return {str(p.relative_to(package)): p.read_bytes() for p in sorted(package.rglob("*.py"))
            if "__pycache__" not in p.parts and p.is_file()}


def check_reference_labkit(reference: Path | str) -> None:
    """GradeInputError unless the labkit running this grader (the one its kernel imports, and
    with it the checks' reference answers, labkit.course.reference) may grade against the
    course copy `reference`: not a learner handout's labkit, and, when `reference` holds a
    labkit/ of its own elsewhere, the same code as it."""
    reference = Path(reference)
    how = (f"run `labkit` from the environment of {reference} (e.g. "
           f"{reference / '.venv' / 'bin' / 'labkit'} grade --reference {reference} NOTEBOOK, "
           f"or `cd {reference} && python -m labkit grade --reference . NOTEBOOK`)")
    if is_handout_labkit(_PACKAGE):
        raise GradeInputError(f"the labkit running this command ({_PACKAGE}) is a learner "
                              "handout's: it has no reference answers, so it cannot grade; "
                              + how)
    theirs = reference / "labkit"
    if not theirs.is_dir() or theirs.resolve() == _PACKAGE:
        return
    mine, other = _python_files(_PACKAGE), _python_files(theirs)
    first = ("course/reference.py", "course/grading.py")    # what the checks compare with
    differ = sorted((k for k in mine.keys() | other.keys() if mine.get(k) != other.get(k)),
                    key=lambda k: (first.index(k) if k in first else len(first), k))
    if differ:
        shown = ", ".join(differ[:3]) + (f" (+{len(differ) - 3})" if len(differ) > 3 else "")
        raise GradeInputError(
            f"--reference {reference}: its labkit ({theirs}) is not the labkit running this "
            f"command ({_PACKAGE}), which runs the checks, and {len(differ)} of their files "
            f"differ ({shown}): the reference answers could differ too; " + how)


def _shown(path: Path) -> str:
    """`path` relative to the working directory when it is below it."""
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def _refuse_non_exercise_file(path: Path, cells: list[dict], template: Path | None,
                              reference: Path | None = None) -> None:
    """A lesson (or any file without exercise cells) is refused at once, naming the exercises."""
    if any(is_exercise_cell(c) for c in cells):
        return
    kind = "a lesson, not an exercise file" if path.resolve().parent.name == "notebooks" else \
        "not an exercise file"
    try:
        template = template or find_template(path, reference)
    except GradeInputError:
        folder = ex_mod.REPO_ROOT / "exercises"
        files = ", ".join(_shown(p) for p in sorted(folder.glob("*.ipynb"))) or "none yet"
        raise GradeInputError(f"{path} is {kind}: it has no exercise cells (code cells tagged "
                              f"'exercise'), and its module has no exercises. Exercise files: "
                              f"{files}") from None
    target = _shown(template.resolve().parent.parent / "exercises" / template.name)
    raise GradeInputError(f"{path} is {kind}: it has no exercise cells (code cells tagged "
                          f"'exercise'). The exercises of this module are in {target}: "
                          f"run `labkit grade {target}`")


def _read_template(path: Path):
    """(notebook, layout, sha256 of the bytes): read once, before any learner code runs, so
    nothing done to the file later changes this grade."""
    if not path.is_file():
        raise GradeInputError(f"template {path}: no such file")
    try:
        data = path.read_bytes()
        nb = ex_mod.parse_notebook(data.decode("utf-8"))
        ex_mod.render(nb, path.name)  # all authoring rules: markers, ids, a check per exercise
        return nb, ex_mod.layout(nb, where=str(path)), hashlib.sha256(data).hexdigest()
    except NotebookFormatError as exc:
        raise GradeInputError(f"the template is not a valid solutions notebook: {exc}") from None
    except Exception as exc:  # noqa: BLE001 - nbformat raises several kinds
        raise GradeInputError(f"template {path} is not a Jupyter notebook ({exc})") from None


# ---------------------------------------------------------------------------------------- merge

def build_graded_notebook(template_nb, lay: ex_mod.Layout, sources: dict[str, str],
                          refused: dict[str, str] | None = None):
    """The template with each exercise cell's source replaced by the learner's (or the stub);
    a refused answer is replaced by a cell that raises the refusal (ForbiddenCall)."""
    nb = copy.deepcopy(template_nb)
    for e in lay.exercises:
        cell = nb.cells[e.index]
        if e.id in (refused or {}):
            cell.source = f"raise {_FORBID}.ForbiddenCall({refused[e.id]!r})"
        elif e.id in sources:
            cell.source = sources[e.id]
        else:
            cell.source = ex_mod.stub_source(ex_mod.source_text(cell), e.id)
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs = []
            cell.execution_count = None
    return nb


# -------------------------------------------------------------------------------------- grading

def _describe(index: int, lay: ex_mod.Layout) -> str:
    for e in lay.exercises:
        if e.index == index:
            return f"exercise {e.id}"
    for c in lay.checks:
        if c.index == index:
            return f"check {c.name}"
    return f"cell {index} of the template"


def _exercise_result(e, run: CellRun, missing: bool, timeout: float, trips: dict,
                     stopped: str) -> ExerciseResult:
    if missing:
        return ExerciseResult(e.id, "missing", f"exercise {e.id} is missing from your file (no "
                              f"cell tagged 'exercise' for it); graded as failed")
    if e.id in trips:
        return ExerciseResult(e.id, "refused", trips[e.id])
    if run.killed:
        return ExerciseResult(e.id, "timeout", f"exercise {e.id} ran past the time limit of "
                              f"{timeout:g} s and did not stop when interrupted (a loop inside "
                              "C code, or SIGINT ignored?): the kernel was stopped")
    if run.died:
        return ExerciseResult(e.id, "error", f"the kernel died while running exercise {e.id} "
                              "(a crash, os._exit or running out of memory in your code?)")
    if not run.ran:
        return ExerciseResult(e.id, "not run", f"exercise {e.id} did not run: {stopped}")
    if run.timed_out:
        return ExerciseResult(e.id, "timeout", f"exercise {e.id} ran longer than {timeout:g} s "
                              "and was interrupted (an endless loop, or a lab that hangs?)")
    if run.error:
        ename, evalue = run.error["ename"], run.error["evalue"]
        if ename == "NotImplementedError":
            return ExerciseResult(e.id, "not attempted", f"exercise {e.id} not attempted yet: its "
                                  f"cell still raises NotImplementedError({evalue})")
        if ename == "ForbiddenCall":
            return ExerciseResult(e.id, "refused", evalue)
        return ExerciseResult(e.id, "error", f"exercise {e.id} raised {ename}: {evalue}",
                              traceback=run.error["traceback"])
    return ExerciseResult(e.id, "ran")


def _check_result(c, run: CellRun, exercise: ExerciseResult | None, timeout: float,
                  stopped: str, done=frozenset(), judge=None) -> CheckResult:
    """The check's verdict, decided here from what the check cell recorded (labkit.course.verdict)
    against the judge's expected values (labkit.course.judge; None: the cell's own records,
    when the answers graded are the solutions' own). It passes when every record passes, as
    many as the judge's, its cell's reply said "ok", it showed no error, the kernel recorded
    that its code ran to its end (`done`, labkit.course.seal) and its exercise ran."""
    def fail(message):
        return CheckResult(c.name, c.exercise, False, message, run.seconds)

    if exercise is not None and exercise.status != "ran":
        why = exercise.message
        if exercise.status == "not attempted":
            why += "; replace the `raise NotImplementedError(...)` line with your code"
        return fail(why)
    if run.killed:
        return fail(f"the check ran past the time limit of {timeout:g} s and did not stop when "
                    "interrupted: the kernel was stopped")
    if run.died:
        return fail("the kernel died while running this check")
    if not run.ran:
        return fail(f"not run: {stopped}")
    if run.timed_out:
        return fail(f"the check ran longer than {timeout:g} s and was interrupted")
    judged = run.records if judge is None else judge.records.get(c.index, [])
    message = (judge_mod.first_failure(run.records, judged) if judge is None
               else judge.message(c.index, run.records))
    if message:
        return fail(message)
    if run.error:
        ename, evalue = run.error["ename"], run.error["evalue"]
        if ename in ("GradingError", "ForbiddenCall"):
            return fail(evalue)
        if ename == "NotImplementedError":
            return fail(f"exercise {c.exercise} not attempted yet: it still raises "
                        f"NotImplementedError({evalue})")
        if ename == "LabError":   # a lab the check started (a hang, a rank that failed): its
            return fail(evalue.split("\n--- Python stack")[0].rstrip())  # story, no stacks
        msg = f"the check raised {ename}: {evalue}"
        if ename == "NameError":
            msg += f" (does your exercise {c.exercise} define the name the check uses?)"
        elif ename == "AssertionError" and not evalue:
            msg = "the check's assertion failed:\n" + run.error["traceback"]
        return fail(msg)
    if run.status != "ok" or c.index not in done or len(run.records) < len(judged):
        return fail("the check did not report its result (it did not run to its end): does "
                    "your code change how the kernel runs cells or reports errors, e.g. "
                    "get_ipython().set_custom_exc(...)? Answers may not")
    return CheckResult(c.name, c.exercise, True, "", run.seconds)


class _Progress:
    """Turns cell runs into exercise and check results as the cells finish."""

    def __init__(self, lay, sources, timeout, report, on_check, judge=None):
        self.lay, self.sources, self.timeout, self.judge = lay, sources, timeout, judge
        self.report, self.on_check = report, on_check
        self.runs: dict[int, CellRun] = {}
        self.trips: dict[str, str] = {}
        self.done: set[int] = set()       # checks whose code ran to its end (labkit.course.seal)
        self.changed: list[str] = []      # what answers changed that the checks use
        self.results: dict[str, ExerciseResult] = {}
        self.checks: dict[str, CheckResult] = {}
        self.stopped = "the kernel stopped earlier"
        self.last = time.monotonic()      # when the previous check was decided

    def _exercise(self, e) -> ExerciseResult | None:
        run = self.runs.get(e.index)
        if run is None:
            return None
        result = _exercise_result(e, run, e.id not in self.sources, self.timeout, self.trips,
                                  self.stopped)
        self.results[e.id] = result
        return result

    def cell_done(self, index: int, run: CellRun) -> None:
        self.runs[index] = run
        if run.probe is not None:   # what labkit.course.seal says; unreadable: nothing is done
            try:
                state = json.loads(ast.literal_eval(run.probe))
                self.trips, self.changed = dict(state["trips"]), list(state["changed"])
                self.done = {int(i) for i in state["done"]}
            except (ValueError, SyntaxError, TypeError, KeyError):
                self.done = set()
        if run.killed:
            self.stopped = (f"the kernel was stopped after {_describe(index, self.lay)} ran past "
                            "the time limit")
        elif run.died:
            self.stopped = f"the kernel died while running {_describe(index, self.lay)}"
        for c in self.lay.checks:
            if c.index == index:
                self._check(c, self.runs[index])

    def _check(self, c, run: CellRun) -> None:
        exercise = None
        if c.exercise is not None:
            e = self.lay.exercise(c.exercise)
            exercise = self._exercise(e)
            if exercise is None:
                return      # its exercise comes later in the notebook: decided at the end
        result = _check_result(c, run, exercise, self.timeout, self.stopped, self.done,
                               self.judge)
        now = time.monotonic()
        result.seconds, self.last = now - self.last, now
        self.checks[c.name] = result
        if self.on_check:
            self.on_check(result)

    def finish(self, runs: list[CellRun]) -> None:
        for i, run in enumerate(runs):
            self.runs.setdefault(i, run)
        for c in self.lay.checks:
            if c.name not in self.checks:
                self._check(c, self.runs[c.index])
        self.report.exercises = [self._exercise(e) for e in self.lay.exercises]
        self.report.checks = [self.checks[c.name] for c in self.lay.checks]
        special = {e.index for e in self.lay.exercises} | {c.index for c in self.lay.checks}
        for i, run in enumerate(runs):
            if i not in special and run.error:
                self.report.notes.append(
                    f"cell {i} of the template (not an exercise) raised {run.error['ename']}: "
                    f"{run.error['evalue']}; an earlier exercise may have left a wrong value behind")
        for i, run in enumerate(runs):
            if run.dropped:
                self.report.notes.append(
                    f"{_describe(i, self.lay)} printed more than the grader keeps "
                    f"({CELL_OUTPUT_LIMIT / 1e6:g} MB a cell; output truncated: "
                    f"{run.dropped / 1e6:.1f} MB)")
        if self.changed:
            shown = ", ".join(self.changed[:6]) + (" ..." if len(self.changed) > 6 else "")
            self.report.notes.append(f"your code changed {shown}; the grader put the originals "
                                     "back before each check")


def _guards(lay, template_nb, graded, path: Path, template: Path,
            digests: dict | None = None) -> dict[int, list[str]]:
    """Snippets the kernel runs before cells: install the guards (labkit.course.forbid) and the
    seal (labkit.course.seal, with the `digests` of the cells `sealed` wrote), then name each
    answer."""
    plan = {e.id: list(e.forbid) for e in lay.exercises}
    protected = {str(template.parent.resolve())} | {str(d) for d in _solutions_dirs(path)}
    if any(path.resolve().is_relative_to(d) for d in protected):
        protected = set()      # a solutions notebook handed in as the learner's: nothing to hide
    else:
        protected.add(str(judge_mod.cache_dir().resolve()))    # expected values, kept
    first = next(i for i, c in enumerate(graded.cells) if c.cell_type == "code")
    answers = {e.index for e in lay.exercises}
    learner = set().union(*(seal.bound_names(template_nb.cells[i].source) for i in answers))
    modules = set().union(*(seal.imported_modules(c.source) for i, c in enumerate(graded.cells)
                            if c.cell_type == "code" and i not in answers))
    before = {first: [f"{_FORBID}.install({plan!r}, {sorted(protected)!r})",
                      f"{_SEAL}.install({sorted(learner)!r}, {sorted(modules)!r}, "
                      f"{dict(digests or {})!r})"]}
    for e in lay.exercises:
        code = f"{_FORBID}.expect({e.id!r}, {graded.cells[e.index].source!r})"
        before.setdefault(e.index, []).append(code)
    return before


# Where a check's call takes its expected value: (position, keyword) of the argument. In the
# learner's kernel that argument becomes grading.JUDGED: the expected value is never computed
# there, the grader decides with the judge's (labkit.course.judge).
_EXPECTED_ARGUMENT = {"check_equal": (2, "expected"), "check_close": (2, "expected"),
                      "check_int": (2, "expected"), "check_tensor_close": (2, "expected"),
                      "check_callable": (3, "reference"), "check_with_mistakes": (3, "reference"),
                      "check_raises": (None, "reference")}
_JUDGED = "__import__('labkit.course.grading', fromlist=['grading']).JUDGED"


def judged_source(source: str) -> str:
    """A check cell's source with each check's expected value swapped for grading.JUDGED (the
    source itself when it has no such call, or is not plain Python)."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return source
    marker = ast.parse(_JUDGED, mode="eval").body
    changed = False
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
        if name not in _EXPECTED_ARGUMENT:
            continue
        position, keyword = _EXPECTED_ARGUMENT[name]
        for kw in node.keywords:
            if kw.arg == keyword:
                kw.value, changed = copy.deepcopy(marker), True
        if position is not None and len(node.args) > position and not any(
                isinstance(a, ast.Starred) for a in node.args[:position + 1]):
            node.args[position], changed = copy.deepcopy(marker), True
    return ast.unparse(ast.fix_missing_locations(tree)) if changed else source


def sealed(graded, lay: ex_mod.Layout, judged: bool = True):
    """`graded` with every code cell that is not an exercise run through labkit.course.seal;
    `judged`: the checks' expected values left to the grader (`judged_source`)."""
    nb = copy.deepcopy(graded)
    answers = {e.index for e in lay.exercises}
    checks = {c.index for c in lay.checks}
    digests = {}
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "code" and i not in answers and cell.source.strip():
            source = judged_source(cell.source) if judged and i in checks else cell.source
            digests[i] = hashlib.sha256(source.encode()).hexdigest()
            cell.source = seal.cell_text(i, source, i in checks)
    nb.metadata["labkit_seal"] = digests      # for seal.install (`_guards`)
    return nb


def _template_note(path: Path, digest: str) -> list[str]:
    try:
        same = hashlib.sha256(path.read_bytes()).hexdigest() == digest
    except OSError:
        same = False
    if same:
        return []
    return [f"the solutions notebook {_shown(path)} was changed or removed while this notebook "
            "was graded (this grade used the copy read before any of your code ran); if your "
            f"code did that, restore it: git checkout -- {_shown(path)}"]


def _judge(name, template_nb, lay, template: Path, timeout, grace, on_judge):
    """The expected values of `template`'s checks: cached, else from a run of the solutions
    in a kernel of their own (in a scratch directory), kept when every check passed."""
    found = judge_mod.load(name)
    if found is not None:
        return found
    if on_judge:
        on_judge()
    own = {e.id: template_nb.cells[e.index].source for e in lay.exercises}
    solutions = build_graded_notebook(template_nb, lay, own)
    with tempfile.TemporaryDirectory(prefix="labkit-judge-") as scratch:
        try:
            nb = sealed(solutions, lay, judged=False)
            runs = execute(nb, timeout=timeout, cwd=Path(scratch),
                           before=_guards(lay, template_nb, solutions, template, template,
                                          nb.metadata["labkit_seal"]),
                           probe=None, grace=grace)
        except KernelStartError as exc:
            raise GradeInputError(str(exc)) from exc
    judge = judge_mod.from_runs(lay.checks, runs)
    judge_mod.save(name, judge)
    return judge


def grade_notebook(path: Path | str, template: Path | str | None = None, *,
                   timeout: float = DEFAULT_TIMEOUT, cwd: Path | str | None = None,
                   on_start=None, on_check=None, grace: float = KILL_GRACE,
                   reference: Path | str | None = None, on_judge=None) -> GradeReport:
    """Grade the learner notebook at `path`; raises GradeInputError for input it cannot grade.

    reference: the instructor's copy of the course (``labkit grade --reference DIR``): the
    template is ``DIR/solutions/<name>`` (`find_template`), for a notebook of a learner handout
    (`labkit workshop handout`) or anywhere else. The checks run with the labkit running this
    grader (its kernel imports it, and the reference answers with it): refused when that is a
    handout's, or differs from DIR's own labkit/ (`check_reference_labkit`).

    on_start(report): called once the template is known, before the kernel starts.
    on_check(check_result): called for each check as soon as it is decided.
    on_judge(): called before the solutions run to compute the expected values (once per
    template and labkit: labkit.course.judge).

    Nothing in the learner's file is trusted but the source of its exercise cells:

    1. The template is the solutions notebook of the same name (`find_template`). A file with
       no exercise cell at all (a lesson of notebooks/) is refused at once, naming the exercise
       file.
    2. The learner's exercise cells are the code cells tagged ``exercise`` or carrying
       ``metadata.labkit.exercise``. Each template exercise takes the source of the learner cell
       with the same id; exercises left unmatched take, in order, the learner's exercise cells
       that have no known id. The learner's outputs, check cells, tags of other cells, markers
       and extra cells are never used. An exercise missing from the file gets the stub and
       fails ("missing"). A damaged file (a cell that is not an object, a source that is not
       text) is refused with the cell and what is wrong (labkit.course.learner).
    3. An answer that uses what its exercise asks to write (``metadata.labkit.forbid`` of the
       template's exercise cell, and the checks' references), or reads the solutions, is
       refused: by its source before it runs, and in the kernel when it calls one
       (labkit.course.forbid).
    4. The template with those sources swapped in is executed top to bottom in a fresh kernel
       of this interpreter (labkit.course.kernel: errors allowed so every check runs; a cell
       still running at `timeout` s is interrupted, and killed with the kernel `grace` s
       later; the kernel dies with the grader; what it prints is kept up to a limit), with the
       learner's notebook directory as working directory. The template is read once, before
       any learner code runs: an answer that changes the solutions file changes nothing in this
       grade (and is named in the notes). Each check is reported (`on_check`) as soon as its
       cell has run.
    5. Every cell of the template that is not an exercise runs through labkit.course.seal: a
       check reads the names its exercises define from the learner and everything else
       (``grading``, the references, the set-up's tables) as the template's own cells bound
       them, and what an answer changed in labkit, math, builtins or IPython's error reporting
       is put back before it runs. A check passes when its cell's reply says "ok", it shows no
       error, its code ran to its end and its exercise cell ran without error. Otherwise its
       message is the exercise's problem ("not attempted yet", the exception it raised, a
       timeout, a refusal) or the check's own error (a ``labkit.course.grading.GradingError``
       explains expected vs received).
    """
    path = Path(path)
    reference = Path(reference).expanduser() if reference is not None else None
    cells = read_learner(path)
    _refuse_non_exercise_file(path, cells, Path(template) if template is not None else None,
                              reference)
    template_path = Path(template) if template is not None else find_template(path, reference)
    if reference is not None:
        check_reference_labkit(reference)
    template_nb, lay, digest = _read_template(template_path)
    if not lay.checks:
        raise GradeInputError(f"the template {template_path} has no check cells")
    sources, notes = learner_sources(cells, lay)
    refused = {}
    for e in lay.exercises:
        why = forbid.scan(sources[e.id], e.forbid, e.id) if e.id in sources else None
        if why:
            refused[e.id] = why
    graded = build_graded_notebook(template_nb, lay, sources, refused)
    report = GradeReport(notebook=str(path), template=str(template_path), timeout=timeout,
                         names=[c.name for c in lay.checks], notes=notes)
    if on_start:
        on_start(report)
    start = time.monotonic()
    # The answers are the solutions' own: this run is also the judge's. Else the judge's
    # expected values come from the cache or a run of the solutions (labkit.course.judge).
    own = not refused and all(sources.get(e.id) == template_nb.cells[e.index].source
                              for e in lay.exercises)
    name = judge_mod.key(digest)
    judge = None if own else _judge(name, template_nb, lay, template_path, timeout, grace, on_judge)
    progress = _Progress(lay, sources, timeout, report, on_check, judge)
    try:
        nb = sealed(graded, lay, judged=not own)
        runs = execute(nb, timeout=timeout, cwd=Path(cwd) if cwd else path.resolve().parent,
                       before=_guards(lay, template_nb, graded, path, template_path,
                                      nb.metadata["labkit_seal"]),
                       probe=f"{_SEAL}.status()", on_cell=progress.cell_done, grace=grace)
    except KernelStartError as exc:
        raise GradeInputError(str(exc)) from exc
    progress.finish(runs)
    if own:
        judge_mod.save(name, judge_mod.from_runs(lay.checks, runs))
    report.notes += _template_note(template_path, digest)
    report.seconds = time.monotonic() - start
    return report
