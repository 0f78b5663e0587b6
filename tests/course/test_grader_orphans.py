"""No process of a grading run outlives `labkit grade` (issue 11, point 2).

`labkit grade` runs as a subprocess on an exercise whose check launches a 2-rank lab that
sleeps without printing; once both ranks run, the grader is stopped with SIGTERM (what a CI
timeout sends), SIGINT (Ctrl-C) or SIGKILL, and every process of that run (the kernel, torchrun,
the ranks) must be gone within 10 s. They are found by a mark in their environment, which the
kernel and the lab inherit from the grader. A kernel spinning in C code (holding the GIL, so
ipykernel's parent poller never runs) must go too when the grader is killed.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import nbformat
import pytest

from labkit.course import exercises as ex
from proctools import MARK, kill_marked, processes_marked, wait_until_gone

pytestmark = [pytest.mark.notebook, pytest.mark.multirank, pytest.mark.slow]

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
