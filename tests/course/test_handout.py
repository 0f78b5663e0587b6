"""A workshop's learner handout and grading against the instructor's copy (red-team report:
solutions/ ships with the course, so for a self-paced learner the grader is a learning aid).

`labkit workshop handout DIR` writes the course without anything that holds an answer: no
solutions/, no tests/, no history that has them, the checks' reference answers replaced by a
stand-in; `labkit grade --reference COURSE NOTEBOOK` grades a handed-in notebook against
COURSE/solutions. The real course is handed out once per module (a copy, ~4 s); grading runs on
the small fixture course of tests/fixtures (a kernel each, a few seconds)."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest

from labkit import cli
from labkit.course import exercises as ex
from labkit.course import grader, grading, workshop
from labkit.course.learner import GradeInputError

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures"
FIXTURE = "99_grading_fixture.ipynb"


def _forms(line: str) -> list[bytes]:
    """`line` as it stands in a .py file and inside a notebook's JSON."""
    return [line.encode(), json.dumps(line)[1:-1].encode()]


def _git_objects(repo: Path) -> bytes:
    """Every object of the repository at `repo`, uncompressed (commits, trees, blobs)."""
    out = subprocess.run(["git", "-C", str(repo), "cat-file", "--batch-all-objects", "--batch"],
                         capture_output=True, check=True, timeout=60)
    return out.stdout


def _holders(folder: Path, lines: set[str]) -> dict[str, list[str]]:
    """{file under `folder` (every file, .git's included): the `lines` it holds}, and the
    repository's objects uncompressed under the key "git objects"."""
    found = {}
    for path in folder.rglob("*"):
        if path.is_file():
            data = path.read_bytes()
            hits = [s for s in lines if any(f in data for f in _forms(s))]
            if hits:
                found[str(path.relative_to(folder))] = hits
    if (folder / ".git").exists():
        data = _git_objects(folder)
        hits = [s for s in lines if any(f in data for f in _forms(s))]
        if hits:
            found["git objects"] = hits
    return found


@pytest.fixture(scope="module")
def handout(tmp_path_factory):
    target = tmp_path_factory.mktemp("learners") / "handout"
    made = workshop.make_handout(target)
    return target, made


@pytest.fixture(scope="module")
def secret():
    lines = workshop.solution_lines(ROOT / "solutions" / "01_memory_math.ipynb")
    assert len(lines) >= 5 and "return weight + grad + master + buffers * state" in lines
    # the scan finds them where they are: the course's solutions notebook
    data = (ROOT / "solutions" / "01_memory_math.ipynb").read_bytes()
    assert all(any(f in data for f in _forms(s)) for s in lines)
    return lines


# ---------------------------------------------------------------------- the handout of the course

def test_handout_holds_no_solutions_nor_a_history_that_has_them(handout, secret):
    target, made = handout
    assert not (target / "solutions").exists() and not (target / "tests").exists()
    assert _holders(target, secret) == {}
    # its git repository (one commit, the handout) knows no solutions/ path either
    log = subprocess.run(["git", "-C", str(target), "log", "--all", "--name-only",
                          "--format=%H"], capture_output=True, text=True, check=True).stdout
    # one commit: one hash line (a file's path may be 40 characters long too, e.g.
    # labkit/data/bigscience_topology_2022.csv)
    assert len([l for l in log.splitlines() if re.fullmatch(r"[0-9a-f]{40}", l)]) == 1
    assert "solutions/" not in log and "tests/" not in log
    assert subprocess.run(["git", "-C", str(target), "show", "HEAD:solutions/01_memory_math.ipynb"],
                          capture_output=True).returncode != 0
    assert subprocess.run(["git", "-C", str(target), "status", "--porcelain"],
                          capture_output=True, text=True).stdout == ""
    gone = dict(made.left_out)
    assert {"solutions/", "tests/", ".git/", workshop.REFERENCE_FILE} <= set(gone)
    assert "wrote a learner handout" in made.text() and "labkit grade --reference" in made.text()


def test_handout_exercises_are_the_courses(handout):
    target, made = handout
    names = sorted(p.name for p in (ROOT / "solutions").glob("*.ipynb"))
    assert made.exercises == names
    assert sorted(p.name for p in (target / "exercises").iterdir()) == names
    for name in names:
        theirs = (ROOT / "exercises" / name).read_bytes()
        assert (target / "exercises" / name).read_bytes() == theirs, name
    for rel in ("labkit/course/grading.py", "notebooks/01_memory_math.ipynb", "README.md",
                "pyproject.toml", "Makefile"):
        assert (target / rel).read_bytes() == (ROOT / rel).read_bytes(), rel


def test_handout_reference_is_a_stand_in(handout):
    target, _ = handout
    text = (target / workshop.REFERENCE_FILE).read_text()
    assert text.startswith(grader.HANDOUT_MARK) and "def min_gpus_zero3" not in text
    assert grader.is_handout_labkit(target / "labkit")
    assert not grader.is_handout_labkit(ROOT / "labkit")
    from labkit.course import reference
    assert all(callable(getattr(reference, n)) for n in workshop.REFERENCE_STUB_NAMES)


def _stand_in():
    module = types.ModuleType("handout_reference")
    exec(compile(workshop._reference_stub(), "reference.py", "exec"), module.__dict__)
    return module


def _outcome(call):
    try:
        call()
    except BaseException as exc:  # noqa: BLE001 - NotInHandout is a BaseException
        return type(exc).__name__, str(exc)
    return None, ""


def test_stand_in_runs_the_learners_code_and_never_passes_or_fails_an_answer():
    ref = _stand_in()

    def stub(p, o):
        raise NotImplementedError("Exercise ex1: write ~6 lines")

    def crashes(p, o):
        return 1 / 0

    def returns(p, o):
        return 16

    def check(fn):
        return _outcome(lambda: grading.check_callable("ex1", fn, [("bf16-mixed", "adamw")],
                                                       ref.model_state_bytes))

    kind, msg = check(stub)
    assert kind == "GradingError" and grading.NOT_ATTEMPTED in msg
    kind, msg = check(crashes)
    assert kind == "GradingError" and "raised ZeroDivisionError" in msg
    kind, msg = check(returns)
    assert kind == "NotInHandout" and "your code gave 16" in msg and "instructor" in msg
    for call in (lambda: grading.check_int("x", 5, ref.min_gpus(1, 2, 3)),
                 lambda: grading.check_close("x", 5.0, ref.states_gb(7e9, 3, 8)),
                 lambda: grading.check_equal("x", [[0, 1]], ref.mesh_groups((2,), ("dp",))),
                 lambda: grading.check_raises("dp_for", lambda *a: 1, (64, 8, 3), ValueError,
                                              reference=ref.dp_for),
                 lambda: ref.check_with_mistakes("bubble", lambda p, m: 0.5, [(4, 8)],
                                                 ref.bubble_share),
                 lambda: ref.check_diagnosis("cause", lambda e: "straggler", ("straggler",),
                                             "name"),
                 lambda: grading.check_callable("kind", ref.by_kind(lambda *a: "memory: 1 GB"),
                                                [("m",)], ref.by_kind(ref.layout_problem)),
                 lambda: f"{ref.activations_alone('llama3-8b', 8192, 'none') / 1e9:,.0f}",
                 lambda: list(ref.llama_configs())):
        kind, msg = _outcome(call)
        assert kind == "NotInHandout" and "not in this learner handout" in msg, (kind, msg)
    kind, msg = _outcome(lambda: ref.check_diagnosis(
        "cause", lambda evidence: stub(evidence, None), ("straggler",), "name",
        seeds=ref.DIAGNOSIS_SEEDS))
    assert kind == "GradingError" and grading.NOT_ATTEMPTED in msg
    assert not hasattr(ref, "_repr_html_")


@pytest.mark.notebook
def test_a_handout_exercise_runs_with_feedback_and_grade_says_where_grading_happens(handout):
    """In the handout's own labkit: a check cell says what the learner's code raised, or that its
    reference answer is not here; `labkit grade` says grading happens on the instructor's copy."""
    target, _ = handout
    nb = ex.read_notebook(target / "exercises" / "01_memory_math.ipynb")
    cells = {c.metadata.get("labkit", {}).get("exercise"): c for c in nb.cells}
    cells["ex1"].source = "def model_state_bytes(precision, optimizer):\n    return 16"
    cells["ex3"].source = cells["ex3"].source.replace(
        'raise NotImplementedError("Exercise ex3: write ~7 lines")', "return 1 / 0")
    (target / "exercises" / "mine.ipynb").write_text(ex.dumps(nb))
    script = ("import sys, json; from pathlib import Path; from labkit.course import kernel, "
              "exercises as ex; nb = ex.read_notebook('exercises/mine.ipynb'); "
              "kernel.execute(nb, timeout=120, cwd=Path('exercises')); "
              "print(json.dumps([[o.get('ename'), ' '.join(o.get('traceback', []))] "
              "for c in nb.cells if 'check' in c.metadata.get('tags', []) for o in c.outputs "
              "if o.output_type == 'error']))")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    try:
        out = subprocess.run([sys.executable, "-c", script], cwd=target, capture_output=True,
                             text=True, timeout=300, env=env)
        assert out.returncode == 0, out.stderr
        errors = json.loads(out.stdout.strip().splitlines()[-1])
        names = [e[0] for e in errors]
        assert names[0] == "NotInHandout" and "no reference answer in this handout" in errors[0][1]
        assert any(n == "GradingError" and "raised ZeroDivisionError" in t for n, t in errors)
        assert any(n == "GradingError" and grading.NOT_ATTEMPTED in t for n, t in errors)
        # `labkit grade` run with the handout's labkit
        out = subprocess.run([sys.executable, "-m", "labkit", "grade",
                              "exercises/01_memory_math.ipynb"], cwd=target, capture_output=True,
                             text=True, timeout=120, env=env)
        assert out.returncode == 2
        assert "learner handout" in out.stderr and "instructor" in out.stderr
        assert "labkit grade --reference" in out.stderr
        # ... and it refuses to grade even when pointed at the course: it has no references
        out = subprocess.run([sys.executable, "-m", "labkit", "grade", "--reference", str(ROOT),
                              "exercises/01_memory_math.ipynb"], cwd=target, capture_output=True,
                             text=True, timeout=120, env=env)
        assert out.returncode == 2 and "is a learner handout's" in out.stderr
    finally:
        (target / "exercises" / "mine.ipynb").unlink()


# ------------------------------------------------------------------------------ refusals

def test_handout_refuses_a_folder_that_is_not_empty(tmp_path, capsys):
    (tmp_path / "mine.txt").write_text("keep me")
    code = cli.main(["workshop", "handout", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 2 and "exists and is not empty" in err and "mine.txt" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine.txt"]
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="not a folder"):
        workshop.make_handout(tmp_path / "file")
    with pytest.raises(ValueError, match="inside the course"):
        workshop.make_handout(ROOT / "docs" / "handout")
    (tmp_path / "course").mkdir()
    with pytest.raises(ValueError, match="no solutions"):
        workshop.make_handout(tmp_path / "new", course=tmp_path / "course")
    assert not (tmp_path / "new").exists() and not (ROOT / "docs" / "handout").exists()


# ------------------------------------------------- grading a handed-in notebook, fixture course

@pytest.fixture
def course(tmp_path):
    """A small course (no git, no labkit/ of its own: the running labkit grades) and its handout
    (no git)."""
    course = tmp_path / "course"
    for sub in ("solutions", "exercises"):
        (course / sub).mkdir(parents=True)
        shutil.copy(FIXTURES / sub / FIXTURE, course / sub / FIXTURE)
    (course / "README.md").write_text("a course\n")
    (course / "tests").mkdir()
    (course / "tests" / "test_answers.py").write_text("ANSWER = 1\n")
    made = workshop.make_handout(tmp_path / "handout", course=course, git=False)
    return course, tmp_path / "handout", made


def _answer(handout: Path, sources: dict[str, str]) -> Path:
    path = handout / "exercises" / FIXTURE
    nb = ex.read_notebook(path)
    for cell in nb.cells:
        id_ = cell.metadata.get("labkit", {}).get("exercise")
        if id_ in sources:
            cell.source = sources[id_]
    path.write_text(ex.dumps(nb))
    return path


def _solved() -> dict[str, str]:
    sol = ex.read_notebook(FIXTURES / "solutions" / FIXTURE)
    lay = ex.layout(sol)
    return {e.id: "\n".join(l for l in sol.cells[e.index].source.split("\n")
                            if l.strip() not in (ex.BEGIN, ex.END)) for e in lay.exercises}


def test_fixture_handout_has_no_git_no_solutions_and_the_courses_exercise(course):
    src, target, made = course
    assert sorted(p.name for p in target.iterdir()) == ["HANDOUT.md", "README.md", "exercises"]
    assert (target / "exercises" / FIXTURE).read_bytes() == \
        (FIXTURES / "exercises" / FIXTURE).read_bytes()
    lines = workshop.solution_lines(src / "solutions" / FIXTURE, min_chars=20)
    assert lines and _holders(target, lines) == {}
    assert made.git == "no git repository (--no-git)"
    assert "git checkout" not in (target / "HANDOUT.md").read_text()


def test_grade_reference_passes_a_right_answer_and_fails_a_wrong_one(course, capsys):
    src, target, _ = course
    nb = _answer(target, _solved())
    assert cli.main(["grade", "--reference", str(src), str(nb)]) == 0
    out = capsys.readouterr().out
    assert f"against {src / 'solutions' / FIXTURE}" in out and "4/4 checks passed" in out
    nb = _answer(target, {"ex2": "adam_bytes = 1.5e9 * 12"})
    assert cli.main(["grade", "--reference", str(src), str(nb)]) == 1
    assert "adam_bytes" in capsys.readouterr().out


def test_grade_reference_errors(course, tmp_path, capsys):
    src, target, _ = course
    nb = target / "exercises" / FIXTURE

    def refused(*args):
        assert cli.main(["grade", *args]) == 2
        return capsys.readouterr().err

    # graded by the instructor's labkit without --reference: says where grading happens
    err = refused(str(nb))
    assert "learner handout" in err and "labkit grade --reference" in err
    err = refused("--reference", str(tmp_path / "nowhere"), str(nb))
    assert "no such folder" in err
    err = refused("--reference", str(target), str(nb))
    assert "is a learner handout" in err and "holds no solutions" in err
    (tmp_path / "bare").mkdir()
    err = refused("--reference", str(tmp_path / "bare"), str(nb))
    assert "has no solutions/ folder" in err
    other = tmp_path / "77_other.ipynb"
    shutil.copy(nb, other)
    err = refused("--reference", str(src), str(other))
    assert "no solutions notebook matches '77_other.ipynb'" in err and FIXTURE in err
    with pytest.raises(SystemExit) as stop:     # argparse: one or the other
        cli.main(["grade", "--reference", str(src), "--template", str(src / "solutions" / FIXTURE),
                  str(nb)])
    assert stop.value.code == 2 and "not allowed with" in capsys.readouterr().err


def test_grade_reference_refuses_a_course_whose_labkit_differs(course, tmp_path):
    src, target, _ = course
    (src / "labkit" / "course").mkdir(parents=True)
    (src / "labkit" / "course" / "reference.py").write_text("def model_state_bytes(): ...\n")
    with pytest.raises(GradeInputError, match=r"files differ \(course/reference.py, "):
        grader.grade_notebook(target / "exercises" / FIXTURE, reference=src)
    # the same labkit elsewhere is fine
    shutil.rmtree(src / "labkit")
    shutil.copytree(ROOT / "labkit", src / "labkit",
                    ignore=shutil.ignore_patterns("__pycache__"))
    grader.check_reference_labkit(src)
