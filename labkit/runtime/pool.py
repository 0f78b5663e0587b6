"""The warm pool: local labs start in well under a second instead of paying every rank's `import
torch` (1-3 s each on a laptop); run_lab uses it on one Linux node (launcher="pool", the default).

    from labkit.runtime import pool
    pool.warm()                          # optional: start it now, e.g. in a notebook's first cell
    pool.warm(preload=["transformers"])  # and import transformers in it too
    pool.shutdown()                      # optional: it also ends with this process

An idle pool gives its memory back: after IDLE_TIMEOUT (10 min) without a lab it leaves, and the
next lab starts it again (LABKIT_POOL_IDLE_TIMEOUT=SECONDS changes that; 0: never). How it works
(`Pool`), when it restarts (`get`), what a lab can tell apart: docs/runtime.md.
"""
from __future__ import annotations

import atexit
import os
import shutil
import socket
import subprocess
import sys
import threading
import time

from labkit.runtime import guard, rundir
from labkit.runtime.zygote import ENV_IDLE, ENV_SLOT, IDLE_EXIT, SLOT_SIZE, recv, send

READY_TIMEOUT = 300.0          # importing torch on a busy laptop takes seconds, not minutes
# An idle warm parent holds a few hundred MB (torch, transformers); a kernel per module each
# with its pool added up to GBs. After this many seconds without a lab it leaves; restarting
# costs one `import torch` (a few seconds), paid by the next lab. ENV_IDLE overrides it.
IDLE_TIMEOUT = 600.0
# Variables a process reads while importing torch/transformers/Python itself: a pool started
# with other values would not give what a fresh process gets.
IMPORT_TIME_PREFIXES = ("PYTHON", "TORCH", "PYTORCH", "OMP_", "MKL_", "OPENBLAS_", "KMP_",
                        "GOMP_", "LD_", "HF_", "TRANSFORMERS_", "TOKENIZERS_", "CUDA_",
                        "LC_", "LANG")
NOT_IMPORT_TIME = ("TORCHELASTIC_", "TORCH_NCCL_ASYNC_ERROR_HANDLING", "PYTHONUNBUFFERED",
                   "TORCH_ELASTIC_SHUTDOWN_TIMEOUT")   # set by run_lab, read later


def supported() -> bool:
    """fork() is safe here: Linux (macOS frameworks abort in forked children). Where fork is
    not safe or not there (macOS, Windows) run_lab uses torchrun."""
    return sys.platform.startswith("linux") and hasattr(os, "fork") and hasattr(socket,
                                                                                "send_fds")


def idle_timeout(env: dict | None = None) -> float:
    """Seconds an idle pool waits for a lab before it leaves: LABKIT_POOL_IDLE_TIMEOUT from
    `env` (default os.environ), else IDLE_TIMEOUT; 0 keeps it until its owner exits."""
    text = (os.environ if env is None else env).get(ENV_IDLE, "").strip()
    if not text:
        return IDLE_TIMEOUT
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not (value >= 0 and value != float("inf")):
        raise PoolError(f"{ENV_IDLE}={text!r} is not a number of seconds; allowed: a number "
                        f">= 0 (0: never leave), or unset for {IDLE_TIMEOUT:g}")
    return value


def import_key(env: dict) -> tuple:
    """The part of a lab's environment that a warm process has already consumed."""
    return tuple(sorted((k, v) for k, v in env.items() if k.startswith(IMPORT_TIME_PREFIXES)
                        and not k.startswith(NOT_IMPORT_TIME)))


class PoolError(RuntimeError):
    """The warm parent could not start or died."""


class Pool:
    """One warm parent process (labkit.runtime.zygote) that has imported torch once; one per
    launcher process.

    Each lab forks a fresh process per rank from it, so nothing leaks between labs, a learner's
    edited code is imported fresh, and the ranks share the parent's memory pages until they
    write them (one warm process serves any number of ranks: the pool needs no size). What a
    lab imported from installed packages (transformers, torch's lazily imported parts) the pool
    imports after it (`PoolJob.after`), so the next such lab starts warm; never labkit's or the
    learner's modules. It leaves with its owner: it watches the owner's pid and its control
    socket.

    What a lab can tell apart from torchrun: its ranks share Python's string-hash seed (fixed
    when the warm parent started, as if PYTHONHASHSEED were set), so a set of strings iterates
    in the same order on every rank; modules from installed packages may already be imported
    (their import-time side effects happened in the warm parent, before RANK was set)."""

    def __init__(self, env: dict, preload=()):
        self.key = import_key(env)
        idle = idle_timeout(env)               # a bad value: refused before anything starts
        self.lock = threading.Lock()           # one message at a time on the control socket
        self._start_lock = threading.Lock()
        self.dir = rundir.make_run_dir("pool")
        self.log_path = os.path.join(self.dir, "warm-parent.log")
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        started = guard.start_time(os.getpid()) or "-"
        # This process's environment, with the lab's import-time variables (not its others:
        # LABKIT_RUN_ID and the lab's own belong to the ranks, which get them at each lab).
        zenv = {**os.environ, **dict(self.key), ENV_SLOT: " " * SLOT_SIZE,
                "PYTHONUNBUFFERED": "1", ENV_IDLE: str(idle)}
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "labkit.runtime.zygote", str(theirs.fileno()),
                 str(os.getpid()), started, *preload],
                pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                start_new_session=True, env=zenv)
        theirs.close()
        self.ctrl = ours
        self.modules: list[str] = []
        self.files: dict[str, float] = {}
        self.requested = set(preload)
        self._ready = False

    def wait_ready(self, timeout: float = READY_TIMEOUT) -> None:
        with self._start_lock:        # two labs at once: one reads "ready", both wait for it
            if not self._ready:
                self._wait_ready(timeout)

    def _wait_ready(self, timeout: float) -> None:
        self.ctrl.settimeout(timeout)
        try:
            msg, _ = recv(self.ctrl)
        except (OSError, socket.timeout) as exc:
            msg = None
            why = f"{type(exc).__name__}: {exc}"
        else:
            why = "it exited"
        finally:
            self.ctrl.settimeout(None)
        if msg is None or msg.get("op") != "ready":
            self.close()
            raise PoolError(f"the warm pool did not start ({why}); its log:\n{self.log()}")
        if msg.get("cuda_initialised"):
            self.close()
            raise PoolError("the warm pool initialised CUDA, so it cannot fork ranks safely")
        self.modules, self.files, self._ready = msg["modules"], msg["files"], True

    def log(self) -> str:
        try:
            with open(self.log_path, encoding="utf-8", errors="replace") as f:
                return f.read()[-4000:] or "(empty)"
        except OSError:
            return "(none)"

    def alive(self) -> bool:
        return self.proc.poll() is None

    def left_idle(self) -> bool:
        """It left after IDLE_TIMEOUT without a lab (not a crash)."""
        return self.proc.poll() == IDLE_EXIT

    def stale(self) -> bool:
        """torch, transformers or the pool's own code changed on disk since it started."""
        for path, mtime in self.files.items():
            try:
                if os.stat(path).st_mtime != mtime:
                    return True
            except OSError:
                return True
        return False

    def preload(self, modules) -> None:
        """Import these in the warm parent, once, from now on (no wait)."""
        new = [m for m in modules if m not in self.requested]
        if new:
            self.requested.update(new)
            with self.lock:
                send(self.ctrl, {"op": "preload", "modules": new})

    def sync(self, timeout: float = READY_TIMEOUT) -> None:
        """Wait until the warm parent has done what it was asked (e.g. a preload)."""
        self.wait_ready(timeout)
        with self.lock:
            self.ctrl.settimeout(timeout)
            try:
                send(self.ctrl, {"op": "ping"})
                msg, _ = recv(self.ctrl)
            except OSError:            # it left (idle) or died meanwhile
                msg = None
            finally:
                self.ctrl.settimeout(None)
        if msg is None:
            raise PoolError(f"the warm pool died; its log:\n{self.log()}")
        self.modules, self.files = msg["modules"], msg["files"]

    def start_lab(self, request: dict, nproc: int):
        """Ask for a lab; returns (lab socket, {read fd: (rank, "stdout"|"stderr")})."""
        lab, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            with self.lock:
                send(self.ctrl, {"op": "run", **request}, [theirs.fileno()])
        finally:
            theirs.close()
        streams = {}
        try:
            for r in range(nproc):
                out_r, out_w = os.pipe()
                err_r, err_w = os.pipe()
                streams[out_r], streams[err_r] = (r, "stdout"), (r, "stderr")
                try:
                    send(lab, {"rank": r}, [out_w, err_w])
                finally:
                    os.close(out_w)
                    os.close(err_w)
        except OSError:
            lab.close()
            for fd in streams:
                os.close(fd)
            raise
        return lab, streams

    def close(self) -> None:
        """Stop the warm parent (an idle one leaves at once; running labs' agents kill their
        ranks when their launcher closes them)."""
        try:
            send(self.ctrl, {"op": "exit"})
        except OSError:
            pass
        self.ctrl.close()
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


_lock = threading.Lock()
_pool: Pool | None = None
_carried: tuple[str, ...] = ()   # what a pool that left idle had imported on request


def _retire(old: Pool) -> None:
    """Stop `old` and forget it (the caller holds _lock); a pool that left idle passes on what
    it had been asked to import, so that its successor is as warm."""
    global _pool, _carried
    if _pool is old:
        _pool = None
    old.close()
    if old.left_idle():
        _carried = tuple(sorted(old.requested))


def discard(p: Pool) -> None:
    """Replace `p` at the next `get` (it refused a request: it left idle, or died)."""
    with _lock:
        _retire(p)


def get(env: dict, preload=(), wait: bool = True) -> Pool:
    """The warm pool for a lab with this environment, started (or restarted) as needed;
    wait: until it is ready (has imported torch).

    It is restarted when it would not give what a fresh process gets: when a variable read at
    import time differs (`import_key`: PYTHON*, TORCH*, OMP_*, MKL_*, HF_*, ...; e.g.
    env={"OMP_NUM_THREADS": "2"}), when torch, transformers or this machinery changed on disk
    (`Pool.stale`), or when it died or left idle (`IDLE_TIMEOUT`; then the new one imports
    what the old one had been asked to, e.g. transformers)."""
    global _pool, _carried
    key = import_key(env)
    with _lock:
        old = _pool
        if old is not None and (old.key != key or not old.alive() or old.stale()):
            _retire(old)
        if _pool is None:
            _pool = Pool(env, tuple(preload) + tuple(m for m in _carried if m not in preload))
            _carried = ()
            atexit.unregister(shutdown)
            atexit.register(shutdown)
        pool = _pool
    if wait:
        pool.wait_ready()      # every caller waits (two labs at once share one start)
    return pool


def current() -> Pool | None:
    return _pool


def warm(preload=(), env: dict | None = None, wait: bool = False) -> Pool | None:
    """Start the warm pool now and return at once (from a notebook's first cell: its imports
    then overlap the reading). preload: also import these (e.g. ["transformers"]). wait:
    return only when it is ready and the preloads are done. env: as run_lab's env= (what its
    labs will add). Returns None where there is no pool (not Linux)."""
    if not supported():
        return None
    full = dict(os.environ)
    full.setdefault("OMP_NUM_THREADS", "1")
    full.update({k: str(v) for k, v in (env or {}).items()})
    for attempt in (1, 2):
        p = get(full, preload, wait=wait)
        try:
            p.preload(preload)
            break
        except OSError:                # it left (idle) since get looked: start a new one, once
            if attempt == 2:
                raise
            discard(p)
    if wait:
        p.sync()
    return p


def shutdown() -> None:
    """Stop the warm pool (run at this process's exit too)."""
    global _pool
    with _lock:
        old, _pool = _pool, None
    if old is not None:
        old.close()


class PoolJob:
    """One lab on the warm pool, as run_lab's pump sees a launcher (launch._TorchrunJob is the
    other): the ranks' pipes (`streams`), the agent's socket (`control`: started, exit codes,
    done), and how to stop it."""

    def __init__(self, target: str, nproc: int, args, env: dict, run_id: str, log_dir: str,
                 timeout: float | None):
        self.nproc = nproc
        request = {"target": target, "args": [str(a) for a in args], "nproc": nproc,
                   "env": env, "cwd": os.getcwd(), "run_id": run_id,
                   "log_dir": os.path.join(log_dir, run_id),
                   "store_timeout": (timeout or 1800.0) + 60.0,
                   "shutdown_timeout": float(env.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", 5)),
                   "guard": guard.enabled(env)}
        for attempt in (1, 2):
            self.pool = get(env)
            try:
                self.conn, self.streams = self.pool.start_lab(request, nproc)
                break
            except OSError:            # it died or left idle since we looked: a new one, once
                if attempt == 2:
                    raise
                discard(self.pool)
        self.control = self.conn.fileno()
        self.pids: dict[int, int] = {}
        self.codes: dict[int, int] = {}
        self.done = self.lost = False

    def line(self, printer, tag, text: str) -> None:
        printer.rank_line(tag[0], text, tag[1])

    def message(self, printer=None, deaths=None) -> bool:
        """Read one message of the agent; False once it has closed its socket."""
        try:
            msg, _ = recv(self.conn)
        except TimeoutError:          # stop() waits 2 s for the last exit codes: not lost
            return False
        except OSError:
            msg = None
        if msg is None:
            self.lost = not self.done
            self.done = True
            return False
        if msg["op"] == "started":
            self.pids = {int(r): p for r, p in msg["pids"].items()}
            if printer is not None:       # shown with verbose=True, kept in result.agent_log
                printer.line(f"warm parent {self.pool.proc.pid} forked agent {msg['agent']}, "
                             f"rendezvous store on 127.0.0.1:{msg['port']}, ranks (pids) "
                             f"{', '.join(f'{r} ({p})' for r, p in sorted(self.pids.items()))}",
                             "stderr")
        elif msg["op"] == "exit":
            self.codes[msg["rank"]] = msg["code"]
            if msg["code"] != 0 and deaths is not None:
                deaths.died.setdefault(msg["rank"], time.time())
        elif msg["op"] == "done":
            self.done = True
        return True

    def ended(self) -> bool:
        return self.done

    def finish(self) -> None:
        pass

    def tick(self, printer) -> None:
        pass

    def stop(self, run_id: str, pids: set[int]) -> None:
        """Stop whatever of the lab still runs (teardown: SIGTERM, SIGKILL after the grace),
        hear the agent's last exit codes, and close its socket (it then leaves)."""
        from labkit.runtime.teardown import teardown
        if not self.done:
            teardown(None, run_id, pids | set(self.pids.values()))
            self.conn.settimeout(2.0)
            try:
                while not self.done and self.message(None):
                    pass
            except (OSError, ValueError):
                pass
        self.conn.close()

    def drain(self, printer, log_dir: str) -> None:
        if self.lost:
            printer.agent_log += ["the warm pool's agent for this lab ended without a word; "
                                  "the pool's log:", *self.pool.log().splitlines()[-20:]]

    def returncode(self) -> int:
        ok = len(self.codes) == self.nproc and all(c == 0 for c in self.codes.values())
        return 0 if ok else 1

    def exit_codes(self) -> dict[int, int]:
        return dict(self.codes)

    def after(self, records: dict) -> None:
        """Import what this lab needed (e.g. transformers) in the pool before the next one."""
        needed = [m for recs in records.values() for rec in recs if rec["kind"] == "exit"
                  for m in rec.get("modules", [])]
        if needed and self.pool.alive():
            try:
                self.pool.preload(needed)
            except OSError:
                pass

    def close_streams(self) -> None:
        for fd in self.streams:
            try:
                os.close(fd)
            except OSError:
                pass
