"""No process of a grading run outlives `labkit grade` (issue 11, point 2; and the red-team
report on processes an answer starts in a session of its own).

`labkit grade` runs as a subprocess on an exercise whose check launches a 2-rank lab that
sleeps without printing; once both ranks run, the grader is stopped with SIGTERM (what a CI
timeout sends), SIGINT (Ctrl-C) or SIGKILL, and every process of that run (the kernel, torchrun,
the ranks) must be gone within 10 s. They are found by a mark in their environment, which the
kernel and the lab inherit from the grader. A kernel spinning in C code (holding the GIL, so
ipykernel's parent poller never runs) must go too when the grader is killed.

An answer may also fork processes that leave the kernel's process group (a new session, a
double fork, a group of their own, a cleared environment): those must be gone too, after
`grade_notebook` returns and after `labkit grade` is stopped (`test_escapees_*`). They are
found by the pid files they write, not by a mark in their environment (one clears it).
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import nbformat
import pytest

from labkit.course import exercises as ex
from labkit.course import grader, kernel
from labkit.runtime.guard import alive, start_time
from proctools import MARK, kill_marked, processes_marked, wait_until_gone

pytestmark = [pytest.mark.notebook]

LAB = Path(__file__).resolve().parents[1] / "fixtures" / "labs" / "sleep_silent.py"
LIMIT = 10.0        # seconds a process of the run may outlive the grader


def _course(tmp_path: Path, marker: Path, busy: bool) -> Path:
    """A template whose check starts the sleeping lab, and an exercise file whose answer is
    right (`busy`: an answer that spins in C code, holding the GIL, once the marker is written)."""
    v4 = nbformat.v4
    template = tmp_path / "solutions" / "96_orphans.ipynb"
    template.parent.mkdir()
    nbformat.write(v4.new_notebook(cells=[
        v4.new_code_cell("from labkit import run_lab\nfrom labkit.course import grading"),
        v4.new_code_cell("### BEGIN SOLUTION\nranks = 2\n### END SOLUTION",
                         metadata={"tags": ["exercise"]}),
        v4.new_code_cell(f"run_lab({str(LAB)!r}, nproc=ranks, timeout=600, quiet=True, env="
                         f"{{'LABKIT_TEST_MARKER': {str(marker)!r}, 'LABKIT_TEST_SLEEP': '300'}})\n"
                         "grading.check('ran', True, '')", metadata={"tags": ["check"]})]),
        str(template))
    learner = tmp_path / "exercises" / template.name
    learner.parent.mkdir()
    nb = ex.render(ex.read_notebook(template), template.name)
    nb.cells[2].source = "ranks = 2"
    if busy:
        nb.cells[2].source = "\n".join(f"open({f'{marker}.{r}'!r}, 'w').close()" for r in (0, 1)) \
            + "\nsum(range(10**13))"
    nbformat.write(nb, str(learner))
    return learner


@pytest.mark.multirank
@pytest.mark.slow
@pytest.mark.parametrize("sig, busy", [(signal.SIGTERM, False), (signal.SIGINT, False),
                                       (signal.SIGKILL, False), (signal.SIGKILL, True)],
                         ids=["SIGTERM", "SIGINT", "SIGKILL", "SIGKILL-busy-kernel"])
def test_nothing_outlives_the_grader(tmp_path, sig, busy):
    mark = uuid.uuid4().hex
    marker = tmp_path / "rank"
    learner = _course(tmp_path, marker, busy)
    tmp = tmp_path / "tmp"          # the grader's temporary files, removed unless SIGKILL
    tmp.mkdir()
    env = {**os.environ, MARK: mark, "OMP_NUM_THREADS": "1", "TMPDIR": str(tmp)}
    # `python -m labkit grade ...` as a terminal runs it: a shell without job control (`make
    # test &`) starts children with SIGINT ignored, and Python then keeps it ignored.
    start = ("import runpy, signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
             f"sys.argv = ['labkit', 'grade', {str(learner)!r}, '--timeout', '300']; "
             "runpy.run_module('labkit', run_name='__main__')")
    grader = subprocess.Popen([sys.executable, "-c", start], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120      # kernel start and imports on a loaded machine
        while not all(Path(f"{marker}.{r}").exists() for r in (0, 1)):
            assert grader.poll() is None, grader.stdout.read()
            assert time.monotonic() < deadline, "the lab's ranks did not start within 120 s"
            time.sleep(0.1)
        alive = processes_marked(mark)
        assert len(alive) >= (1 if busy else 4), f"expected the kernel (torchrun, 2 ranks): {alive}"
        t0 = time.monotonic()
        grader.send_signal(sig)
        status = grader.wait(30)
        after, left = wait_until_gone(mark, LIMIT)
        out = grader.stdout.read()
        print(f"\n{sig.name}{' (busy kernel)' if busy else ''}: grader exited {status} after "
              f"{time.monotonic() - t0 - after:.2f} s; the run's processes were gone {after:.2f} "
              f"s later\n{out}")
        assert left == [], f"pids {left} outlived the grader by {LIMIT:g} s ({sig.name})"
        if sig != signal.SIGKILL:
            assert status == 128 + sig, (status, out)
            assert f"stopped by {sig.name}" in out and "Traceback" not in out, out
            assert [p.name for p in tmp.iterdir() if p.name.startswith("labkit-grade")] == []
    finally:
        if grader.poll() is None:
            grader.kill()
        kill_marked(mark)


# ------------------------------------------------------------- processes that leave the group

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
SOLUTION = FIXTURES / "solutions" / "99_grading_fixture.ipynb"
EXERCISE = FIXTURES / "exercises" / "99_grading_fixture.ipynb"
ESCAPE_LIMIT = 5.0     # seconds an escapee may outlive grading (the sweep's grace is ~1 s)

# What an answer may do to leave the kernel's process group: fork (a program it starts is refused
# while grading, labkit.course.forbid, but a fork runs on in Python, the kernel's guards with it).
# Each escapee forks from the answer, does `how` and forks again (or not: "a"), and the last
# child writes its pid and sleeps, re-parented away from the kernel.
ESCAPEES = {
    "a": "a forked python sleeping in a new session (setsid)",
    "b": "a double-forked python, setsid() between the forks",
    "c": "a double-forked python in a process group of its own (setpgid)",
    "d": "a double-forked python, setsid(), its environment emptied",
}


def _escaping_answer(piddir: Path, then: str = "") -> str:
    """ex1's right answer, after starting the ESCAPEES (each writes its pid to piddir/<key>)
    and waiting until all have; `then`: code run after that (e.g. a long sleep)."""
    d = str(piddir)
    return textwrap.dedent(f"""
        import os, sys, time

        def escape(path, how):
            if os.fork():
                return
            if how in ("setsid", "new session", "empty"):
                os.setsid()
            if how != "new session" and os.fork():
                os._exit(0)
            if how == "setpgid":
                os.setpgid(0, 0)
            if how == "empty":
                os.environ.clear()
            with open(path + ".tmp", "w") as f:
                f.write(str(os.getpid()))
            os.rename(path + ".tmp", path)
            time.sleep(300)
            os._exit(0)

        for key, how in (("a", "new session"), ("b", "setsid"), ("c", "setpgid"), ("d", "empty")):
            if key in {"".join(ESCAPEES)!r}:
                escape(os.path.join({d!r}, key), how)
        t0 = time.monotonic()
        while not all(os.path.exists(os.path.join({d!r}, k)) for k in {"".join(ESCAPEES)!r}):
            assert time.monotonic() - t0 < 60, "the escapees did not start"
            time.sleep(0.05)
        {then}

        def param_bytes(num_params, dtype):
            size = {{"fp32": 4, "bf16": 2, "fp16": 2}}[dtype]
            return num_params * size
    """)


def _learner(tmp_path: Path, ex1: str) -> Path:
    """The fixture's exercise file with the right answers, ex1's replaced by `ex1`."""
    sol = ex.read_notebook(SOLUTION)
    lay = ex.layout(sol)
    nb = ex.read_notebook(EXERCISE)
    for cell in nb.cells:
        id_ = cell.metadata.get("labkit", {}).get("exercise")
        if id_:
            right = sol.cells[lay.exercise(id_).index].source
            cell.source = ex1 if id_ == "ex1" else "\n".join(
                line for line in right.split("\n") if line.strip() not in (ex.BEGIN, ex.END))
    path = tmp_path / EXERCISE.name
    nbformat.write(nb, str(path))
    return path


def _escapees(piddir: Path) -> dict[str, tuple[int, str | None]]:
    """key -> (pid, start time) of each escapee that wrote its pid file."""
    found = {}
    for key in ESCAPEES:
        try:
            pid = int((piddir / key).read_text())
        except (OSError, ValueError):
            continue
        found[key] = (pid, start_time(pid))
    return found


def _alive(procs) -> list[str]:
    return [k for k, (pid, started) in procs.items() if started and alive(pid, started)]


def _left_after(procs, limit: float) -> tuple[list[str], float]:
    """Escapees still alive `limit` s from now (or [] as soon as none is), and the seconds."""
    t0 = time.monotonic()
    while _alive(procs) and time.monotonic() - t0 < limit:
        time.sleep(0.05)
    return _alive(procs), time.monotonic() - t0


def _kill(procs) -> None:
    for key in _alive(procs):
        try:
            os.kill(procs[key][0], signal.SIGKILL)
        except OSError:
            pass


def _describe(keys) -> str:
    return "; ".join(f"({k}) {ESCAPEES[k]}" for k in keys)


def test_escapees_are_gone_when_grading_returns(tmp_path):
    """(a)-(d) leave the kernel's process group; killing the group at the end left 2-4 of them
    running 120 s after grade_notebook returned."""
    piddir = tmp_path / "pids"
    piddir.mkdir()
    path = _learner(tmp_path, _escaping_answer(piddir))
    # Not the run's: a process in a session of its own that carries another run's token. The
    # sweep must leave it alone.
    bystander = subprocess.Popen(["sleep", "300"], start_new_session=True,
                                 env={**os.environ, kernel.ENV_GRADE_RUN: uuid.uuid4().hex})
    procs = {}
    try:
        report = grader.grade_notebook(path, template=SOLUTION, timeout=120)
        procs = _escapees(piddir)
        at_return = _alive(procs)
        left, waited = _left_after(procs, ESCAPE_LIMIT)
        print(f"\nalive when grade_notebook returned: {len(at_return)} {at_return}; "
              f"{waited:.1f} s later: {len(left)} {left}")
        assert sorted(procs) == sorted(ESCAPEES), (procs, report.format())
        assert report.ok, report.format()
        assert left == [], f"outlived grading by {ESCAPE_LIMIT:g} s: {_describe(left)}"
        assert bystander.poll() is None, "the sweep stopped a process of another run"
    finally:
        bystander.kill()
        bystander.wait()
        _kill(procs or _escapees(piddir))


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGKILL],
                         ids=["SIGTERM", "SIGINT", "SIGKILL"])
def test_escapees_are_gone_when_labkit_grade_is_stopped(tmp_path, sig):
    """`labkit grade` stopped mid-run (the answer sleeps once (a)-(d) run): they go with it.
    SIGKILL leaves the grader no code to run: the kernel's parent (a subreaper, Linux) sweeps."""
    if sig == signal.SIGKILL and not sys.platform.startswith("linux"):
        pytest.skip("only Linux has a parent-death signal and subreapers")
    piddir = tmp_path / "pids"
    piddir.mkdir()
    path = _learner(tmp_path, _escaping_answer(piddir, then="time.sleep(300)"))
    start = ("import runpy, signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
             f"sys.argv = ['labkit', 'grade', {str(path)!r}, '--template', {str(SOLUTION)!r}, "
             "'--timeout', '300']; runpy.run_module('labkit', run_name='__main__')")
    grader_proc = subprocess.Popen([sys.executable, "-c", start], stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, text=True)
    procs = {}
    try:
        deadline = time.monotonic() + 120      # kernel start and imports on a loaded machine
        while len(procs := _escapees(piddir)) < len(ESCAPEES):
            assert grader_proc.poll() is None, grader_proc.stdout.read()
            assert time.monotonic() < deadline, "the escapees did not start within 120 s"
            time.sleep(0.1)
        assert _alive(procs) == sorted(ESCAPEES)
        grader_proc.send_signal(sig)
        status = grader_proc.wait(30)
        at_exit = _alive(procs)
        left, waited = _left_after(procs, ESCAPE_LIMIT)
        out = grader_proc.stdout.read()
        print(f"\n{sig.name}: grader exited {status}; escapees alive then: {len(at_exit)} "
              f"{at_exit}; {waited:.1f} s later: {len(left)} {left}\n{out}")
        assert left == [], f"outlived `labkit grade` by {ESCAPE_LIMIT:g} s: {_describe(left)}"
        if sig != signal.SIGKILL:
            assert status == 128 + sig, (status, out)
            assert f"stopped by {sig.name}" in out and "Traceback" not in out, out
    finally:
        if grader_proc.poll() is None:
            grader_proc.kill()
        _kill(procs or _escapees(piddir))
