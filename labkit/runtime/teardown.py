"""Stopping a lab's processes for good: torchrun runs in a session of its own and each rank in
its own, so teardown signals every process group and every process that carries the run's
LABKIT_RUN_ID, SIGTERM first and SIGKILL after a grace period (used by labkit.runtime.launch)."""
from __future__ import annotations

import os
import signal
import subprocess
import time

from labkit.runtime.dist import ENV_RUN_ID
from labkit.runtime.guard import alive as proc_alive

GRACE_SECONDS = 3.0          # between SIGTERM and SIGKILL at teardown


def marked_pids(name: str, value: str) -> set[int]:
    """Live processes whose environment holds name=value (e.g. LABKIT_RUN_ID=<run>)."""
    needle = f"{name}={value}".encode()
    found = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if needle in f.read().split(b"\0") and proc_alive(int(entry)):
                    found.add(int(entry))
        except OSError:
            continue
    return found


def _signal_all(proc: subprocess.Popen | None, pids: set[int], sig: int) -> None:
    for pgid in {*([proc.pid] if proc else []), *pids}:   # each leads its own session
        try:
            os.killpg(pgid, sig)
        except (ProcessLookupError, PermissionError):
            pass
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def teardown(proc: subprocess.Popen | None, run_id: str, rank_pids: set[int]) -> None:
    """SIGTERM everything of this run, SIGKILL what is left after a grace period, reap torchrun
    (proc; None for the pool launcher, whose agent is not our child)."""
    pids = {p for p in rank_pids | marked_pids(ENV_RUN_ID, run_id) if proc_alive(p)}
    if not pids and (proc is None or proc.poll() is not None):
        return                        # a clean end: nothing to stop
    _signal_all(proc, pids, signal.SIGTERM)
    deadline = time.monotonic() + GRACE_SECONDS
    while time.monotonic() < deadline:
        if (proc is None or proc.poll() is not None) and not any(proc_alive(p) for p in pids):
            break
        time.sleep(0.05)
    for _ in range(3):
        pids = {p for p in pids | marked_pids(ENV_RUN_ID, run_id) if proc_alive(p)}
        if proc is not None and proc.poll() is None:
            pids.add(proc.pid)
        if not pids:
            break
        _signal_all(proc, pids, signal.SIGKILL)
        time.sleep(0.1)
    if proc is not None:
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass


def shielded(fn) -> None:
    """Run fn with Ctrl-C ignored (a second interrupt must not cut a clean-up short)."""
    import threading
    if threading.current_thread() is not threading.main_thread():
        return fn()
    old = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        fn()
    finally:
        signal.signal(signal.SIGINT, old)
