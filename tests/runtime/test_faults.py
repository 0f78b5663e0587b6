"""Faults end cleanly: a raising rank, a hanging rank, an interrupt, two labs at once, on both
launchers (the warm pool and torchrun: every test runs once with each).

Each test marks its processes with a unique environment variable and checks afterwards that no
process carrying it survives (torchrun, its workers, anything they started).
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from labkit.runtime.launch import LabError, run_lab
from proctools import MARK

LABS = Path(__file__).resolve().parents[1] / "fixtures" / "labs"

pytestmark = pytest.mark.multirank


def test_raising_rank_names_rank_type_message_and_traceback(launcher, mark):
    t = time.monotonic()
    with pytest.raises(LabError) as info:
        run_lab(LABS / "raise_on_rank.py", nproc=2, args=["--rank", "1"], timeout=90,
                env={MARK: mark}, quiet=True, launcher=launcher)
    err = info.value
    assert (err.reason, err.rank, err.exc_type) == ("exception", 1, "ValueError")
    assert err.exc_message == "boom on rank 1"
    text = str(err)
    assert text.startswith("lab ") and "rank 1 raised ValueError: boom on rank 1" in text
    assert "Traceback of rank 1" in text and "raise_on_rank.py" in err.traceback
    assert "runtime/bootstrap.py" not in err.traceback and "runpy" not in err.traceback  # launcher frames trimmed
    # the other rank was torn down promptly, not after a collective timeout
    assert err.result.ranks[0].exit_code not in (0, None)
    assert time.monotonic() - t < 60


@pytest.mark.parametrize("how, says, reason", [
    ("exit", "rank 1 exited with code 3 without raising a Python exception", "exit"),
    ("kill", "rank 1 was killed by SIGKILL; the kernel's OOM killer", "signal"),
    ("segv", "rank 1 was killed by SIGSEGV; a crash in native code", "signal"),
])
def test_a_rank_that_dies_silently_is_blamed_not_its_peers(launcher, mark, how, says, reason):
    """Issue 11 (1): its peers fail with "Connection closed by peer"; they must not be blamed."""
    with pytest.raises(LabError) as info:
        run_lab(str(LABS / "die_on_rank.py"), nproc=3, args=["--rank", "1", "--how", how],
                timeout=120, quiet=True, env={MARK: mark}, launcher=launcher)
    err = info.value
    text = str(err)
    assert (err.rank, err.reason, err.exc_type) == (1, reason, None), text
    assert text.startswith(f"lab {Path('tests/fixtures/labs/die_on_rank.py')}") or "die_on_rank.py" in text
    assert says in text.splitlines()[0], text
    assert "[rank 1] going" in text                        # its last words are shown
    assert "raised RuntimeError" not in text.splitlines()[0]
    # the peers either failed on the lost connection or were stopped first (the pool's agent
    # hears of the death at once; torchrun polls): either way they are named, not blamed
    launcher_name = {"pool": "the pool launcher"}.get(launcher, launcher)
    assert ("because rank 1 was gone" in text
            or f"ranks 0, 2 stopped by {launcher_name} after rank 1 failed" in text), text
    assert "pair.cc" not in text                            # gloo's source path is trimmed
    assert f"stopped by {launcher_name} after rank 1" in text or "ranks 0, 2 then failed" in text
    assert err.result.launcher == launcher


# The timeout is the behaviour here, so it leaves room for a loaded machine (issue 28, item 14:
# with 20 s, torchrun's agent and ranks, each importing torch on 2 cores shared with load 8-15,
# had not always reached the hang when it fired). The pool forks its ranks from a warm parent.
HANG_TIMEOUT = {"pool": 30, "torchrun": 60}
STOP_ROOM = 60       # seconds after it to stop the ranks, read their stacks and explain


def test_hanging_rank_is_stopped_at_the_timeout_and_named(launcher, mark):
    timeout = HANG_TIMEOUT[launcher]
    t = time.monotonic()
    with pytest.raises(LabError) as info:
        run_lab(LABS / "hang_on_rank.py", nproc=2, args=["--rank", "1"], timeout=timeout,
                env={MARK: mark}, quiet=True, launcher=launcher)
    elapsed = time.monotonic() - t
    err = info.value
    text = str(err)
    assert err.reason == "timeout", text
    ready = [r for r in (0, 1) if f"[rank {r}] ready" in err.result.output]
    assert ready == [0, 1], (f"when the timeout of {timeout} s fired, ranks {ready} of 0, 1 had "
                             f"passed their barrier: the others were still starting (a machine "
                             f"too busy to start {launcher}'s ranks in {timeout} s)\n{text}")
    assert f"timeout of {timeout} s fired" in text and "ranks 0, 1 still running" in text
    assert "rank 1 is not in a collective" in text and "stuck_forever" in text
    assert "rank 0 waits in all_reduce" in text and "rank 1 never joined it" in text
    assert elapsed >= timeout, f"stopped after {elapsed:.1f} s, before its timeout of {timeout} s"
    assert elapsed < timeout + STOP_ROOM, (
        f"stopping the ranks, reading their stacks and explaining took {elapsed - timeout:.0f} s "
        f"after the timeout fired (room: {STOP_ROOM} s)")


def test_a_rank_that_ignores_sigterm_is_killed(launcher, mark):
    """A rank deaf to SIGTERM does not survive the lab. (Both torchrun's own shutdown and
    labkit's teardown escalate to SIGKILL; with teardown disabled this test fails.)"""
    with pytest.raises(LabError) as info:
        run_lab(LABS / "hang_on_rank.py", nproc=2, args=["--rank", "1", "--ignore-sigterm"],
                timeout=15, env={MARK: mark}, quiet=True, launcher=launcher)
    assert info.value.reason == "timeout"
    # the `mark` fixture asserts that no process of the run is left


def test_interrupt_kills_every_rank(launcher, mark):
    # A shell without job control starts background commands with SIGINT ignored, and Python
    # then keeps it ignored (no KeyboardInterrupt): `make test &` made this test fail for that
    # reason alone. A Jupyter kernel installs its own handler; so does this child.
    code = ("import signal; signal.signal(signal.SIGINT, signal.default_int_handler); "
            "import sys; from labkit.runtime.launch import run_lab; "
            f"run_lab({str(LABS / 'hang_on_rank.py')!r}, nproc=2, timeout=300, "
            f"env={{{MARK!r}: {mark!r}}}, launcher={launcher!r})")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, MARK: mark})
    try:
        seen = []
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:   # wait until both ranks are up
            line = proc.stdout.readline()
            if not line:
                break
            seen.append(line)
            if sum(line.endswith("] ready\n") for line in seen) == 2:
                break
        assert sum(s.endswith("] ready\n") for s in seen) == 2, seen
        assert {s.split("]")[0] for s in seen} >= {"[rank 0", "[rank 1"}
        t = time.monotonic()
        proc.send_signal(signal.SIGINT)          # what the Jupyter stop button does
        _, err = proc.communicate(timeout=30)
        stopped = time.monotonic() - t
        print(f"\nlab stopped {stopped:.2f} s after SIGINT (load {os.getloadavg()[0]:.1f})")
        assert stopped < 15
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0
    assert "labkit: interrupted" in err and "KeyboardInterrupt" in err


def test_two_labs_at_once(launcher, mark):
    results, errors = {}, []

    def one(name):
        try:
            results[name] = run_lab("hello", nproc=2, timeout=120, env={MARK: mark},
                                    quiet=True, launcher=launcher)
        except Exception as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(n,)) for n in "ab"]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors, errors
    assert results["a"].run_id != results["b"].run_id
    for r in results.values():
        assert r.ok and [x["all_reduce"] for x in r.results] == [3.0, 3.0]


def test_an_output_flood_arrives_whole_and_in_order(launcher, mark, capsys):
    """Each rank prints LINES numbered lines as fast as it can, stdout and stderr interleaved,
    and a last line without a newline: every line arrives, once, in each rank's order."""
    lines = 20000
    result = run_lab(LABS / "flood.py", nproc=2, args=["--lines", str(lines)], timeout=120,
                     env={MARK: mark}, launcher=launcher)
    out, err = capsys.readouterr()
    for r in (0, 1):
        got = [int(x.split()[-1]) for x in out.splitlines() if x.startswith(f"[rank {r}] out ")]
        assert got == list(range(0, lines, 2)), (r, len(got))
        got = [int(x.split()[-1]) for x in err.splitlines() if x.startswith(f"[rank {r}] err ")]
        assert got == list(range(1, lines, 2)), (r, len(got))
        assert f"[rank {r}] no newline at the end" in out
    assert len(result.output) == 2 * (lines + 1)
