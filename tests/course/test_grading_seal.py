"""An answer cannot change what its checks see (issue 11, points 8 and 9; labkit.course.seal).

Each attack below is a wrong answer plus a trick that made it pass before: rebinding a name the
checks use, a helper named like the reference, patching the grading module, a labkit function a
reference calls, math.isclose or a check's defaults, patching from inside the function the check
calls, or hiding the check's error from the grader (set_custom_exc, a patched run_cell, an input
transformer). Every check must still fail, and the honest answer must still pass with no note.
"""
from __future__ import annotations

from pathlib import Path

import nbformat
import pytest

from labkit.course import exercises as ex
from labkit.course import grader, seal

pytestmark = pytest.mark.notebook

TEMPLATE = [
    ("import math\n\nfrom labkit.course import grading, reference\n"
     "from labkit.memory import PRECISIONS", {}),
    ("def model_state_bytes(precision, optimizer):\n    ### BEGIN SOLUTION\n"
     "    weight = 4 if precision == 'fp32' else 2\n"
     "    master = 4 if precision.endswith('-mixed') else 0\n"
     "    state = 2 if precision == 'bf16' else 4\n"
     "    buffers = {'sgd': 0, 'sgd-momentum': 1, 'adam': 2, 'adamw': 2}[optimizer]\n"
     "    return 2 * weight + master + buffers * state\n    ### END SOLUTION",
     {"tags": ["exercise"], "labkit": {"forbid": ["labkit.memory.bytes_per_param"]}}),
    ("grading.check_int('ex1.1', model_state_bytes('bf16-mixed', 'adamw'),\n"
     "                  reference.model_state_bytes('bf16-mixed', 'adamw'))\n"
     "grading.check_callable('ex1.2', model_state_bytes,\n"
     "                       cases=[(p, o) for p in PRECISIONS for o in ('sgd', 'adamw')],\n"
     "                       reference=reference.model_state_bytes)", {"tags": ["check"]}),
    ("### BEGIN SOLUTION\nt_ddp = 2 * 7 / 8 * 2 * 7e9 / 450e9 + 14 * 2e-6\n### END SOLUTION",
     {"tags": ["exercise"], "labkit": {"forbid": ["labkit.comm.collective_time"]}}),
    ("grading.check_close('t_ddp', t_ddp, reference.ddp_all_reduce_time(), unit='s')",
     {"tags": ["check"]}),
]
RIGHT_T = "t_ddp = 2 * 7 / 8 * 2 * 7e9 / 450e9 + 14 * 2e-6"
WRONG_1 = "def model_state_bytes(precision, optimizer):\n    return 16\n"
WRONG_2 = "t_ddp = 0.0"

ATTACKS = {   # added to the first answer (wrong), with the second answer wrong too
    "a name the check uses": "PRECISIONS = ()",
    "a helper named like the reference": (
        "class reference:\n    model_state_bytes = staticmethod(lambda p, o: 16)\n"
        "    ddp_all_reduce_time = staticmethod(lambda: 0.0)"),
    "grading rebound": ("class _Pass:\n    def __getattr__(self, name):\n"
                        "        return lambda *a, **k: None\n\ngrading = _Pass()"),
    "grading patched": ("import sys\ng = sys.modules['labkit.course.grading']\n"
                        "g.check_callable = g.check_close = lambda *a, **k: None"),
    "check code replaced": ("import sys\ng = sys.modules['labkit.course.grading']\n"
                            "g.check_callable.__code__ = g.check_close.__code__ = "
                            "(lambda *a, **k: None).__code__"),
    "defaults loosened": ("import sys\ng = sys.modules['labkit.course.grading']\n"
                          "g.check_close.__kwdefaults__['rtol'] = 2.0\n"
                          "g.check_callable.__kwdefaults__['rtol'] = 2.0"),
    "what the references call": (
        "import importlib\nm = importlib.import_module('labkit.' + 'memory')\n"
        "c = importlib.import_module('labkit.' + 'comm')\n"
        "setattr(m, 'bytes_per' + '_param', lambda p, o: 16)\n"
        "setattr(c, 'collective' + '_time', lambda *a: 0.0)"),
    "math.isclose": "import math\nmath.isclose = lambda *a, **k: True",
    "patched while the check runs": (
        "def model_state_bytes(precision, optimizer):\n    import sys\n"
        "    g = sys.modules['labkit.course.grading']\n"
        "    g.check_callable = g.check_close = lambda *a, **k: None\n"
        "    globals()['reference'] = type('R', (), {'ddp_all_reduce_time': lambda: 0.0})\n"
        "    return 16"),
    "set_custom_exc": ("get_ipython().set_custom_exc((BaseException,), "
                       "lambda *a, **k: None)"),
    "sys.excepthook": "import sys\nsys.excepthook = lambda *a: None",   # never worked: kept
    "run_cell swallows errors": (
        "ip = get_ipython()\nrun = type(ip).run_cell_async\n\n"
        "async def quiet(self, *args, **kwargs):\n"
        "    result = await run(self, *args, **kwargs)\n"
        "    result.error_in_exec = None\n    return result\n\n"
        "type(ip).run_cell_async = quiet\nip.showtraceback = lambda *a, **k: None"),
    "an input transformer": ("get_ipython().input_transformers_post.append(\n"
                             "    lambda lines: ['pass\\n'] if 'check' in ''.join(lines) "
                             "else lines)"),
    # Passed before the verdict left the kernel (labkit.course.judge): the seal's record of
    # finished checks written by the answer, the checks themselves never run.
    "the seal's verdict written by the answer": (
        "import sys\nsys.modules['labkit.course.seal']._DONE.update(range(100))\n"
        "get_ipython().input_transformers_post.append(\n"
        "    lambda lines: ['pass\\n'] if 'check' in ''.join(lines) else lines)"),
    "a done-marking transformer": (
        "import re, sys\nseal = sys.modules['labkit.course.seal']\n\n"
        "def mark(lines):\n    m = re.search(r'\\.run\\((\\d+),', ''.join(lines))\n"
        "    if m and 'check=True' in ''.join(lines):\n"
        "        seal._DONE.add(int(m.group(1)))\n        return ['pass\\n']\n"
        "    return lines\n\nget_ipython().input_transformers_post.append(mark)"),
    # the third red-team pass: records rewritten on their way out of the kernel
    "the publisher wrapped": (
        "ip = get_ipython()\npublish = ip.display_pub.publish\n\n"
        "def rewrite(data, metadata=None, **kw):\n    import json\n"
        "    for k, v in data.items():\n"
        "        if k.endswith('check+json'):\n            r = json.loads(v)\n"
        "            r.update(calls=[], results=[], received=16)\n"
        "            data = {k: json.JSONEncoder().encode(r)}\n"
        "    return publish(data, metadata, **kw)\n\nip.display_pub.publish = rewrite"),
    "json.dumps replaced": (
        "import json\ndumps = json.dumps\n"
        "json.dumps = lambda o, *a, **k: dumps(dict(o, calls=[], results=[]) if isinstance(o, "
        "dict) and o.get('kind') == 'callable' else o, *a, **k)"),
    "records forged": (
        "import json, re\nfrom IPython.display import publish_display_data\n"
        "MIME = 'application/vnd.labkit.check+json'\n"
        "FAKE = {'int': {'kind': 'int', 'name': 'ex1.1', 'received': 15},\n"
        "        'close': {'kind': 'close', 'name': 't_ddp', 'received': 1.0}}\n\n"
        "def forge(lines):\n    text = ''.join(lines)\n"
        "    kinds = [k for k, f in (('int', 'check_int'), ('close', 'check_close')) if f in text]\n"
        "    if not kinds:\n        return lines\n"
        "    return [f'publish_display_data({{MIME: json.dumps({FAKE[k]!r})}})\\n' "
        "for k in kinds]\n\nget_ipython().input_transformers_post.append(forge)"),
}


def _grade(tmp_path: Path, first: str, second: str):
    v4 = nbformat.v4
    template = tmp_path / "solutions" / "95_seal.ipynb"
    template.parent.mkdir(parents=True)
    nbformat.write(v4.new_notebook(cells=[v4.new_code_cell(s, metadata=m) for s, m in TEMPLATE]),
                   str(template))
    learner = ex.render(ex.read_notebook(template), template.name)
    learner.cells[2].source, learner.cells[4].source = first, second
    path = tmp_path / "exercises" / template.name
    path.parent.mkdir()
    nbformat.write(learner, str(path))
    return grader.grade_notebook(path, template=template, timeout=60)


def test_the_honest_answer_passes_with_no_note(tmp_path):
    honest = "\n".join(line for line in TEMPLATE[1][0].split("\n") if "SOLUTION" not in line)
    report = _grade(tmp_path, honest, RIGHT_T)
    assert report.ok and report.notes == [], report.format()


@pytest.mark.parametrize("attack", list(ATTACKS))
def test_a_trick_does_not_make_a_wrong_answer_pass(tmp_path, attack):
    trick = ATTACKS[attack]
    first = trick if trick.startswith("def model_state_bytes") else WRONG_1 + "\n" + trick
    report = _grade(tmp_path, first, WRONG_2)
    assert [c.passed for c in report.checks] == [False, False], report.format()
    assert report.checks[1].message, report.format()


def test_a_patch_of_labkit_is_refused_where_it_is_made(tmp_path):
    """labkit's modules are frozen while answers run (labkit.course.fence): a patch made in an
    answer, or inside the function a check calls, is refused there, with what it changed."""
    report = _grade(tmp_path, WRONG_1 + ATTACKS["patched while the check runs"], WRONG_2)
    assert report.checks[0].message == (
        "your exercise ex1 changes labkit.course.grading.check_callable, labkit's own (a way "
        "around the grader's guards); write it yourself"), report.checks[0].message
    report = _grade(tmp_path / "again", WRONG_1 + ATTACKS["grading patched"], RIGHT_T)
    assert report.checks[0].message.startswith("exercise ex1 was refused") or \
        "changes labkit.course.grading.check_" in report.checks[0].message, report.format()
    assert report.checks[1].passed, report.format()    # the right answer, graded as ever


def test_a_hidden_error_fails_with_its_own_message(tmp_path):
    report = _grade(tmp_path, WRONG_1 + ATTACKS["set_custom_exc"] + "\n1 / 0", RIGHT_T)
    assert report.checks[0].message == "exercise ex1 raised ZeroDivisionError: division by zero"
    assert report.checks[1].passed, report.format()


def test_bound_names_are_the_top_level_bindings():
    src = ("import os.path\nfrom math import pi as PI\nx, (y, *z) = 1, (2, 3)\nfor i in []: pass\n"
           "def f(a):\n    b = 1\nclass C:\n    d = 2\nwith open('f') as fh: pass\n"
           "squares = [k * k for k in range(3)]\n%time w = 1")
    assert seal.bound_names(src) == {"os", "PI", "x", "y", "z", "i", "f", "C", "fh", "squares"}
    assert seal.imported_modules(src) == {"os.path", "math"}
