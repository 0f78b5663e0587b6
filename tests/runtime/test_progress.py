"""A long lab call shows live progress in a notebook (labkit.runtime.progress), even quiet.

In a real kernel (nbclient), a fixture lab that sleeps 4 s: one display line naming the lab,
updated in place with the seconds so far, replaced at the end by its total time; the ranks'
lines stay out with quiet=True; labs inside a task (a diagnosis case) share its line. Outside a
kernel, run_lab(quiet=True) prints nothing new; a TTY gets one updating line, then erased. The
laptop times (labkit.runtime.lab_times) are the table the README shows, for course_labs' runs.
What the learner saw before: issue 28, item 3 (a 67 s cell without a word).
"""
from __future__ import annotations

import io
import re
from pathlib import Path

import nbformat
import pytest

from labkit.runtime import lab_times, progress
from labkit.runtime.launch import _label, run_lab

ROOT = Path(__file__).resolve().parents[2]
SLOW = ROOT / "tests" / "fixtures" / "labs" / "slow_print.py"


def run_cells(sources: list[str], tmp_path):
    """Execute the cells in a fresh kernel: (the notebook, [(cell, msg_type, content)])."""
    from nbclient import NotebookClient

    from labkit.course.kernel import kernel_env

    seen = []

    class Client(NotebookClient):
        def process_message(self, msg, cell, cell_index):
            seen.append((cell_index, msg["msg_type"], msg["content"]))
            return super().process_message(msg, cell, cell_index)

    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(s) for s in sources])
    Client(nb, kernel_name="python3", timeout=300, allow_errors=False,
           resources={"metadata": {"path": str(tmp_path)}}).execute(env=kernel_env())
    return nb, seen


def shown(seen, cell: int, kind: str) -> list[str]:
    return [c["data"]["text/plain"] for i, k, c in seen
            if i == cell and k == kind and "text/plain" in c.get("data", {})]


@pytest.mark.notebook
@pytest.mark.multirank
def test_a_quiet_lab_shows_a_live_line_in_a_notebook_then_its_total(tmp_path):
    nb, seen = run_cells([
        "from labkit import run_lab\nfrom labkit.runtime import progress",
        f"r = run_lab({str(SLOW)!r}, nproc=2, args=['--sleep', '4'], quiet=True, timeout=120)",
        "with progress.task('two labs'):\n"
        f"    for _ in range(2):\n"
        f"        run_lab({str(SLOW)!r}, nproc=2, args=['--sleep', '1'], quiet=True)",
    ], tmp_path)
    first = shown(seen, 1, "display_data")
    updates = shown(seen, 1, "update_display_data")
    assert first and first[0].startswith("running lab slow_print.py on 2 ranks: 0 s"), first
    seconds = [int(re.search(r": (\d+) s", u).group(1)) for u in updates[:-1]]
    assert len(seconds) >= 3 and seconds == sorted(seconds) and seconds[-1] >= 3, updates
    assert re.fullmatch(r"lab slow_print\.py on 2 ranks: done in \d+\.\d s", updates[-1])
    (out,) = nb.cells[1].outputs           # only the line, now the total; no rank's lines
    assert out["data"]["text/plain"] == updates[-1]
    assert not any(k == "stream" for i, k, _ in seen if i == 1)
    nested = [o["data"]["text/plain"] for o in nb.cells[2].outputs]
    assert len(nested) == 1 and re.fullmatch(r"two labs: done in \d+\.\d s \(2 labs\)", nested[0])
    assert any("| now lab slow_print.py on 2 ranks" in u
               for u in shown(seen, 2, "update_display_data"))


@pytest.mark.multirank
def test_outside_a_kernel_a_quiet_lab_prints_nothing_new(capfd):
    result = run_lab(SLOW, nproc=2, args=["--sleep", "0.2"], quiet=True, timeout=120)
    out, err = capfd.readouterr()
    assert (out, err) == ("", "") and result.results[0]["slept"] == 0.2


class FakeTTY(io.StringIO):
    def isatty(self):
        return True


def test_a_terminal_gets_one_updating_line_only_when_asked(monkeypatch):
    tty = FakeTTY()
    monkeypatch.setattr("sys.stdout", tty)
    with progress.task("lab x on 2 ranks", expected=3.0):
        progress.tick()
    assert tty.getvalue().startswith("\rrunning lab x on 2 ranks: 0 s (about 3 s on a 2-core")
    assert tty.getvalue().endswith("\r\x1b[K") and "\n" not in tty.getvalue()   # erased
    tty.seek(0), tty.truncate()
    with progress.task("lab y on 2 ranks", terminal=False):     # the ranks' lines print here
        progress.tick()
    assert tty.getvalue() == ""


def test_the_line_says_how_it_ended(monkeypatch):
    from labkit.runtime.results import LabError

    lines = []
    monkeypatch.setattr(progress._Line, "_show", lambda self, text, final=False: lines.append(text))
    for exc, ended in ((ValueError("bad"), "failed after"), (KeyboardInterrupt(), "stopped after"),
                       (LabError("slow", reason="timeout"), "timed out after")):
        with pytest.raises(type(exc)):
            with progress.task("lab z on 1 rank"):
                raise exc
        assert re.fullmatch(rf"lab z on 1 rank: {ended} \d\.\d s", lines[-1])
    assert progress._here.line is None


def test_a_slow_run_says_why_it_may_be_slow():
    assert progress._about(12, 10) == "12 s (about 10 s on a 2-core laptop)"
    assert "longer than the 10 s of a 2-core laptop" in progress._about(21, 10)
    assert progress._about(7, None) == "7 s"


def test_labels_name_the_lab_and_its_part():
    assert _label("labkit.labs.pp", 4, ["--part", "torch"], 1) == "lab pp --part torch on 4 ranks"
    assert _label("labkit.labs.memory", 1, [], 1) == "lab memory on 1 rank"
    assert _label(str(SLOW), 2, ["--part"], 2) == "lab slow_print.py on 2 ranks x 2 nodes"


def test_laptop_times_are_found_for_the_course_s_runs_whatever_the_paths():
    assert lab_times.expected_seconds("labkit.labs.pp", 4, ["--part", "torch", "--schedules",
                                                           "all"]) == 40.2
    assert lab_times.expected_seconds("collectives", 4, ["--sizes", "4K,64K,512K,2M,8M", "-n",
                                      "3", "-w", "1", "--plot", "/tmp/x.png"]) == 1.5
    assert lab_times.expected_seconds("labkit.labs.pp", 2, ["--part", "torch"]) is None
    assert lab_times.expected_seconds("labkit.labs.pp", 4, ["--part", "torch", "--repeats",
                                                            "1"]) is None


def test_one_table_of_laptop_times_for_the_runs_the_course_makes():
    from labkit.course.course_labs import COURSE_LABS

    key = lab_times.arg_key
    ours = {name: (lab, n, key(args)) for name, lab, n, args, _ in lab_times.LAB_TIMES}
    course = {r.name: (r.lab, r.nproc, key(r.args)) for r in COURSE_LABS}
    assert ours == course, "labkit.runtime.lab_times.LAB_TIMES and course_labs.COURSE_LABS differ"
    readme = (ROOT / "README.md").read_text()
    rows = dict(re.findall(r"^\| \d\d \| `([\w:-]+)` \| \d+ \| ([\d.]+) \(", readme, re.M))
    assert rows == {name: f"{s:.1f}" for name, _, _, _, s in lab_times.LAB_TIMES}, \
        "the README's 'Time per lab' table and labkit.runtime.lab_times.LAB_TIMES differ"
