"""Run a lab on N ranks from a notebook or the shell, and say clearly how it ended.

    from labkit import run_lab, LabError
    result = run_lab("labkit.labs.hello", nproc=4, timeout=120)
    result.results[1]["all_reduce"]      # what rank 1 passed to labkit.runtime.dist.report()
    result.ranks[1].exit_code, result.ranks[1].wall_time, result.wall_time, result.launcher

Two launchers, the same ranks, output, results and failure reports: "pool" (the default on one
Linux machine: labkit.runtime.pool) and "torchrun" (several nodes, SLURM, launcher="torchrun").
How each works, and why so: docs/runtime.md.
"""
from __future__ import annotations

import importlib.util
import math
import os
import pkgutil
import re
import selectors
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections import defaultdict

from labkit.runtime import guard, lab_times, nodes, progress, rundir, system
from labkit.runtime.dist import ENV_COLLECTIVE_TIMEOUT, ENV_RESULTS_DIR, ENV_RUN_ID
from labkit.runtime.postmortem import dump_stacks, first_record, read_records
from labkit.runtime.results import LabError, LabResult, RankResult  # noqa: F401 (re-exported)
from labkit.runtime.teardown import proc_alive, shielded, teardown
from labkit.runtime.verdict import DeathWatch, collect, last_attempt
from labkit.validate import positive, positive_int

# Under the launcher a collective waits this much longer than the launcher's own timeout, so a
# hang is reported by the launcher (which can say who never joined) rather than by a rank. It
# covers the launcher's stopping too (stacks dumped and read, ranks stopped): on a 2-core
# machine under full load that took over 30 s once, the waiting rank's collective timed out
# first, and the report named only the stuck rank (tests/runtime/test_faults.py).
COLLECTIVE_TIMEOUT_MARGIN = 90.0
LABS_PACKAGE = "labkit.labs"
ENV_OVERSUBSCRIBE = "LABKIT_OVERSUBSCRIBE"
ENV_LAUNCHER = "LABKIT_LAUNCHER"            # pool | torchrun | auto: run_lab's launcher=
LAUNCHERS = ("auto", "pool", "torchrun")
SHARED_STORE_OPT_OUT = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"   # see _launch (max_restarts)

PEER_GONE = re.compile(r"(Connection|closed|reset) by peer|Broken pipe|Connection refused")
_PREFIX = re.compile(r"^\[[A-Za-z_]*?(\d+)\]:(.*)$")
_TORCH_RANK_PREFIX = re.compile(r"^\[rank\d+\]: ?")


# ---------------------------------------------------------------------------------------------
# targets

def available_labs() -> list[str]:
    """Short names of the labs in labkit.labs. Found by location, not imported: the launcher
    starts labs by name in other processes and never runs their code itself."""
    spec = importlib.util.find_spec(LABS_PACKAGE)
    return sorted(m.name for m in pkgutil.iter_modules(spec.submodule_search_locations or [])
                  if not m.name.startswith("_"))


def resolve_target(target) -> str:
    """A script path (made absolute), a module name, or a short lab name ("hello")."""
    text = os.fspath(target)
    if text.endswith(".py") or os.sep in text:
        path = os.path.abspath(text)
        if not os.path.isfile(path):
            raise ValueError(f"target={text!r}: no such script")
        return path
    if "." not in text and text in available_labs():
        return f"{LABS_PACKAGE}.{text}"
    try:
        found = importlib.util.find_spec(text) is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        raise ValueError(f"target={text!r} is neither a script path nor an importable module; "
                         f"labs: {', '.join(available_labs())}")
    return text


# ---------------------------------------------------------------------------------------------
# the launcher

def choose_launcher(launcher: str | None, nnodes: int) -> str:
    """"pool" or "torchrun" for a lab on `nnodes` nodes; launcher None reads LABKIT_LAUNCHER,
    "auto" (its default) means the pool on one Linux node and torchrun everywhere else."""
    from labkit.runtime import pool
    from labkit.validate import choice
    if launcher is None:
        launcher = os.environ.get(ENV_LAUNCHER) or "auto"
    choice("launcher", launcher, LAUNCHERS)
    if launcher == "auto":
        return "pool" if nnodes == 1 and pool.supported() else "torchrun"
    if launcher == "pool" and nnodes > 1:
        raise ValueError(f"launcher='pool' starts ranks on this machine only, and nnodes="
                         f"{nnodes}; allowed: launcher='torchrun' (or 'auto') for several nodes")
    if launcher == "pool" and not pool.supported():
        raise ValueError(f"launcher='pool' needs Linux (fork), and this is {sys.platform}; "
                         "allowed: launcher='torchrun' or 'auto'")
    return launcher


# `python -m torch.distributed.run`, not `torchrun`: a bare `torchrun` may not be on a kernel's
# PATH. A c10d rendezvous on 127.0.0.1:0 lets the OS pick the port, so two labs can run at once
# (a fixed --master-port collides, --master-port 0 hangs). --redirects 3: each rank's output goes
# to a log file that LogTail reads. Each rank runs labkit.runtime.bootstrap, which records
# start/exit/error in LABKIT_RESULTS_DIR and writes torch elastic's error file, so every failure
# comes back with its rank, exception and traceback.
def _torchrun_command(target: str, nproc: int, args, log_dir: str, run_id: str, nnodes: int,
                      node_rank: int | None, rdzv_endpoint: str | None,
                      rdzv_id: str | None, join_timeout: float | None = None,
                      local_addr: str | None = None) -> list[str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nnodes),
           "--nproc-per-node", str(nproc), "--rdzv-backend", "c10d",
           "--rdzv-endpoint", rdzv_endpoint or "127.0.0.1:0",
           "--rdzv-id", rdzv_id or run_id, "--max-restarts", "0",
           "--log-dir", log_dir, "--redirects", "3"]
    if node_rank is not None:
        cmd += ["--node-rank", str(node_rank)]
    if nnodes > 1:
        cmd += nodes.rdzv_args(node_rank, join_timeout, local_addr)
    return cmd + ["-m", "labkit.runtime.bootstrap", target, *[str(a) for a in args]]


def run_lab(target, nproc: int | None = None, args=(), timeout: float | None = 300,
            env: dict | None = None, *, nnodes: int = 1, node_rank: int | None = None,
            rdzv_endpoint: str | None = None, rdzv_id: str | None = None,
            local_addr: str | None = None, quiet: bool = False, verbose: bool = False, keep_logs: bool = False,
            oversubscribe: bool | None = None, launcher: str | None = None,
            max_restarts: int = 0) -> LabResult:
    """Run `target` on `nproc` ranks and return a `LabResult`; raise `LabError` if a rank fails
    or the lab runs past `timeout` seconds (None: no limit).

    target: a module ("labkit.labs.hello", or just "hello" for a lab of labkit.labs) or a path
        to a script. args: the lab's command-line arguments. env: extra environment variables
        for the ranks (OMP_NUM_THREADS=1 is set unless given here).
    nnodes/node_rank/rdzv_endpoint/rdzv_id: multi-node runs (same rdzv_endpoint and rdzv_id on
        every node). local_addr: this node's own address, where it is not the one its
        host name resolves to (127.0.0.2 simulates a second node on one machine; torchrun's
        --local-addr). quiet: do not print the ranks' output (it is still in result.output); the
        progress line still shows in a notebook (labkit.runtime.progress), and on a TTY.
    verbose: also print the launcher's own log lines. keep_logs: keep the run directory (its
        path is in the LabError message). oversubscribe: start more ranks per node than this
        machine holds (system.max_local_ranks); default from LABKIT_OVERSUBSCRIBE=1, else refused.
    launcher: "pool" (ranks forked from a warm process that has imported torch: labkit.runtime.
        pool; one node, Linux), "torchrun" (`python -m torch.distributed.run`: several nodes,
        SLURM, the standard path), or "auto" (the pool where it can, else torchrun); default
        from LABKIT_LAUNCHER, else "auto". Ranks see the same variables under both.
    max_restarts: after a rank fails, torchrun stops the others and starts every rank afresh, up
        to this many times (torchrun's --max-restarts; each rank reads TORCHELASTIC_RESTART_COUNT
        and should resume from its checkpoint). The warm pool cannot restart ranks: > 0 runs
        under torchrun ("auto", or LABKIT_LAUNCHER=pool), and launcher="pool" is refused. The
        result is the last attempt's; result.restarts and result.failures say what came before.
    """
    t0 = time.monotonic()
    target = resolve_target(target)
    nproc = system.default_nproc() if nproc is None else positive_int("nproc", nproc)
    nnodes = positive_int("nnodes", nnodes)
    if timeout is not None:
        timeout = positive("timeout", timeout)
        if not math.isfinite(timeout):
            raise ValueError(f"timeout={timeout!r} must be a finite number of seconds > 0; "
                             "allowed: a number, or None for no limit")
    if oversubscribe is None:
        oversubscribe = os.environ.get(ENV_OVERSUBSCRIBE, "0") == "1"
    limit, why = system.max_local_ranks()
    if nproc > limit and not oversubscribe:
        raise ValueError(f"nproc={nproc} is more ranks than this machine holds ({why}: at most "
                         f"{limit}); allowed: 1 to {limit}, or oversubscribe=True "
                         f"(labkit run --oversubscribe, or {ENV_OVERSUBSCRIBE}=1) to start "
                         "them anyway")
    if node_rank is not None and not (isinstance(node_rank, int) and 0 <= node_rank < nnodes):
        raise ValueError(f"node_rank={node_rank!r} is not a node of nnodes={nnodes}; allowed: "
                         f"0 to {nnodes - 1}, or None")
    if nnodes > 1 and not rdzv_endpoint:
        raise ValueError(f"nnodes={nnodes} needs rdzv_endpoint='HOST:PORT' (the same on every "
                         "node); allowed: nnodes=1 without it")
    if nnodes > 1 and rdzv_id is None:  # every node's run_lab must name the same rendezvous
        rdzv_id = "labkit-" + "".join(c if c.isalnum() else "-" for c in
                                      lab_times.lab_name(target))
    if nnodes > 1:        # a mistake that would hang every node is refused here, at once
        for note in nodes.preflight(rdzv_endpoint, nnodes, node_rank, local_addr):
            print(f"labkit: {note}", file=sys.stderr, flush=True)
        if node_rank == 0 and local_addr is None:
            local_addr = nodes.host_address(rdzv_endpoint)
    max_restarts = _check_restarts(max_restarts, launcher)
    explicit = (launcher if launcher is not None else os.environ.get(ENV_LAUNCHER)) == "pool"
    launcher = choose_launcher(launcher, nnodes)
    if max_restarts and launcher == "pool":     # "auto" (or LABKIT_LAUNCHER) chose it
        launcher, explicit = "torchrun", False
    # The progress line (labkit.runtime.progress) says which lab runs, for how long so far,
    # and how long the course's run of it takes on a 2-core laptop; quiet=True keeps the
    # ranks' lines out, not this.
    expected = lab_times.expected_seconds(target, nproc, args) if nnodes == 1 else None
    with progress.task(_label(target, nproc, args, nnodes), expected, terminal=quiet):
        return _launch(target, nproc, args, timeout, env, nnodes=nnodes, node_rank=node_rank,
                       rdzv_endpoint=rdzv_endpoint, rdzv_id=rdzv_id, local_addr=local_addr,
                       quiet=quiet,
                       verbose=verbose, keep_logs=keep_logs, launcher=launcher,
                       explicit=explicit, t0=t0, max_restarts=max_restarts)


def _launch(target: str, nproc: int, args, timeout: float | None, env: dict | None, *,
            nnodes: int, node_rank: int | None, rdzv_endpoint: str | None, rdzv_id: str | None,
            local_addr: str | None, quiet: bool, verbose: bool, keep_logs: bool, launcher: str, explicit: bool,
            t0: float, max_restarts: int = 0) -> LabResult:
    """run_lab once its arguments are checked: start the ranks, relay their output, collect
    how each ended (explicit: the pool was asked for by name, so no fallback to torchrun)."""
    run_id = uuid.uuid4().hex[:12]
    rundir.sweep_stale()          # left by launchers killed before they could clean up
    run_dir = rundir.make_run_dir(run_id)
    results_dir, log_dir = os.path.join(run_dir, "results"), os.path.join(run_dir, "logs")
    os.makedirs(results_dir)

    child_env = rank_env(env, run_id, results_dir, timeout, max_restarts)
    job = notice = None
    try:
        if launcher == "pool":
            from labkit.runtime.pool import PoolError, PoolJob
            try:
                job = PoolJob(target, nproc, args, child_env, run_id, log_dir, timeout)
            except (PoolError, OSError) as exc:
                if explicit:
                    raise LabError(f"lab {target}: the warm pool could not start: {exc}",
                                   reason="launcher") from exc
                print(f"labkit: the warm pool could not start ({exc}); using torchrun",
                      file=sys.stderr, flush=True)
                launcher = "torchrun"
        if job is None:
            if nnodes > 1 and node_rank:     # node 0 may start later: say so if it does
                notice = nodes.notice_if_waiting(
                    *nodes.parse_endpoint(rdzv_endpoint), node_rank, 5.0,
                    lambda text: print(f"labkit: {text}", file=sys.stderr, flush=True))
            job = _TorchrunJob(_torchrun_command(target, nproc, args, log_dir, run_id, nnodes,
                                                 node_rank, rdzv_endpoint, rdzv_id,
                                                 _join_timeout(timeout, t0), local_addr),
                               child_env, log_dir, max_restarts)
    except BaseException:            # LabError, an interrupt while the pool starts, ...
        shutil.rmtree(run_dir, ignore_errors=True)
        raise
    printer = _Printer(quiet, verbose, _rank_labeller(nnodes, results_dir), launcher)
    deaths = DeathWatch(results_dir)        # when each rank died: who failed first
    stacks: dict[int, str] = {}
    state, stuck = "exited", None

    def rank_pids() -> dict[int, int]:
        pids = {r: s["pid"] for r, recs in last_attempt(read_records(results_dir)).items()
                if (s := first_record(recs, "start"))}
        return {**job.pids, **pids}

    # Every rank runs in a session of its own, so a timeout, a failure or KeyboardInterrupt (the
    # notebook's stop button) ends with SIGTERM then SIGKILL to each rank's group (and
    # torchrun's), and to any process carrying this run's LABKIT_RUN_ID (job.stop: teardown).
    try:
        # On one node, return once every rank has exited 0 (see _pump). Not on several:
        # torchrun's exit barrier there keeps the other nodes' agents in step.
        done = (lambda: _all_ranks_done(results_dir, nproc)) if nnodes == 1 else None
        state = _pump(job, t0, timeout, printer, done, deaths if nnodes == 1 else None)
        if state == "timeout":
            pids = {r: p for r, p in rank_pids().items() if proc_alive(p)}
            stacks = dump_stacks(pids, results_dir)
        if state == "timeout" and nnodes > 1 and not read_records(results_dir):
            # read while node 0's store still lives: who came to the rendezvous
            stuck = _rendezvous_stuck(rdzv_endpoint, rdzv_id or run_id, nnodes, node_rank,
                                      time.monotonic() - t0)
    except KeyboardInterrupt:
        if notice is not None:
            notice.cancel()
        shielded(lambda: job.stop(run_id, set(rank_pids().values())))
        print(f"labkit: interrupted; stopped the ranks of {target}",
              file=sys.stderr, flush=True)
        if not keep_logs:
            shutil.rmtree(run_dir, ignore_errors=True)
        raise
    if notice is not None:
        notice.cancel()
    shielded(lambda: job.stop(run_id, set(rank_pids().values())))   # clean exit too
    job.drain(printer, log_dir)
    returncode = 0 if state == "finished" else job.returncode()
    wall = time.monotonic() - t0
    try:
        result, failure = collect(target, nproc, results_dir, log_dir, returncode, wall,
                                  printer.output, printer.agent_log, run_id,
                                  state == "timeout", timeout, stacks, deaths.died,
                                  job.exit_codes(), launcher, deaths.codes, deaths.earlier)
        job.after(read_records(results_dir))
    finally:
        if not keep_logs:
            shutil.rmtree(run_dir, ignore_errors=True)
    if failure is not None and stuck is not None:
        failure = LabError(stuck, reason="rendezvous", result=result)
    elif failure is not None and nnodes > 1 and PEER_GONE.search(failure.args[0]):
        failure.args = (failure.args[0] + f"\n(a lab across {nnodes} nodes: this node's ranks "
                        "lost a peer, which happens when a rank on another node dies; that "
                        "node's own output says why)",)
    if failure is not None:
        text = rundir.cap_message(failure.args[0], run_id)
        failure.args = (text + (f"\n(run directory kept: {run_dir})" if keep_logs else ""),)
        raise failure
    return result


def rank_env(env: dict | None, run_id: str, results_dir: str, timeout: float | None,
             max_restarts: int = 0) -> dict:
    """The environment every rank of a run gets (run_lab's, and a %ranks world's)."""
    child_env = dict(os.environ)
    # One thread per rank: N ranks share the cores. torchrun does the same for N > 1 (with a
    # warning); setting it here keeps that warning out of the output and covers N = 1 too.
    child_env.setdefault("OMP_NUM_THREADS", "1")
    child_env.update({k: str(v) for k, v in (env or {}).items()})
    child_env.update({ENV_RUN_ID: run_id, ENV_RESULTS_DIR: results_dir,
                      "PYTHONUNBUFFERED": "1", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "5"})
    if timeout is not None and ENV_COLLECTIVE_TIMEOUT not in (env or {}):
        child_env[ENV_COLLECTIVE_TIMEOUT] = str(timeout + COLLECTIVE_TIMEOUT_MARGIN)
    child_env.pop(ENV_LAUNCHER, None)      # a lab that launches labs chooses afresh
    if max_restarts:
        # torchrun's agent keeps one TCPStore for every attempt and the ranks use it without a
        # per-attempt prefix, so a restarted rank may read a dead rank's gloo address and fail
        # with "connectFullMesh ... Connection refused" (measured: 4 restarts in 6 failed on
        # torch 2.13; pytorch issue 135712). Opting out of the shared store gives each attempt
        # a store of its own, hosted by its rank 0.
        child_env.setdefault(SHARED_STORE_OPT_OUT, "1")
    if guard.enabled(child_env):
        # torchrun and the ranks die with this process (a kernel restart, shutdown or kill -9
        # would otherwise leave them running): see labkit.runtime.guard.
        child_env.update(guard.launcher_env())
    return child_env


def _rendezvous_stuck(endpoint: str, rdzv_id: str, nnodes: int, node_rank: int | None,
                      waited: float) -> str:
    """The message for a node whose ranks never started: the rendezvous did not complete."""
    host, port = nodes.parse_endpoint(endpoint)
    if node_rank and not nodes.listening(host, port):
        return nodes.nobody_listens(host, port, node_rank, waited)
    came = nodes.joined(host, port, rdzv_id)
    who = ("" if came is None else f"; {len(came)} of {nnodes} joined"
           + (f" ({', '.join(came)})" if came else ""))
    return (f"node {node_rank if node_rank is not None else '?'} waited {waited:.0f} s at the "
            f"rendezvous {host}:{port} (id {rdzv_id}) for {nnodes} nodes{who}: the other "
            f"node(s) never came. Start every node with the same --nnodes {nnodes}, "
            f"--rdzv-endpoint {host}:{port} and --rdzv-id {rdzv_id}; a node that did start "
            "and waits elsewhere was given another endpoint (its own address?) or id")


def _join_timeout(timeout: float | None, t0: float) -> float | None:
    """torchrun's rendezvous outwaits the lab's timeout, so that the launcher, which can read
    who came, is the one that reports a node that never came."""
    left = _left(timeout, t0)
    return None if left is None else left + 30


def _left(timeout: float | None, t0: float) -> float | None:
    """Seconds left of the lab's timeout (None: no limit)."""
    return None if timeout is None else max(1.0, timeout - (time.monotonic() - t0))


def _check_restarts(max_restarts, launcher: str | None) -> int:
    """max_restarts as an int >= 0; refused with launcher="pool" (its ranks cannot restart)."""
    if isinstance(max_restarts, bool) or not isinstance(max_restarts, int) or max_restarts < 0:
        raise ValueError(f"max_restarts={max_restarts!r} must be a whole number >= 0 (how many "
                         "times torchrun may restart the ranks after a failure)")
    if max_restarts and launcher == "pool":
        raise ValueError(f"max_restarts={max_restarts} needs torchrun, which restarts the ranks "
                         "after a failure, and launcher='pool' was asked for; the warm pool "
                         "cannot restart them. allowed: launcher='torchrun' or 'auto' with "
                         "max_restarts, or launcher='pool' with max_restarts=0")
    return max_restarts


def _label(target: str, nproc: int, args, nnodes: int) -> str:
    """"lab pp --part torch on 4 ranks": the lab and its part, as the progress line names it."""
    args = [str(a) for a in args]
    part = args[args.index("--part") + 1] if "--part" in args[:-1] else None
    ranks = f"{nproc} rank{'s' if nproc > 1 else ''}" + (f" x {nnodes} nodes" if nnodes > 1 else "")
    return f"lab {lab_times.lab_name(target)}{f' --part {part}' if part else ''} on {ranks}"


class _TorchrunJob:
    """A lab under `python -m torch.distributed.run` (through the guard), read through its two
    pipes; what _pump and run_lab need of a launcher (PoolJob is the other)."""

    def __init__(self, cmd: list[str], env: dict, log_dir: str, max_restarts: int = 0):
        if max_restarts:            # _torchrun_command's default is 0: fail at the first failure
            cmd = list(cmd)
            cmd[cmd.index("--max-restarts") + 1] = str(max_restarts)
        if guard.enabled(env):
            cmd = guard.guarded_command(cmd)
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     env=env, start_new_session=True, stdin=subprocess.DEVNULL)
        self.streams = {self.proc.stdout.fileno(): "stdout", self.proc.stderr.fileno(): "stderr"}
        self.control = None
        self.pids: dict[int, int] = {}
        self.tail = LogTail(log_dir)

    def line(self, printer, tag, text: str) -> None:
        printer.line(text, tag)      # torchrun's own lines: the ranks' are in their log files

    def tick(self, printer) -> None:
        self.tail.poll(printer)

    def ended(self) -> bool:
        return self.proc.poll() is not None

    def finish(self) -> None:
        """Every rank is done: torchrun's own exit takes ~2 s more and adds nothing."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def stop(self, run_id: str, pids: set[int]) -> None:
        teardown(self.proc, run_id, pids)

    def drain(self, printer, log_dir: str) -> None:
        self.tail.poll(printer, final=True)

    def returncode(self) -> int | None:
        return self.proc.returncode

    def exit_codes(self):
        return None          # read from torchrun's failure summary

    def after(self, records) -> None:
        pass

    def message(self, printer, deaths) -> bool:
        return False

    def close_streams(self) -> None:
        pass


def _rank_labeller(nnodes: int, results_dir: str):
    """torchrun prefixes local ranks; on several nodes, name the global rank once it is known
    (from the rank's start record)."""
    if nnodes == 1:
        return lambda local: f"rank {local}"
    known: dict[int, int] = {}

    def label(local: int) -> str:
        if local not in known:
            for r, recs in read_records(results_dir).items():
                if (s := first_record(recs, "start")):
                    known[s["local_rank"]] = r
        return f"rank {known[local]}" if local in known else f"local rank {local}"
    return label


class _Printer:
    """Prints the ranks' lines as "[rank R] text" on our stdout/stderr (looked up at each
    write, so a notebook cell or pytest's capture gets them); the launcher's own lines go to
    agent_log (and are shown with verbose)."""

    def __init__(self, quiet: bool, verbose: bool, label, launcher: str = "torchrun"):
        self.quiet, self.verbose, self.label, self.launcher = quiet, verbose, label, launcher
        self.output: list[str] = []
        self.agent_log: list[str] = []

    def line(self, line: str, dest: str) -> None:
        m = _PREFIX.match(line)
        if m is None:
            self.agent_log.append(line)
            if not self.verbose:
                return
            text = f"[{self.launcher}] {line}"
        else:
            return self.rank_line(int(m.group(1)), m.group(2), dest)
        self._show(text, dest)

    def rank_line(self, local: int, content: str, dest: str) -> None:
        """One line a rank wrote (without torchrun's prefix)."""
        content = _TORCH_RANK_PREFIX.sub("", content)
        if not content.strip():
            return
        text = f"[{self.label(local)}] {content}"
        self.output.append(text)
        self._show(text, dest)

    def _show(self, text: str, dest: str) -> None:
        if not self.quiet:
            stream = sys.stdout if dest == "stdout" else sys.stderr
            stream.write(text + "\n")
            stream.flush()



class LogTail:
    """Reads the ranks' log files torchrun writes (<log_dir>/<run>/attempt_N/<local>/std*.log,
    with --redirects) as they grow, and hands whole lines to printer.rank_line. Read here, not
    through torchrun's --tee: its tailer prints a line it caught half-written as two pieces
    ("[default0]:ou" then "[default0]:t 19746"), which garbles the line and breaks ordering."""

    def __init__(self, log_dir: str):
        self.log_dir = log_dir
        self.files: dict[str, tuple[int, str]] = {}     # path -> (local rank, dest)
        self.offset: dict[str, int] = defaultdict(int)
        self.partial: dict[str, bytes] = defaultdict(bytes)

    def _find(self) -> None:
        for root, _dirs, files in os.walk(self.log_dir):
            if os.path.basename(root).isdigit():
                for dest in ("stdout", "stderr"):
                    path = os.path.join(root, f"{dest}.log")
                    if f"{dest}.log" in files and path not in self.files:
                        self.files[path] = (int(os.path.basename(root)), dest)

    def poll(self, printer, final: bool = False) -> None:
        """Print what the files gained since the last call (final: also a last line that has
        no newline)."""
        self._find()
        for path, (local, dest) in sorted(self.files.items(), key=lambda kv: kv[1]):
            try:
                with open(path, "rb") as f:
                    f.seek(self.offset[path])
                    chunk = f.read()
            except OSError:
                continue
            self.offset[path] += len(chunk)
            *lines, self.partial[path] = (self.partial[path] + chunk).split(b"\n")
            if final and self.partial[path]:
                lines.append(self.partial[path])
                self.partial[path] = b""
            for raw in lines:
                printer.rank_line(local, raw.decode("utf-8", "replace"), dest)


def _all_ranks_done(results_dir: str, nproc: int) -> bool:
    """Every rank wrote an exit record with code 0 and its process is gone (in the last
    attempt, after restarts)."""
    records = last_attempt(read_records(results_dir))
    if len(records) < nproc:
        return False
    for recs in records.values():
        start, exit_ = first_record(recs, "start"), first_record(recs, "exit")
        if not (start and exit_ and exit_["code"] == 0) or proc_alive(start["pid"]):
            return False
    return True


_DEATH = object()      # the selector's tag for a rank's pidfd (DeathWatch.fds)


def _pump(job, t0, timeout, printer: _Printer, done=None, deaths: DeathWatch | None = None) -> str:
    """Print the ranks' lines as they arrive until the launcher's side ends ("exited"), the
    timeout fires ("timeout"), or done() says the ranks have all finished ("finished": the
    launcher is then ended rather than waited for). deaths.poll() runs every 0.1 s, and
    at once when a rank's pidfd says it exited (so that who died first, and its exit code,
    are known under torchrun too: DeathWatch).
    Printing here, in the caller's (main) thread, is what makes output live in a Jupyter cell;
    the launcher's own lines are kept in `result.agent_log`."""
    sel = selectors.DefaultSelector()
    partial = {}
    for fd, tag in job.streams.items():
        sel.register(fd, selectors.EVENT_READ, tag)
        partial[fd] = b""
    if job.control is not None:
        sel.register(job.control, selectors.EVENT_READ, None)
    open_streams = set(job.streams)
    exited_at, checked, watched, state = None, 0.0, 0.0, "exited"
    try:
        while open_streams or not job.ended():
            now = time.monotonic()
            if deaths is not None and now - watched > 0.1:
                watched = now
                deaths.poll()
                for fd in deaths.take_new_fds():     # a rank's exit wakes the select below
                    sel.register(fd, selectors.EVENT_READ, _DEATH)
            if timeout is not None and now - t0 > timeout:
                return "timeout"
            if job.ended():
                exited_at = exited_at or now
                if now - exited_at > 1.0:   # a leftover process holds the pipe: stop reading
                    break
            elif done is not None and now - checked > 0.2:
                checked = now
                if done():
                    state = "finished"
                    job.finish()
            job.tick(printer)
            wait = 0.1 if timeout is None else max(0.0, min(0.1, t0 + timeout - now))
            for key, _ in sel.select(wait):
                if key.data is _DEATH:             # a rank exited: when, and how (DeathWatch)
                    sel.unregister(key.fileobj)
                    deaths.poll()
                    continue
                if key.data is None:               # the pool agent's messages
                    if not job.message(printer, deaths):
                        sel.unregister(key.fileobj)
                    continue
                fd = key.fd
                chunk = os.read(fd, 65536)
                if not chunk:
                    sel.unregister(key.fileobj)
                    open_streams.discard(fd)
                    chunk = b"\n" if partial[fd] else b""
                *lines, partial[fd] = (partial[fd] + chunk).split(b"\n")
                for raw in lines:
                    job.line(printer, key.data, raw.decode("utf-8", "replace"))
    finally:
        sel.close()
        job.close_streams()
        if deaths is not None:
            deaths.poll()            # a rank that exited since the last look
            deaths.close()
    return state
