"""The verdict is decided in the grader's process (labkit.course.verdict, labkit.course.judge):
the learner's kernel records what each check received, never an expected value; the grader
decides against the records of a run of the solutions, with the checks' own messages."""
from __future__ import annotations

import json
import math

import pytest

from labkit.course import exercises as ex
from labkit.course import grader, grading, judge, verdict

REAL = sorted((ex.REPO_ROOT / "solutions").glob("*.ipynb"))


class _Shell:
    def __init__(self):
        self.records = []
        self.display_pub = self

    def publish(self, data, metadata=None):
        self.records.append(json.loads(data[verdict.MIME]))


@pytest.fixture
def shell(monkeypatch):
    import IPython

    fake = _Shell()
    monkeypatch.setenv("LABKIT_GRADE_RUN", "test")
    monkeypatch.setattr(IPython, "get_ipython", lambda: fake)
    monkeypatch.setattr(grading, "_PUBLISH", [fake.publish])    # bound at import in a kernel
    return fake


def test_the_grading_kernels_variable_is_the_kernels():
    from labkit.course import kernel

    assert grading._GRADE_RUN == kernel.ENV_GRADE_RUN


@pytest.mark.parametrize("value", [
    0, -7, 2**80, 1.5, math.inf, -math.inf, "text", b"\x00\xff", 3 + 4j, None, True,
    (1, (2.5, "a")), [1, [2, (3,)]], frozenset({1, 2}), {1: "a", (2, 3): [4.0]},
    {"x": {"y": (1, 2)}}, {"\x00labkit": "tuple", "v": [1]},
])
def test_plain_values_survive_the_trip_as_they_were(value):
    back = verdict.decode(json.loads(json.dumps(verdict.encode(grading.plain(value)))))
    assert back == value and type(back) is type(value)


def test_nan_opaque_and_tensors_survive_the_trip():
    torch = pytest.importorskip("torch")
    assert math.isnan(verdict.decode(verdict.encode(math.nan)))
    opaque = verdict.decode(verdict.encode(grading.plain(object())))
    assert isinstance(opaque, grading.Opaque) and opaque.kind == "object"
    t = torch.arange(6, dtype=torch.bfloat16).reshape(2, 3)
    back = verdict.decode(json.loads(json.dumps(verdict.encode(t))))
    assert back.dtype == torch.bfloat16 and torch.equal(back, t)


def _wrong_callable(x):
    if x == 3:
        raise KeyError("no such size")
    return x * 2


def _stub(x):
    raise NotImplementedError("Exercise ex1: write ~1 line")


def _square(x):
    return x * x


# (check function, the learner's arguments, the reference's arguments): each fails.
CASES = {
    "close: wrong": (grading.check_close, ("m", 1.0e9), ("m", 2**30), {"unit": "bytes"}),
    "close: not a number": (grading.check_close, ("m", "12"), ("m", 12.0), {}),
    "int: wrong": (grading.check_int, ("n", 7), ("n", 8), {"hint": "count again"}),
    "int: a fraction": (grading.check_int, ("n", 7.5), ("n", 8), {}),
    "equal: another type": (grading.check_equal, ("e", [1, 2]), ("e", (1, 2)), {}),
    "check: false": (grading.check, ("c", False, "the lab said no"), None, {}),
    "callable: wrong": (grading.check_callable, ("f", lambda x: x * 3, [1, 2]),
                        ("f", _square, [1, 2]), {"rtol": 1e-9}),
    "callable: raises": (grading.check_callable, ("f", _wrong_callable, [2, 3]),
                         ("f", _square, [2, 3]), {}),
    "callable: a stub": (grading.check_callable, ("f", _stub, [2]), ("f", _square, [2]), {}),
    "callable: not a function": (grading.check_callable, ("f", 42, [2]), ("f", _square, [2]),
                                 {}),
    "raises: returns": (grading.check_raises, ("r", _square, (2,), ValueError),
                        ("r", _stub, (2,), NotImplementedError), {"why": "it must"}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_grader_decides_with_the_kernels_own_message(case, shell):
    """Kernel side, the check with its expected value fails with message M; the learner's
    record (expected value JUDGED) decided against the judge's record gives M exactly."""
    check, mine, theirs, options = CASES[case]
    if check is grading.check_callable:
        judged_args = (*mine, grading.JUDGED)
        kernel_args, judge_args = (*mine, theirs[1]), (*theirs, theirs[1])
    elif check is grading.check_raises:
        judged_args, kernel_args, judge_args = mine, mine, theirs
        options = dict(options, reference=None)
    elif check is grading.check:
        judged_args = kernel_args = judge_args = mine
    else:
        judged_args, kernel_args, judge_args = (*mine, grading.JUDGED), (*mine, theirs[1]), \
            (*theirs, theirs[1])
    with pytest.raises(grading.GradingError) as err:
        check(*kernel_args, **options)
    shell.records.clear()
    if check is grading.check_raises:       # the judge's record: its reference raises
        check(theirs[0], theirs[1], theirs[2], NotImplementedError, **options)
        judged = dict(shell.records[-1], exception="ValueError")
    elif check is grading.check:
        judged = {"kind": "check", "name": "c"}
    else:
        check(*judge_args, **options)
        judged = shell.records[-1]
    shell.records.clear()
    try:
        check(*judged_args, **options)
    except grading.GradingError:
        pass                # the learner's kernel may fail too (a stub, not a function)
    assert judge.decide(shell.records[-1], judged) == str(err.value)


def test_a_learner_record_with_the_right_values_passes_and_nothing_is_decided_in_kernel(shell):
    grading.check_close("x", 0.5, grading.JUDGED)          # no expected value: no error here
    grading.check_callable("f", _square, [1, 2, 3], grading.JUDGED)
    learner = list(shell.records)
    shell.records.clear()
    grading.check_close("x", 0.5 + 1e-12, 0.5)
    grading.check_callable("f", _square, [1, 2, 3], _square)
    assert judge.first_failure(learner, shell.records) is None
    assert "expected" not in learner[0] and "expected" not in learner[1]
    assert "0.7" in judge.first_failure([dict(learner[0], received=0.7)], shell.records)


def test_a_callable_record_that_drops_its_calls_fails(shell):
    """The third red-team pass: a record rewritten in the kernel (calls=[]) compared nothing."""
    grading.check_callable("f", lambda x: x + 1, [1, 2, 3], grading.JUDGED)
    learner = shell.records[-1]
    grading.check_callable("f", _square, [1, 2, 3], _square)
    judged = shell.records[-1]
    for forged in (dict(learner, calls=[]), dict(learner, calls=[], results=[]),
                   dict(learner, results=learner["results"][:1], calls=learner["calls"][:1])):
        assert "does your code change how checks report" in judge.decide(forged, judged)


def test_more_records_than_the_judge_has_fail():
    rec = {"kind": "int", "name": "n", "received": 1}
    message = judge.first_failure([rec, rec], [dict(rec, expected=1, unit=None, hint=None)])
    assert message.startswith("n: the check reported more results (2) than it makes (1)")


def test_judged_source_takes_every_expected_value_out_of_the_kernel():
    src = ("grading.check_close('a', a, reference.f(), unit='s')\n"
           "grading.check_int('b', b, expected=len(reference.g()))\n"
           "grading.check_callable('c', c, cases=[1], reference=reference.c)\n"
           "reference.check_with_mistakes('d', d, [1], reference.d, rtol=0.1)\n"
           "grading.check_raises('e', e, (1,), ValueError, reference=reference.e)\n"
           "grading.check('f', ok, 'why')\n")
    out = grader.judged_source(src)
    for gone in ("reference.f()", "reference.g()", "=reference.c", "reference.d,",
                 "=reference.e"):
        assert gone not in out, out
    assert out.count(".JUDGED") == 5 and "grading.check('f', ok, 'why')" in out
    assert grader.judged_source("x = 1  # no checks") == "x = 1  # no checks"
    assert grader.judged_source("%time broken(") == "%time broken("


@pytest.mark.parametrize("solution", REAL, ids=[p.name for p in REAL])
def test_no_check_of_the_real_solutions_computes_an_expected_value_in_the_learners_kernel(
        solution):
    import ast

    nb = ex.read_notebook(solution)
    lay = ex.layout(nb, where=str(solution))
    for c in lay.checks:
        tree = ast.parse(grader.judged_source(nb.cells[c.index].source))
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            name = getattr(node.func, "attr", getattr(node.func, "id", None))
            if name not in grader._EXPECTED_ARGUMENT:
                continue
            position, keyword = grader._EXPECTED_ARGUMENT[name]
            given = [kw.value for kw in node.keywords if kw.arg == keyword]
            if position is not None and len(node.args) > position:
                given.append(node.args[position])
            assert given, f"{solution.name} cell {c.index}: {name} without its expected value"
            for value in given:
                assert ast.unparse(value) == grader._JUDGED, (solution.name, c.index,
                                                              ast.unparse(node))


def test_a_judge_is_kept_per_template_and_only_when_it_passed(tmp_path, monkeypatch):
    monkeypatch.setenv(judge.CACHE_ENV, str(tmp_path))
    assert judge.key("a" * 64) != judge.key("b" * 64)
    judge.save("k1", judge.Judge({3: [{"kind": "int"}]}))
    judge.save("k2", judge.Judge({3: []}, failures={3: "it failed"}))
    assert judge.load("k1").records == {3: [{"kind": "int"}]}
    assert judge.load("k2") is None and judge.load("nothing") is None
    (tmp_path / "k3.json").write_text("{not json")
    assert judge.load("k3") is None
