"""The warm pool launcher (issue 12): ranks forked from a process that imported torch once must
be indistinguishable, to a lab, from ranks torchrun starts; each lab runs in fresh processes;
the pool restarts when it would not give what a fresh process gets, and dies with its owner.
(The fault suite, tests/runtime/test_faults.py and tests/runtime/test_orphans.py, runs on both launchers.)"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from labkit.runtime import pool, system
from labkit.runtime.launch import LabError, choose_launcher, run_lab

LABS = Path(__file__).resolve().parents[1] / "fixtures" / "labs"
PROBE = LABS / "pool_probe.py"

pytestmark = [pytest.mark.multirank,
              pytest.mark.skipif(not pool.supported(), reason="the pool needs Linux")]


def probe(*args, launcher="pool", nproc=2, **kw):
    return run_lab(PROBE, nproc=nproc, args=list(args), timeout=120, quiet=True,
                   launcher=launcher, **kw)


def test_ranks_see_what_torchrun_would_give_them():
    a, b = probe(launcher="pool"), probe(launcher="torchrun")
    assert (a.launcher, b.launcher) == ("pool", "torchrun")
    for res, name in ((a, "pool"), (b, "torchrun")):
        for r, got in enumerate(res.results):
            v = got["vars"]
            assert [k for k, x in v.items() if x is None] == [], (name, v)
            assert (v["RANK"], v["LOCAL_RANK"], v["WORLD_SIZE"], v["LOCAL_WORLD_SIZE"]) == \
                (str(r), str(r), "2", "2")
            assert v["TORCHELASTIC_USE_AGENT_STORE"] == "True" and v["OMP_NUM_THREADS"] == "1"
            # as `python -m labkit.runtime.bootstrap script.py` here: the script's directory,
            # then the working directory
            assert got["cwd"] == os.getcwd() and got["path"] == [str(LABS), os.getcwd()]
            assert got["launcher"] == name and got["threads"] == 1
            assert got["visible_run_id"], "LABKIT_RUN_ID must show in /proc/PID/environ"
            assert got["cuda_initialised"] is False
    # one rendezvous port per lab, and a fresh one for the next lab
    assert len({g["vars"]["MASTER_PORT"] for g in a.results}) == 1
    assert a.results[0]["vars"]["MASTER_PORT"] != probe().results[0]["vars"]["MASTER_PORT"]


def test_every_lab_runs_in_fresh_processes(tmp_path, monkeypatch):
    """Nothing leaks from one lab to the next; a learner's edited module is imported anew;
    each rank has its own random state; the lab's atexit handlers run."""
    (tmp_path / "learner_mod.py").write_text("VALUE = 1\n")
    monkeypatch.chdir(tmp_path)              # the ranks start here: sys.path[0] finds it
    first = probe("--import", "learner_mod", "--leak", "--atexit", str(tmp_path / "bye"))
    (tmp_path / "learner_mod.py").write_text("VALUE = 222\n")
    second = probe("--import", "learner_mod")
    assert [g["imported"] for g in first.results] == [{"was_loaded": False, "value": 1}] * 2
    assert [g["imported"] for g in second.results] == [{"was_loaded": False, "value": 222}] * 2
    assert [g["leaked"] for g in second.results] == [False, False]
    assert all((tmp_path / f"bye.{r}").read_text() == "bye" for r in (0, 1))
    for i, name in enumerate(["random", "numpy.random"]):     # unseeded generators differ
        numbers = [g["random"][i] for res in (first, second) for g in res.results]
        assert len(set(numbers)) == 4, (name, numbers)
    pids = [g["pid"] for res in (first, second) for g in res.results]
    assert len(set(pids)) == 4
    # and never imported by the pool itself (only installed packages are)
    pool.current().sync()
    assert "learner_mod" not in pool.current().modules
    assert not any(m.startswith("labkit") for m in pool.current().modules)


# installed modules that torch itself may or may not import; the test takes one it does not
CANDIDATES = ("packaging.requirements", "packaging.markers", "packaging.tags",
              "packaging.specifiers", "packaging.version", "idna", "certifi")


def not_warm_yet(warm) -> str:
    """A module of CANDIDATES that is installed and not yet imported by the warm pool `warm`."""
    import importlib.util

    name = next((m for m in CANDIDATES if m not in warm.modules
                 and importlib.util.find_spec(m.split(".")[0])), None)
    if name is None:
        pytest.skip(f"every candidate module is already in the warm pool: {CANDIDATES}")
    return name


def test_the_pool_is_reused_and_imports_what_labs_imported():
    probe()
    first = pool.current()
    first.sync()
    name = not_warm_yet(first)
    res = probe("--import", name)
    assert pool.current() is first and first.alive()
    first.sync()
    assert name in first.modules
    # the next lab finds it already imported: it was imported in the warm parent
    again = probe("--import", name)
    assert [g["imported"]["was_loaded"] for g in again.results] == [True, True]
    assert [g["imported"]["was_loaded"] for g in res.results] == [False, False]


def test_an_import_time_variable_restarts_the_pool():
    probe()
    before = pool.current().proc.pid
    res = probe(env={"OMP_NUM_THREADS": "2"})
    assert [g["threads"] for g in res.results] == [2, 2]
    assert pool.current().proc.pid != before
    res = probe()
    assert [g["threads"] for g in res.results] == [1, 1]


def test_a_stale_or_dead_pool_is_replaced():
    probe()
    p = pool.current()
    path = next(iter(p.files))
    p.files[path] = 0.0                      # as if the file had changed since it started
    assert p.stale()
    probe()
    assert pool.current() is not p and not p.alive()
    q = pool.current()
    q.proc.kill()
    q.proc.wait()
    res = probe()
    assert res.ok and pool.current() is not q


def test_the_pool_leaves_with_its_owner(tmp_path):
    code = textwrap.dedent("""
        import sys, time
        from labkit.runtime import pool
        p = pool.warm()
        print(p.proc.pid, flush=True)
        time.sleep(300)
    """)
    owner = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        zygote = int(owner.stdout.readline())
        assert system_alive(zygote)
        owner.send_signal(signal.SIGKILL)
        owner.wait()
        deadline = time.monotonic() + 10
        while system_alive(zygote) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not system_alive(zygote), "the warm pool outlived its owner"
    finally:
        owner.kill()


def system_alive(pid: int) -> bool:
    from labkit.runtime.guard import alive
    return alive(pid)


def test_after_a_lab_only_the_idle_pool_is_left_and_it_listens_on_loopback():
    res = run_lab("hello", nproc=2, timeout=120, quiet=True, launcher="pool")
    listens = res.results[0]["launcher_listens"]
    assert listens and system.exposed([tuple(x) for x in listens]) == [], listens
    p = pool.current()
    deadline = time.monotonic() + 5
    while children(p.proc.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert children(p.proc.pid) == [], "an agent or rank outlived its lab"


def children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] not in (b"Z", b"X"):
            out.append(int(entry))
    return out


def test_choosing_the_launcher(monkeypatch):
    assert choose_launcher("auto", 1) == "pool" and choose_launcher("auto", 2) == "torchrun"
    with pytest.raises(ValueError, match="nnodes=2; allowed: launcher='torchrun'"):
        choose_launcher("pool", 2)
    with pytest.raises(ValueError, match="launcher"):
        choose_launcher("mpirun", 1)
    monkeypatch.setenv("LABKIT_LAUNCHER", "torchrun")
    assert choose_launcher(None, 1) == "torchrun"
    monkeypatch.setenv("LABKIT_LAUNCHER", "pool")
    assert choose_launcher(None, 1) == "pool"


def test_a_pool_that_cannot_start_falls_back_to_torchrun_unless_asked_for(monkeypatch, capsys):
    monkeypatch.delenv("LABKIT_LAUNCHER", raising=False)     # the default, "auto"
    def broken(env, preload=()):
        raise pool.PoolError("simulated")
    monkeypatch.setattr(pool, "get", broken)
    res = run_lab("hello", nproc=2, timeout=120, quiet=True)
    assert res.ok and res.launcher == "torchrun"
    assert "the warm pool could not start (simulated); using torchrun" in capsys.readouterr().err
    with pytest.raises(LabError, match="the warm pool could not start: simulated") as info:
        run_lab("hello", nproc=2, timeout=120, quiet=True, launcher="pool")
    assert info.value.reason == "launcher"


def test_warm_returns_at_once_and_takes_preloads_before_it_is_ready():
    pool.shutdown()
    t = time.monotonic()
    p = pool.warm(preload=["packaging.version"])
    assert time.monotonic() - t < 1.0 and not p._ready      # torch is still importing
    p.preload(["packaging.specifiers"])                      # queued while it imports
    p.sync()
    assert {"torch", "packaging.version", "packaging.specifiers"} <= set(p.modules)
    assert probe().launcher == "pool" and pool.current() is p


# ---- issue 28, item 7: an idle pool gives its memory back --------------------------------

@pytest.fixture
def short_idle(monkeypatch):
    """Pools started in this test leave after 2 s without a lab; none is left for the next
    test (the variable is read when a pool starts, so the next one is back to the default)."""
    pool.shutdown()
    monkeypatch.setenv("LABKIT_POOL_IDLE_TIMEOUT", "2")
    yield 2.0
    pool.shutdown()


def wait_gone(p, within: float) -> float:
    t = time.monotonic()
    while p.alive() and time.monotonic() - t < within:
        time.sleep(0.1)
    return time.monotonic() - t


def test_an_idle_pool_leaves_and_the_next_lab_restarts_it_as_warm(short_idle):
    assert probe().launcher == "pool"
    first = pool.current()
    first.sync()
    name = not_warm_yet(first)
    first.preload([name])                             # asked for, as after a transformers lab
    first.sync()
    waited = wait_gone(first, within=short_idle + 60)
    assert not first.alive(), (f"the pool was still there {waited:.0f} s after its last lab "
                               f"(idle timeout {short_idle:g} s); its log:\n{first.log()}")
    assert first.left_idle() and "no lab for" in first.log(), first.log()
    res = probe("--import", name)                     # transparently started again
    again = pool.current()
    assert res.ok and res.launcher == "pool" and again is not first and again.alive()
    # ... and as warm as the one that left: what it had been asked to import, it imports
    assert [g["imported"]["was_loaded"] for g in res.results] == [True, True], res.results


def test_a_running_lab_keeps_the_pool(short_idle, monkeypatch):
    """Idle means no lab: a lab longer than the idle timeout runs to its end, and the pool
    leaves only after it."""
    idle = 4                 # its clock restarts when the lab ends: the check below has 4 s
    monkeypatch.setenv("LABKIT_POOL_IDLE_TIMEOUT", str(idle))
    monkeypatch.setenv("LABKIT_TEST_SLEEP", str(idle + 3))
    res = run_lab(LABS / "sleep_silent.py", nproc=2, timeout=120, quiet=True, launcher="pool")
    p = pool.current()
    assert res.ok and res.launcher == "pool" and p is not None
    assert p.alive() and "no lab for" not in p.log(), p.log()


def test_the_idle_timeout_is_read_from_the_environment():
    assert pool.idle_timeout({}) == pool.IDLE_TIMEOUT == 600
    assert pool.idle_timeout({"LABKIT_POOL_IDLE_TIMEOUT": "0.5"}) == 0.5
    assert pool.idle_timeout({"LABKIT_POOL_IDLE_TIMEOUT": "0"}) == 0       # never
    for bad in ("ten", "-1", "inf", "nan"):
        with pytest.raises(pool.PoolError, match=f"LABKIT_POOL_IDLE_TIMEOUT='{bad}' is not a "
                                                 "number of seconds; allowed: a number >= 0"):
            pool.idle_timeout({"LABKIT_POOL_IDLE_TIMEOUT": bad})
