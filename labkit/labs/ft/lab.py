"""Fault tolerance without stopping the job: torchft's lighthouse and 2 replica groups train the
same model; one is killed with SIGKILL mid-step and restarted, the other never stops.

    python -m labkit.labs.ft                                  # 30 steps, group 1 killed in step 8
    python -m labkit.labs.ft --steps 40 --kill-at 10 --step-seconds 0.5 --restart-delay 2
    python -m labkit.labs.ft --group-size 2                   # 2 ranks a group: 4 processes

From a notebook: `from labkit.labs.ft import measure; r = measure(steps=30, kill_at=8)`: the
elastic lab's figures (losses, step_end, lost_seconds, goodput, ...) and torchft's own. Each
group is a run_lab of labkit.labs.ft.group (by hand: its docstring). Linux x86-64 only (torchft's
wheels; `unavailable()` says so elsewhere). More: docs/labs.md, ## ft.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import signal
import sys
import tempfile
import threading
import time
import uuid
from types import SimpleNamespace

from labkit.labs.common.flags import between, positive_int as positive_int_flag
from labkit.labs.ft.figures import figures, summary
from labkit.labs.ft.lighthouse import VERSION, Lighthouse
from labkit.runtime import system
from labkit.runtime.launch import LabError, choose_launcher, run_lab
from labkit.runtime.teardown import marked_pids, shielded
from labkit.validate import non_negative, positive, positive_int

GROUP = "labkit.labs.ft.group"
SEQUENCES_PER_RANK = 4         # the global batch: 4 per rank (8 for 2 groups of 1, as the crash lab)
MAX_GROUPS = 4
PRELOAD = ("transformers", "transformers.models.llama.modeling_llama", "torchft")
ENV_RUN = "LABKIT_FT_RUN"      # marks every process of one measure(): what its clean-up stops


def unavailable() -> str | None:
    """Why this lab cannot run here (torchft missing, or no wheel for this platform), or None."""
    if not (sys.platform.startswith("linux") and platform.machine() in ("x86_64", "AMD64")
            and sys.version_info < (3, 14)):
        return (f"torchft {VERSION} has wheels only for Linux on x86-64 (CPython 3.10-3.13), and "
                f"this is Python {sys.version_info.major}.{sys.version_info.minor} on "
                f"{sys.platform} {platform.machine()}; its source needs Rust and "
                "protobuf to build. Run this lab on a Linux x86-64 machine (a cloud VM, WSL2 on "
                "Windows, or a container: docker run --platform linux/amd64 ...), where "
                "`make setup` installs it.")
    if importlib.util.find_spec("torchft") is None:
        return (f"torchft is not installed in this environment ({sys.executable}); install it "
                f"with `pip install torchft=={VERSION}` (or run `make setup`)")
    return None


class Group(threading.Thread):
    """One replica group, run by run_lab in this thread. The victim's first run ends with its
    planned SIGKILL (run_lab raises LabError); once `before_restart(killed)` returns it is
    started again with --rejoin. runs: what rank 0 reported, one dict per run; error: an
    unplanned failure; restarted_at: when the second run was launched."""

    def __init__(self, group: int, launch, stopping: threading.Event, before_restart=None):
        super().__init__(name=f"labkit-ft-group{group}", daemon=True)
        self.group, self.launch, self.stopping = group, launch, stopping
        self.before_restart = before_restart
        self.runs: list[dict] = []
        self.error: BaseException | None = None
        self.failed_at = float("inf")
        self.restarted_at: float | None = None

    def run(self) -> None:
        if self.stopping.is_set():
            return
        try:
            try:
                self.runs.append(self.launch(self.group, rejoin=False).results[0])
                return
            except LabError as err:
                before = (err.result.results[0] if err.result and err.result.results else {})
                if "killed" not in before:
                    raise
                self.runs.append(before)
            if self.before_restart is not None:
                self.before_restart(before["killed"])
            if not self.stopping.is_set():
                self.restarted_at = time.time()
                self.runs.append(self.launch(self.group, rejoin=True).results[0])
        except BaseException as exc:             # reported by measure(), in the caller's thread
            self.error, self.failed_at = exc, time.time()


def shrunk(run_dir: str, since: float, groups: int) -> bool:
    """Whether a group has committed a step without all `groups` after time `since`: the
    lighthouse has dropped the dead one (its heartbeat timed out), and the job went on."""
    for name in os.listdir(run_dir):
        if name.startswith("steps"):
            with open(os.path.join(run_dir, name)) as f:
                for line in f:
                    if line.endswith("\n"):
                        rec = json.loads(line)
                        if rec["end"] > since and rec["participants"] < groups:
                            return True
    return False


def check(steps, kill_at, step_seconds, group_size, groups, restart_delay=0.0) -> tuple:
    """measure()'s arguments, checked (a ValueError says what is wrong and what is allowed)."""
    steps = positive_int("steps", steps, 100_000)
    if steps < 2:
        raise ValueError(f"steps={steps}: a group must die and rejoin within the run; allowed: "
                         "steps >= 2 (20 or more leaves time to heal)")
    kill_at = positive_int("kill_at", kill_at)
    if kill_at >= steps:
        raise ValueError(f"kill_at={kill_at} must come before the last step so that the killed "
                         f"group can rejoin; allowed: 1 to {steps - 1} (steps={steps})")
    step_seconds = positive("step_seconds", step_seconds, 60.0)
    restart_delay = non_negative("restart_delay", restart_delay, 600.0)
    groups = positive_int("groups", groups, MAX_GROUPS)
    if groups < 2:
        raise ValueError(f"groups={groups}: fault tolerance needs a peer to carry on and to heal "
                         f"from; allowed: 2 to {MAX_GROUPS}")
    limit, why = system.max_local_ranks()
    group_size = positive_int("group_size", group_size)
    if groups * group_size > limit // 2:
        raise ValueError(f"groups x group_size = {groups * group_size} processes (and as many "
                         f"again while one restarts) is more than this machine holds ({why}: "
                         f"{limit} ranks); allowed: groups x group_size <= {limit // 2}")
    return steps, kill_at, step_seconds, group_size, groups, restart_delay


def measure(steps: int = 30, kill_at: int = 8, step_seconds: float = 0.3, group_size: int = 1,
            *, groups: int = 2, restart_delay: float = 0.0, timeout: float | None = None,
            quiet: bool = True, env: dict | None = None, launcher: str | None = None) -> dict:
    """Run the lighthouse and `groups` replica groups of `group_size` ranks for `steps` steps;
    the last group kills itself (SIGKILL, rank 0) in the middle of step `kill_at`; once the
    others have committed a step without it (the lighthouse dropped it) and `restart_delay`
    more seconds have passed (a scheduler replacing a host: minutes in a cluster, 0 here by
    default), it is started again and heals from a peer. Returns the figures (`figures`). Each
    step is padded to `step_seconds` of wall time.

    What counts: a step is committed by the quorum (the groups alive at that moment), so the
    job's step count never stops for a dead group. lost_seconds = wall - steps x step_seconds is
    the time no step was committed (the step the failure broke, the lighthouse's detection, the
    heal); goodput = steps x step_seconds / wall. Samples count too: while a group is down each
    step trains on (groups - 1)/groups of the global batch, and goodput_samples = samples
    processed / (wall x the full rate) says so.

    timeout: seconds each group's run may take (default: generous for a busy laptop).
    quiet: keep the groups' output (run_lab's); env: extra variables for every process;
    launcher: run_lab's. Nothing is left running on return, on error or on interrupt: the
    lighthouse, the groups and the restarted group are stopped (a failure of a group other than
    the planned kill raises LabError naming the group, its rank, exception and traceback)."""
    steps, kill_at, step_seconds, group_size, groups, restart_delay = check(
        steps, kill_at, step_seconds, group_size, groups, restart_delay)
    why = unavailable()
    if why:
        raise RuntimeError(why)
    if timeout is None:
        timeout = 120.0 + 4 * steps * step_seconds + restart_delay
    token = uuid.uuid4().hex
    env = {"OMP_NUM_THREADS": "1", **os.environ, **(env or {}), ENV_RUN: token}
    lab_env = {k: v for k, v in env.items() if os.environ.get(k) != v}
    if choose_launcher(launcher, 1) == "pool":
        # A warm pool that has imported what a group needs: the restart then takes ~0.5 s
        # instead of ~2.5 s (1.7 s of it importing transformers' Llama on a 2-core laptop).
        from labkit.runtime import pool
        pool.warm(PRELOAD, env=lab_env, wait=True)
    run = SimpleNamespace(steps=steps, kill_at=kill_at, step_seconds=step_seconds,
                          group_size=group_size, groups=groups, restart_delay=restart_delay,
                          timeout=timeout, quiet=quiet, launcher=launcher, env=lab_env,
                          stopping=threading.Event())
    lighthouse, threads = None, []
    with tempfile.TemporaryDirectory(prefix="labkit-ft-") as tmp:
        run.dir = os.path.join(tmp, "run")
        os.makedirs(run.dir)
        try:
            lighthouse = Lighthouse(env, os.path.join(tmp, "lighthouse.log"))
            start_groups(run, lighthouse.address, threads)
            while any(t.is_alive() for t in threads) and not any(t.error for t in threads):
                time.sleep(0.1)
        finally:       # also on KeyboardInterrupt: nothing of this run may outlive the call
            shielded(lambda: stop_all(run.stopping, token, threads, lighthouse, run.dir))
        failed = sorted((t for t in threads if t.error), key=lambda t: t.failed_at)
        if failed:
            raise _group_error(failed[0])
    return figures([t.runs for t in threads], threads[-1].restarted_at, steps=steps,
                   step_seconds=step_seconds, groups=groups, group_size=group_size,
                   restart_delay=restart_delay)


def start_groups(run, lighthouse: str, threads: list[Group]) -> None:
    """A thread per group, each started as soon as it is in `threads` (so that an interrupt
    finds every one of them): each runs its group with run_lab; the last group's first run has
    --kill-at, and its second (--rejoin) starts once the job went on without it."""
    def launch(g: int, rejoin: bool):
        args = ["--group", g, "--groups", run.groups, "--lighthouse", lighthouse,
                "--steps", run.steps, "--step-seconds", run.step_seconds, "--global-batch",
                SEQUENCES_PER_RANK * run.groups * run.group_size, "--run-dir", run.dir]
        if rejoin:
            args.append("--rejoin")
        elif g == run.groups - 1:
            args += ["--kill-at", run.kill_at]
        return run_lab(GROUP, nproc=run.group_size, args=args, timeout=run.timeout,
                       env=run.env, quiet=run.quiet, launcher=run.launcher)

    def before_restart(killed: dict) -> None:
        """As a scheduler replaces what the job reported lost: once a group has committed a
        step without the dead one (the lighthouse dropped it), and restart_delay later."""
        while not (run.stopping.is_set() or shrunk(run.dir, killed["time"], run.groups)
                   or not any(t.is_alive() for t in threads[:-1])):
            time.sleep(0.05)
        run.stopping.wait(run.restart_delay)

    for g in range(run.groups):
        threads.append(Group(g, launch, run.stopping,
                             before_restart if g == run.groups - 1 else None))
        threads[-1].start()


def stop_all(stopping: threading.Event, token: str, threads: list[Group], lighthouse,
             run_dir: str | None = None) -> None:
    """Stop every process of the run (SIGKILL to all that carry its token: torchrun if used,
    its ranks, the lighthouse; and to every rank that wrote its pid in run_dir: ranks forked
    from the warm pool keep the pool's environment) until the groups' threads have ended: a
    thread may be launching the restarted group at the very moment, so one sweep is not
    enough."""
    stopping.set()
    deadline = time.monotonic() + 60
    while True:
        for pid in marked_pids(ENV_RUN, token) | recorded_pids(run_dir):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        alive = [t for t in threads if t.is_alive()]
        if not alive or time.monotonic() > deadline:
            break
        alive[0].join(timeout=0.2)
    if lighthouse is not None:
        lighthouse.stop()


def recorded_pids(run_dir: str | None) -> set[int]:
    """The live ranks that recorded themselves in run_dir (group.record_pid): pid and start
    time, so that a reused pid is never signalled."""
    from labkit.runtime.guard import alive
    found = set()
    for name in os.listdir(run_dir) if run_dir and os.path.isdir(run_dir) else ():
        if name.startswith("pid") and name[3:].isdigit():
            with open(os.path.join(run_dir, name)) as f:
                started = f.read().strip() or None
            if alive(int(name[3:]), started):
                found.add(int(name[3:]))
    return found


def _group_error(t: Group) -> BaseException:
    """The first unplanned failure, naming its group (and its run: first, or restarted)."""
    err = t.error
    which = "restarted " if len(t.runs) else ""
    if not isinstance(err, LabError):
        return RuntimeError(f"{which}replica group {t.group}: {type(err).__name__}: {err}")
    return LabError(f"{which}replica group {t.group}: {err}", reason=err.reason, rank=err.rank,
                    exc_type=err.exc_type, exc_message=err.exc_message,
                    traceback=err.traceback, result=err.result)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=positive_int_flag, default=30, help="steps (default 30)")
    p.add_argument("--kill-at", type=positive_int_flag, default=8,
                   help="the step in which the last group is killed (default 8)")
    p.add_argument("--step-seconds", type=between(0.01, 60, "a number of seconds"), default=0.3,
                   help="wall time of a step, padded (default 0.3)")
    p.add_argument("--group-size", type=positive_int_flag, default=1,
                   help="ranks per replica group (default 1)")
    p.add_argument("--groups", type=positive_int_flag, default=2,
                   help=f"replica groups, 2 to {MAX_GROUPS} (default 2)")
    p.add_argument("--restart-delay", type=between(0, 600, "a number of seconds"), default=0.0,
                   help="seconds before the killed group is started again, once the others "
                        "went on without it (default 0)")
    p.add_argument("--verbose", action="store_true",
                   help="show the groups' output (torchft logs each quorum)")
    args = p.parse_args(argv)
    try:
        check(args.steps, args.kill_at, args.step_seconds, args.group_size, args.groups,
              args.restart_delay)
    except ValueError as exc:
        p.error(str(exc))
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    why = unavailable()
    if why:
        raise SystemExit(f"labkit.labs.ft: {why}")
    r = measure(args.steps, args.kill_at, args.step_seconds, args.group_size,
                groups=args.groups, restart_delay=args.restart_delay, quiet=not args.verbose)
    print(summary(r))
    print({k: v for k, v in r.items() if k not in ("losses", "step_end")})
