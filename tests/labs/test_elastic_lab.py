"""The elastic-restart lab (labkit.labs.elastic) and run_lab(max_restarts=N).

Rank 1 of 2 is killed with SIGKILL in step 5 of 8 (checkpoints after steps 3 and 6): restarted
in place by torchrun ("elastic") or launched again ("relaunch"), the run must give the
uninterrupted run's losses exactly, name the kill among its failures, and lose the time
labkit.resilience predicts. The reference run uses the warm pool with no padding (fast); the
strategies run under torchrun with 0.3 s steps. The verdict's attempt logic is tested on
recorded evidence, without a launch.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from labkit import resilience
from labkit.cli import main
from labkit.labs import elastic
from labkit.runtime import verdict
from labkit.runtime.launch import LabError, resolve_target, run_lab
from proctools import MARK, kill_marked, wait_until_gone

LABS = Path(__file__).resolve().parents[1] / "fixtures" / "labs"
STEPS, EVERY, KILL, STEP_S = 8, 3, 5, 0.3


@pytest.fixture(scope="module")
def mark():
    value = uuid.uuid4().hex
    yield value
    kill_marked(value)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, mark):
    """The uninterrupted run's losses (warm pool, no padding: the same arithmetic)."""
    folder = tmp_path_factory.mktemp("reference")
    result = run_lab("elastic", nproc=2, timeout=180, quiet=True, env={MARK: mark},
                     args=["--ckpt-dir", str(folder), "--steps", str(STEPS),
                           "--save-every", str(EVERY)])
    return [tuple(x) for x in result.results[0]["losses"]]


def strategy(name, mark):
    return elastic.measure(name, nproc=2, steps=STEPS, save_every=EVERY, kill_at=KILL,
                           step_seconds=STEP_S, env={MARK: mark})


@pytest.fixture(scope="module")
def restarted(mark):
    return strategy("elastic", mark)


@pytest.fixture(scope="module")
def relaunched(mark):
    return strategy("relaunch", mark)


def check_time_lost(r):
    """Bounds that load cannot flip. Every step, padded, takes at least STEP_S, and the restart
    is measured from the kill to the first step after it, so the run loses at least the
    prediction: the STEP_S x (5 - 1 - 3) of work since the checkpoint plus the restart. What it
    loses beyond that is a busy machine's: steps that overran their padding or gaps between
    them (measured: overrun_seconds), and the forward of the killed step before the kill (not
    a step of the timeline; at most a step's padding, plus 2 s for a stall of the loaded
    machine there)."""
    assert r["since_checkpoint_seconds"] == pytest.approx(STEP_S * (KILL - 1 - 3))
    assert r["restart_seconds"] > 0
    assert r["predicted_lost_seconds"] == pytest.approx(resilience.restart_lost_seconds(
        r["since_checkpoint_seconds"], r["restart_seconds"]))
    assert r["lost_seconds"] >= r["predicted_lost_seconds"] - 1e-3, r
    slack = r["overrun_seconds"] + STEP_S + 2.0
    assert r["lost_seconds"] <= r["predicted_lost_seconds"] + slack, r
    assert r["wall_seconds"] == pytest.approx(STEPS * STEP_S + r["lost_seconds"])
    assert r["goodput"] == pytest.approx(STEPS * STEP_S / r["wall_seconds"])
    assert r["step_end"][-1] == pytest.approx(r["wall_seconds"])
    assert r["step_end"] == sorted(r["step_end"])
    parts = r["restart_parts"]
    assert sum(parts.values()) == pytest.approx(r["restart_seconds"]) and min(parts.values()) >= 0


@pytest.mark.multirank
def test_torchrun_restarts_the_ranks_and_they_give_the_same_losses_exactly(restarted, reference):
    r = restarted
    assert r["strategy"] == "elastic" and r["killed_at_step"] == KILL
    assert r["losses"] == reference                      # every step, exactly (==)
    assert [s for s, _ in r["losses"]] == list(range(1, STEPS + 1))
    assert r["restarts"] == 1
    [failure] = r["failures"]
    assert (failure["attempt"], failure["rank"], failure["signal"]) == (0, 1, "SIGKILL"), failure
    assert failure["exit_code"] == -9 and "rank 1 was killed by SIGKILL" in failure["message"]
    check_time_lost(r)


@pytest.mark.multirank
def test_a_relaunched_job_gives_the_same_losses_and_costs_a_whole_start(relaunched, reference):
    r = relaunched
    assert r["strategy"] == "relaunch" and r["losses"] == reference
    assert r["restarts"] == 1 and r["failures"][0]["signal"] == "SIGKILL"
    assert r["failures"][0]["rank"] == 1
    check_time_lost(r)


@pytest.mark.multirank
def test_when_every_attempt_dies_the_error_names_the_last_and_the_restarts(mark):
    with pytest.raises(LabError) as info:
        run_lab(LABS / "kill_every_attempt.py", nproc=2, timeout=120, quiet=True,
                max_restarts=2, args=["--rank", "1"], env={MARK: mark})
    err, text = info.value, str(info.value)
    head = text.splitlines()[0]
    assert (err.rank, err.reason) == (1, "signal"), text
    assert "failed in every attempt (restarted 2 times); the last: rank 1 was killed by " \
           "SIGKILL" in head, text
    for k in (0, 1):
        assert f"attempt {k} failed: rank 1 was killed by SIGKILL" in text, text
    assert err.result.restarts == 2 and err.result.launcher == "torchrun"
    assert [f["signal"] for f in err.result.failures] == ["SIGKILL", "SIGKILL"]
    assert "[rank 1] attempt 2" in err.result.output         # the third start ran


@pytest.mark.multirank
def test_nothing_is_left_running(restarted, relaunched, mark):
    waited, left = wait_until_gone(mark, 10.0)
    assert not left, f"still running after {waited:.1f} s: {left}"


# --- without a launch: flags, the launcher's checks, the verdict across attempts ---

def test_labkit_run_finds_the_lab_and_takes_max_restarts(capsys):
    assert resolve_target("elastic") == "labkit.labs.elastic"
    assert main(["run", "hello", "--max-restarts", "-1"]) == 2
    assert "max_restarts=-1 must be a whole number >= 0" in capsys.readouterr().err


@pytest.mark.parametrize("kwargs, says", [
    ({"max_restarts": -1}, "max_restarts=-1 must be a whole number >= 0"),
    ({"max_restarts": 1.5}, "max_restarts=1.5 must be a whole number >= 0"),
    ({"max_restarts": True}, "max_restarts=True must be a whole number >= 0"),
    ({"max_restarts": 1, "launcher": "pool"},
     "max_restarts=1 needs torchrun, which restarts the ranks after a failure, and "
     "launcher='pool' was asked for"),
])
def test_run_lab_refuses_restarts_it_cannot_give(kwargs, says):
    with pytest.raises(ValueError, match=None) as info:
        run_lab("hello", nproc=2, quiet=True, **kwargs)
    assert says in str(info.value), str(info.value)


def test_restarts_run_under_torchrun_where_the_pool_is_only_the_default(monkeypatch):
    from labkit.runtime import launch
    seen = {}
    monkeypatch.setattr(launch, "_launch", lambda *a, **k: seen.update(k) or "launched")
    monkeypatch.setenv("LABKIT_LAUNCHER", "pool")
    assert run_lab("hello", nproc=2, quiet=True, max_restarts=1) == "launched"
    assert (seen["launcher"], seen["max_restarts"], seen["explicit"]) == ("torchrun", 1, False)


@pytest.mark.parametrize("argv, says", [
    ([], "argument --ckpt-dir: needed (every start resumes from it); allowed: a folder"),
    (["--kill-at-step", "9"], "argument --kill-at-step: 9 is after the last step; allowed: 1"),
    (["--kill-rank", "2"], "argument --kill-rank: 2 is not a rank of this run (1 rank); "
                           "allowed: 0 to 0"),
    (["--step-seconds", "nan"], "argument --step-seconds: nan is not a step time; allowed: 0"),
    (["--step-seconds", "-1"], "argument --step-seconds: -1.0 is not a step time"),
])
def test_bad_flags_say_which_and_what_is_allowed(capsys, tmp_path, argv, says):
    ckpt = [] if not argv else ["--ckpt-dir", str(tmp_path)]
    with pytest.raises(SystemExit):
        elastic.parse_args([*ckpt, *argv])
    assert says in capsys.readouterr().err


@pytest.mark.parametrize("kwargs, says", [
    ({"strategy": "restart"}, "strategy='restart' is not supported; allowed: 'elastic'"),
    ({"kill_at": 9}, "kill_at=9 must be a whole number >= 1 and <= 8"),
    ({"kill_rank": 2}, "kill_rank=2 is not a rank of nproc=2; allowed: 0 to 1"),
    ({"step_seconds": -0.1}, "step_seconds=-0.1 must be a number >= 0"),
])
def test_measure_refuses_bad_input_before_any_launch(kwargs, says):
    call = {"strategy": "elastic", "steps": 8, **kwargs}
    with pytest.raises(ValueError) as info:
        elastic.measure(**call)
    assert says in str(info.value), str(info.value)


def test_the_timeline_summary_takes_each_step_s_last_record():
    """Steps 4 and 5 were done twice (killed in 5, resumed from the checkpoint of 3)."""
    events, t = [], 100.0
    for step in (1, 2, 3, 4):
        events.append({"event": "step", "pid": 1, "step": step, "begin": t, "end": t + 0.3,
                       "loss": 9.0, "time": t + 0.3})
        t += 0.3
    events.append({"event": "kill", "pid": 2, "step": 5, "time": t + 0.05})
    events += [{"event": "joined", "pid": 3, "time": t + 1.05},
               {"event": "resumed", "pid": 3, "time": t + 2.05}]
    t += 2.05
    for step in range(4, 9):
        events.append({"event": "step", "pid": 3, "step": step, "begin": t, "end": t + 0.3,
                       "loss": float(step), "time": t + 0.3})
        t += 0.3
    r = elastic._summary(events, 8, 3, 0.3, 5)
    assert r["losses"][:3] == [(1, 9.0), (2, 9.0), (3, 9.0)] and r["losses"][3] == (4, 4.0)
    assert r["restart_seconds"] == pytest.approx(2.0)          # kill -> step 4 begins again
    assert r["since_checkpoint_seconds"] == pytest.approx(0.3)  # step 4 lost
    assert r["lost_seconds"] == pytest.approx(0.3 + 0.05 + 2.0)
    assert r["overrun_seconds"] == pytest.approx(0.0)
    assert r["restart_parts"] == pytest.approx({"start_and_rendezvous": 1.0,
                                                "build_and_load": 1.0, "to_first_step": 0.0})
    with pytest.raises(RuntimeError, match=r"the timeline has steps \[1, 2, 3, 4, 5, 6, 7, 8\];"
                                           r" expected 1 to 9"):
        elastic._summary(events, 9, 3, 0.3, 5)


def _records(tmp_path, per_rank):
    results = tmp_path / "results"
    results.mkdir()
    for r, recs in per_rank.items():
        with open(results / f"rank{r}.jsonl", "w") as f:
            f.writelines(json.dumps(rec) + "\n" for rec in recs)
    return str(results)


def _start(r, pid, t=100.0):
    return {"kind": "start", "time": t, "rank": r, "local_rank": r, "world_size": 2,
            "pid": pid, "host": "h"}


LOST = {"kind": "error", "time": 100.4, "exc_type": "RuntimeError", "traceback": "Traceback",
        "message": "[/x/gloo/pair.cc:537] Read error: Connection reset by peer"}
RESTART = "[default] Worker group FAILED. 1/1 attempts left; will restart worker group"


def _two_attempts(second0, second1):
    """Attempt 0: rank 1 killed, rank 0 lost it; attempt 1: what second0/1 say."""
    return {0: [_start(0, 100), LOST, {"kind": "exit", "time": 100.5, "code": 1},
                {"kind": "attempt", "time": 102.0, "attempt": 1, "pid": 200},
                _start(0, 200, 102.0), *second0],
            1: [_start(1, 101), {"kind": "attempt", "time": 102.0, "attempt": 1, "pid": 201},
                _start(1, 201, 102.0), *second1]}


def test_a_run_whose_last_attempt_succeeded_is_ok_and_lists_the_earlier_failure(tmp_path):
    done = [{"kind": "report", "time": 103.0, "metrics": {"x": 2}},
            {"kind": "exit", "time": 103.1, "code": 0, "wall_time": 1.1}]
    results = _records(tmp_path, _two_attempts(done, done[1:]))
    agent = ["E1 api.py:1002] failed (exitcode: 1) local_rank: 0 (pid: 100) of binary: python",
             RESTART]
    result, err = verdict.collect("lab.py", 2, results, str(tmp_path), 0, 3.0, [], agent, "run",
                                  False, None, {}, {}, None, "torchrun", {},
                                  {0: {"pids": {0: 100, 1: 101}, "died": {1: 100.3, 0: 100.6},
                                       "codes": {1: -9}}})
    assert err is None and result.ok and result.restarts == 1
    assert result.results == [{"x": 2}, {}]                 # the last attempt's reports
    assert [rr.pid for rr in result.ranks] == [200, 201]
    [f] = result.failures
    assert (f["attempt"], f["rank"], f["reason"], f["exit_code"], f["signal"]) == (
        0, 1, "signal", -9, "SIGKILL"), f
    assert f["message"].startswith("rank 1 was killed by SIGKILL") and f["time"] == 100.3
    assert "restarts=1" in repr(result)


def test_torchrun_s_log_line_gives_the_exit_code_the_watch_missed(tmp_path):
    done = [{"kind": "exit", "time": 103.1, "code": 0, "wall_time": 1.1}]
    results = _records(tmp_path, _two_attempts(done, done))
    agent = ["E1 api.py:1002] failed (exitcode: -9) local_rank: 1 (pid: 101) of binary: py",
             RESTART]
    result, _ = verdict.collect("lab.py", 2, results, str(tmp_path), 0, 3.0, [], agent, "run",
                                False, None, {}, {}, None, "torchrun", {},
                                {0: {"pids": {}, "died": {1: 100.3, 0: 100.6}, "codes": {}}})
    assert (result.failures[0]["rank"], result.failures[0]["signal"]) == (1, "SIGKILL")


def test_when_every_attempt_failed_the_error_is_the_last_attempt_s(tmp_path):
    results = _records(tmp_path, _two_attempts([{**LOST, "time": 102.4}], []))
    agent = [RESTART, "rank : 1 (local_rank: 1)\n  exitcode  : -9"]
    result, err = verdict.collect("lab.py", 2, results, str(tmp_path), 1, 3.0, [], agent, "run",
                                  False, None, {}, {1: 102.3, 0: 102.5}, None, "torchrun", {},
                                  {0: {"pids": {}, "died": {1: 100.3}, "codes": {1: -9}}})
    text = str(err)
    assert text.startswith("lab lab.py failed in every attempt (restarted 1 time); the last: "
                           "rank 1 was killed by SIGKILL"), text
    assert "attempt 0 failed: rank 1 was killed by SIGKILL" in text.splitlines()[1], text
    assert (err.rank, err.reason, err.result.restarts) == (1, "signal", 1)


def test_the_death_watch_follows_a_restart(tmp_path):
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    results = _records(tmp_path, {0: [_start(0, gone.pid)]})
    watch = verdict.DeathWatch(results)
    watch.poll()
    assert watch.attempt == 0 and 0 in watch.died
    with open(os.path.join(results, "rank0.jsonl"), "a") as f:
        for rec in ({"kind": "attempt", "time": time.time(), "attempt": 1, "pid": os.getpid()},
                    _start(0, os.getpid())):
            f.write(json.dumps(rec) + "\n")
    watch.poll()
    assert watch.attempt == 1 and watch.pids == {0: os.getpid()} and watch.died == {}
    assert watch.earlier[0]["pids"] == {0: gone.pid} and 0 in watch.earlier[0]["died"]
    watch.close()
    assert verdict.split_attempts({0: [{"kind": "x"}, {"kind": "attempt", "attempt": 2},
                                       {"kind": "y"}]}) == {
        0: {0: [{"kind": "x"}]}, 2: {0: [{"kind": "attempt", "attempt": 2}, {"kind": "y"}]}}
