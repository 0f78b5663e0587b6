"""labkit.course.grading messages, and `labkit grade`: it discriminates right from wrong answers and only
trusts the source of the learner's exercise cells (DESIGN "Grading").

Each learner variant of the fixture is executed once (a kernel each, ~1-3 s) and shared through a
module-scoped cache; the merge itself is also tested without a kernel."""
from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import nbformat
import pytest

from labkit import cli
from labkit.course import grader, grading
from labkit.course import exercises as ex
from labkit.course.grading import GradingError

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
SOLUTION = FIXTURES / "solutions" / "99_grading_fixture.ipynb"
EXERCISE = FIXTURES / "exercises" / "99_grading_fixture.ipynb"
REAL = sorted((ex.REPO_ROOT / "solutions").glob("*.ipynb"))


# ================================================================= labkit.course.grading (no kernel)

def _message(fn, *args, **kwargs) -> str:
    with pytest.raises(GradingError) as info:
        fn(*args, **kwargs)
    assert isinstance(info.value, AssertionError)
    return str(info.value)


def test_check_close_bytes_message_states_both_values_units_ratio_and_hint():
    msg = _message(grading.check_close, "adam", 12e9, 24e9, unit="bytes", hint="4 bytes each")
    assert msg.splitlines() == [
        "adam: wrong value (relative tolerance 1e-06)",
        "  expected: 24,000,000,000 bytes (24 GB = 22.35 GiB)",
        "  received: 12,000,000,000 bytes (12 GB = 11.18 GiB)",
        "  ratio received/expected: 0.5 (received is 1/2 of expected)",
        "  look at: 4 bytes each",
    ]


def test_check_close_names_gib_vs_gb_and_bits_vs_bytes():
    assert "GiB vs GB?" in _message(grading.check_close, "m", 14 * 2**30, 14e9, unit="bytes")
    assert "bits vs bytes?" in _message(grading.check_close, "bw", 8 * 25e9, 25e9, unit="bytes/s")
    assert "25 GB/s" in _message(grading.check_close, "bw", 8 * 25e9, 25e9, unit="bytes/s")


def test_check_close_passes_within_tolerance_and_prints(capsys):
    grading.check_close("t", 1.0 + 1e-9, 1.0)
    grading.check_close("t", 105, 100, rtol=0.1, unit="s")
    assert capsys.readouterr().out == "\u2713 t: 1\n\u2713 t: 105 s\n"


@pytest.mark.parametrize("received", [None, "24e9", [1.0], float("nan")])
def test_check_close_rejects_non_numbers(received):
    msg = _message(grading.check_close, "x", received, 24e9, unit="bytes")
    assert "24,000,000,000 bytes" in msg
    assert ("expected a number" in msg) or ("received: nan" in msg)


def test_check_int_and_equal():
    assert grading.check_int("n", 7.0, 7) is None
    msg = _message(grading.check_int, "n", 6, 7, hint="count the biases")
    assert "expected: 7" in msg and "received: 6" in msg and "look at: count the biases" in msg
    assert "whole number" in _message(grading.check_int, "n", 6.5, 7)
    msg = _message(grading.check_equal, "shape", "4", 4)
    assert "expected: 4" in msg and "received: '4'" in msg and "types: expected int, received str" in msg
    grading.check_equal("tuple", (1, 2), (1, 2))


def test_check_callable_compares_with_reference_per_case():
    def ref(n, dtype="fp32"):
        return n * (4 if dtype == "fp32" else 2)

    grading.check_callable("ok", ref, [1, (3, "bf16"), {"n": 2, "dtype": "fp16"},
                                       ((5,), {"dtype": "bf16"})], ref)
    msg = _message(grading.check_callable, "pb", lambda n, dtype="fp32": n * 4,
                   [(10, "fp32"), (7_000_000_000, "bf16")], ref, unit="bytes",
                   hint="bf16 is 2 bytes")
    assert "pb: wrong result for <lambda>(7000000000, 'bf16')" in msg
    assert "expected: 14,000,000,000 bytes (14 GB = 13.04 GiB)" in msg
    assert "received: 28,000,000,000 bytes" in msg
    assert "received is 2x expected" in msg and "look at: bf16 is 2 bytes" in msg


def test_check_callable_not_attempted_and_exceptions():
    def stub(n):
        raise NotImplementedError("Exercise ex1: write ~2 lines")

    msg = _message(grading.check_callable, "ex1", stub, [1], lambda n: n)
    assert "exercise not attempted yet" in msg and "Exercise ex1: write ~2 lines" in msg

    def broken(n):
        return 1 / 0

    msg = _message(grading.check_callable, "ex1", broken, [3], lambda n: n, hint="h")
    assert "broken(3) raised ZeroDivisionError: division by zero" in msg
    assert "expected it to return 3" in msg
    assert "expected a function" in _message(grading.check_callable, "ex1", 42, [1], lambda n: n)


def test_check_callable_floats_lists_and_dicts():
    grading.check_callable("f", lambda x: x * 0.1 * 3, [1.0], lambda x: x * 0.3)
    grading.check_callable("l", lambda x: [x, {"a": x / 3}], [2], lambda x: [x, {"a": 2 * x / 6}])
    msg = _message(grading.check_callable, "l", lambda x: [x, x], [2], lambda x: [x, x + 1])
    assert "expected: [2, 3]" in msg and "received: [2, 2]" in msg


def test_check_and_format_value():
    grading.check("c", True, "never shown")
    assert _message(grading.check, "c", False, "rank 2 holds 3.1 MB; expected 0.78 MB",
                    hint="ZeRO-1 shards optimizer states") == (
        "c: rank 2 holds 3.1 MB; expected 0.78 MB\n  look at: ZeRO-1 shards optimizer states")
    assert grading.format_value(512, "bytes") == "512 bytes"
    assert grading.format_value(3 * 2**20, "bytes") == "3,145,728 bytes (3.146 MB = 3 MiB)"
    assert grading.format_value(2.5e-3, "s") == "0.0025 s"
    assert grading.format_value("x") == "'x'"


def test_grading_does_not_import_torch():
    import subprocess

    code = "import sys, labkit.course.grading; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_check_tensor_close():
    torch = pytest.importorskip("torch")
    a = torch.arange(6.0).reshape(2, 3)
    grading.check_tensor_close("t", a.clone(), a)
    b = a.clone()
    b[1, 2] = 9.0
    msg = _message(grading.check_tensor_close, "t", b, a, hint="the last column")
    assert "1 of 6 elements differ" in msg
    assert "largest difference at index (1, 2): expected 5, received 9" in msg
    assert "look at: the last column" in msg
    msg = _message(grading.check_tensor_close, "t", a.T, a)
    assert "expected shape: (2, 3)" in msg and "received shape: (3, 2)" in msg
    assert "expected a tensor" in _message(grading.check_tensor_close, "t", [1, 2], a)
    grading.check_callable("tc", lambda x: x * 2, [a], lambda x: x + x)
    assert "wrong result" in _message(grading.check_callable, "tc", lambda x: x * 3, [a],
                                      lambda x: x + x)


# ============================================================ learner variants of the fixture

def _exercise_nb():
    return ex.read_notebook(EXERCISE)


def _solution_code(id_: str) -> str:
    """The fixture's answer for one exercise: its solutions cell with the marker lines dropped."""
    sol = ex.read_notebook(SOLUTION)
    lay = ex.layout(sol)
    src = sol.cells[lay.exercise(id_).index].source
    return "\n".join(l for l in src.split("\n") if l.strip() not in (ex.BEGIN, ex.END))


WRONG = {
    "ex1": 'def param_bytes(num_params, dtype):\n    return num_params * 4',
    "ex2": 'adam_bytes = 1.5e9 * 8',
    "layers": ('def count_params(shapes, bias=True):\n    return sum(i * o + 1 for i, o in shapes)\n\n'
               'n_layer_params = count_params(layer_shapes)'),
}


def _set(nb, id_: str, source: str):
    for cell in nb.cells:
        if cell.metadata.get("labkit", {}).get("exercise") == id_:
            cell.source = source
            return nb
    raise KeyError(id_)


def _wrong_nb():
    nb = _exercise_nb()
    for id_, src in WRONG.items():
        _set(nb, id_, src)
    return nb


def _checks(nb):
    return [c for c in nb.cells if "check" in c.metadata.get("tags", [])]


def _fake_pass_outputs(nb):
    """Outputs edited to what the right answers print, with execution counts."""
    for n, cell in enumerate(c for c in nb.cells if c.cell_type == "code"):
        cell.execution_count = n + 1
        cell.outputs = [nbformat.v4.new_output("stream", text="\u2713 all good: 24 GB\n")]
    return nb


def _retag(nb):
    first, second, third, _ = _checks(nb)
    first.metadata["tags"] = ["exercise"]
    first.source = "pass"
    second.metadata["tags"] = []
    second.source = "pass"
    third.metadata["tags"] = ["exercise"]           # a check pretending to be exercise "layers"
    third.metadata["labkit"] = {"exercise": "layers"}
    third.source = "n_layer_params = sum(i * o + o for i, o in layer_shapes)"
    return nb


def _markers(nb):
    # answers wrapped in solution markers, and an "empty" region hoping to get the solution back
    _set(nb, "ex1", f"{ex.BEGIN}\n{WRONG['ex1']}\n{ex.END}")
    _set(nb, "ex2", f"{ex.BEGIN}\n{ex.END}\n### BEGIN SOLUTION ###\nadam_bytes = 1.5e9 * 8")
    _set(nb, "layers", f"{ex.BEGIN}\n{ex.END}\n" + WRONG["layers"])
    return nb


def _extra_cells(nb):
    v4 = nbformat.v4
    right = v4.new_code_cell("adam_bytes = 1.5e9 * 16\nn_layer_params = 2_362_368\n"
                             "def param_bytes(n, d):\n    return n * {'fp32': 4}.get(d, 2)")
    fake_check = v4.new_code_cell("pass", metadata={"tags": ["check"]})
    nb.cells.insert(1, v4.new_markdown_cell("# my notes"))
    nb.cells.insert(5, right)
    nb.cells.append(v4.new_code_cell(right.source))
    nb.cells.append(fake_check)
    return nb


def _missing_layers(nb):
    _set(nb, "ex1", _solution_code("ex1"))
    _set(nb, "ex2", _solution_code("ex2"))
    nb.cells = [c for c in nb.cells if c.metadata.get("labkit", {}).get("exercise") != "layers"]
    return nb


def _exception(nb):
    _set(nb, "ex1", WRONG["ex1"])
    _set(nb, "ex2", "def helper():\n    return 1 / 0\n\nadam_bytes = helper()")
    _set(nb, "layers", _solution_code("layers"))
    return nb


def _no_ids_in_order(nb):
    """Right answers in a file whose exercise cells lost their labkit metadata (kept the tag)."""
    for id_ in ("ex1", "ex2", "layers"):
        _set(nb, id_, _solution_code(id_))
    for cell in nb.cells:
        cell.metadata.pop("labkit", None)
    return nb


def _old_imports(nb):
    """Right answers in a file written against labkit 0.1's module paths (issue 9): its set-up
    and check cells import `labkit.grading`, and its answers import from old paths too. Those
    paths are gone (issue 27): the template's own cells are used, and an answer that imports an
    old path fails, naming it."""
    for id_ in ("ex1", "ex2", "layers"):
        _set(nb, id_, "from labkit.launch import run_lab   # a 0.1 path\nimport labkit.grading\n"
             + _solution_code(id_))
    for cell in nb.cells:
        cell.source = cell.source.replace("from labkit.course import grading",
                                          "from labkit import grading")
    return nb


VARIANTS = {
    "wrong": lambda: _wrong_nb(),
    "old-imports": lambda: _old_imports(_exercise_nb()),
    "edited-outputs": lambda: _fake_pass_outputs(_wrong_nb()),
    "checks-deleted": lambda: _delete_checks(_wrong_nb()),
    "checks-retagged": lambda: _retag(_wrong_nb()),
    "markers-changed": lambda: _markers(_exercise_nb()),
    "extra-cells": lambda: _extra_cells(_wrong_nb()),
    "missing-exercise": lambda: _missing_layers(_exercise_nb()),
    "exception": lambda: _exception(_exercise_nb()),
    "no-ids": lambda: _no_ids_in_order(_exercise_nb()),
}
ATTACKS = ["edited-outputs", "checks-deleted", "checks-retagged", "markers-changed", "extra-cells"]


def _delete_checks(nb):
    nb.cells = [c for c in nb.cells if "check" not in c.metadata.get("tags", [])]
    return nb


def _write(nb, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, str(path))
    return path


@pytest.fixture(scope="module")
def learner_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("learner")


@pytest.fixture(scope="module")
def graded(learner_dir):
    """name -> GradeReport, each variant executed at most once for the whole module."""
    cache: dict[str, grader.GradeReport] = {}

    def get(name: str, timeout: float = 60) -> grader.GradeReport:
        if name not in cache:
            if name == "untouched":
                cache[name] = grader.grade_notebook(EXERCISE, timeout=timeout)  # template found
            elif name == "solution":  # the solutions file handed in as a learner's file
                (learner_dir / "solution").mkdir()
                path = shutil.copy(SOLUTION, learner_dir / "solution" / EXERCISE.name)
                cache[name] = grader.grade_notebook(path, template=SOLUTION, timeout=timeout)
            else:
                nb = VARIANTS[name]() if name in VARIANTS else _TIMEOUT_VARIANT()
                path = _write(nb, learner_dir / name / EXERCISE.name)
                cache[name] = grader.grade_notebook(path, template=SOLUTION, timeout=timeout)
        return cache[name]

    return get


def _by_name(report):
    return {c.name: c for c in report.checks}


# ---------------------------------------------------------------------- merging (no kernel)

@pytest.mark.parametrize("variant", ATTACKS + ["wrong"])
def test_merge_keeps_template_checks_and_takes_only_exercise_sources(variant):
    template = ex.read_notebook(SOLUTION)
    lay = ex.layout(template)
    learner = json.loads(nbformat.writes(VARIANTS[variant]()))
    sources, _ = grader.learner_sources(learner["cells"], lay)
    merged = grader.build_graded_notebook(template, lay, sources)
    assert len(merged.cells) == len(template.cells)
    for i, (m, t) in enumerate(zip(merged.cells, template.cells)):
        if i in {e.index for e in lay.exercises}:
            continue
        assert m.source == t.source and m.metadata == t.metadata
        assert m.get("outputs", []) == []
    if variant == "markers-changed":  # taken verbatim: markers in a learner cell mean nothing
        learner_ex = [c for c in learner["cells"] if "exercise" in c["metadata"].get("tags", [])]
        assert list(sources.values()) == [ex.source_text(c) for c in learner_ex]
    else:
        assert sources == WRONG


# ------------------------------------------------------------------------------- executions

@pytest.mark.notebook
def test_kernel_is_this_interpreter(tmp_path):
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(
        "import sys, os, labkit\nprint(sys.executable)\nprint(os.getcwd())\nprint(labkit.__file__)")])
    runs = grader.execute(nb, timeout=30, cwd=tmp_path)
    assert runs[0].ran and runs[0].error is None
    printed = nb.cells[0].outputs[0]["text"].split("\n")
    assert printed[0] == sys.executable
    assert Path(printed[1]) == tmp_path
    assert Path(printed[2]) == Path(grader.__file__).parents[1] / "__init__.py"


@pytest.mark.notebook
def test_untouched_exercises_fail_every_check_as_not_attempted(graded):
    report = graded("untouched")
    assert report.template == str(SOLUTION.resolve())   # found next to exercises/, in solutions/
    assert [c.name for c in report.checks] == ["ex1", "ex2", "layers.1", "layers.2"]
    assert report.passed == 0 and not report.ok
    for check in report.checks:
        assert "not attempted yet" in check.message, check
    assert "Exercise ex2: write ~1 line" in _by_name(report)["ex2"].message
    assert [e.status for e in report.exercises] == ["ran", "not attempted", "not attempted"]
    assert report.format().endswith("0/4 checks passed; 4 failed")


@pytest.mark.notebook
def test_solution_passes_with_full_score(graded):
    report = graded("solution")
    assert report.ok and (report.passed, report.total) == (4, 4), report.format()
    assert report.notes == []
    assert "  ex1       PASS" in report.format() and report.format().endswith("4/4 checks passed")


@pytest.mark.notebook
def test_an_answer_importing_a_removed_module_path_fails_naming_it(graded):
    report = graded("old-imports")
    assert not report.ok and report.passed < report.total, report.format()
    assert "labkit.launch" in report.format(), report.format()


def test_wrong_answers_fail_with_expected_and_received(graded):
    report = graded("wrong")
    checks = _by_name(report)
    assert report.passed == 0
    assert "wrong result for param_bytes(7000000000, 'bf16')" in checks["ex1"].message
    assert "expected: 14,000,000,000 bytes" in checks["ex1"].message
    assert "received: 28,000,000,000 bytes" in checks["ex1"].message
    assert "expected: 24,000,000,000 bytes (24 GB = 22.35 GiB)" in checks["ex2"].message
    assert "received: 12,000,000,000 bytes" in checks["ex2"].message
    assert "look at: weights, gradients and both AdamW moments" in checks["ex2"].message
    assert "expected: 2,362,368" in checks["layers.1"].message
    assert "received: 2,359,299" in checks["layers.1"].message


@pytest.mark.notebook
@pytest.mark.parametrize("attack", ATTACKS)
def test_attacks_do_not_make_wrong_answers_pass(graded, attack):
    report = graded(attack)
    assert [c.name for c in report.checks] == ["ex1", "ex2", "layers.1", "layers.2"]
    assert report.passed == 0 and not report.ok, report.format()
    if attack != "markers-changed":
        assert "received: 12,000,000,000 bytes" in _by_name(report)["ex2"].message
    if attack == "checks-retagged":
        assert any("matches no exercise" in n for n in report.notes)


@pytest.mark.notebook
def test_missing_exercise_is_named_and_failed(graded):
    report = graded("missing-exercise")
    checks = _by_name(report)
    assert checks["ex1"].passed and checks["ex2"].passed
    for name in ("layers.1", "layers.2"):
        assert not checks[name].passed
        assert "exercise layers is missing from your file" in checks[name].message
    assert report.format().endswith("2/4 checks passed; 2 failed")


@pytest.mark.notebook
def test_exception_in_an_exercise_is_shown(graded):
    report = graded("exception")
    checks = _by_name(report)
    assert not checks["ex1"].passed and "received: 28,000,000,000 bytes" in checks["ex1"].message
    assert checks["ex2"].message == "exercise ex2 raised ZeroDivisionError: division by zero"
    assert checks["layers.1"].passed and checks["layers.2"].passed
    (ex2,) = [e for e in report.exercises if e.id == "ex2"]
    assert ex2.status == "error"
    assert "return 1 / 0" in ex2.traceback and "ZeroDivisionError" in ex2.traceback
    text = report.format()
    assert "Errors in your exercise cells:" in text and "return 1 / 0" in text
    assert "\x1b[" not in text


@pytest.mark.notebook
def test_exercise_cells_without_ids_are_matched_in_order(graded):
    report = graded("no-ids")
    assert report.ok, report.format()


def _TIMEOUT_VARIANT():
    nb = _exercise_nb()
    _set(nb, "ex1", _solution_code("ex1"))
    _set(nb, "ex2", "while True:\n    pass")
    return nb


@pytest.mark.notebook
def test_endless_exercise_is_interrupted_and_the_rest_still_graded(graded):
    report = graded("timeout", timeout=2)
    checks = _by_name(report)
    assert checks["ex1"].passed
    assert "exercise ex2 ran longer than 2 s and was interrupted" in checks["ex2"].message
    assert "not attempted" in checks["layers.1"].message


# -------------------------------------------------------------------------------- the command

@pytest.mark.notebook
def test_cli_exit_codes_and_json(learner_dir, capsys):
    path = _write(_exception(_exercise_nb()), learner_dir / "cli" / EXERCISE.name)
    assert cli.main(["grade", str(path), "--template", str(SOLUTION), "--json"]) == 1
    data = json.loads(capsys.readouterr().out)
    assert (data["passed"], data["total"], data["ok"]) == (2, 4, False)
    assert [c["passed"] for c in data["checks"]] == [False, False, True, True]
    assert cli.main(["grade", str(SOLUTION)]) == 0
    assert capsys.readouterr().out.rstrip().endswith("4/4 checks passed")


def test_cli_bad_input_exits_2(tmp_path, capsys):
    assert cli.main(["grade", str(tmp_path / "nope.ipynb")]) == 2
    assert "no such file" in capsys.readouterr().err
    bad = tmp_path / "99_grading_fixture.ipynb"
    bad.write_text("this is not json")
    assert cli.main(["grade", str(bad), "--template", str(SOLUTION)]) == 2
    assert "is not a Jupyter notebook" in capsys.readouterr().err
    bad.write_text('{"cells": 3}')
    assert cli.main(["grade", str(bad), "--template", str(SOLUTION)]) == 2
    assert "is not a Jupyter notebook" in capsys.readouterr().err
    lone = tmp_path / "77_unknown_module.ipynb"
    shutil.copy(EXERCISE, lone)
    assert cli.main(["grade", str(lone)]) == 2
    assert "no solutions notebook matches '77_unknown_module.ipynb'" in capsys.readouterr().err
    assert cli.main(["grade", str(EXERCISE), "--timeout", "0"]) == 2
    assert "--timeout=0" in capsys.readouterr().err
    assert cli.main(["grade", str(EXERCISE), "--template", str(EXERCISE)]) == 2
    assert "not a valid solutions notebook" in capsys.readouterr().err


def test_find_template_by_name_then_by_number(tmp_path):
    (tmp_path / "solutions").mkdir()
    (tmp_path / "exercises").mkdir()
    sol = tmp_path / "solutions" / "97_pipeline.ipynb"
    shutil.copy(SOLUTION, sol)
    assert grader.find_template(tmp_path / "exercises" / "97_pipeline.ipynb") == sol
    assert grader.find_template(tmp_path / "exercises" / "97_pipeline (copy).ipynb") == sol
    with pytest.raises(grader.GradeInputError, match="available: .*97_pipeline.ipynb"):
        grader.find_template(tmp_path / "exercises" / "98_other.ipynb")


# ------------------------------------------------------------------ the course's real notebooks

@pytest.mark.notebook
@pytest.mark.slow
@pytest.mark.parametrize("solution", REAL, ids=[p.name for p in REAL])
def test_real_solution_passes_and_untouched_exercise_fails(solution, tmp_path):
    report = grader.grade_notebook(solution, template=solution)
    assert report.ok, report.format()
    # the exercise as generated (exercises/ in the working tree may hold a learner's answers)
    exercise = tmp_path / "exercises" / solution.name
    exercise.parent.mkdir()
    exercise.write_text(ex.render_path(solution), encoding="utf-8")
    report = grader.grade_notebook(exercise, template=solution)
    failed = [c.name for c in report.checks if not c.passed]
    assert failed == [c.name for c in report.checks], (
        "every check must fail on the untouched exercise notebook:\n" + report.format())


# ------------------------------------------------------------------ answers that game a check
# (issue 30: an int whose __eq__ always says yes, a value that reads the check's frame)

class _AlwaysEqual(int):
    def __eq__(self, other):
        return True

    __hash__ = int.__hash__


class _FrameReader:
    """A 'number' whose conversion reads `expected` from the check's frame."""

    def __float__(self):
        import sys
        frame = sys._getframe(1)
        while frame is not None:
            if "expected" in frame.f_locals:
                return float(frame.f_locals["expected"])
            frame = frame.f_back
        return -1.0


def test_an_int_whose_eq_always_agrees_is_compared_by_its_value():
    with pytest.raises(grading.GradingError, match="wrong value"):
        grading.check_int("x", _AlwaysEqual(3), 7)
    with pytest.raises(grading.GradingError, match="wrong value"):
        grading.check_equal("x", _AlwaysEqual(3), 7)
    with pytest.raises(grading.GradingError, match="wrong result"):
        grading.check_callable("f", lambda n: _AlwaysEqual(0), cases=[1, 2], reference=lambda n: n)
    grading.check_int("x", _AlwaysEqual(7), 7)          # its value, when right, still passes


def test_a_value_that_reads_the_checks_frame_is_not_a_number():
    import numbers
    numbers.Real.register(_FrameReader)                # as a determined answer would
    with pytest.raises(grading.GradingError, match="expected a number"):
        grading.check_close("x", _FrameReader(), 123.0)
    with pytest.raises(grading.GradingError):
        grading.check("x", _FrameReader(), "a plain condition")


def test_the_learner_runs_before_any_expected_value_exists():
    """check_callable calls the learner's function on every case before the reference: a
    function that looks for `expected` up its callers' frames finds none."""
    import sys

    def peek(n):
        frame = sys._getframe(1)
        while frame is not None:
            if "expected" in frame.f_locals:
                return frame.f_locals["expected"]
            frame = frame.f_back
        return None

    with pytest.raises(grading.GradingError, match="wrong result"):
        grading.check_callable("f", peek, cases=[1, 2, 3], reference=lambda n: 10 * n)


def test_plain_values_keep_what_honest_answers_return():
    import numpy as np
    torch = pytest.importorskip("torch")
    grading.check_callable("f", lambda n: np.arange(n), cases=[3], reference=lambda n: list(range(n)))
    grading.check_close("x", np.float32(0.5), 0.5)
    grading.check_equal("t", (1, "a", [2.0]), (1, "a", [2.0]))
    grading.check_int("n", torch.tensor(4), 4)
    assert grading.plain({"a": (1, [np.int64(2)])}) == {"a": (1, [2])}
