"""exercises/ is generated from solutions/ (labkit.course.exercises): stubs, no leaks, determinism, sync.

Runs on the fixture under tests/fixtures/ and on every real solutions/*.ipynb; a learner's answers
in exercises/ (edited, committed) never fail it, and regenerating never loses them."""
from __future__ import annotations

import copy
import shutil
import subprocess
from pathlib import Path

import nbformat
import pytest

from labkit.course import exercises as ex

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
FIX_SOL = FIXTURES / "solutions"
FIX_EX = FIXTURES / "exercises"
FIXTURE = FIX_SOL / "99_grading_fixture.ipynb"
REAL = sorted((ex.REPO_ROOT / "solutions").glob("*.ipynb"))


def _nb(*cells):
    return nbformat.v4.new_notebook(cells=list(cells))


def _code(src, *tags, **labkit):
    meta = {"tags": list(tags)} if tags else {}
    if labkit:
        meta["labkit"] = labkit
    return nbformat.v4.new_code_cell(src, metadata=meta)


# ------------------------------------------------------------------------------------- stubbing

def test_stub_keeps_indentation_and_counts_code_lines():
    src = ("def f(x):\n    '''doc'''\n    ### BEGIN SOLUTION\n    # a comment\n    y = x + 1\n\n"
           "    return y\n    ### END SOLUTION\n\nz = f(1)")
    out = ex.stub_source(src, "ex7")
    assert out == ("def f(x):\n    '''doc'''\n"
                   '    raise NotImplementedError("Exercise ex7: write ~2 lines")\n\nz = f(1)')


def test_stub_replaces_every_region_and_singular_hint():
    src = "### BEGIN SOLUTION\na = 1\n### END SOLUTION\nif True:\n  ### BEGIN SOLUTION\n  b = 2\n  c = 3\n  ### END SOLUTION"
    out = ex.stub_source(src, "e")
    assert out.splitlines() == ['raise NotImplementedError("Exercise e: write ~1 line")', "if True:",
                                '  raise NotImplementedError("Exercise e: write ~2 lines")']


@pytest.mark.parametrize("src, words", [
    ("### BEGIN SOLUTION\nx = 1", "never closed"),
    ("x = 1\n### END SOLUTION", "without"),
    ("### BEGIN SOLUTION\n### BEGIN SOLUTION\n### END SOLUTION", "nested"),
    ("## BEGIN SOLUTION\nx = 1\n## END SOLUTION", "malformed marker"),
    ("### BEGIN SOLUTION  \nx = 1\n###END SOLUTION", "malformed marker"),
    ("x = 1", "no '### BEGIN SOLUTION'"),
])
def test_stub_rejects_broken_markers(src, words):
    with pytest.raises(ex.NotebookFormatError, match=words):
        ex.stub_source(src, "ex1", "nb, cell 3")


def test_layout_ids_and_check_names():
    nb = _nb(_code("setup = 1"),
             _code("### BEGIN SOLUTION\na = 1\n### END SOLUTION", "exercise"),
             _code("check a", "check"),
             _code("### BEGIN SOLUTION\nb = 1\n### END SOLUTION", "exercise", exercise="bee"),
             _code("check b1", "check"),
             _code("check b2", "check", check="b-named"),
             _code("check a again", "check", checks="ex1"))
    lay = ex.layout(nb)
    assert [(e.id, e.index) for e in lay.exercises] == [("ex1", 1), ("bee", 3)]
    assert [(c.name, c.exercise, c.index) for c in lay.checks] == [
        ("ex1.1", "ex1", 2), ("bee", "bee", 4), ("b-named", "bee", 5), ("ex1.2", "ex1", 6)]


@pytest.mark.parametrize("cells, words", [
    ([_code("### BEGIN SOLUTION\na=1\n### END SOLUTION", "exercise")], "has no check"),
    ([_code("x", "exercise", "check")], "both"),
    ([_code("### BEGIN SOLUTION\na=1\n### END SOLUTION", "exercise", exercise="a b"),
      _code("c", "check")], "exercise id"),
    ([_code("### BEGIN SOLUTION\na=1\n### END SOLUTION", "exercise"),
      _code("c", "check", checks="nope")], "unknown exercise"),
])
def test_layout_rejects_bad_solutions(cells, words):
    with pytest.raises(ex.NotebookFormatError, match=words):
        ex.layout(_nb(*cells))


def test_markers_outside_exercise_cells_are_refused():
    nb = _nb(_code("### BEGIN SOLUTION\nsecret = 42\n### END SOLUTION"),
             _code("### BEGIN SOLUTION\na=1\n### END SOLUTION", "exercise"), _code("c", "check"))
    with pytest.raises(ex.NotebookFormatError, match="outside a cell tagged"):
        ex.render(nb, "01_x.ipynb")


# ------------------------------------------------------------------------------------- rendering

@pytest.fixture(scope="module")
def fixture_pair():
    sol = ex.read_notebook(FIXTURE)
    return sol, ex.render(sol, FIXTURE.name)


def test_fixture_exercises_are_stubbed(fixture_pair):
    sol, rendered = fixture_pair
    lay = ex.layout(sol)
    assert [e.id for e in lay.exercises] == ["ex1", "ex2", "layers"]
    text = ex.dumps(rendered)
    assert "BEGIN SOLUTION" not in text and "END SOLUTION" not in text
    stubs = [c for c in rendered.cells if "exercise" in c.metadata.get("tags", [])]
    assert [c.metadata["labkit"]["exercise"] for c in stubs] == ["ex1", "ex2", "layers"]
    for cell, id_ in zip(stubs, ["ex1", "ex2", "layers"]):
        assert f'raise NotImplementedError("Exercise {id_}: write ~' in cell.source
    assert ex.leaked_lines(sol, rendered) == []
    # the same number of cells plus the header, in the same order and kinds
    assert [c.cell_type for c in rendered.cells[1:]] == [c.cell_type for c in sol.cells]


def test_rendered_notebook_is_clean(fixture_pair):
    _, rendered = fixture_pair
    header = rendered.cells[0]
    assert header.id == ex.HEADER_ID
    assert "labkit grade exercises/99_grading_fixture.ipynb" in header.source
    for cell in rendered.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None
        assert set(cell.metadata) <= set(ex._KEEP_CELL_METADATA)
        if "check" in cell.metadata.get("tags", []):
            assert cell.metadata["editable"] is False and cell.metadata["deletable"] is False
    nbformat.validate(rendered)


def test_leak_detector_finds_a_leak(fixture_pair):
    sol, rendered = fixture_pair
    leaky = copy.deepcopy(rendered)
    leaky.cells[4].source += "\n    size = {\"fp32\": 4, \"bf16\": 2, \"fp16\": 2}[dtype]"
    assert ex.leaked_lines(sol, leaky) == ['size = {"fp32": 4, "bf16": 2, "fp16": 2}[dtype]']


def test_render_ignores_outputs_and_noise_in_solutions(fixture_pair):
    sol, rendered = fixture_pair
    noisy = copy.deepcopy(sol)
    for i, cell in enumerate(noisy.cells):
        cell.id = f"random-{i * 7919}"
        cell.metadata["ExecuteTime"] = {"end_time": "2025-01-01"}
        if cell.cell_type == "code":
            cell.execution_count = i
            cell.outputs = [nbformat.v4.new_output("stream", text="14.0 GB\n")]
    noisy.metadata["language_info"] = {"name": "python", "version": "3.12.1"}
    assert ex.dumps(ex.render(noisy, FIXTURE.name)) == ex.dumps(rendered)


def test_generate_is_deterministic_and_does_not_rewrite(tmp_path):
    out = tmp_path / "exercises"
    assert ex.generate(FIX_SOL, out) == [ex.Written(out / FIXTURE.name, backup=None)]
    first = (out / FIXTURE.name).read_bytes()
    assert ex.generate(FIX_SOL, out) == []          # unchanged: nothing written
    (out / FIXTURE.name).unlink()
    ex.generate(FIX_SOL, out)
    assert (out / FIXTURE.name).read_bytes() == first
    assert ex.check_sync(FIX_SOL, out) == []


def test_check_sync_reports_stale_missing_orphan_and_leaks(tmp_path):
    out = tmp_path / "exercises"
    assert "is missing; run `python -m labkit.course.exercises`" in ex.check_sync(FIX_SOL, out)[0]
    ex.generate(FIX_SOL, out)
    target = out / FIXTURE.name
    nb = ex.read_notebook(target)
    nb.cells[4].source = nb.cells[4].source.replace(
        'raise NotImplementedError("Exercise ex1: write ~2 lines")', "return num_params * size")
    target.write_text(ex.dumps(nb), encoding="utf-8")
    (out / "42_orphan.ipynb").write_text(ex.dumps(nbformat.v4.new_notebook()), encoding="utf-8")
    problems = ex.check_sync(FIX_SOL, out)
    assert any("out of date" in p for p in problems)
    assert any("contains solution lines" in p and "return num_params * size" in p for p in problems)
    assert any("42_orphan.ipynb has no solutions notebook" in p for p in problems)
    assert ex.main(["--solutions", str(FIX_SOL), "--exercises", str(out), "--check"]) == 1


def test_committed_fixture_exercises_are_in_sync():
    assert ex.check_sync(FIX_SOL, FIX_EX) == []
    assert ex.main(["--solutions", str(FIX_SOL), "--exercises", str(FIX_EX), "--check"]) == 0


# ------------------------------------------------- a learner's answers (issue 10, point 5)

def _git(cwd, *args):
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@example.com", *args],
                   cwd=cwd, check=True, capture_output=True)


@pytest.fixture
def course(tmp_path):
    """A git checkout with solutions/ and the exercises/ generated from it, committed."""
    if shutil.which("git") is None:
        pytest.skip("needs git")
    shutil.copytree(FIX_SOL, tmp_path / "solutions")
    ex.generate(tmp_path / "solutions", tmp_path / "exercises")
    _git(tmp_path, "init", "-q")
    _git(tmp_path, "add", ".")
    _git(tmp_path, "commit", "-q", "-m", "course")
    return tmp_path


def _answer(path: Path) -> str:
    """Write an answer and an output into the exercise file, as a learner does in Jupyter."""
    nb = ex.read_notebook(path)
    cell = next(c for c in nb.cells if c.metadata.get("labkit", {}).get("exercise") == "ex1")
    cell.source = "def param_bytes(num_params, dtype):\n    return num_params * 2  # mine"
    cell.outputs = [nbformat.v4.new_output("stream", text="done\n")]
    cell.execution_count = 3
    nbformat.write(nb, str(path))
    return path.read_text(encoding="utf-8")


def test_learner_answers_never_make_the_exercises_out_of_sync(course):
    sols, exs = course / "solutions", course / "exercises"
    _answer(exs / FIXTURE.name)
    assert ex.check_sync(sols, exs) == []                  # answers in the working tree
    (exs / "99_grading_fixture (my copy).ipynb").write_text("{}")
    assert ex.check_sync(sols, exs) == []                  # a notebook of the learner's own
    _git(course, "add", ".")
    _git(course, "commit", "-q", "-m", "my answers")
    assert ex.check_sync(sols, exs) == []                  # answers committed
    nb = ex.read_notebook(sols / FIXTURE.name)             # a solution changes, not regenerated
    nb.cells[0].source += "\n\nA new sentence."
    nbformat.write(nb, str(sols / FIXTURE.name))
    assert [p for p in ex.check_sync(sols, exs) if "out of date" in p] == [
        f"{exs / FIXTURE.name} is out of date with {sols / FIXTURE.name}; run `python -m "
        "labkit.course.exercises` (it keeps a copy of an edited file)"]
    shutil.copy(exs / FIXTURE.name, exs / "42_orphan.ipynb")   # the maintainers' own orphan
    _git(course, "add", ".")
    _git(course, "commit", "-q", "-m", "a solution changes; an exercise without a solution")
    assert any("42_orphan.ipynb has no solutions notebook" in p
               for p in ex.check_sync(sols, exs))


def test_regenerating_keeps_a_copy_of_edited_exercises(course, capsys):
    sols, exs = course / "solutions", course / "exercises"
    target = exs / FIXTURE.name
    mine = _answer(target)
    assert ex.main(["--solutions", str(sols), "--exercises", str(exs)]) == 0
    out = capsys.readouterr().out
    (backup,) = sorted((exs / ".backup").glob("99_grading_fixture.*.ipynb"))
    assert backup.read_text(encoding="utf-8") == mine      # the answers are kept, byte for byte
    assert f"kept them in {backup}" in out
    assert target.read_text(encoding="utf-8") == ex.render_path(sols / FIXTURE.name)
    assert (exs / ".backup" / ".gitignore").read_text().strip().endswith("*")
    # an untouched file that is only stale (as committed) is replaced without a copy
    nb = ex.read_notebook(sols / FIXTURE.name)
    nb.cells[0].source += "\n\nA new sentence."
    nbformat.write(nb, str(sols / FIXTURE.name))
    _git(course, "checkout", "-q", "--", "exercises")
    assert ex.generate(sols, exs) == [ex.Written(target, backup=None)]
    assert len(list((exs / ".backup").glob("*.ipynb"))) == 1


def test_regenerating_outside_git_keeps_a_copy_too(tmp_path):
    out = tmp_path / "exercises"
    ex.generate(FIX_SOL, out)
    mine = _answer(out / FIXTURE.name)
    (written,) = ex.generate(FIX_SOL, out)
    assert written.backup is not None and written.backup.read_text(encoding="utf-8") == mine


# ---------------------------------------------------------------------- the course's real notebooks

def test_real_exercises_in_sync():
    """Judged as committed (or as just regenerated): a learner's answers do not count."""
    assert REAL, "no solutions notebooks found"
    assert ex.check_sync(ex.REPO_ROOT / "solutions", ex.REPO_ROOT / "exercises") == []
