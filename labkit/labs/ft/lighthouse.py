"""torchft's lighthouse for the lab: its command, a process of it that dies with its launcher,
and when it forms a quorum without a dead group (`expected_detection`, what
labkit.resilience.ft_lost_seconds calls detect).

    torchft_lighthouse --min_replicas 1 --bind 127.0.0.1:0 --join_timeout_ms 500 \
        --heartbeat_timeout_ms 1000                   # what Lighthouse() starts
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time

from labkit.runtime import guard

VERSION = "0.2.0"              # the torchft this lab was written against (pyproject pins it)
# The lighthouse's clocks. It drops a group HEARTBEAT_SECONDS after its last heartbeat (torchft:
# 5 s) and waits JOIN_SECONDS for a heartbeating group to join a quorum (torchft: 60 s); a
# laptop's run would otherwise be all waiting.
HEARTBEAT_SECONDS = 1.0
JOIN_SECONDS = 0.5


def expected_detection(groups: int, step_seconds: float) -> float:
    """Seconds from a group's failure until the lighthouse forms a quorum without it, as
    torchft 0.2.0 behaves (measured with this lab): the survivors ask for a quorum when their
    broken step ends, step/2 after the failure on average. If they are more than half of the
    groups it waits JOIN_SECONDS for the missing one, then goes on without it; if not (1 of 2)
    it waits until the dead group's heartbeat times out, HEARTBEAT_SECONDS after its last
    beat (sent every 0.1 s)."""
    if 2 * (groups - 1) > groups:
        return min(HEARTBEAT_SECONDS, step_seconds / 2 + JOIN_SECONDS)
    return HEARTBEAT_SECONDS


def lighthouse_command() -> list[str]:
    """torchft_lighthouse from this interpreter's environment (beside python), else the PATH."""
    here = os.path.join(os.path.dirname(sys.executable), "torchft_lighthouse")
    found = here if os.access(here, os.X_OK) else shutil.which("torchft_lighthouse")
    if not found:
        raise FileNotFoundError(f"torchft_lighthouse is neither beside {sys.executable} nor on "
                                f"the PATH: reinstall torchft=={VERSION}")
    return [found, "--min_replicas", "1", "--bind", "127.0.0.1:0",
            "--join_timeout_ms", str(int(JOIN_SECONDS * 1000)),
            "--heartbeat_timeout_ms", str(int(HEARTBEAT_SECONDS * 1000))]


class Lighthouse:
    """torchft's lighthouse (the quorum service) as a process of its own, listening on
    127.0.0.1 only, at a port the OS picked (read from its first log line). It dies with this
    process (labkit.runtime.guard) and runs in a session of its own, so stop() takes it all."""

    def __init__(self, env: dict, log_path: str, wait: float = 60.0):
        cmd = lighthouse_command()
        if guard.enabled(env):
            cmd = guard.guarded_command(cmd)
        self.log_path = log_path
        env = {**env, "RUST_LOG": "info"}        # its address is in its first INFO line
        with open(log_path, "w") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                         stdin=subprocess.DEVNULL, start_new_session=True)
        self.address = self._address(wait)

    def _address(self, wait: float) -> str:
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            for line in self.log().splitlines():
                if "Lighthouse listening on:" in line:
                    return f"http://127.0.0.1:{line.rsplit(':', 1)[1].strip()}"
            if self.proc.poll() is not None:
                break
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"torchft_lighthouse did not start within {wait:.0f} s; its log:\n"
                           f"{self.log()}")

    def log(self) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return f.read()[-4000:]
        except OSError:
            return ""

    def stop(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(self.proc.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
            try:
                self.proc.wait(timeout=3)
                return
            except subprocess.TimeoutExpired:
                continue


