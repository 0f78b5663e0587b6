"""How a lab ended, read from what its ranks left behind: the JSON-lines records of
labkit.runtime.dist, torch elastic's error files, torchrun's failure summary, and the stacks ranks dump on
SIGUSR1 when a timeout fires (used by labkit.runtime.launch to write its LabError messages)."""
from __future__ import annotations

import json
import os
import re
import signal
import time

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


def dump_stacks(pids: dict[int, int], results_dir: str) -> dict[int, str]:
    for pid in pids.values():
        try:
            os.kill(pid, signal.SIGUSR1)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + STACK_WAIT_SECONDS
    stacks: dict[int, str] = {}
    while time.monotonic() < deadline and len(stacks) < len(pids):
        time.sleep(0.1)
        for r in pids:
            try:
                with open(os.path.join(results_dir, f"rank{r}.stack"), encoding="utf-8",
                          errors="replace") as f:
                    text = f.read()
            except OSError:
                continue
            if "Current thread" in text and text.endswith("\n"):
                stacks[r] = text
    return stacks


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
