"""A lab run's private directory (the ranks' records and torchrun's logs) and what outlives it.

Each run gets `<tmp>/labkit-<run id>-XXXX/` with an `owner.json` naming the launcher (pid and
start time). Normally run_lab removes it; a launcher killed hard (kill -9, a kernel restart with
now=True) cannot, so the next run sweeps every run directory whose owner is gone.
A failure's full message is kept in a file when it is too long to read (`cap_message`).
"""
from __future__ import annotations

import glob
import json
import os
import shutil
import tempfile
import time

from labkit.runtime import guard

PREFIX = "labkit-"
MAX_MESSAGE_LINES = 60
MAX_MESSAGE_CHARS = 8000
LEGACY_AGE_SECONDS = 24 * 3600     # run directories without an owner file (labkit 0.1)


def make_run_dir(run_id: str) -> str:
    path = tempfile.mkdtemp(prefix=f"{PREFIX}{run_id}-")
    with open(os.path.join(path, "owner.json"), "w") as f:
        json.dump({"pid": os.getpid(), "start": guard.start_time(os.getpid())}, f)
    return path


def _owner_gone(path: str) -> bool:
    try:
        with open(os.path.join(path, "owner.json")) as f:
            owner = json.load(f)
    except FileNotFoundError:
        # A run directory from before owner files: old enough means nobody uses it.
        return (os.path.isdir(os.path.join(path, "results"))
                and time.time() - os.path.getmtime(path) > LEGACY_AGE_SECONDS)
    except (OSError, ValueError):
        return False
    if not isinstance(owner, dict) or not isinstance(owner.get("pid"), int):
        return False
    return not guard.alive(owner["pid"], owner.get("start"))


def sweep_stale(tmp: str | None = None) -> list[str]:
    """Remove run directories whose launcher is dead; return their paths."""
    removed = []
    for path in glob.glob(os.path.join(tmp or tempfile.gettempdir(), f"{PREFIX}*-*")):
        if os.path.isdir(path) and not os.path.islink(path) and _owner_gone(path):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def cap_message(text: str, run_id: str) -> str:
    """The text itself when it is readable, else its head and tail with the full text saved
    to a file that the message names (a lab of 1000 ranks made 200 KB messages)."""
    lines = text.splitlines()
    if len(lines) <= MAX_MESSAGE_LINES and len(text) <= MAX_MESSAGE_CHARS:
        return text
    fd, path = tempfile.mkstemp(prefix=f"labkit-error-{run_id}-", suffix=".txt")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text + "\n")
    head, tail = lines[:40], lines[-10:] if len(lines) > 50 else []
    short = [line if len(line) <= 300 else line[:297] + "..." for line in head]
    short += [f"... ({len(lines) - len(head) - len(tail)} more lines; the whole message: {path})"]
    short += [line if len(line) <= 300 else line[:297] + "..." for line in tail]
    return "\n".join(short)[:MAX_MESSAGE_CHARS]
