"""The pool launcher's warm parent: one process that has imported torch, and forks a fresh
process for every rank of every lab (started by labkit.runtime.pool; run_lab uses it).

    python -m labkit.runtime.zygote CTRL_FD LAUNCHER_PID LAUNCHER_START [MODULE...]

Three kinds of process, all forked from this one: the warm parent (`main`), one agent per lab
(`_agent`, what torchrun's agent is to its workers) and the ranks (`_rank`); each function says
what its process does. Nothing outlives the launcher: the warm parent leaves when its control
socket closes, the launcher's pid is gone (a pidfd) or no lab came for ENV_IDLE seconds, an
agent kills its ranks when its lab socket closes, and each rank watches the launcher itself.
"""
from __future__ import annotations

import json
import os
import select
import signal
import socket
import sys
import threading
import time

ENV_SLOT = "LABKIT_ENV_SLOT"   # blank space in this process's environment block, see _show_env
SLOT_SIZE = 8192
MAX_MESSAGE = 1 << 20
ENV_AGENT_PID = "LABKIT_AGENT_PID"           # the same name as labkit.runtime.guard's
ENV_LAUNCHER = "LABKIT_RANK_LAUNCHER"       # "pool" in a pool rank (labkit.runtime.dist.launcher)
ENV_IDLE = "LABKIT_POOL_IDLE_TIMEOUT"     # seconds without a lab before the warm parent leaves
IDLE_EXIT = 3                             # its exit status then (the launcher restarts it)
# Imported here so that ranks do not pay for them (what most labs import beyond torch).
WARM_MODULES = ("torch", "torch.distributed", "torch.nn", "torch.optim",
                "torch.distributed.elastic.multiprocessing.errors")


# ---------------------------------------------------------------------------------------------
# messages: one JSON object per SOCK_SEQPACKET packet, file descriptors alongside

def send(sock: socket.socket, obj: dict, fds=()) -> None:
    data = json.dumps(obj).encode()
    if fds:
        socket.send_fds(sock, [data], list(fds))
    else:
        sock.send(data)


def recv(sock: socket.socket, maxfds: int = 0) -> tuple[dict | None, list[int]]:
    """(message, fds); (None, []) when the peer closed."""
    if maxfds:
        data, fds, _flags, _addr = socket.recv_fds(sock, MAX_MESSAGE, maxfds)
    else:
        data, fds = sock.recv(MAX_MESSAGE), []
    return (json.loads(data) if data else None), fds


# ---------------------------------------------------------------------------------------------
# the warm parent

def _pidfd(pid: int) -> int | None:
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None


def _launcher_gone(pid: int, started: str | None) -> bool:
    from labkit.runtime.guard import alive
    return not alive(pid, started)


def _watch_while_importing(ctrl, pid: int, started: str | None):
    """Imports take seconds; leave at once if the launcher dies meanwhile. Returns a function
    that stops the watcher (no thread may run when the parent forks)."""
    stop_r, stop_w = os.pipe()
    fd = _pidfd(pid)

    def watch():
        listen = True
        while True:
            watched = [stop_r] + ([ctrl] if listen else []) + ([fd] if fd is not None else [])
            ready, _, _ = select.select(watched, [], [], 0.5)
            if stop_r in ready:
                return
            if ctrl in ready:
                try:
                    closed = ctrl.recv(1, socket.MSG_PEEK) == b""
                except OSError:
                    closed = True
                if not closed:
                    listen = False    # a request waits (e.g. a preload): read after imports
            else:
                closed = False
            if closed or (fd is not None and fd in ready) or _launcher_gone(pid, started):
                os._exit(0)    # the launcher is gone (or closed us): nobody wants this pool

    thread = threading.Thread(target=watch, name="labkit-pool-import-watch", daemon=True)
    thread.start()

    def stop():
        os.write(stop_w, b"x")
        thread.join()
        for f in (stop_r, stop_w) + ((fd,) if fd is not None else ()):
            os.close(f)
    return stop


def _import(names) -> list[str]:
    import importlib
    done = []
    for name in names:
        try:
            importlib.import_module(name)
            done.append(name)
        except Exception as exc:   # a missing optional package: the ranks will say so
            print(f"labkit pool: could not import {name}: {type(exc).__name__}: {exc}",
                  file=sys.stderr, flush=True)
    return done


def _watched_files(names) -> dict[str, float]:
    """Files whose change makes this pool stale: the packages it imported, and this file."""
    files = {}
    for name in ["labkit.runtime.zygote", *(n for n in names if "." not in n)]:
        mod = sys.modules.get(name) or (sys.modules["__main__"] if name ==
                                        "labkit.runtime.zygote" else None)
        path = getattr(mod, "__file__", None)
        if path:
            files[path] = os.stat(path).st_mtime
    import torch
    files[torch.version.__file__] = os.stat(torch.version.__file__).st_mtime
    return files


def _check_threads() -> None:
    """An import that starts a thread makes later forks risky (a lock it holds stays held in
    the child): say so in the pool's log, where a hang's investigation will look."""
    tasks = os.listdir("/proc/self/task")
    if len(tasks) > 1:
        names = []
        for t in tasks:
            try:
                with open(f"/proc/self/task/{t}/comm") as f:
                    names.append(f.read().strip())
            except OSError:
                pass
        print(f"labkit pool: warning: {len(tasks)} threads after imports ({', '.join(names)})",
              file=sys.stderr, flush=True)


def _cuda_initialised() -> bool:
    torch = sys.modules.get("torch")
    return bool(torch is not None and torch.cuda.is_initialized())


def main(argv: list[str]) -> None:
    """The warm parent: imports torch (and the MODULEs, e.g. transformers), says "ready", then
    waits for requests on CTRL_FD (a SOCK_SEQPACKET socket to the launcher). It never
    initialises CUDA (forking after CUDA init is unsafe) and runs no lab code. It leaves when
    its control socket closes, the launcher's pid is gone (a pidfd), or no lab has run nor been
    asked for during ENV_IDLE seconds (`_leave_idle`: its memory goes back to the system)."""
    ctrl_fd, launcher_pid, launcher_start, *preload = argv
    ctrl = socket.socket(fileno=int(ctrl_fd))
    launcher_pid, started = int(launcher_pid), (None if launcher_start == "-" else launcher_start)
    signal.signal(signal.SIGINT, signal.SIG_IGN)     # the launcher says when to stop
    idle_timeout = float(os.environ.get(ENV_IDLE) or 0)     # 0: never (the launcher validated it)
    stop = _watch_while_importing(ctrl, launcher_pid, started)
    loaded = _import(WARM_MODULES + tuple(preload))
    stop()
    _check_threads()
    send(ctrl, {"op": "ready", "pid": os.getpid(), "modules": loaded,
                "files": _watched_files(loaded), "cuda_initialised": _cuda_initialised()})
    launcher = _pidfd(launcher_pid)
    agents: set[int] = set()          # labs running (their agents are our only children)
    last = time.monotonic()           # the end of the last request or lab
    code = 0
    while True:
        wait = 1.0 if idle_timeout <= 0 else min(1.0, idle_timeout)
        watched = [ctrl] + ([launcher] if launcher is not None else [])
        ready, _, _ = select.select(watched, [], [], wait)
        agents -= _reap()
        now = time.monotonic()
        if agents:
            last = now
        if launcher in ready or (launcher is None and _launcher_gone(launcher_pid, started)):
            break
        if ctrl not in ready:
            if idle_timeout > 0 and now - last >= idle_timeout:
                print(f"labkit pool: no lab for {now - last:.0f} s ({ENV_IDLE}="
                      f"{idle_timeout:g}); leaving (the next lab starts a new pool)",
                      file=sys.stderr, flush=True)
                code = IDLE_EXIT
                _leave_idle(ctrl, lambda msg, fds: _serve(msg, fds, ctrl, launcher, loaded,
                                                          agents))
                break
            continue
        try:
            msg, fds = recv(ctrl, maxfds=1)
        except OSError:
            break
        if not _serve(msg, fds, ctrl, launcher, loaded, agents):
            break
        last = time.monotonic()
    os._exit(code)


def _serve(msg, fds, ctrl, launcher, loaded: list[str], agents: set[int]) -> bool:
    """Do what one request asks (preload, ping, run a lab); False: leave now."""
    if msg is None or msg["op"] == "exit":
        return False
    if msg["op"] == "preload":
        known = set(loaded)
        loaded += [m for m in _import(m for m in msg["modules"] if m not in known)]
        _check_threads()
    elif msg["op"] == "ping":
        send(ctrl, {"op": "pong", "modules": loaded, "files": _watched_files(loaded)})
    elif msg["op"] == "run":
        if _cuda_initialised():      # a preload did it: never fork now; the next
            print("labkit pool: CUDA was initialised here; leaving (forked ranks could "
                  "not use it)", file=sys.stderr, flush=True)
            return False             # lab starts a new pool
        pid = os.fork()
        if pid == 0:
            try:
                ctrl.close()
                if launcher is not None:
                    os.close(launcher)
                _agent(socket.socket(fileno=fds[0]), msg)
            finally:
                os._exit(0)
        agents.add(pid)
        os.close(fds[0])
    return True


def _leave_idle(ctrl: socket.socket, serve) -> None:
    """Stop taking requests, then serve those already sent. Once this end is shut for reading,
    the launcher's next send fails at once (EPIPE), so it starts a new pool (`pool.get`, PoolJob)
    instead of waiting on this one; a request that was on its way before is still served (a lab
    then runs to its end under its own agent), none is lost."""
    try:
        ctrl.shutdown(socket.SHUT_RD)
        ctrl.setblocking(False)
        while True:
            msg, fds = recv(ctrl, maxfds=1)
            if msg is None or not serve(msg, fds):
                return
    except OSError:                  # nothing left to read, or the launcher has gone
        return


def _reap() -> set[int]:
    """Collect the agents that have exited; returns their pids."""
    gone = set()
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return gone
        if pid == 0:
            return gone
        gone.add(pid)


# ---------------------------------------------------------------------------------------------
# one lab: the agent

def _signal_groups(pids, sig) -> None:
    for pid in pids:
        for kill in (os.killpg, os.kill):
            try:
                kill(pid, sig)
            except OSError:
                pass


def _agent(conn: socket.socket, req: dict) -> None:
    """One lab's agent, what torchrun's agent is to its workers: it binds the rendezvous store
    on 127.0.0.1 only (torch's TCPStore otherwise listens on every interface), forks the ranks,
    tells the launcher their pids and exit codes, and when a rank fails stops the others
    (SIGTERM, then SIGKILL after the shutdown timeout), as torchrun does. It kills its ranks
    when its lab socket closes."""
    nproc = req["nproc"]
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(max(128, nproc))
    port = listener.getsockname()[1]
    pids: dict[int, int] = {}
    for r in range(nproc):
        msg, fds = recv(conn, maxfds=2)
        if msg is None:                       # the launcher gave up before we started
            _signal_groups(pids.values(), signal.SIGKILL)
            return
        pid = os.fork()
        if pid == 0:
            _rank(r, fds, req, port, (conn, listener))
        pids[r] = pid
        for fd in fds:
            os.close(fd)
    import datetime

    from torch.distributed import TCPStore
    store = TCPStore("127.0.0.1", port, None, True,    # noqa: F841 (serves until we exit)
                     datetime.timedelta(seconds=req["store_timeout"]),
                     wait_for_workers=False, master_listen_fd=listener.detach())
    try:
        send(conn, {"op": "started", "pids": {str(r): p for r, p in pids.items()},
                    "port": port, "agent": os.getpid()})
    except OSError:
        _signal_groups(pids.values(), signal.SIGKILL)
        return
    _monitor(conn, pids, req["shutdown_timeout"], req.get("guard", True))


def _monitor(conn: socket.socket, pids: dict[int, int], shutdown_timeout: float,
             guard: bool = True) -> None:
    """Report each rank's exit; when one fails, stop the others as torchrun does; when the
    launcher closes the socket, kill them all (unless LABKIT_ORPHAN_GUARD=0 asked to see what
    happens without: then they run on)."""
    running = dict(pids)
    fds = {r: fd for r, p in pids.items() if (fd := _pidfd(p)) is not None}
    kill_at = None
    listening = True
    while running:
        watched = ([conn] if listening else []) + [fds[r] for r in running if r in fds]
        wait = 0.05 if len(fds) < len(running) else 1.0
        try:
            ready, _, _ = select.select(watched, [], [], wait)
        except InterruptedError:
            ready = []
        if conn in ready:
            try:
                msg, _ = recv(conn)
            except OSError:
                msg = None
            if msg is None and not guard:
                listening = False
            elif msg is None or msg.get("op") == "kill":
                _signal_groups(running.values(), signal.SIGKILL)
                kill_at = kill_at or time.monotonic()
        for r, pid in list(running.items()):
            done, status = os.waitpid(pid, os.WNOHANG)
            if not done:
                continue
            code = os.waitstatus_to_exitcode(status)
            del running[r]
            try:
                send(conn, {"op": "exit", "rank": r, "code": code})
            except OSError:
                pass
            if code != 0 and kill_at is None and running:
                _signal_groups(running.values(), signal.SIGTERM)
                kill_at = time.monotonic() + shutdown_timeout
        if kill_at is not None and time.monotonic() >= kill_at and running:
            _signal_groups(running.values(), signal.SIGKILL)
    try:
        send(conn, {"op": "done"})
    except OSError:
        pass


# ---------------------------------------------------------------------------------------------
# one rank

def _slot() -> tuple[int, int] | None:
    """(address, size) of the blank ENV_SLOT entry in this process's original environment block,
    which is what /proc/PID/environ (and `ps e`) shows; None where there is none."""
    try:
        import ctypes
        libc = ctypes.CDLL(None)
        libc.getenv.restype = ctypes.c_void_p
        value = libc.getenv(ENV_SLOT.encode())
        if not value or ctypes.string_at(value, 8) != b" " * 8:
            return None
        name = len(ENV_SLOT) + 1
        return value - name, name + SLOT_SIZE
    except (OSError, AttributeError):
        return None


def _show_env(slot, env: dict, base: dict, first: tuple[str, ...]) -> None:
    """A forked process keeps its parent's environment block in /proc/PID/environ whatever it
    sets later; write the variables that differ from the parent's into the blank slot, so that
    tools (and labkit's teardown, which looks for LABKIT_RUN_ID) see this rank's environment as
    they would under torchrun. Variables that do not fit are left out, `first` ones first in."""
    if slot is None:
        return
    import ctypes
    address, size = slot
    names = [k for k in first if k in env] + sorted(k for k in env if k not in first
                                                    and base.get(k) != env[k])
    data = b""
    for k in names:
        entry = f"{k}={env[k]}".encode(errors="replace") + b"\0"
        if len(data) + len(entry) < size:
            data += entry
    ctypes.memmove(address, data + b"\0" * (size - len(data)), size)


def _rank(r: int, fds: list[int], req: dict, port: int, close: tuple) -> None:
    """The forked rank process: never returns. Each rank runs in a session of its own, with
    stdout/stderr on pipes the launcher made, the lab's environment (RANK, LOCAL_RANK,
    WORLD_SIZE, MASTER_ADDR/PORT, TORCHELASTIC_* as torchrun sets them), the launcher's working
    directory, and labkit's modules dropped so that they and the learner's code are imported
    fresh; then labkit.runtime.bootstrap runs the lab exactly as under torchrun, and the rank
    watches the launcher itself (labkit.runtime.guard)."""
    code = 1
    try:
        os.setsid()
        for s in close:
            s.close()
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(fds[0], 1)
        os.dup2(fds[1], 2)
        for fd in (null, *fds):
            os.close(fd)
        slot, base = _slot(), dict(os.environ)
        nproc = req["nproc"]
        env = dict(req["env"])
        env.update(RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(nproc),
                   LOCAL_WORLD_SIZE=str(nproc), GROUP_RANK="0", GROUP_WORLD_SIZE="1",
                   ROLE_NAME="default", ROLE_RANK=str(r), ROLE_WORLD_SIZE=str(nproc),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   TORCHELASTIC_RUN_ID=req["run_id"], TORCHELASTIC_RESTART_COUNT="0",
                   TORCHELASTIC_MAX_RESTARTS="0", TORCHELASTIC_USE_AGENT_STORE="True",
                   TORCH_NCCL_ASYNC_ERROR_HANDLING="1",
                   TORCHELASTIC_ERROR_FILE=os.path.join(req["log_dir"], "attempt_0", str(r),
                                                        "error.json"))
        env[ENV_AGENT_PID] = str(os.getppid())
        env[ENV_LAUNCHER] = "pool"
        os.makedirs(os.path.dirname(env["TORCHELASTIC_ERROR_FILE"]), exist_ok=True)
        os.environ.clear()
        os.environ.update(env)
        _show_env(slot, env, base, ("LABKIT_RUN_ID", "RANK", "LOCAL_RANK", "WORLD_SIZE"))
        os.chdir(req["cwd"])
        sys.path[0] = req["cwd"]          # as `python -m` in this directory would have it
        for name in [m for m in sys.modules if m == "labkit" or m.startswith("labkit.")]:
            del sys.modules[name]         # labkit's code (and the learner's) imported fresh
        import atexit
        import random
        atexit._clear()                   # the lab's own exit handlers run, not the parent's
        random.seed()                     # a fresh process has its own state (Python's
        if "numpy" in sys.modules:        # random also reseeds at fork; numpy's does not)
            sys.modules["numpy"].random.seed()
        for sig in (signal.SIGTERM, signal.SIGCHLD, signal.SIGUSR1, signal.SIGHUP):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        from labkit.runtime import bootstrap
        bootstrap.main([req["target"], *req["args"]])
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:
        import traceback
        traceback.print_exc()
        code = 1
    finally:
        _exit(code)


def _exit(code: int) -> None:
    """What interpreter exit does for a lab (threads joined, atexit run, streams flushed),
    without the parent's finalisation."""
    try:
        threading._shutdown()
        import atexit
        atexit._run_exitfuncs()
    except BaseException:
        pass
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    os._exit(code)


if __name__ == "__main__":
    main(sys.argv[1:])
