"""How a lab ended, read from what its ranks left behind: the JSON-lines records of
labkit.runtime.dist, torch elastic's error files, torchrun's failure summary, and the stacks ranks dump on
SIGUSR1 when a timeout fires (used by labkit.runtime.launch to write its LabError messages)."""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import time

from labkit.runtime.dist import ENV_RUN_ID
from labkit.runtime.guard import alive as proc_alive

STACK_WAIT_SECONDS = 2.0     # how long a timeout waits for the ranks' stack dumps


# ---------------------------------------------------------------------------------------------
# records written by the ranks (labkit.runtime.dist / labkit.runtime.bootstrap)

def read_records(results_dir: str) -> dict[int, list[dict]]:
    records: dict[int, list[dict]] = {}
    if not os.path.isdir(results_dir):
        return records
    for name in os.listdir(results_dir):
        m = re.fullmatch(r"rank(\d+)\.jsonl", name)
        if not m:
            continue
        with open(os.path.join(results_dir, name), encoding="utf-8") as f:
            lines = [json.loads(line) for line in f if line.endswith("\n") and line.strip()]
        records[int(m.group(1))] = lines
    return records


def first_record(records: list[dict], kind: str) -> dict | None:
    return next((r for r in records if r["kind"] == kind), None)


def exit_codes_from_summary(agent_log: list[str]) -> dict[int, int]:
    """torchrun's failure summary lists 'rank : R (local_rank: L)' then 'exitcode : C'."""
    text = "\n".join(agent_log)
    pattern = r"rank\s*:\s*(\d+) \(local_rank: \d+\)\s*\n\s*exitcode\s*:\s*(-?\d+)"
    return {int(r): int(c) for r, c in re.findall(pattern, text)}


def elastic_errors(log_dir: str) -> list[dict]:
    """torch elastic's error files (<log_dir>/<run>/attempt_N/<local rank>/error.json)."""
    errors = []
    for root, _dirs, files in os.walk(log_dir):
        if "error.json" not in files:
            continue
        try:
            with open(os.path.join(root, "error.json"), encoding="utf-8") as f:
                msg = json.load(f)["message"]
            info = msg.get("extraInfo", {}) if isinstance(msg, dict) else {}
            text = msg.get("message", "") if isinstance(msg, dict) else str(msg)
            exc_type, _, exc_message = text.partition(": ")
            errors.append({"rank": int(os.path.basename(root)), "exc_type": exc_type,
                           "message": exc_message, "traceback": info.get("py_callstack", ""),
                           "time": float(info.get("timestamp", 0))})
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return sorted(errors, key=lambda e: e["time"])


# ---------------------------------------------------------------------------------------------
# where was each rank at a timeout

_FRAME = re.compile(r'^\s*File "(.+)", line (\d+) in (\S+)')


def main_thread_frames(stack_text: str) -> list[tuple[str, int, str]]:
    """Frames (file, line, function), most recent first, of the thread faulthandler ran in."""
    block, current = [], False
    for line in stack_text.splitlines():
        if line.startswith("Current thread"):
            current, block = True, []
        elif line.startswith("Thread "):
            current = False
        elif current and (m := _FRAME.match(line)):
            block.append((m.group(1), int(m.group(2)), m.group(3)))
    return block


def short_path(path: str) -> str:
    """A path relative to the working directory when it lies below it, else as it is."""
    rel = os.path.relpath(path) if os.path.isabs(path) else path
    return path if rel.startswith("..") else rel


def is_plumbing(path: str) -> bool:
    return path.startswith("<frozen runpy") or path.endswith(("labkit/runtime/bootstrap.py", "runpy.py"))


def where(frames: list[tuple[str, int, str]]) -> tuple[str | None, str]:
    """(collective the rank waits in or None, "file:line in function" of the lab's own code)."""
    collective = next((fn for path, _, fn in frames
                       if path.endswith("torch/distributed/distributed_c10d.py")), None)
    mine = next((f"{short_path(p)}:{ln} in {fn}"
                 for p, ln, fn in frames
                 if "site-packages" not in p and not p.startswith("<") and not is_plumbing(p)),
                "an unknown place")
    return collective, mine


def _stack_file(results_dir: str, r: int) -> str:
    return os.path.join(results_dir, f"rank{r}.stack")


def _file_size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


def dump_stacks(pids: dict[int, int], results_dir: str,
                wait: float = STACK_WAIT_SECONDS) -> dict[int, str]:
    """Ask each rank (rank -> pid) for its Python stacks (SIGUSR1: faulthandler, registered by
    labkit.runtime.dist._begin) and return rank -> what it wrote, waiting up to `wait` seconds.
    Only what a rank writes after this call counts (its file may hold an earlier dump), and a
    dump counts once it has stopped growing (faulthandler writes it in many small writes)."""
    before = {r: _file_size(_stack_file(results_dir, r)) for r in pids}
    asked = {}
    for r, pid in pids.items():
        try:
            os.kill(pid, signal.SIGUSR1)
            asked[r] = pid
        except (ProcessLookupError, PermissionError):
            pass
    deadline = time.monotonic() + wait
    stacks: dict[int, str] = {}
    seen: dict[int, str] = {}
    while time.monotonic() < deadline and len(stacks) < len(asked):
        time.sleep(0.1)
        for r, pid in asked.items():
            if r in stacks:
                continue
            try:
                with open(_stack_file(results_dir, r), "rb") as f:
                    f.seek(before[r])
                    text = f.read().decode("utf-8", "replace")
            except OSError:
                continue
            if "Current thread" in text and text.endswith("\n") and seen.get(r) == text:
                stacks[r] = text
            seen[r] = text
        if all(r in stacks or not proc_alive(pid) for r, pid in asked.items()):
            break            # the others are gone: nothing more will come
    for r in asked:          # a dump cut short by the deadline is still better than none
        if r not in stacks and "Current thread" in seen.get(r, ""):
            stacks[r] = seen[r]
    return stacks


def read_stacks(results_dir: str) -> dict[int, str]:
    """Every stack dump the ranks left in the run directory (rank -> text; the last dump in a
    text is the latest: `main_thread_frames` reads that one)."""
    stacks = {}
    if not os.path.isdir(results_dir):
        return stacks
    for name in os.listdir(results_dir):
        m = re.fullmatch(r"rank(\d+)\.stack", name)
        if not m:
            continue
        try:
            with open(os.path.join(results_dir, name), encoding="utf-8", errors="replace") as f:
                text = f.read()
        except OSError:
            continue
        if "Current thread" in text:
            stacks[int(m.group(1))] = text
    return stacks


def _carries(pid: int, name: str, value: str) -> bool:
    """Whether process `pid`'s environment holds name=value (True where there is no /proc)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return f"{name}={value}".encode() in f.read().split(b"\0")
    except FileNotFoundError:
        return not os.path.isdir("/proc")
    except OSError:
        return False


def dump_peer_stacks(results_dir: str, me: int, run_id: str | None = None,
                     wait: float = STACK_WAIT_SECONDS) -> dict[int, str]:
    """Called by a rank whose collective timed out, before it exits (labkit.runtime.bootstrap):
    the stacks of its peers on this host that are still running (no error or exit record), so
    that the launcher can say which rank never joined the collective. They must be asked now:
    once this rank exits, the launcher's agent stops the others (SIGTERM) within a moment."""
    host = socket.gethostname()
    pids = {}
    for r, recs in read_records(results_dir).items():
        start = first_record(recs, "start")
        if (r == me or not start or start.get("host") != host or first_record(recs, "error")
                or first_record(recs, "exit")):
            continue
        pid = start["pid"]
        if pid != os.getpid() and proc_alive(pid) and (
                run_id is None or _carries(pid, ENV_RUN_ID, run_id)):
            pids[r] = pid
    return dump_stacks(pids, results_dir, wait) if pids else {}


# What a rank raises when a collective waited longer than the process group's timeout (gloo:
# "Timed out waiting 10000ms for recv operation to complete"; c10d: "... timed out ...").
COLLECTIVE_TIMED_OUT = re.compile(r"timed out|timeout", re.I)
_TB_FRAME = re.compile(r'^\s*File "(.+)", line (\d+), in (\S+)', re.M)


def traceback_frames(tb: str) -> list[tuple[str, int, str]]:
    """Frames (file, line, function) of a Python traceback's text, most recent first (as
    `main_thread_frames` gives a faulthandler dump's)."""
    return [(p, int(ln), fn) for p, ln, fn in _TB_FRAME.findall(tb or "")][::-1]


def timed_out_collective(message: str | None, tb: str | None) -> str | None:
    """The collective (e.g. "all_reduce") a rank gave up waiting in, when its exception is a
    collective's timeout raised inside torch.distributed; else None."""
    if not message or not COLLECTIVE_TIMED_OUT.search(message):
        return None
    return where(traceback_frames(tb or ""))[0]


def hang_diagnosis(running: list[int], stacks: dict[int, str]) -> list[str]:
    waiting, elsewhere = {}, {}
    for r in running:
        if r not in stacks:
            continue
        collective, mine = where(main_thread_frames(stacks[r]))
        (waiting if collective else elsewhere)[r] = (collective, mine)
    lines = [f"rank {r} is not in a collective: it is at {mine}"
             for r, (_, mine) in sorted(elsewhere.items())]
    for r, (coll, mine) in sorted(waiting.items()):
        blame = (f": rank{'s' if len(elsewhere) > 1 else ''} "
                 f"{ranks_text(elsewhere)} never joined it" if elsewhere else "")
        lines.append(f"rank {r} waits in {coll} ({mine}){blame}")
    kinds = {c for c, _ in waiting.values()}
    if waiting and not elsewhere and len(kinds) > 1:
        lines.append("the ranks wait in different collectives: a mismatch, each waits forever")
    return lines


def ranks_text(ranks) -> str:
    return ", ".join(str(r) for r in sorted(ranks))
