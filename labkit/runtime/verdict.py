"""How a lab ended, and whom to blame: builds the `LabResult` and, for a failed lab, the
`LabError` whose message names the rank that failed first and how (used by run_lab).

Who failed first is not always who raised first. A rank that dies without a Python exception
(`os._exit(3)`, SIGKILL from the kernel's OOM killer, SIGSEGV in native code) leaves no error
record; its peers then fail inside a collective ("Connection closed by peer") and their
exceptions would be blamed, the causality reversed. So: a rank that died silently (no error or
exit record, a non-zero exit, not the launcher's SIGTERM) is the culprit unless a rank raised a
real exception (not a lost-peer one) before it was seen dead. The launcher watches the ranks'
pids (`DeathWatch`) to know when each died.
"""
from __future__ import annotations

import re
import signal
import time

from labkit.runtime.postmortem import (elastic_errors, exit_codes_from_summary, first_record,
                                       hang_diagnosis, is_plumbing, main_thread_frames,
                                       ranks_text, read_records, short_path)
from labkit.runtime.results import LabError, LabResult, RankResult
from labkit.runtime.teardown import proc_alive

# What a rank raises when a peer vanished under it (gloo, NCCL, the c10d store).
PEER_LOST = re.compile(r"Connection (closed|reset) by peer|Broken pipe|remote (worker|process)"
                       r"|communicator was aborted|peer.*(closed|disconnect)|Socket closed"
                       r"|ProcessGroupNCCL.*(abort|watchdog)|store.*(closed|disconnected)", re.I)

SIGNAL_HINTS = {
    signal.SIGKILL: "the kernel's OOM killer does this when memory runs out (look at the "
                    "rank's memory, or `dmesg`), and so does `kill -9`",
    signal.SIGSEGV: "a crash in native code (a C/C++ extension, an out-of-bounds access)",
    signal.SIGABRT: "a C++ abort: a failed check inside torch, gloo or NCCL",
    signal.SIGBUS: "a bad memory access, often /dev/shm full",
}


class DeathWatch:
    """When each rank's process was first seen gone (the launcher polls it while it pumps
    output; single node only: other nodes' pids are not ours to watch)."""

    def __init__(self, results_dir: str):
        self.results_dir = results_dir
        self.pids: dict[int, int] = {}
        self.died: dict[int, float] = {}

    def poll(self) -> None:
        for r, recs in read_records(self.results_dir).items():
            if r not in self.pids and (start := first_record(recs, "start")):
                self.pids[r] = start["pid"]
        now = time.time()
        for r, pid in self.pids.items():
            if r not in self.died and not proc_alive(pid):
                self.died[r] = now


def how_it_ended(code: int) -> str:
    if code < 0 and -code in signal.valid_signals():
        sig = signal.Signals(-code)
        hint = SIGNAL_HINTS.get(sig)
        return f"was killed by {sig.name}" + (f"; {hint}" if hint else "")
    return f"exited with code {code}"


def collect(target, nproc, results_dir, log_dir, returncode, wall, output, agent_log, run_id,
            timed_out, timeout, stacks, died=None, exit_codes=None, launcher="torchrun"):
    """Build the LabResult and, when the lab failed, the LabError to raise. died: rank -> time
    (time.time()) its process was first seen gone, from a DeathWatch. exit_codes: rank -> exit
    code (negative: the signal) where the launcher knows them (the pool's agent reaps the
    ranks); else read from torchrun's failure summary."""
    died = died or {}
    records = read_records(results_dir)
    summary_codes = exit_codes_from_summary(agent_log) if exit_codes is None else exit_codes
    world = max([nproc] + [s["world_size"] for recs in records.values()
                           if (s := first_record(recs, "start"))])
    end = time.time()
    ranks, results = [], []
    for r in range(world):
        recs = records.get(r, [])
        start, exit_ = first_record(recs, "start"), first_record(recs, "exit")
        code = exit_["code"] if exit_ else summary_codes.get(r)
        if code is None and returncode == 0 and start:
            code = 0
        wall_r = exit_["wall_time"] if exit_ else (end - start["time"] if start else None)
        ranks.append(RankResult(r, code, wall_r, start and start["pid"], start and start["host"]))
        merged: dict = {}
        for rec in recs:
            if rec["kind"] == "report":
                merged.update(rec["metrics"])
        results.append(merged)
    result = LabResult(target, nproc, ranks, results, wall, returncode, output, agent_log, run_id,
                       launcher)
    name = short_path(target)
    if timed_out:
        return result, _timeout_error(name, result, records, timeout, stacks)
    if result.ok:
        return result, None
    return result, _failure(name, result, records, log_dir, returncode, output, agent_log, died,
                            launcher)


def _timeout_error(name, result, records, timeout, stacks) -> LabError:
    running = [rr.rank for rr in result.ranks if records.get(rr.rank) and not first_record(
        records[rr.rank], "exit") and not first_record(records[rr.rank], "error")]
    lines = [f"lab {name} timed out: the launcher's timeout of {timeout:g} s fired with "
             + (f"rank{'s' if len(running) > 1 else ''} {ranks_text(running)} still running"
                if running else "no rank started yet (imports too slow? raise timeout)")]
    lines += hang_diagnosis(running, stacks)
    for r in sorted(stacks):
        lines.append(f"--- Python stack of rank {r} at the timeout (most recent call first):")
        frames = main_thread_frames(stacks[r])
        lines += [f"  {p}:{ln} in {fn}" for p, ln, fn in frames if not is_plumbing(p)]
    return LabError("\n".join(lines), reason="timeout", result=result)


def _silent_deaths(result, records, died) -> list[RankResult]:
    """Ranks that died without a Python exception, earliest seen first (then by rank)."""
    out = []
    for rr in result.ranks:
        recs = records.get(rr.rank, [])
        if (rr.exit_code in (0, None) or rr.exit_code == -signal.SIGTERM
                or first_record(recs, "error") or first_record(recs, "exit")):
            continue
        out.append(rr)
    return sorted(out, key=lambda rr: (died.get(rr.rank, float("inf")), rr.rank))


def _failure(name, result, records, log_dir, returncode, output, agent_log, died,
             launcher="torchrun") -> LabError:
    launcher = "the pool launcher" if launcher == "pool" else launcher
    errors = sorted(({**rec, "rank": r} for r, recs in records.items() for rec in recs
                     if rec["kind"] == "error"), key=lambda e: e["time"])
    if not errors:
        errors = elastic_errors(log_dir)
    real = [e for e in errors if not PEER_LOST.search(e.get("message") or "")]
    silent = _silent_deaths(result, records, died)
    culprit = silent[0] if silent else None
    if culprit is not None and real and died.get(culprit.rank, float("inf")) > real[0]["time"]:
        culprit = None          # a real exception came first; the silent death followed it
    others: list[str] = []
    exc_type = exc_msg = tb = None
    if culprit is not None:
        rank = culprit.rank
        reason = "signal" if culprit.exit_code < 0 else "exit"
        head = f"lab {name} failed: rank {rank} {how_it_ended(culprit.exit_code)}"
        if culprit.exit_code > 0:
            head += " without raising a Python exception (os._exit, or a crash in native code)"
        said = [o for o in output if o.startswith(f"[rank {rank}] ")][-5:]
        others += (["its last output:"] + [f"  {o}" for o in said]) if said else []
        for rr in silent[1:]:
            others.append(f"rank {rr.rank} {how_it_ended(rr.exit_code)} too")
        lost = sorted({e["rank"] for e in errors if e["rank"] != rank})
        if lost:
            first = errors[0]["message"].splitlines()[0] if errors[0]["message"] else ""
            others.append(f"rank{'s' if len(lost) > 1 else ''} {ranks_text(lost)} then failed "
                          f"because rank {rank} was gone ({_short(first)})")
    elif errors:
        first = real[0] if real else errors[0]
        reason, rank, exc_type, exc_msg, tb = ("exception", first["rank"], first["exc_type"],
                                               first["message"], first["traceback"])
        head = f"lab {name} failed: rank {rank} raised {exc_type}: {exc_msg}"
        if exc_type == "SystemExit":   # e.g. argparse: the rank printed why; show that instead
            head = f"lab {name} failed: rank {rank} exited with code {exc_msg} (sys.exit)"
            said = [o for o in output if o.startswith(f"[rank {rank}] ")][-5:]
            others = (["its last output:"] + [f"  {o}" for o in said]) if said else []
            reason, tb = "exit", None
        else:
            for e in errors:
                if e is not first:
                    others.append(f"rank {e['rank']} then raised {e['exc_type']}: "
                                  f"{_short(e['message'].splitlines()[0] if e['message'] else '')}")
    else:
        bad = [rr for rr in result.ranks if rr.exit_code not in (0, None)]
        if bad:
            rr = bad[0]
            head = f"lab {name} failed: rank {rr.rank} {how_it_ended(rr.exit_code)}"
            reason, rank = ("signal" if rr.exit_code < 0 else "exit"), rr.rank
        else:
            head = f"lab {name} failed: {launcher} exited with code {returncode}"
            reason, rank = "launcher", None
            others += [f"{launcher} said:"] + agent_log[-20:]
    errored = {e["rank"] for e in errors}
    silent_ranks = {rr.rank for rr in silent}
    stopped = [rr.rank for rr in result.ranks if rr.exit_code is not None and rr.exit_code < 0
               and rr.rank not in errored | silent_ranks and rr.rank != rank]
    if stopped and rank is not None:
        others.append(f"rank{'s' if len(stopped) > 1 else ''} {ranks_text(stopped)} "
                      f"stopped by {launcher} after rank {rank} failed")
    if (exc_msg and re.search(r"timed out|timeout", exc_msg, re.I)
            and len(result.ranks) > 1):
        others.append(f"hint: rank {rank} gave up waiting in a collective; a rank that never "
                      "joined it is the usual cause. With the collective timeout above the "
                      "launcher's (the default under run_lab) the launcher reports where every "
                      "rank was.")
    text = "\n".join([head, *others] + ([f"Traceback of rank {rank} (the first to fail):",
                                        tb.rstrip()] if tb else []))
    return LabError(text, reason=reason, rank=rank, exc_type=exc_type,
                    exc_message=exc_msg, traceback=tb, result=result)


def _short(text: str, limit: int = 120) -> str:
    """One line of an exception message, without gloo's "[/path/to/pair.cc:553] " prefix."""
    text = re.sub(r"^\[[^\]]*\.(cc|cpp|h):\d+\]\s*", "", text)
    return text if len(text) <= limit else text[:limit - 3] + "..."
