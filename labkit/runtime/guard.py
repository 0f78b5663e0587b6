"""Tie a lab's processes to the process that launched it, so that none outlives it.

    python -m labkit.runtime.guard PARENT_PID -- torchrun ...   # what run_lab starts: `main`
    guard.protect_rank()                                          # in each rank's bootstrap

Why: torchrun and each rank run in sessions of their own (so that teardown can signal their
groups), and a kernel restart or `kill -9` used to leave them running (measured: ranks alive
62 s after `kill -9` of the kernel). Two links, each enough alone on Linux: launcher -> torchrun
(`main`) and torchrun, launcher -> rank (`protect_rank`). LABKIT_ORPHAN_GUARD=0 turns both off
(tests/runtime/test_orphans.py); plain `torchrun` runs are unaffected.
"""
from __future__ import annotations

import os
import signal
import sys
import threading
import time

ENV_LAUNCHER_PID = "LABKIT_LAUNCHER_PID"
ENV_LAUNCHER_START = "LABKIT_LAUNCHER_START"   # the launcher's start time (guards pid reuse)
ENV_AGENT_PID = "LABKIT_AGENT_PID"              # torchrun's pid (the guard's, kept by exec)
ENV_SWITCH = "LABKIT_ORPHAN_GUARD"
POLL_SECONDS = 0.5

_PR_SET_PDEATHSIG = 1


def enabled(env=None) -> bool:
    return (env if env is not None else os.environ).get(ENV_SWITCH, "1") != "0"


def die_with_parent(sig: int = signal.SIGKILL) -> bool:
    """Ask Linux to send `sig` to this process when its parent (thread) dies. False where the
    platform cannot (not Linux, no libc)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (/proc/PID/stat field 22), or None.
    With the pid it names one process for good: a reused pid has another start time."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[19].decode()
    except (OSError, IndexError):
        return None


def launcher_env() -> dict[str, str]:
    """What run_lab adds to the ranks' environment so that they can watch it."""
    pid = os.getpid()
    env = {ENV_LAUNCHER_PID: str(pid)}
    started = start_time(pid)
    if started is not None:
        env[ENV_LAUNCHER_START] = started
    return env


def guarded_command(cmd: list[str]) -> list[str]:
    """`cmd` run through this module, so that it dies with the calling process."""
    return [sys.executable, "-m", "labkit.runtime.guard", str(os.getpid()), "--", *cmd]


def alive(pid: int, started: str | None = None) -> bool:
    """Whether process `pid` runs (a zombie does not), and is the one that started at `started`
    (a start time from `start_time`) when that is given. Without /proc (macOS): kill(pid, 0)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except FileNotFoundError:
        if os.path.isdir("/proc"):
            return False
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass
        return True
    except (OSError, IndexError):
        return True
    if fields[0] in (b"Z", b"X"):
        return False
    return started is None or fields[19].decode() == started


def _wait_for_exit(pid: int, started: str | None) -> None:
    """Block until the process is gone."""
    if hasattr(os, "pidfd_open"):
        try:
            fd = os.pidfd_open(pid)
        except OSError:
            fd = None
        if fd is not None:
            import select
            try:
                if started is None or start_time(pid) == started:   # the same process
                    select.select([fd], [], [])                      # readable once it exits
                return
            finally:
                os.close(fd)
    while alive(pid, started):
        time.sleep(POLL_SECONDS)


def _kill_own_group() -> None:
    sys.stderr.write(f"labkit: the launcher (pid {os.environ.get(ENV_LAUNCHER_PID)}) is gone; "
                     f"rank process {os.getpid()} stops itself\n")
    try:
        sys.stderr.flush()
    except Exception:
        pass
    try:
        if os.getpgid(0) == os.getpid():     # a group leader: take its children with it
            os.killpg(os.getpid(), signal.SIGKILL)
    except OSError:
        pass
    os.kill(os.getpid(), signal.SIGKILL)


def protect_rank(env=None) -> bool:
    """Called by each rank's bootstrap: die with torchrun and with the launcher. Returns
    whether a launcher is being watched.

    The second link (torchrun -> rank and launcher -> rank): the same death signal as `main`'s,
    against torchrun (in the kernel: it works while the rank holds the GIL in C code), and a
    watchdog thread that waits on the launcher's pid (a pidfd where Linux has one; polling
    elsewhere, e.g. macOS, where prctl does not exist) and kills the rank's own process group
    when the launcher is gone. Without the launcher's variables (plain torchrun) nothing is set."""
    env = env if env is not None else os.environ
    if not enabled(env) or ENV_LAUNCHER_PID not in env:
        return False
    agent = env.get(ENV_AGENT_PID)
    if agent is not None and int(agent) == os.getppid():
        die_with_parent()
        if os.getppid() != int(agent):      # torchrun died before the line above took effect
            _kill_own_group()
    pid, started = int(env[ENV_LAUNCHER_PID]), env.get(ENV_LAUNCHER_START)

    def watch():
        _wait_for_exit(pid, started)
        _kill_own_group()

    threading.Thread(target=watch, name="labkit-launcher-watchdog", daemon=True).start()
    return True


def main(argv: list[str]) -> None:
    """The first link (launcher -> torchrun): `run_lab` starts `python -m labkit.runtime.guard
    PID -- torchrun ...`, which asks the kernel (Linux `prctl(PR_SET_PDEATHSIG, SIGKILL)`) to
    kill it when its parent dies, checks that the parent is still PID (it may have died
    already), and then *becomes* torchrun (`execv`; the death signal survives exec). Costs one
    small interpreter start, ~50 ms."""
    if len(argv) < 3 or argv[1] != "--":
        raise SystemExit("usage: python -m labkit.runtime.guard PARENT_PID -- COMMAND [ARGS...]")
    parent, cmd = int(argv[0]), argv[2:]
    die_with_parent()
    if os.getppid() != parent:               # the parent died before prctl took effect
        raise SystemExit(1)
    os.environ[ENV_AGENT_PID] = str(os.getpid())   # exec keeps the pid: torchrun's
    os.execv(cmd[0], cmd)


if __name__ == "__main__":
    main(sys.argv[1:])
