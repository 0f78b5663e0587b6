"""An answer may not be the labkit function it asks for, nor the solutions (issue 10, point 8):
the grader refuses it by its source (labkit.course.forbid.scan) and, for what the source hides,
in the kernel (guarded callables, an audit hook on solutions/); set-up and check cells of the
real solutions hand out neither the answers' code nor their functions."""
from __future__ import annotations

import ast
from pathlib import Path

import nbformat
import pytest

from labkit.course import exercises as ex
from labkit.course import forbid, grader

REAL = sorted((ex.REPO_ROOT / "solutions").glob("*.ipynb"))
BPP = ["labkit.memory.bytes_per_param"]
RING = ["torch.distributed.all_reduce", "torch.distributed.reduce"]


# ------------------------------------------------------------------------------ the source scan

@pytest.mark.parametrize("source, forbidden, message", [
    ("from labkit.memory import bytes_per_param\n\ndef model_state_bytes(p, o):\n"
     "    return bytes_per_param(p, o)", BPP,
     "your exercise ex1 imports labkit.memory.bytes_per_param; write it yourself"),
    ("def model_state_bytes(p, o):\n    return bytes_per_param(p, o)   # from the set-up cell",
     BPP, "your model_state_bytes calls labkit.memory.bytes_per_param; write it yourself"),
    ("import labkit.memory as m\n\ndef f(p, o):\n    return m.bytes_per_param(p, o)", BPP,
     "your f calls labkit.memory.bytes_per_param; write it yourself"),
    ("import torch.distributed as dist\n\ndef ring_all_reduce(t):\n    dist.all_reduce(t)\n"
     "    return t", RING,
     "your ring_all_reduce calls torch.distributed.all_reduce; write it yourself"),
    ("%run ../solutions/02_collectives.ipynb", [],
     "your exercise ex1 reads the solutions ('../solutions/02_collectives.ipynb'); write it yourself"),
    ("import json\ncells = json.load(open('../solutions/02_collectives.ipynb'))['cells']\n"
     "exec(''.join(cells[3]['source']))", [],
     "your exercise ex1 reads the solutions ('../solutions/02_collectives.ipynb'); write it yourself"),
    ("from labkit.course import reference\nt = reference.ddp_all_reduce_time()", [],
     "your exercise ex1 imports labkit.course.reference; write it yourself"),
])
def test_scan_refuses_answers_that_use_the_answer(source, forbidden, message):
    assert forbid.scan(source, forbidden, "ex1") == message


@pytest.mark.parametrize("source, forbidden", [
    ("def bytes_per_param(p, o):\n    return {'fp32': 16}[p]\n\nx = bytes_per_param('fp32', 'adam')",
     BPP),                                            # the learner's own function of that name
    ("from functools import reduce\nimport operator\n\ndef f(xs):\n"
     "    return reduce(operator.add, xs)", RING),   # another module's `reduce`
    ("import torch.distributed as dist\n\ndef ring(t):\n    dist.isend(t, 1).wait()", RING),
    ("def broken(:\n    pass", BPP),                # a syntax error is Python's to report
])
def test_scan_accepts_honest_answers(source, forbidden):
    assert forbid.scan(source, forbidden, "ex1") is None


@pytest.mark.parametrize("solution", REAL, ids=[p.name for p in REAL])
def test_real_solutions_pass_their_own_scan(solution):
    nb = ex.read_notebook(solution)
    for e in ex.layout(nb).exercises:
        assert forbid.scan(nb.cells[e.index].source, e.forbid, e.id) is None, e.id


@pytest.mark.parametrize("solution", REAL, ids=[p.name for p in REAL])
def test_set_up_and_check_cells_do_not_hand_out_answers(solution):
    nb = ex.read_notebook(solution)
    lay = ex.layout(nb)
    assert any(e.forbid for e in lay.exercises), "declare what the exercises may not call"
    every = sorted({name for e in lay.exercises for name in e.forbid})
    exercise_cells = {e.index for e in lay.exercises}
    check_cells = {c.index for c in lay.checks}
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code" or i in exercise_cells:
            continue
        if i not in check_cells:      # set-up: imports nothing an exercise may not call
            assert forbid.scan(cell.source, every, f"cell {i}") is None, cell.source
            continue
        tree = ast.parse(cell.source)  # checks: no reference implementation inline
        inline = [type(n).__name__ for n in ast.walk(tree)
                  if isinstance(n, (ast.FunctionDef, ast.Lambda, ast.ClassDef, ast.While))]
        assert inline == [], f"cell {i} defines {inline}: put references in labkit.course.reference"
        names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
        spelled = {f for f in every if f.rsplit(".", 1)[-1] in names}
        assert not spelled, f"check cell {i} calls {spelled}; call labkit.course.reference instead"


def test_forbid_metadata_is_validated():
    cell = nbformat.v4.new_code_cell("### BEGIN SOLUTION\nx = 1\n### END SOLUTION",
                                     metadata={"tags": ["exercise"],
                                               "labkit": {"forbid": ["labkit.memory.bytes per"]}})
    nb = nbformat.v4.new_notebook(cells=[cell, nbformat.v4.new_code_cell("c", metadata={"tags": ["check"]})])
    with pytest.raises(ex.NotebookFormatError, match="labkit.forbid"):
        ex.layout(nb)


# ------------------------------------------------------------------- in the kernel (runtime)

TEMPLATE_CELLS = [
    ("from labkit.course import grading\nfrom labkit.course import reference", {}),
    ("def bpp(precision, optimizer):\n    ### BEGIN SOLUTION\n"
     "    return {'bf16-mixed': 16, 'fp32': 8}[precision]\n    ### END SOLUTION",
     {"tags": ["exercise"], "labkit": {"forbid": BPP}}),
    ("grading.check_callable('bpp', bpp, cases=[('bf16-mixed', 'adamw'), ('fp32', 'sgd')],\n"
     "                       reference=reference.model_state_bytes)", {"tags": ["check"]}),
    ("### BEGIN SOLUTION\nvalue = 16\n### END SOLUTION", {"tags": ["exercise"]}),
    ("grading.check_int('value', value, reference.model_state_bytes('bf16-mixed', 'adamw'))",
     {"tags": ["check"]}),
    ("### BEGIN SOLUTION\nbytes_adamw = 16\n### END SOLUTION",
     {"tags": ["exercise"], "labkit": {"forbid": BPP}}),
    ("grading.check_int('adamw', bytes_adamw, reference.model_state_bytes('bf16-mixed', 'adamw'))",
     {"tags": ["check"]}),
]
LEARNER_CELL = {"ex1": 2, "ex2": 4, "ex3": 6}     # in the generated file (after its header)

HIDDEN_CALL = ("import importlib\nm = importlib.import_module('labkit.' + 'memory')\n\n"
               "def bpp(precision, optimizer):\n"
               "    return getattr(m, 'bytes_per' + '_param')(precision, optimizer)")
SWALLOWED = ("import importlib\nm = importlib.import_module('labkit.' + 'memory')\n\n"
             "def bpp(precision, optimizer):\n    try:\n"
             "        getattr(m, 'bytes_per' + '_param')(precision, optimizer)\n"
             "    except Exception:\n        pass\n"
             "    return {'bf16-mixed': 16, 'fp32': 8}[precision]")
READS_SOLUTIONS = ("import os\nhere = os.path.dirname(os.getcwd())\n"
                   "folder = os.path.join(here, 'sol' + 'utions')\n"
                   "text = open(os.path.join(folder, os.listdir(folder)[0])).read()\nvalue = 16")
IMPORTS = "from labkit.memory import bytes_per_param\n"


def _course(tmp_path: Path, answers: dict[str, str]) -> tuple[Path, Path]:
    v4 = nbformat.v4
    cells = [v4.new_code_cell(src, metadata=meta) for src, meta in TEMPLATE_CELLS]
    template = tmp_path / "solutions" / "97_forbid.ipynb"
    template.parent.mkdir()
    nbformat.write(v4.new_notebook(cells=cells), str(template))
    learner = ex.render(ex.read_notebook(template), template.name)
    for id_, src in answers.items():
        learner.cells[LEARNER_CELL[id_]].source = src
    path = tmp_path / "exercises" / template.name
    path.parent.mkdir()
    nbformat.write(learner, str(path))
    return path, template


@pytest.mark.notebook
def test_kernel_refuses_a_hidden_call_and_reading_the_solutions(tmp_path):
    path, template = _course(tmp_path, {"ex1": HIDDEN_CALL, "ex2": READS_SOLUTIONS,
                                        "ex3": "bytes_adamw = 2 + 2 + 4 + 4 + 4"})
    report = grader.grade_notebook(path, template=template, timeout=60)
    checks = {c.name: c for c in report.checks}
    assert checks["ex1"].message == "your bpp calls labkit.memory.bytes_per_param; write it yourself"
    assert "your exercise ex2 reads the solutions" in checks["ex2"].message
    assert checks["ex3"].passed                       # an honest answer passes with the guards on
    assert [e.status for e in report.exercises] == ["refused", "refused", "ran"]
    assert (report.passed, report.total) == (1, 3)


@pytest.mark.notebook
def test_a_swallowed_refusal_still_fails_and_the_lists_are_per_exercise(tmp_path):
    path, template = _course(tmp_path, {
        "ex1": SWALLOWED,                                             # right values, refused
        "ex2": IMPORTS + "value = bytes_per_param('bf16-mixed', 'adamw')",  # allowed in ex2
        "ex3": IMPORTS + "bytes_adamw = bytes_per_param('bf16-mixed', 'adamw')"})
    report = grader.grade_notebook(path, template=template, timeout=60)
    checks = {c.name: c for c in report.checks}
    assert checks["ex1"].message == "your bpp calls labkit.memory.bytes_per_param; write it yourself"
    assert checks["ex2"].passed, report.format()
    assert checks["ex3"].message == ("your exercise ex3 imports labkit.memory.bytes_per_param; "
                                     "write it yourself")     # refused by the scan, never run
    assert [e.status for e in report.exercises] == ["refused", "ran", "refused"]


GUARD_SCRIPT = """
from labkit.course import forbid
from labkit.models import get_model
forbid.install({"ex2": ["labkit.models.ModelSpec.params_per_layer", "labkit.models.ModelSpec"]})
forbid._LEARNER["<answer ex2>"] = "ex2"
learner = compile(
    "def per_layer(name):\\n    return get_model(name).params_per_layer()\\n"
    "def build():\\n    return ModelSpec(name='x', hidden_size=8, num_layers=1, num_heads=1, vocab_size=8)\\n",
    "<answer ex2>", "exec")
ns = {"get_model": get_model, "ModelSpec": __import__("labkit.models").models.ModelSpec}
exec(learner, ns)
for call in (lambda: ns["per_layer"]("llama2-7b"), ns["build"]):
    try:
        call()
        print("allowed")
    except forbid.ForbiddenCall as exc:
        print(exc)
spec = get_model("llama2-7b")          # labkit builds ModelSpecs itself: not the learner's call
print(spec.params_per_layer() > 0, forbid.trips())
"""


def test_guards_refuse_methods_and_classes_only_when_the_learner_calls_them():
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", GUARD_SCRIPT], capture_output=True, text=True,
                         check=True, timeout=120).stdout.splitlines()
    assert out[0] == ("your per_layer calls labkit.models.ModelSpec.params_per_layer; "
                      "write it yourself")
    assert out[1] == "your build calls labkit.models.ModelSpec; write it yourself"
    assert out[2].startswith("True {\"ex2\": \"your per_layer calls")
