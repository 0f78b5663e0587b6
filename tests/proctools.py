"""Finding a test's processes: each test marks what it starts with a unique environment
variable, and these look for live processes that carry it (torchrun, its ranks, their children)."""
from __future__ import annotations

import os
import time

MARK = "LABKIT_TEST_MARK"


def processes_marked(value: str, name: str = MARK) -> list[int]:
    """Live (non-zombie) processes whose environment contains name=value."""
    needle = f"{name}={value}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = f.read().split(b"\0")
            with open(f"/proc/{entry}/stat", "rb") as f:
                state = f.read().rsplit(b")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if needle in env and state not in (b"Z", b"X"):
            found.append(int(entry))
    return found


def wait_until_gone(value: str, limit: float) -> tuple[float, list[int]]:
    """Seconds until no marked process is left (polling every 50 ms), and what is left at the
    limit (empty when all went)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < limit:
        if not processes_marked(value):
            return time.monotonic() - t0, []
        time.sleep(0.05)
    return time.monotonic() - t0, processes_marked(value)


def kill_marked(value: str) -> None:
    import signal
    for pid in processes_marked(value):
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
