"""How a lab ended, and whom to blame: builds the `LabResult` and, for a failed lab, the
`LabError` whose message names the rank that failed first and how (used by run_lab).

Who failed first is not always who raised first. A rank that dies without a Python exception
(`os._exit(3)`, SIGKILL from the kernel's OOM killer, SIGSEGV in native code) leaves no error
record; its peers then fail inside a collective ("Connection closed by peer") and their
exceptions would be blamed, the causality reversed. So: a rank that died silently (no error or
exit record, a non-zero exit, not the launcher's SIGTERM) is the culprit unless a rank raised a
real exception (not a lost-peer one) before it was seen dead. The launcher watches the ranks'
pids (`DeathWatch`) to know when each died. After torchrun's restarts (run_lab max_restarts)
the last attempt is judged, the earlier ones listed (`split_attempts`, `_attempt_failures`).
"""
from __future__ import annotations

import os
import re
import signal
import time

from labkit.runtime.postmortem import (elastic_errors, exit_codes_from_summary, first_record,
                                       hang_diagnosis, is_plumbing, main_thread_frames,
                                       ranks_text, read_records, read_stacks, short_path,
                                       timed_out_collective, traceback_frames, where)
from labkit.runtime.results import LabError, LabResult, RankResult
from labkit.runtime.teardown import proc_alive

# What a rank raises when a peer vanished under it (gloo, NCCL, the c10d store).
PEER_LOST = re.compile(r"Connection (closed|reset) by peer|Broken pipe|remote (worker|process)"
                       r"|communicator was aborted|peer.*(closed|disconnect)|Socket closed"
                       r"|ProcessGroupNCCL.*(abort|watchdog)|store.*(closed|disconnected)", re.I)

# torchrun's agent logs the first failure of each attempt it ends (the pid names the process;
# its choice of the "first" is by whole seconds, so the rank it names may be a peer that died
# in the same second: only the pid -> exit code pairing is used).
AGENT_FAILURE = re.compile(r"failed \(exitcode: (-?\d+)\) local_rank: \d+ \(pid: (\d+)\)")
AGENT_RESTART = re.compile(r"attempts left; will restart worker group")

SIGNAL_HINTS = {
    signal.SIGKILL: "the kernel's OOM killer does this when memory runs out (look at the "
                    "rank's memory, or `dmesg`), and so does `kill -9`",
    signal.SIGSEGV: "a crash in native code (a C/C++ extension, an out-of-bounds access)",
    signal.SIGABRT: "a C++ abort: a failed check inside torch, gloo or NCCL",
    signal.SIGBUS: "a bad memory access, often /dev/shm full",
}


def split_attempts(records: dict[int, list[dict]]) -> dict[int, dict[int, list[dict]]]:
    """attempt -> rank -> that attempt's records. A rank's file holds its attempts one after
    the other (torchrun stops every rank before it starts the next attempt); an "attempt"
    record opens each restart's records, and what comes before any is attempt 0."""
    out: dict[int, dict[int, list[dict]]] = {}
    for r, recs in records.items():
        attempt = 0
        for rec in recs:
            if rec["kind"] == "attempt":
                attempt = int(rec["attempt"])
            out.setdefault(attempt, {}).setdefault(r, []).append(rec)
    return out


def last_attempt(records: dict[int, list[dict]]) -> dict[int, list[dict]]:
    """rank -> records of the newest attempt (all records when the lab never restarted)."""
    attempts = split_attempts(records)
    return attempts[max(attempts)] if attempts else {}


class DeathWatch:
    """When each rank's process was first seen gone, and how it ended where the launcher can
    tell (the launcher polls it while it pumps output; single node only: other nodes' pids are
    not ours to watch).

    Under torchrun the ranks are not the launcher's children: their exit codes come from
    torchrun's failure summary, which torchrun may fail to print. So each rank's pid is also
    watched through a pidfd (`fds`: readable the moment the process exits, which _pump waits
    on), and a rank seen as a zombie (exited, not yet reaped by torchrun, whose monitor looks
    every 0.1 s) gives its exit status from /proc (`codes`).

    pids, died and codes are of the current attempt; when a restart's records appear (torchrun
    --max-restarts) they move to `earlier[attempt]` and the watch follows the new processes."""

    def __init__(self, results_dir: str):
        self.results_dir = results_dir
        self.pids: dict[int, int] = {}
        self.died: dict[int, float] = {}
        self.codes: dict[int, int] = {}      # rank -> exit code (negative: signal), when seen
        self.fds: dict[int, int] = {}        # pidfd -> rank (open until close())
        self.new_fds: list[int] = []         # opened since the last take_new_fds()
        self.attempt = 0
        self.earlier: dict[int, dict] = {}   # attempt -> {"pids", "died", "codes"}

    def _next_attempt(self, attempt: int) -> None:
        """Keep what was seen of the current attempt (its processes are gone: torchrun stops
        them all before it starts the next), and start afresh."""
        self._look()
        now = time.time()
        for r in self.pids:
            self.died.setdefault(r, now)
        self.earlier[self.attempt] = {"pids": self.pids, "died": self.died, "codes": self.codes}
        self.pids, self.died, self.codes, self.attempt = {}, {}, {}, attempt

    def poll(self) -> None:
        self._look()       # first: a zombie's exit code is there only until torchrun reaps it
        attempts = split_attempts(read_records(self.results_dir))
        if attempts and max(attempts) > self.attempt:
            self._next_attempt(max(attempts))
        for r, recs in attempts.get(self.attempt, {}).items():
            if r not in self.pids and (start := first_record(recs, "start")):
                self.pids[r] = start["pid"]
                self._open(r, start["pid"])
        self._look()

    def _look(self) -> None:
        now = time.time()
        for r, pid in self.pids.items():
            if r in self.died:
                continue
            code = zombie_exit_code(pid)
            if code is not None or not proc_alive(pid):
                self.died[r] = now
                if code is not None:
                    self.codes.setdefault(r, code)

    def _open(self, r: int, pid: int) -> None:
        if not hasattr(os, "pidfd_open"):
            return
        try:
            fd = os.pidfd_open(pid)
        except OSError:             # already gone (and reaped), or not ours to watch
            return
        self.fds[fd] = r
        self.new_fds.append(fd)

    def take_new_fds(self) -> list[int]:
        fds, self.new_fds = self.new_fds, []
        return fds

    def close(self) -> None:
        """Close the pidfds (after the selector that waited on them is closed)."""
        for fd in self.fds:
            os.close(fd)
        self.fds.clear()
        self.new_fds.clear()


def zombie_exit_code(pid: int) -> int | None:
    """The exit code (negative: the signal) of a process that has exited but not yet been
    reaped by its parent, from /proc/PID/stat's exit_code field (Linux 3.5+); None while it
    runs, once it is reaped, or where the field says nothing (0: an unprivileged reader sees 0,
    and a rank that exits 0 has left an exit record anyway)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None
    if len(fields) < 50 or fields[0] != b"Z":
        return None
    try:
        status = int(fields[49])
        return os.waitstatus_to_exitcode(status) if status else None
    except ValueError:
        return None


def how_it_ended(code: int) -> str:
    if code < 0 and -code in signal.valid_signals():
        sig = signal.Signals(-code)
        hint = SIGNAL_HINTS.get(sig)
        return f"was killed by {sig.name}" + (f"; {hint}" if hint else "")
    return f"exited with code {code}"


def collect(target, nproc, results_dir, log_dir, returncode, wall, output, agent_log, run_id,
            timed_out, timeout, stacks, died=None, exit_codes=None, launcher="torchrun",
            seen_codes=None, earlier=None):
    """Build the LabResult and, when the lab failed, the LabError to raise. died: rank -> time
    (time.time()) its process was first seen gone, from a DeathWatch. exit_codes: rank -> exit
    code (negative: the signal) where the launcher knows them (the pool's agent reaps the
    ranks); else read from torchrun's failure summary, and where that does not give one (it
    may be missing: torchrun can crash before printing it), from seen_codes (what a DeathWatch
    read of the exited ranks).

    After restarts (torchrun --max-restarts), the last attempt is judged; earlier: attempt ->
    {"pids", "died", "codes"} (DeathWatch.earlier) for the failures of the earlier attempts,
    listed in result.failures (and, when the last attempt failed too, in the LabError)."""
    died = died or {}
    attempts = split_attempts(read_records(results_dir))
    last = max(attempts, default=0)
    restarts = max(last, len(AGENT_RESTART.findall("\n".join(agent_log))))
    records = attempts.get(last, {}) if restarts == last else {}   # {}: it left no records
    if restarts != last:
        died, seen_codes = {}, None
    by_pid = agent_exit_codes(agent_log)
    if exit_codes is None:
        summary_codes = {**(seen_codes or {}), **exit_codes_from_summary(agent_log)}
    else:
        summary_codes = exit_codes
    world = max([nproc] + [s["world_size"] for recs in records.values()
                           if (s := first_record(recs, "start"))])
    end = time.time()
    ranks, results = [], []
    for r in range(world):
        recs = records.get(r, [])
        start, exit_ = first_record(recs, "start"), first_record(recs, "exit")
        code = exit_["code"] if exit_ else summary_codes.get(r)
        if code is None and start:
            code = by_pid.get(start["pid"])
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
    if restarts:
        result.restarts = restarts
        result.failures = _attempt_failures(name, nproc, attempts, range(restarts),
                                            earlier or {}, by_pid, log_dir, launcher)
        log_dir = attempt_log_dir(log_dir, restarts)
    if timed_out:
        failure = _timeout_error(name, result, records, timeout, stacks)
    elif result.ok:
        return result, None
    else:
        failure = _failure(name, result, records, log_dir, returncode, output, agent_log, died,
                           launcher, read_stacks(results_dir))
    return result, _after_restarts(failure, name, result) if restarts else failure


def agent_exit_codes(agent_log: list[str]) -> dict[int, int]:
    """pid -> exit code of the processes torchrun's agent logged as failed (AGENT_FAILURE)."""
    return {int(pid): int(code) for code, pid in AGENT_FAILURE.findall("\n".join(agent_log))}


def attempt_log_dir(log_dir: str, attempt: int) -> str:
    """torchrun's folder of one attempt's logs and error files (<log_dir>/<run>/attempt_N);
    a path that does not exist when there is none."""
    import glob
    found = sorted(glob.glob(os.path.join(glob.escape(log_dir), "*", f"attempt_{attempt}")))
    return found[0] if found else os.path.join(log_dir, f"attempt_{attempt}")


def _attempt_failures(name, nproc, attempts, numbers, earlier, by_pid, log_dir,
                      launcher) -> list[dict]:
    """How each of the earlier attempts failed, judged as a run of its own (`_failure`): {
    "attempt", "rank" (the culprit, or None), "reason", "exit_code", "signal" ("SIGKILL" or
    None), "exc_type", "message" (one line), "time" (when its culprit was seen gone, or None)}."""
    out = []
    for k in numbers:
        recs, seen = attempts.get(k, {}), earlier.get(k, {})
        codes, died = seen.get("codes", {}), seen.get("died", {})
        ranks = []
        world = max([nproc] + [s["world_size"] for rr in recs.values()
                               if (s := first_record(rr, "start"))])
        for r in range(world):
            start, exit_ = (first_record(recs.get(r, []), kind) for kind in ("start", "exit"))
            code = exit_["code"] if exit_ else (start and by_pid.get(start["pid"]))
            code = codes.get(r) if code is None else code
            ranks.append(RankResult(r, code, None, start and start["pid"], None))
        trial = LabResult(name, nproc, ranks, [{} for _ in ranks], 0.0, 1, [], [], "", launcher)
        err = _failure(name, trial, recs, attempt_log_dir(log_dir, k), 1, [], [], died,
                       launcher, None)
        code = ranks[err.rank].exit_code if err.rank is not None else None
        sig = (signal.Signals(-code).name if code is not None and code < 0
               and -code in signal.valid_signals() else None)
        out.append({"attempt": k, "rank": err.rank, "reason": err.reason, "exit_code": code,
                    "signal": sig, "exc_type": err.exc_type,
                    "message": str(err).splitlines()[0].replace(f"lab {name} failed: ", "", 1),
                    "time": died.get(err.rank)})
    return out


def _after_restarts(err: LabError, name: str, result: LabResult) -> LabError:
    """The last attempt's LabError, saying that the lab restarted and how each earlier
    attempt failed."""
    times = f"restarted {result.restarts} time{'s' * (result.restarts > 1)}"
    head, *rest = str(err).splitlines()
    head = head.replace(f"lab {name} failed: ", f"lab {name} failed in every attempt ({times});"
                        " the last: ", 1).replace(f"lab {name} timed out: ", f"lab {name} timed"
                                                  f" out in its last attempt ({times}): ", 1)
    earlier = [f"attempt {f['attempt']} failed: {f['message']}" for f in result.failures]
    err.args = ("\n".join([head, *earlier, *rest]),)
    return err


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


def _never_joined(result, records, stacks, errored) -> tuple[list[int], list[str]]:
    """After a rank gave up waiting in a collective: the ranks that were not in any collective
    when it asked where they were (their stack dumps: labkit.runtime.bootstrap), and one line
    per rank that dumped its stack saying where it was."""
    absent, lines = [], []
    for rr in result.ranks:
        r = rr.rank
        if r in errored or r not in stacks or first_record(records.get(r, []), "exit"):
            continue
        frames = main_thread_frames(stacks[r])
        if not frames:
            continue
        collective, mine = where(frames)
        if collective:
            lines.append(f"rank {r} waits in {collective} ({mine})")
        else:
            absent.append(r)
            lines.append(f"rank {r} is not in a collective: it is at {mine}")
    return absent, lines


def _unreported_deaths(result, records, died) -> list[RankResult]:
    """Ranks seen gone whose exit code nobody reported and that left no error or exit record,
    earliest seen first (then by rank). One stopped by the launcher after another failed looks
    the same, so only the first is a suspect, and only where no other evidence names one."""
    out = [rr for rr in result.ranks
           if rr.exit_code is None and rr.rank in died
           and first_record(records.get(rr.rank, []), "start")
           and not first_record(records.get(rr.rank, []), "error")
           and not first_record(records.get(rr.rank, []), "exit")]
    return sorted(out, key=lambda rr: (died[rr.rank], rr.rank))


def _failure(name, result, records, log_dir, returncode, output, agent_log, died,
             launcher="torchrun", stacks=None) -> LabError:
    launcher = "the pool launcher" if launcher == "pool" else launcher
    errors = sorted(({**rec, "rank": r} for r, recs in records.items() for rec in recs
                     if rec["kind"] == "error"), key=lambda e: e["time"])
    if not errors:
        errors = elastic_errors(log_dir)
    real = [e for e in errors if not PEER_LOST.search(e.get("message") or "")]
    silent = _silent_deaths(result, records, died)
    if not silent and result.launcher != "pool":
        # torchrun said nothing of the exit codes (and the DeathWatch missed them): the rank
        # seen gone first without a record of how it ended is the one whose peers lost it
        silent = _unreported_deaths(result, records, died)[:1]
    culprit = silent[0] if silent else None
    if culprit is not None and real and died.get(culprit.rank, float("inf")) > real[0]["time"]:
        culprit = None          # a real exception came first; the silent death followed it
    others: list[str] = []
    exc_type = exc_msg = tb = None
    diagnosed = False          # a collective's timeout whose absent rank is named
    if culprit is not None:
        rank = culprit.rank
        if culprit.exit_code is None:
            reason = "exit"
            head = (f"lab {name} failed: rank {rank} ended without raising a Python exception "
                    f"(os._exit, a signal, or a crash in native code; {launcher} did not report "
                    "its exit code)")
        else:
            reason = "signal" if culprit.exit_code < 0 else "exit"
            head = f"lab {name} failed: rank {rank} {how_it_ended(culprit.exit_code)}"
        if culprit.exit_code is not None and culprit.exit_code > 0:
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
            waited = timed_out_collective(exc_msg, tb) if len(result.ranks) > 1 else None
            if waited:
                # A collective's timeout: the rank that never joined it is the cause, and the
                # one that gave up waiting only its messenger; name the former first, as the
                # launcher's own timeout does (postmortem.hang_diagnosis).
                absent, where_lines = _never_joined(result, records, stacks or {},
                                                    {e["rank"] for e in errors})
                if absent:
                    diagnosed = True
                    _, mine = where(traceback_frames(tb))
                    they = f"rank{'s' if len(absent) > 1 else ''} {ranks_text(absent)}"
                    head = (f"lab {name} failed: {they} never joined the {waited} that rank "
                            f"{rank} waited in; rank {rank} gave up after its collective "
                            f"timeout and raised {exc_type}: {_short(exc_msg.splitlines()[0])}")
                    others += where_lines
                    others.append(f"rank {rank} waits in {waited} ({mine}): {they} never "
                                  "joined it")
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
            and len(result.ranks) > 1 and not diagnosed):
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
