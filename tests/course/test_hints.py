"""The hints of the check cells of solutions/*.ipynb (issue 28, item 10): a hint names the concept
or the likely mistake, never the code, the formula that is the answer, or the number.

03's straggler hint was `1 - 1 / (1 + x), not x`, loss_40's `1 - 1/1.4 = 0.2857`, 06's row hint
`G.apply(x @ W_i^T), then + bias, once`, 02's share hint `450 GB/s per direction`. Every `hint=`
of every check cell (the strings of its expression, and of any dict or list it reads) is parsed
here with ast and must not hold:

- a number of 2 or more significant digits that is an expected value of a check of its cell
  (the checks' references are evaluated on their cases: the cell runs with recording stubs);
- call text of what its exercise forbids (the exercise cell's metadata labkit.forbid), or any
  other code: `name(`, `name[`, `name=value`, `**`, `//`, `@`;
- a formula: an operator between two operands (`p - 1`, `S/N`, `16 x 7e9`, `k >= 1`);
- a hardware or size figure (`450 GB/s`, `80 GB`, `16 bytes`, `12 B/param`).

The wording rules of labkit's own named mistakes are in test_grading_hints.py.
"""
from __future__ import annotations

import ast
import builtins
import functools
import importlib
import inspect
import math
import re
import types
from dataclasses import dataclass, field
from pathlib import Path

import nbformat
import pytest

from labkit.course import forbid, grading, reference

ROOT = Path(__file__).resolve().parents[2]
SOLUTIONS = sorted((ROOT / "solutions").glob("[0-9][0-9]_*.ipynb"))


# ------------------------------------------------------------------------------ the hints

@dataclass
class CheckCell:
    index: int
    source: str
    tree: ast.Module
    forbid: tuple[str, ...]                 # its exercise's metadata labkit.forbid
    hints: list[str] = field(default_factory=list)


def _tags(cell) -> set[str]:
    return set(cell.get("metadata", {}).get("tags", []))


def _strings(node: ast.AST, assigned: dict[str, list[ast.AST]], seen=frozenset()) -> list[str]:
    """The strings of a hint expression: its str constants (an f-string's literal parts, `{}`
    where a value goes), those of the cell-level dicts and lists a name in it refers to, and
    those of `reference.X` objects."""
    out: list[str] = []
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, ast.JoinedStr):
        return ["".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values)]
    if isinstance(node, ast.Name) and node.id in assigned and node.id not in seen:
        for value in assigned[node.id]:
            out += _strings(value, assigned, seen | {node.id})
        return out
    if isinstance(node, ast.Subscript):           # HINTS[key]: what HINTS holds, not the key
        return _strings(node.value, assigned, seen)
    if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
            and node.value.id == "reference"):
        return _object_strings(getattr(reference, node.attr, None))
    for child in ast.iter_child_nodes(node):
        out += _strings(child, assigned, seen)
    return out


def _object_strings(obj) -> list[str]:
    if isinstance(obj, str):
        return [obj]
    if isinstance(obj, dict):
        obj = list(obj.values())
    if isinstance(obj, (list, tuple, set)):
        return [s for item in obj for s in _object_strings(item)]
    return []


@functools.lru_cache(maxsize=None)
def check_cells(path: Path) -> tuple[CheckCell, ...]:
    nb = nbformat.read(path, as_version=4)
    trees = {i: ast.parse(forbid.python_source(c.source)) for i, c in enumerate(nb.cells)
             if c.cell_type == "code"}
    assigned: dict[str, list[ast.AST]] = {}
    for tree in trees.values():
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign):
                for target in node.targets:
                    if isinstance(target, ast.Name):
                        assigned.setdefault(target.id, []).append(node.value)
    out, current = [], ()
    for i, cell in enumerate(nb.cells):
        if "exercise" in _tags(cell):
            current = tuple(cell.metadata.get("labkit", {}).get("forbid", []))
        if "check" not in _tags(cell):
            continue
        check = CheckCell(i, cell.source, trees[i], current)
        for node in ast.walk(check.tree):
            if not isinstance(node, ast.Call):
                continue
            for kw in node.keywords:
                if kw.arg == "hint":
                    check.hints += _strings(kw.value, assigned)
            if _callee(node) == "reference.check_diagnosis":     # its hints live in reference
                check.hints += _object_strings(reference.DIAGNOSIS_HINTS)
        out.append(check)
    return tuple(out)


def _callee(call: ast.Call) -> str:
    try:
        return ast.unparse(call.func)
    except Exception:  # noqa: BLE001
        return ""


# ------------------------------------------------------------------------------ the rules

_NUMBER = re.compile(r"(?<![\w.])(\d+(?:,\d{3})*(?:\.\d+)?|\.\d+)(?:e[-+]?\d+)?", re.I)
# an operand: a number (maybe times a letter: 6N, 2R) or a lone letter (p, m, N, S)
_ATOM = r"(?<![\w.])(?:\d+(?:[.,]\d+)*(?:e\d+)?[A-Za-z]?|[A-Za-z])(?!\w)"
_FORMULA = [
    re.compile(_ATOM + r"\s*\)*\s*(?:[-+*/^<>]=?|==|\sx\s|×)\s*\(*\s*" + _ATOM),   # p - 1, S/N
    re.compile(r"[\w)]\s*[+*]\s*[\w(]"),                                         # 6N + 3 a
    re.compile(r"\d\s+x\s+[\w(]|[\w)]\s+x\s+\d"),                                 # days x 86,400
    re.compile(r"(?<![\w.])\d[\d,.]*(?:e\d+)?\s+[A-Z](?!\w)"),                    # 20 N tokens
]
_HYPHENATED = re.compile(r"\b[A-Za-z]{2,}(?:-[\w.]+)+")      # Llama-2-70B, ZeRO-3, all-gather
_EMPHASIS = re.compile(r"(?<![\w*])\*(\w[^*]*?)\*(?![\w*])")     # *and*: markdown, not a product
_CODE = [(re.compile(r"[A-Za-z_][\w.]*\("), "call text"),
         (re.compile(r"[A-Za-z_]\w*\["), "subscript"),
         (re.compile(r"[A-Za-z_]\w*\s*=\s*[\w'\"(\[.-]"), "an assignment or keyword argument"),
         (re.compile(r"\*\*|//|@|->"), "a Python operator")]
_FIGURE = re.compile(r"\d[\d,.]*(?:e\d+)?(?:\s*(?:[kKMGTPE]i?B(?:/s)?|[kMGT]b(?:/s|ps)|"
                     r"[kMGTP]?FLOP/?S?|bytes?)|\s+B)(?![A-Za-z])")


def significant(text: str) -> str:
    """The significant digits of a number as written: '0.2857' -> '2857', '86,400' -> '864'."""
    mantissa = re.split(r"[eE]", text)[0]
    return re.sub(r"\D", "", mantissa).lstrip("0").rstrip("0")


def digits_of(value: float, k: int) -> set[str]:
    """`value`'s first k significant digits, rounded and cut."""
    if not value or not math.isfinite(value):
        return set()
    rounded = re.sub(r"\D", "", f"{abs(value):.{k - 1}e}".split("e")[0])
    cut = re.sub(r"\D", "", f"{abs(value):.15e}".split("e")[0])[:k]
    return {rounded.rstrip("0") or "0", cut.rstrip("0") or "0"}


@functools.lru_cache(maxsize=None)
def forbidden_calls(names: tuple[str, ...]) -> frozenset[str]:
    """The names a hint may not show as call text: each forbidden callable's, and every public
    function and class of a forbidden module."""
    out = set()
    for name in (*names, *forbid.ALWAYS):
        out.add(name.rsplit(".", 1)[-1])
        obj = _resolve(name)
        if isinstance(obj, types.ModuleType):
            out |= {n for n, v in vars(obj).items() if not n.startswith("_")
                    and (inspect.isfunction(v) or inspect.isclass(v))
                    and getattr(v, "__module__", None) == obj.__name__}
    return frozenset(out)


def _resolve(name: str):
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        try:
            for part in parts[cut:]:
                obj = getattr(obj, part)
        except AttributeError:
            return None
        return obj
    return None


def problems(hint: str, forbidden: tuple[str, ...], expected: list[float] | None) -> list[str]:
    """What gives the answer away in `hint` (empty: nothing). `expected`: the values of its
    cell's checks (None: not computed, the hint has no number that could be one)."""
    found = []
    for name in (*forbidden, *forbid.ALWAYS):
        if name in hint:
            found.append(f"names what the exercise forbids: {name}")
    for name in sorted(forbidden_calls(forbidden)):
        if re.search(rf"(?<![\w.]){re.escape(name)}\(", hint):
            found.append(f"call text of what the exercise forbids: {name}(")
    for pattern, what in _CODE:
        if m := pattern.search(hint):
            found.append(f"code ({what}): {m.group(0)!r}")
    words = _EMPHASIS.sub(r"\1", _HYPHENATED.sub("W", hint))
    for pattern in _FORMULA:
        if m := pattern.search(words):
            found.append(f"a formula: {m.group(0)!r}")
            break
    if m := _FIGURE.search(hint):
        found.append(f"a figure: {m.group(0)!r}")
    for m in _NUMBER.finditer(hint):
        d = significant(m.group(0))
        if len(d) >= 2 and expected is not None:
            if any(d in digits_of(v, len(d)) for v in expected):
                found.append(f"the number {m.group(0)} is an expected value of the cell's checks")
    return found


def _has_long_number(hint: str) -> bool:
    return any(len(significant(m.group(0))) >= 2 for m in _NUMBER.finditer(hint))


# -------------------------------------------------------- the expected values of a cell's checks

class _Dummy:
    """What a lab run or a learner's answer gives: anything, falsy, formats as '?'."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return self

    def __call__(self, *args, **kwargs):
        return self

    def __getitem__(self, key):
        return self

    def __iter__(self):
        return iter(())

    def __bool__(self):
        return False

    def __format__(self, spec):
        return "?"


DUMMY = _Dummy()


def _numbers(value) -> list[float]:
    if isinstance(value, bool):
        return []
    if isinstance(value, (int, float)):
        return [float(value)]
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple, set)):
        return [x for item in value for x in _numbers(item)]
    return []


def _recorder(sinks: dict[int, list[float]], cell: list[int], fn):
    """A stand-in for the check `fn` that records, in sinks[the cell running], the values its
    reference gives on its cases (check_callable, check_with_mistakes) or its `expected`."""
    signature = inspect.signature(fn)
    params = signature.parameters

    def record(*args, **kwargs):
        bound = signature.bind(*args, **kwargs).arguments
        sink = sinks[cell[0]]
        if "cases" in params and "reference" in params:
            for case in list(bound["cases"]):
                case_args, case_kwargs = grading._split_case(case)
                sink.extend(_numbers(bound["reference"](*case_args, **case_kwargs)))
        elif "expected" in params:
            sink.extend(_numbers(bound["expected"]))

    return record


def _loaded_names(tree: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}


def _bound_names(tree: ast.AST) -> set[str]:
    out = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Name) and isinstance(n.ctx, (ast.Store, ast.Del)):
            out.add(n.id)
        elif isinstance(n, (ast.Import, ast.ImportFrom)):
            out |= {(a.asname or a.name).split(".")[0] for a in n.names}
        elif isinstance(n, (ast.FunctionDef, ast.ClassDef)):
            out.add(n.name)
    return out


@functools.lru_cache(maxsize=None)
def expected_values(path: Path) -> dict[int, list[float]]:
    """{check cell index: the expected values of its checks}: the set-up cells run as they are
    (with no warm pool, no lab), the exercise cells' imports only, each check cell with
    grading's checks replaced by recorders (the learner's answers and the labs' results: a
    dummy)."""
    nb = nbformat.read(path, as_version=4)
    ns: dict = {"__name__": "__hints__"}
    sinks: dict[int, list[float]] = {}
    running = [-1]                         # the index of the check cell running
    with pytest.MonkeyPatch.context() as mp:
        for module, name in [*((grading, n) for n in dir(grading) if n.startswith("check")),
                             (reference, "check_with_mistakes"), (reference, "check_diagnosis")]:
            fn = getattr(module, name)
            if inspect.isfunction(fn):
                mp.setattr(module, name, _recorder(sinks, running, fn))
        from labkit.runtime import pool
        mp.setattr(pool, "warm", lambda *a, **k: None)
        for i, cell in enumerate(nb.cells):
            if cell.cell_type != "code":
                continue
            tags = _tags(cell)
            tree = ast.parse(forbid.python_source(cell.source))
            if "exercise" in tags:        # the answer is not run: its imports only
                tree = ast.Module([n for n in tree.body if isinstance(n, (ast.Import,
                                                                        ast.ImportFrom))], [])
            elif "check" in tags:
                sinks[i], running[0] = [], i
                for name in _loaded_names(tree) - _bound_names(tree) - set(ns) - set(vars(builtins)):
                    ns[name] = DUMMY      # a learner's answer, or what a lab run returned
            exec(compile(tree, f"{path.name} cell {i}", "exec"), ns)   # noqa: S102
            for name in [n for n in ns if n.startswith("run_user_")]:
                ns[name] = DUMMY          # a lab: ranks are not started here
    return sinks


# ------------------------------------------------------------------------------------ tests

@pytest.mark.parametrize("path", SOLUTIONS, ids=lambda p: p.stem)
def test_every_check_cell_is_parsed_and_has_hints(path):
    cells = check_cells(path)
    assert cells, f"{path.name}: no cell tagged 'check'"
    assert any(c.hints for c in cells), f"{path.name}: no hint= found in its check cells"


@pytest.mark.parametrize("path", SOLUTIONS, ids=lambda p: p.stem)
def test_no_hint_gives_the_answer_away(path):
    cells = check_cells(path)
    # the checks' expected values are computed only where a hint shows a number that could be one
    values = expected_values(path) if any(_has_long_number(h) for c in cells
                                          for h in c.hints) else {}
    bad = []
    for cell in cells:
        for hint in cell.hints:
            for why in problems(hint, cell.forbid, values.get(cell.index)):
                bad.append(f"{path.name} cell {cell.index}: {hint!r}\n    {why}")
    assert not bad, ("hints that give the answer away (name the concept or the likely "
                     "mistake instead):\n" + "\n".join(bad))


@pytest.mark.parametrize("hint, expected, word", [
    ("1 - 1/1.4 = 0.2857: a 40% longer step keeps 1/1.4 of the throughput", [0.285714], "2857"),
    ("16 x 7e9 = 112 GB at stage 0", [112e9], "formula"),
    ("NVLink 4 carries 450 GB/s per direction", [0.73], "figure"),
    ("G.apply(x @ W_i^T), then + bias, once", [], "call text"),
    ("len(assign_buckets(gpt2_sizes, 25.0))", [7.0], "call text"),
    ("(p - 1)/(m + p - 1) of the step", [0.2727], "formula"),
    ("MixedPrecisionPolicy(param_dtype=...)", [], "call text"),
    ("SHARD_GRAD_OP: reshard_after_forward=False", [], "keyword"),
    ("LINKS['nvlink4'].bandwidth, not .bidirectional", [], "subscript"),
    ("a month of training needs 14 GPUs", [14.0], "expected value"),
    ("MFU: (6N + 3 x attention) x tokens/s / (GPUs x peak)", [], "formula"),
    ("FLOPs delivered (days x 86,400 x GPUs x dense peak x MFU)", [], "formula"),
    ("20 N tokens / the tokens one GPU trains in a month", [], "formula"),
    ("warm-up min(p - r - 1, m) forwards", [], "call text"),
    ("12 B/param", [], "figure"),
    ("none: s*b*h*(34 + 5*a*s/h)", [], "formula"),
])
def test_the_rules_catch_the_hints_that_were_the_answer(hint, expected, word):
    found = problems(hint, ("labkit.pipeline",), expected)
    assert found and any(word in f for f in found), (hint, found)


@pytest.mark.parametrize("hint", [
    "throughput goes as 1 / step time: a step x longer does not lose x of it",
    "the throughput lost is not the 40 % the step grew by",
    "each rank's product is a partial sum: sum it over the ranks (g) before the bias, which is "
    "added once",
    "the share of the whole step a stage waits",
    "idle time over busy time, not over the step",
    "the idle share of the whole step falls as m grows: the fewest m that meets the target "
    "(interleaved: a multiple of p)",
    "Llama-2-70B and Llama-3 use grouped-query attention",
    "ZeRO-3 shards the model states, never the activations",
    "every parameter *and* buffer (the model has one)",
    "sum it over the ranks before the bias (g: an all-reduce); the bias is added once",
])
def test_the_rules_let_a_concept_through(hint):
    assert problems(hint, ("labkit.pipeline",), [0.2857, 0.4, 8.0, 14.0]) == []


def test_the_forbidden_calls_of_an_exercise_are_known():
    names = forbidden_calls(("labkit.scaling", "labkit.memory.bytes_per_param"))
    assert {"bytes_per_param", "check_with_mistakes"} <= names
    assert any(n in names for n in vars(importlib.import_module("labkit.scaling")))
    assert problems("use check_with_mistakes(...) here", (), None)
    assert problems("what bytes_per_param(p) gives", ("labkit.memory.bytes_per_param",), None)


def test_min_microbatches_names_the_mix_up_of_the_bubble_relative_to_the_ideal_time():
    """07's check, called as the notebook calls it: a learner who solves (p-1)/(v m) <= target
    (the bubble relative to the ideal time) for m is told the target is the idle share."""
    path = ROOT / "solutions" / "07_pipeline_parallel.ipynb"
    calls = [node for cell in check_cells(path) for node in ast.walk(cell.tree)
             if isinstance(node, ast.Call) and _callee(node) == "reference.check_with_mistakes"
             and node.args and isinstance(node.args[0], ast.Constant)
             and node.args[0].value == "min_microbatches"]
    assert len(calls) == 1, "07's min_microbatches check is reference.check_with_mistakes"
    call = calls[0]
    kwargs = {kw.arg: kw.value for kw in call.keywords}
    args = list(call.args) + [kwargs.pop(k) for k in ("fn", "cases", "reference") if k in kwargs]
    cases = ast.literal_eval(args[2])
    ref = getattr(reference, ast.unparse(args[3]).removeprefix("reference."))
    hint = ast.literal_eval(kwargs["hint"])
    assert ref is reference.pp_min_microbatches

    def relative(p, target, chunks=1):
        m = math.ceil((p - 1) / (chunks * target))
        return m if chunks == 1 else -(-m // p) * p

    with pytest.raises(grading.GradingError) as err:
        reference.check_with_mistakes("min_microbatches", relative, cases, ref, hint=hint)
    text = str(err.value)
    assert "that is a known mistake" in text and "relative to the ideal time" in text, text
    assert "idle share" in text and hint in text, text
    reference.check_with_mistakes("min_microbatches", reference.pp_min_microbatches, cases, ref,
                                  hint=hint)


@pytest.mark.parametrize("path", SOLUTIONS, ids=lambda p: p.stem)
def test_the_expected_values_of_the_checks_are_computed(path):
    """The machinery of the number rule runs on every notebook (today no hint shows a number
    of 2 significant digits, so the rule would not run it)."""
    values = expected_values(path)
    assert set(values) == {c.index for c in check_cells(path)}
    assert any(values.values()), f"{path.name}: no check's expected value was computed"


def test_the_number_rule_sees_the_old_hints_of_03_and_04():
    def cell(path, text):
        return next(c.index for c in check_cells(path) if text in c.source)

    ddp, zero = ROOT / "solutions" / "03_ddp.ipynb", ROOT / "solutions" / "04_zero.ipynb"
    loss = expected_values(ddp)[cell(ddp, '"loss_40"')]
    assert any(math.isclose(v, 1 - 1 / 1.4) for v in loss)
    assert any("0.2857 is an expected value" in p
               for p in problems("keeps 0.2857 of it", (), loss))
    stages = expected_values(zero)[cell(zero, '"seven_b_4[')]
    assert 112e9 in stages
    assert any("112 is an expected value" in p for p in problems("112 at stage 0", (), stages))
