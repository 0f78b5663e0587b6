"""Ranks that stay: a `World` keeps N ranks and their process group alive between notebook cells.

    w = World(4).start()                 # what `%ranks start -n 4` does (labkit.runtime.magic)
    r = w.run("x = torch.ones(2) * rank\\ndist.all_reduce(x)\\nx")   # %%ranks; names stay
    r.values[2]                          # rank 2's last expression -> `_ranks[2]`
    w.stop()                             # also at exit; a killed kernel's ranks die with it

The ranks are forked from the warm pool (torchrun where there is none) and run
labkit.runtime.rankserver; the same guard, teardown and stack dumps as run_lab. A rank that raises
stays usable; a cell that hangs stops at its timeout, says where each rank waits, and the world
is started again.
"""
from __future__ import annotations

import atexit
import os
import selectors
import shutil
import signal
import socket
import sys
import time
import uuid
from dataclasses import dataclass, field

from labkit.runtime import launch, rundir, system
from labkit.runtime.postmortem import (dump_stacks, first_record, is_plumbing,
                                       main_thread_frames, ranks_text, read_records, where)
from labkit.runtime.rankserver import (ENV_DEVICE, ENV_SOCKET, Frames, cell_filename, rss_bytes,
                                       send)
from labkit.runtime.results import LabError
from labkit.runtime.teardown import proc_alive, shielded

START_TIMEOUT = 180.0        # importing torch in 4 fresh processes on a busy 2-core laptop
STOP_GRACE = 3.0             # seconds the ranks get to leave before they are killed
INTERRUPT_GRACE = 3.0        # seconds interrupted ranks get to stop their cell
GROUP_TIMEOUT = 3600.0       # the process group's own collective timeout: the cell's fires first
TARGET = "labkit.runtime.rankserver"


class RanksError(LabError):
    """A %ranks world could not start, or a cell failed on a rank, hung or was interrupted.
    reason: "start" | "exception" | "timeout" | "died" | "stopped"; `cell` the CellResult."""

    def __init__(self, message: str, *, reason: str, cell=None, **kw):
        super().__init__(message, reason=reason, **kw)
        self.cell = cell

    def _render_traceback_(self) -> list[str]:
        """What Jupyter shows: the ranks' story, not the kernel's frames that told it."""
        return [f"\x1b[31mRanksError\x1b[0m: {self.args[0]}"]


class RankValues(dict):
    """rank -> the value of a cell's last expression on that rank (`_ranks`)."""

    def __init__(self, values=(), why=None):
        super().__init__(values)
        self.why = dict(why or {})

    def __missing__(self, rank):
        raise KeyError(self.why.get(rank, f"rank {rank!r} has no value in this cell; ranks with "
                                          f"one: {ranks_text(self) or 'none'}"))


@dataclass
class RankCell:
    """How one rank ran one cell."""
    rank: int
    error: dict | None = None            # {"type", "message", "traceback"}
    interrupted: bool = False
    has_value: bool = False
    value_error: str | None = None
    wall: float | None = None
    collectives: dict | None = None      # kind -> (count, bytes), CollectiveCounter.by_kind
    rss_start: int | None = None
    peak_rss: int | None = None
    rss: int | None = None
    cuda_peak: int | None = None
    output: list[str] = field(default_factory=list)


@dataclass
class CellResult:
    cell: int
    ranks: list[int]
    by_rank: dict[int, RankCell]
    values: RankValues
    wall: float

    @property
    def failed(self) -> list[int]:
        return [r for r in self.ranks if self.by_rank[r].error]


class _Lines:
    """Where the ranks' lines go (the run_lab printer's protocol): `show(rank, text, dest)`."""

    def __init__(self, show=None):
        self.show = show or _print
        self.agent_log: list[str] = []
        self.cell: dict[int, RankCell] = {}     # the running cell's ranks: their lines kept

    def rank_line(self, local: int, text: str, dest: str) -> None:
        if local in self.cell:
            self.cell[local].output.append(text)
        self.show(local, text, dest)

    def line(self, text: str, dest: str) -> None:
        m = launch._PREFIX.match(text)
        if m:
            self.show(int(m.group(1)), m.group(2), dest)
        else:
            self.agent_log.append(text)


def _print(rank: int, text: str, dest: str) -> None:
    stream = sys.stdout if dest == "stdout" else sys.stderr
    stream.write(f"[rank {rank}] {text}\n")
    stream.flush()


class World:
    """N persistent ranks with an initialised process group (the environment torchrun gives).

    nproc: ranks (default as run_lab). backend: "gloo" | "nccl" (default: NCCL when each rank has
    a GPU, else gloo). device: "cpu" | "cuda" (default from the backend). timeout: seconds a
    cell may run (`run`'s default). launcher: as run_lab's. env: extra variables for the ranks."""

    def __init__(self, nproc: int | None = None, backend: str | None = None,
                 device: str | None = None, timeout: float = 60.0, launcher: str | None = None,
                 env: dict | None = None):
        from labkit.validate import choice, positive, positive_int
        self.nproc = system.default_nproc() if nproc is None else positive_int("nproc", nproc)
        if backend is not None:
            choice("backend", backend, ("gloo", "nccl"))
        if device is not None:
            choice("device", device, ("cpu", "cuda"))
        if backend == "nccl" and device == "cpu":
            raise ValueError("backend='nccl' moves CUDA tensors only, and device='cpu' was "
                             "asked for; allowed: backend='gloo' with device='cpu', or "
                             "device='cuda'")
        if (backend == "nccl" or device == "cuda") and system.cuda_device_count() < self.nproc:
            raise ValueError(f"{self.nproc} ranks on CUDA need {self.nproc} GPUs, and this "
                             f"machine has {system.cuda_device_count()}; allowed: backend='gloo'"
                             " and device='cpu' (every lab runs there), or fewer ranks")
        limit, why = system.max_local_ranks()
        if self.nproc > limit and os.environ.get(launch.ENV_OVERSUBSCRIBE, "0") != "1":
            raise ValueError(f"nproc={self.nproc} is more ranks than this machine holds ({why}: "
                             f"at most {limit}); allowed: 1 to {limit}, or "
                             f"{launch.ENV_OVERSUBSCRIBE}=1")
        self.backend, self.device = backend, device
        self.timeout = positive("timeout", timeout)
        self.launcher, self.env = launcher, dict(env or {})
        self.job = None
        self.pids: dict[int, int] = {}
        self.backend_used = self.device_used = self.launcher_used = None
        self.cells = 0
        self.last: CellResult | None = None
        self.last_by_rank: dict[int, tuple[int, RankCell]] = {}
        self.restarts = 0
        self.started_at: float | None = None

    # --- life ------------------------------------------------------------------------------

    @property
    def alive(self) -> bool:
        return self.job is not None and all(proc_alive(p) for p in self.pids.values())

    def options(self) -> str:
        return (f"{self.nproc} ranks, {self.backend_used or self.backend or 'auto'}"
                f" on {self.device_used or self.device or 'auto'}, cell timeout "
                f"{self.timeout:g} s, launcher {self.launcher_used or self.launcher or 'auto'}")

    def start(self, show=None) -> World:
        """Start the ranks and wait until each has its process group and has said hello."""
        if self.job is not None:
            return self
        self.run_id = uuid.uuid4().hex[:12]
        rundir.sweep_stale()
        self.run_dir = rundir.make_run_dir(self.run_id)
        self.results_dir = os.path.join(self.run_dir, "results")
        self.log_dir = os.path.join(self.run_dir, "logs")
        os.makedirs(self.results_dir)
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        path = os.path.join(self.run_dir, "ranks.sock")
        self.listener.bind(path)
        self.listener.listen(self.nproc)
        env = {**self.env, ENV_SOCKET: path, "LABKIT_COLLECTIVE_TIMEOUT": str(GROUP_TIMEOUT)}
        if self.backend:
            env["LABKIT_BACKEND"] = self.backend
        if self.device:
            env[ENV_DEVICE] = self.device
        child_env = launch.rank_env(env, self.run_id, self.results_dir, None)
        self.conns: dict[int, socket.socket] = {}
        self.frames: dict[int, Frames] = {}
        self.pids: dict[int, int] = {}
        self.partial: dict[int, bytes] = {}
        self.backend_used = self.device_used = None
        self.lines = _Lines(show)
        t0 = time.monotonic()
        try:
            self._launch(child_env)
            self._greet(t0)
        except BaseException:
            shielded(self._teardown)
            raise
        self.started_at = time.time()
        _live.add(self)
        return self

    def _launch(self, child_env: dict) -> None:
        explicit = (self.launcher or os.environ.get(launch.ENV_LAUNCHER)) == "pool"
        self.launcher_used = launch.choose_launcher(self.launcher, 1)
        if self.launcher_used == "pool":
            from labkit.runtime.pool import PoolError, PoolJob
            try:
                self.job = PoolJob(TARGET, self.nproc, [], child_env, self.run_id,
                                   self.log_dir, None)
                return
            except (PoolError, OSError) as exc:
                if explicit:
                    raise RanksError(f"the warm pool could not start: {exc}",
                                     reason="start") from exc
                self.launcher_used = "torchrun"
        cmd = launch._torchrun_command(TARGET, self.nproc, [], self.log_dir, self.run_id, 1,
                                       None, None, None)
        self.job = launch._TorchrunJob(cmd, child_env, self.log_dir)

    def _greet(self, t0: float) -> None:
        """Accept each rank's connection and read its hello."""
        sel = self._selector(listen=True)
        try:
            while len(self.pids) < self.nproc:
                if time.monotonic() - t0 > START_TIMEOUT:
                    raise RanksError(self._start_failure(f"only {len(self.pids)} of "
                                     f"{self.nproc} ranks started within {START_TIMEOUT:g} s"),
                                     reason="start")
                if self._some_rank_exited():
                    self._drain(sel)
                    raise RanksError(self._start_failure("a rank exited while starting"),
                                     reason="start")
                self._step(sel, 0.1)
        finally:
            sel.close()

    def _some_rank_exited(self) -> bool:
        codes = self.job.exit_codes() or {}
        return self.job.ended() or any(c is not None for c in codes.values()) or any(
            not proc_alive(p) for p in self.pids.values())

    def _start_failure(self, head: str) -> str:
        lines = [f"the world of {self.nproc} ranks did not start: {head}"]
        for r, recs in sorted(read_records(self.results_dir).items()):
            err = first_record(recs, "error")
            if err:
                lines += [f"rank {r} raised {err['exc_type']}: {err['message']}",
                          err["traceback"].rstrip()]
                break
        else:
            lines += self.lines.agent_log[-15:]
        return "\n".join(lines)

    def stop(self) -> None:
        """Ask every rank to leave, then stop what is left (SIGTERM, SIGKILL); nothing stays."""
        if self.job is None:
            return
        for conn in self.conns.values():
            try:
                send(conn, {"op": "stop"})
            except OSError:
                pass
        deadline = time.monotonic() + STOP_GRACE
        while time.monotonic() < deadline and any(proc_alive(p) for p in self.pids.values()):
            time.sleep(0.05)
        shielded(self._teardown)

    def _teardown(self) -> None:
        job, self.job = self.job, None
        if job is not None:
            job.stop(self.run_id, set(self.pids.values()))
            job.close_streams()
        for conn in getattr(self, "conns", {}).values():
            conn.close()
        self.conns = {}
        if getattr(self, "listener", None) is not None:
            self.listener.close()
            self.listener = None
        shutil.rmtree(getattr(self, "run_dir", ""), ignore_errors=True)
        _live.discard(self)

    def restart(self, show=None) -> World:
        self.stop()
        self.restarts += 1
        self.cells = 0
        self.last, self.last_by_rank = None, {}
        return self.start(show)

    def status(self) -> list[dict]:
        """One row per rank: pid, alive, resident memory (bytes), the last cell it ran."""
        rows = []
        for r in range(self.nproc):
            pid = self.pids.get(r)
            cell, last = self.last_by_rank.get(r, (None, None))
            rows.append({"rank": r, "pid": pid, "alive": bool(pid and proc_alive(pid)),
                         "rss": rss_bytes(pid) if pid else None, "last_cell": cell,
                         "last_outcome": None if last is None else (
                             "interrupted" if last.interrupted else
                             f"raised {last.error['type']}" if last.error else "ok")})
        return rows

    # --- cells -----------------------------------------------------------------------------

    def run(self, code: str, ranks=None, timeout: float | None = None, count: bool = True,
            show=None) -> CellResult:
        """Run `code` on `ranks` (default all) in their namespaces; return a CellResult, or
        raise RanksError when a rank raised (after every rank has answered), the cell ran past
        `timeout` (the world is then started again) or a rank died."""
        if self.job is None:
            raise RanksError("no ranks are running; start them with `%ranks start -n 4` "
                             "(World.start())", reason="stopped")
        ranks = sorted(set(range(self.nproc) if ranks is None else ranks))
        bad = [r for r in ranks if not (isinstance(r, int) and 0 <= r < self.nproc)]
        if bad or not ranks:
            raise ValueError(f"ranks {bad or '(none)'} are not ranks of this world; allowed: "
                             f"0 to {self.nproc - 1}")
        timeout = self.timeout if timeout is None else timeout
        self.lines.show = show or _print
        dead = [r for r, p in self.pids.items() if not proc_alive(p)]
        if dead:
            self.restart(show)
            raise RanksError(f"rank{'s' if len(dead) > 1 else ''} {ranks_text(dead)} died "
                             "since the last cell; the world was started again (names "
                             "defined in earlier cells are gone): run the cell again",
                             reason="died")
        self.cells += 1
        cell = self.cells
        by_rank = {r: RankCell(r) for r in ranks}
        self.lines.cell = by_rank
        for r in ranks:
            send(self.conns[r], {"op": "run", "code": code, "cell": cell, "count": count})
        pending, t0 = set(ranks), time.monotonic()
        sel = self._selector()
        try:
            state = self._wait(sel, pending, by_rank, t0 + timeout)
        except KeyboardInterrupt:
            shielded(lambda: self._interrupted(sel, pending, by_rank, cell))
            raise
        finally:
            sel.close()
        result = self._result(cell, ranks, by_rank, time.monotonic() - t0)
        if state == "timeout":
            msg = self._hang_message(cell, ranks, pending, by_rank, timeout)
            self.restart(show)
            raise RanksError(msg, reason="timeout", cell=result)
        if state == "died":
            gone = [r for r, p in self.pids.items() if not proc_alive(p)]
            self.restart(show)
            raise RanksError(f"rank{'s' if len(gone) > 1 else ''} {ranks_text(gone)} died "
                             f"during cell {cell}; the world was started again (names defined "
                             "in earlier cells are gone)", reason="died", cell=result)
        self.last = result
        self.last_by_rank.update({r: (cell, rc) for r, rc in by_rank.items()})
        if result.failed:
            raise RanksError(self._error_message(result), reason="exception", cell=result,
                             rank=result.failed[0], exc_type=by_rank[result.failed[0]].error["type"],
                             exc_message=by_rank[result.failed[0]].error["message"],
                             traceback=by_rank[result.failed[0]].error["traceback"])
        return result

    def _error_message(self, result: CellResult) -> str:
        """Each distinct exception once, with the ranks that raised it and its traceback."""
        groups: dict[tuple, list[int]] = {}
        for r in result.failed:
            e = result.by_rank[r].error
            groups.setdefault((e["type"], e["message"], e["traceback"]), []).append(r)
        lines = []
        for (kind, message, tb), rs in groups.items():
            lines.append(f"rank{'s' if len(rs) > 1 else ''} {ranks_text(rs)} raised {kind}"
                         f"{': ' + message if message else ''} (cell {result.cell})")
            lines.append(tb.rstrip())
        ok = [r for r in result.ranks if r not in result.failed]
        lines.append((f"rank{'s' if len(ok) > 1 else ''} {ranks_text(ok)} finished the cell; "
                      if ok else "") + "every rank is still running, with the names it had")
        return "\n".join(lines)

    def _result(self, cell, ranks, by_rank, wall) -> CellResult:
        values, why = {}, {}
        for r, rc in by_rank.items():
            raw = getattr(rc, "_raw", None)
            if rc.error:
                why[r] = f"rank {r} raised {rc.error['type']} in cell {cell}: no value"
            elif rc.value_error:
                why[r] = f"rank {r}: {rc.value_error}"
            elif raw is not None:
                try:
                    import pickle
                    values[r] = pickle.loads(raw)
                except Exception as exc:
                    rc.value_error = (f"its value cannot be rebuilt in the notebook "
                                      f"({type(exc).__name__}: {exc}); return plain data "
                                      "(numbers, lists, tensors), not objects of classes "
                                      "defined in a %%ranks cell")
                    why[r] = f"rank {r}: {rc.value_error}"
            elif not rc.has_value:
                why[r] = (f"rank {r} has no value in cell {cell}: its last line is not an "
                          "expression (or is None, or ends with ';')")
        for r in range(self.nproc):
            if r not in by_rank:
                why[r] = f"rank {r} did not run cell {cell} (it ran on ranks {ranks_text(ranks)})"
        return CellResult(cell, ranks, by_rank, RankValues(values, why), wall)

    def _hang_message(self, cell, ranks, pending, by_rank, timeout) -> str:
        running = sorted(pending)
        stacks = dump_stacks({r: self.pids[r] for r in running}, self.results_dir)
        lines = [f"cell {cell} timed out after {timeout:g} s: rank{'s' if len(running) > 1 else ''}"
                 f" {ranks_text(running)} still running it"]
        waits = []
        for r in running:
            frames = [f for f in main_thread_frames(stacks.get(r, "")) if not is_plumbing(f[0])
                      and not f[0].endswith("rankserver.py")]
            if not frames:
                lines.append(f"rank {r}: no stack (it did not answer)")
                continue
            collective, mine = where(frames)
            if collective:
                waits.append(collective)
                lines.append(f"rank {r} waits in {collective} ({mine})")
            else:
                lines.append(f"rank {r} is not in a collective: it is at {mine}")
        if waits:
            for r, rc in sorted(by_rank.items()):
                if r not in pending:
                    how = (f"raised {rc.error['type']}: {rc.error['message']}" if rc.error
                           else "finished the cell")
                    lines.append(f"rank {r} {how}, so it never joined {waits[0]}")
            for r in range(self.nproc):
                if r not in by_rank:
                    lines.append(f"rank {r} did not run this cell (ranks {ranks_text(ranks)}), "
                                 f"so it never joined {waits[0]}")
        lines.append(f"the world of {self.nproc} ranks was started again: names defined in "
                     "earlier cells are gone")
        return "\n".join(lines)

    def _interrupted(self, sel, pending, by_rank, cell) -> None:
        """Ctrl-C in the kernel: interrupt the ranks' cell (state kept); ranks that do not stop
        within INTERRUPT_GRACE (e.g. blocked in a collective) mean a fresh world."""
        for r in pending:
            try:
                os.kill(self.pids[r], signal.SIGINT)
            except OSError:
                pass
        try:
            state = self._wait(sel, pending, by_rank, time.monotonic() + INTERRUPT_GRACE)
        except Exception:
            state = "died"
        self.last = self._result(cell, sorted(by_rank), by_rank, 0.0)
        self.last_by_rank.update({r: (cell, rc) for r, rc in by_rank.items()})
        if state != "done":
            stuck = ranks_text(pending) if pending else "some"
            self.restart()
            print(f"labkit: interrupted; rank(s) {stuck} did not stop within "
                  f"{INTERRUPT_GRACE:g} s, so the world of {self.nproc} ranks was started "
                  "again (names defined in earlier cells are gone)", file=sys.stderr, flush=True)
        else:
            print(f"labkit: interrupted cell {cell} on every rank; the ranks and their names "
                  "are kept", file=sys.stderr, flush=True)

    # --- the event loop ----------------------------------------------------------------------

    def _selector(self, listen: bool = False) -> selectors.BaseSelector:
        sel = selectors.DefaultSelector()
        for fd, tag in self.job.streams.items():
            if fd not in getattr(self, "_closed_fds", set()):
                sel.register(fd, selectors.EVENT_READ, ("stream", tag))
        if self.job.control is not None and not getattr(self, "_agent_gone", False):
            sel.register(self.job.control, selectors.EVENT_READ, ("agent", None))
        for r, conn in self.conns.items():
            sel.register(conn, selectors.EVENT_READ, ("rank", r))
        if listen:
            sel.register(self.listener, selectors.EVENT_READ, ("listen", None))
        return sel

    def _wait(self, sel, pending: set, by_rank: dict, deadline: float) -> str:
        while pending:
            now = time.monotonic()
            if now > deadline:
                return "timeout"
            if self._step(sel, min(0.1, deadline - now), pending, by_rank) == "died":
                return "died"
        self._drain(sel)
        return "done"

    def _drain(self, sel) -> None:
        """What the ranks wrote before they answered is in the pipes now: show it."""
        self.job.tick(self.lines)
        while any(key.data[0] == "stream" for key, _ in sel.select(0)):
            self._step(sel, 0, streams_only=True)

    def _step(self, sel, wait: float, pending=None, by_rank=None, streams_only=False):
        self.job.tick(self.lines)
        if (tick := getattr(self.lines.show, "tick", None)) is not None:
            tick()                     # a live view redraws what came since its last draw
        for key, _ in sel.select(wait):
            kind, tag = key.data
            if kind == "stream":
                self._read_stream(sel, key.fd, tag)
            elif streams_only:
                continue
            elif kind == "agent":
                if not self.job.message(None, None):
                    sel.unregister(key.fileobj)
                    self._agent_gone = True
            elif kind == "listen":
                conn, _ = self.listener.accept()
                conn.setblocking(True)
                self._hello(sel, conn)
            else:
                data = key.fileobj.recv(1 << 20)
                if not data:
                    sel.unregister(key.fileobj)
                    return "died"
                for msg in self.frames[tag].feed(data):
                    if msg.get("op") == "done" and by_rank is not None and tag in by_rank:
                        self._take_reply(by_rank[tag], msg)
                        pending.discard(tag)
        return None

    def _hello(self, sel, conn) -> None:
        frames, conn_deadline = Frames(), time.monotonic() + 30
        msgs = []
        while not msgs and time.monotonic() < conn_deadline:
            data = conn.recv(1 << 16)
            if not data:
                conn.close()
                return
            msgs = frames.feed(data)
        hello = msgs[0]
        r = hello["rank"]
        self.conns[r], self.frames[r], self.pids[r] = conn, frames, hello["pid"]
        self.backend_used, self.device_used = hello["backend"], hello["device"].split(":")[0]
        sel.register(conn, selectors.EVENT_READ, ("rank", r))

    def _take_reply(self, rc: RankCell, msg: dict) -> None:
        rc.error, rc.interrupted = msg.get("error"), msg.get("interrupted", False)
        rc.has_value, rc.value_error = msg.get("has_value", False), msg.get("value_error")
        rc._raw = msg.get("value")
        for name in ("wall", "collectives", "rss_start", "peak_rss", "rss", "cuda_peak"):
            setattr(rc, name, msg.get(name))

    def _read_stream(self, sel, fd: int, tag) -> None:
        chunk = os.read(fd, 65536)
        if not chunk:
            sel.unregister(fd)
            self._closed_fds = getattr(self, "_closed_fds", set()) | {fd}
            chunk = b"\n" if self.partial.get(fd) else b""
        *lines, self.partial[fd] = (self.partial.get(fd, b"") + chunk).split(b"\n")
        for raw in lines:
            self.job.line(self.lines, tag, raw.decode("utf-8", "replace"))


_live: set[World] = set()
_current: World | None = None


def current() -> World | None:
    """The world the %ranks magic started in this process (None: none)."""
    return _current


def set_current(world: World | None) -> None:
    global _current
    _current = world


@atexit.register
def _stop_all() -> None:
    for w in list(_live):
        try:
            w.stop()
        except Exception:
            pass


__all__ = ["World", "RanksError", "CellResult", "RankCell", "RankValues", "current",
           "cell_filename"]
