"""What the grader does with input meant to break it (issue 11, point 10): a damaged notebook is
refused with its cell and what is wrong (exit 2, no traceback); an answer cannot change the
solutions it is graded against, and one that changes them behind the grader's back is named;
50 MB of printing does not grow the grader by 50 MB."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from labkit import cli
from labkit.course import exercises as ex
from labkit.course import grader
from labkit.course.kernel import CELL_OUTPUT_LIMIT

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
SOLUTION = FIXTURES / "solutions" / "99_grading_fixture.ipynb"
EXERCISE = FIXTURES / "exercises" / "99_grading_fixture.ipynb"


# ------------------------------------------------------------------------- damaged notebooks

def _damage(cells: list, how: str) -> None:
    code = [c for c in cells if c["cell_type"] == "code"]
    if how == "source-ints":
        code[1]["source"] = [1, 2, 3]
    elif how == "source-number":
        code[1]["source"] = 5
    elif how == "metadata-list":
        code[1]["metadata"] = ["exercise"]
    elif how == "cell-not-an-object":
        cells.insert(2, 7)
    elif how == "cell-type-number":
        code[1]["cell_type"] = 3


@pytest.mark.parametrize("how, says", [
    ("source-ints", "cell 4 has a source list holding a number (1)"),
    ("source-number", "cell 4 has source a number"),
    ("metadata-list", "cell 4 has metadata a list; it must be an object"),
    ("cell-not-an-object", "cell 2 is a number, not a cell"),
    ("cell-type-number", "cell 4 has cell_type a number"),
])
def test_a_damaged_notebook_is_refused_with_its_cell(tmp_path, capsys, how, says):
    data = json.loads(EXERCISE.read_text())
    _damage(data["cells"], how)
    path = tmp_path / EXERCISE.name
    path.write_text(json.dumps(data))
    assert cli.main(["grade", str(path), "--template", str(SOLUTION)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"labkit grade: {path} is damaged: ") and says in err, err
    assert "Traceback" not in err


# -------------------------------------------------------------------------- the solutions file

def _course(tmp_path: Path, answer: str) -> tuple[Path, Path]:
    (tmp_path / "solutions").mkdir()
    template = tmp_path / "solutions" / SOLUTION.name
    template.write_bytes(SOLUTION.read_bytes())
    learner = ex.render(ex.read_notebook(template), template.name)
    for cell in learner.cells:
        if cell.metadata.get("labkit", {}).get("exercise") == "ex2":
            cell.source = answer + "\nadam_bytes = 1.5e9 * 16"
    path = tmp_path / "exercises" / template.name
    path.parent.mkdir()
    nbformat.write(learner, str(path))
    return path, template


PATH = ("import os\nfolder = os.path.join('..', 'sol' + 'utions')\n"
        "path = os.path.join(folder, os.listdir(folder)[0])\n")


@pytest.mark.notebook
@pytest.mark.parametrize("how", ["truncate", "remove", "rename"])
def test_an_answer_cannot_change_the_solutions(tmp_path, how):
    call = {"truncate": "os.truncate(path, 0)", "remove": "os.remove(path)",
            "rename": "os.rename(path, path + '.old')"}[how]
    path, template = _course(tmp_path, PATH + call)
    before = template.read_bytes()
    report = grader.grade_notebook(path, template=template, timeout=60)
    assert template.read_bytes() == before
    verb = {"truncate": "truncates", "remove": "deletes", "rename": "moves"}[how]
    assert f"your exercise ex2 {verb} the solutions" in report.checks[1].message, report.format()


@pytest.mark.notebook
def test_solutions_changed_behind_the_graders_back_are_named_and_not_used(tmp_path):
    """A program could change the solutions where the audit hook does not see it: an answer
    may not start one (labkit.course.fence), and a change from outside the kernel (here, once
    the template is read) is named and not used."""
    path, template = _course(tmp_path, PATH + "import subprocess\n"
                                              "subprocess.run(['truncate', '-s', '0', path])")
    report = grader.grade_notebook(path, template=template, timeout=60,
                                   on_start=lambda report: template.write_bytes(b""))
    assert template.read_bytes() == b""
    assert [c.passed for c in report.checks] == [False, False, False, False]  # graded as before
    assert report.checks[1].message.startswith("your exercise ex2 starts a program "), \
        report.checks[1].message
    assert any(f"the solutions notebook {template} was changed or removed while this notebook "
               "was graded" in n for n in report.notes), report.notes


# ------------------------------------------------------------------------------- big outputs

MEASURE = """
import json, re, sys
from labkit.course import grader
import nbclient, jupyter_client, zmq  # what grading imports, loaded before the measure

def status(key):
    return int(re.search(key + r":\\s+(\\d+)", open("/proc/self/status").read()).group(1)) * 1024

open("/proc/self/clear_refs", "w").write("5")        # the peak starts from here
before = status("VmRSS")
report = grader.grade_notebook(sys.argv[1], template=sys.argv[2], timeout=120)
print(json.dumps({"growth": status("VmHWM") - before, "ok": report.ok, "notes": report.notes}))
"""


@pytest.mark.notebook
def test_fifty_megabytes_of_output_do_not_grow_the_grader(tmp_path):
    path, template = _course(tmp_path, "import sys\nfor _ in range(50):\n"
                                       "    sys.stdout.write('x' * 999_999 + '\\n')")
    out = subprocess.run([sys.executable, "-c", MEASURE, str(path), str(template)],
                         capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": str(ex.REPO_ROOT)})
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.splitlines()[-1])
    print(f"\ngrader's peak memory grew {result['growth'] / 1e6:.1f} MB for 50 MB printed")
    assert result["growth"] < 30e6, result
    assert any(f"exercise ex2 printed more than the grader keeps "
               f"({CELL_OUTPUT_LIMIT / 1e6:g} MB a cell; output truncated: 49.0 MB)" in n
               for n in result["notes"]), result["notes"]


# ------------------------------------------------------------------- what is not a notebook file

@pytest.mark.parametrize("make, says", [
    (lambda d: os.mkfifo(d / "x.ipynb"), "is not a regular file (a pipe, a device or a socket)"),
    (lambda d: (d / "x.ipynb").symlink_to("/dev/zero"), "is not a regular file"),
    (lambda d: (d / "x.ipynb").write_bytes(b" " * (grader_learner().MAX_NOTEBOOK_BYTES + 1)),
     "MiB, more than an exercise notebook holds; clear its outputs"),
])
def test_what_is_not_a_notebook_is_refused_at_once(tmp_path, capsys, make, says):
    """A FIFO blocked the grader forever, /dev/zero grew it to 4 GB: refused before reading."""
    make(tmp_path)
    path = tmp_path / "x.ipynb"
    assert cli.main(["grade", str(path), "--template", str(SOLUTION)]) == 2
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err, err


def test_an_exercise_cell_of_megabytes_is_refused(tmp_path, capsys):
    """A 200 MB exercise cell ran the grading kernel to 3.7 GB for 491 s."""
    data = json.loads(EXERCISE.read_text())
    code = [c for c in data["cells"] if c["cell_type"] == "code"]
    code[1]["source"] = "x = 1\n" * (grader_learner().MAX_SOURCE_CHARS // 6 + 1)
    path = tmp_path / EXERCISE.name
    path.write_text(json.dumps(data))
    assert cli.main(["grade", str(path), "--template", str(SOLUTION)]) == 2
    err = capsys.readouterr().err
    assert "MiB of code, more than an answer needs" in err and "Traceback" not in err, err


def grader_learner():
    from labkit.course import learner
    return learner
