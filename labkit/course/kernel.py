"""Run a notebook's code cells in a fresh kernel of this interpreter, one at a time, under a hard
time limit: the engine of labkit.course.grader (`execute`).

A cell may run `timeout` seconds; then the kernel is interrupted (SIGINT, as Jupyter's stop button
does), and killed with its process group `grace` seconds later (`_Watchdog`). The kernel dies
with the grader however the grader ends (`_client_class`), and the outputs kept are bounded
(CELL_OUTPUT_LIMIT, TOTAL_OUTPUT_LIMIT, `bound_messages`). The details: docs/runtime.md.

Nothing the kernel started outlives grading (`Leftovers`): a run token in the kernel's
environment and, on Linux, a subreaper parent (`reaper_main`) find what left its process group;
how, and what still escapes: docs/runtime.md, ### kernel.
"""
from __future__ import annotations

import json
import os
import re
import signal
import sys
import tempfile
import threading
import time
import types
import uuid
from dataclasses import dataclass, field
from pathlib import Path

KILL_GRACE = 5.0  # seconds between the interrupt at the limit and killing the kernel
SWEEP_GRACE = 1.0  # seconds between SIGTERM and SIGKILL for what the kernel left running
ENV_GRADE_RUN = "LABKIT_GRADE_RUN"   # in the kernel's environment: this grading run's token
# What the grader keeps of the outputs is bounded: at most CELL_OUTPUT_LIMIT characters a cell
# and TOTAL_OUTPUT_LIMIT in all (errors are kept, shortened); what was dropped is counted
# (`CellRun.dropped`) and said in the cell's outputs. The kernel sends its stdout and stderr in
# messages of at most MESSAGE_CHARS characters (`bound_messages`), so that what the grader holds
# while it reads one stays small too.
CELL_OUTPUT_LIMIT = 1_000_000     # characters of output kept per cell
RECORDS_PER_CELL = 2000           # check records (labkit.course.verdict) kept per cell ...
RECORD_CHARS_PER_CELL = 64_000_000    # ... and their characters
TOTAL_OUTPUT_LIMIT = 8_000_000    # ... and for the whole notebook
ERROR_TEXT_LIMIT = 4_000          # characters kept of an error's value
MESSAGE_CHARS = 1 << 18           # the largest stream message the kernel sends
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


class KernelStartError(RuntimeError):
    """No kernel could be started (no ipykernel, a broken environment, ...), or the caller's
    set-up code (`before`) failed in it."""


@dataclass
class CellRun:
    ran: bool = False
    error: dict | None = None     # {"ename", "evalue", "traceback"}
    timed_out: bool = False       # still running at the limit: interrupted
    killed: bool = False          # ... and still running `grace` s later: the kernel was killed
    died: bool = False            # the kernel died by itself (a crash, os._exit, out of memory)
    seconds: float = 0.0
    probe: str | None = None      # repr of `probe` evaluated after the cell
    status: str | None = None     # the execute reply's status: "ok", "error", "aborted"
    dropped: int = 0              # characters of output not kept (over the limits)
    records: list = field(default_factory=list)     # what its checks received (verdict.MIME)


def kernel_env(token: str | None = None) -> dict:
    """The kernel's environment: this process's, labkit importable, and `token` (ENV_GRADE_RUN)
    when given."""
    env = dict(os.environ)
    if token:
        env[ENV_GRADE_RUN] = token
    # The kernel imports the same labkit as the grader, whatever its working directory.
    root = str(Path(__file__).resolve().parents[2])   # the folder that holds labkit/
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    if env.get("MPLBACKEND", "").lower() == "agg":  # DESIGN: never Agg in kernels (no figures)
        del env["MPLBACKEND"]
    return env


def _signal(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


# ------------------------------------------------------------ what the kernel leaves running

_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36


def _prctl(option: int, value: int) -> bool:
    try:
        import ctypes
        return ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def descendants(root: int) -> set[int]:
    """The pids below process `root` (children, theirs, ...), from /proc; empty without it."""
    children: dict[int, list[int]] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return set()
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                ppid = int(f.read().rsplit(b")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    found, todo = set(), [root]
    while todo:
        for child in children.get(todo.pop(), ()):
            if child not in found and child != root:
                found.add(child)
                todo.append(child)
    return found


class Leftovers:
    """The processes of one grading run: those whose environment carries ENV_GRADE_RUN=`token`
    and, while `root` (the kernel's reaper) lives, those below it. Each is remembered with its
    start time when first seen (`find`), so that it can still be stopped after its parent is
    gone, and a pid reused by another process is never signalled. Never this process."""

    def __init__(self, token: str | None, root: int | None = None, reap: bool = False):
        from labkit.runtime.guard import start_time

        self.token, self.root, self.reap = token, root, reap
        self.root_start = start_time(root) if root else None
        self.seen: dict[int, str] = {}
        self._lock = threading.Lock()

    def find(self) -> set[int]:
        """Look again (each call adds what is new), and return the live ones seen so far."""
        from labkit.runtime.guard import alive, start_time

        pids: set[int] = set()
        if self.token:
            from labkit.runtime.teardown import marked_pids
            try:
                pids |= marked_pids(ENV_GRADE_RUN, self.token)
            except OSError:         # no /proc (macOS): nothing to find this way
                pass
        if self.root and alive(self.root, self.root_start):
            pids |= descendants(self.root)
        pids.discard(os.getpid())
        with self._lock:
            for pid in pids - self.seen.keys():
                started = start_time(pid)
                if started is not None:
                    self.seen[pid] = started
            return {pid for pid, started in self.seen.items() if alive(pid, started)}

    def _send(self, pids: set[int], sig: int) -> None:
        for pid in pids:
            try:
                os.kill(pid, sig)
            except (ProcessLookupError, PermissionError):
                pass

    def _reap_children(self) -> None:
        while self.reap:        # the reaper: collect its exited children (adopted orphans)
            try:
                if os.waitpid(-1, os.WNOHANG)[0] == 0:
                    return
            except ChildProcessError:
                return

    def sweep(self, grace: float = SWEEP_GRACE) -> int:
        """SIGTERM what is left, SIGKILL what is still there `grace` s later (at once when a
        second Ctrl-C or SIGTERM cuts the grace short); the number of processes found."""
        live = self.find()
        found = len(live)
        if not live:
            return 0
        try:
            if grace > 0:
                self._send(live, signal.SIGTERM)
                deadline = time.monotonic() + grace
                while live and time.monotonic() < deadline:
                    time.sleep(0.05)
                    self._reap_children()
                    live = self.find()
        finally:
            for _ in range(40):     # what forks as fast as it is killed: given up after ~2 s
                self._reap_children()
                live = self.find()
                if not live:
                    break
                self._send(live, signal.SIGKILL)
                time.sleep(0.05)
            self._reap_children()
        return found


def reaper_command(cmd: list[str]) -> list[str]:
    """`cmd` (the kernel) run below `reaper_main`, which dies with this process."""
    return [sys.executable, "-c", "import sys; from labkit.course.kernel import reaper_main; "
            "reaper_main(sys.argv[1:])", str(os.getpid()), "--", *cmd]


def reaper_main(argv: list[str]) -> None:
    """The kernel's parent (Linux): `python -c ... GRADER_PID -- KERNEL_CMD...`.

    It asks for SIGTERM when the grader dies (PR_SET_PDEATHSIG) and to adopt the orphans below
    it (PR_SET_CHILD_SUBREAPER), then forks the kernel, which dies with it (SIGKILL as its own
    parent-death signal) and gets SIGINT as the grader sent it. The kernel's process group is
    the reaper's (Jupyter's interrupt and kill reach both; the reaper ignores SIGINT and a
    SIGTERM while the grader lives). When the kernel exits, the reaper stops what is left below
    it (SIGTERM, SWEEP_GRACE, SIGKILL) and exits as the kernel did; when the grader dies, it
    SIGKILLs everything below it at once and exits."""
    if len(argv) < 3 or argv[1] != "--":
        raise SystemExit("usage: reaper_main GRADER_PID -- KERNEL_COMMAND [ARGS...]")
    grader, cmd = int(argv[0]), argv[2:]
    _prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != grader:           # the grader died before the line above took effect
        os._exit(1)
    _prctl(_PR_SET_CHILD_SUBREAPER, 1)
    me = os.getpid()
    below = Leftovers(None, root=me, reap=True)
    sigint = signal.getsignal(signal.SIGINT)

    def on_term(signum, frame):
        if os.getppid() != grader:       # the parent-death signal: the grader is gone
            below.sweep(grace=0)
            os._exit(1)
        # else SIGTERM to the kernel's group (Jupyter's shutdown): the kernel has it too

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    kernel = os.fork()
    if kernel == 0:
        try:
            signal.signal(signal.SIGINT, signal.SIG_IGN if sigint == signal.SIG_IGN
                          else signal.SIG_DFL)
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
            if os.getppid() == me:
                os.execv(cmd[0], cmd)
        finally:
            os._exit(127)
    while True:
        pid, status = os.waitpid(-1, 0)      # the kernel, and adopted orphans as they exit
        if pid == kernel:
            break
    signal.signal(signal.SIGTERM, signal.SIG_IGN)   # the grader's stop must not cut this short
    below.sweep()
    code = os.waitstatus_to_exitcode(status)
    if code < 0:                          # killed by a signal: so is the reaper
        signal.signal(-code, signal.SIG_DFL)
        os.kill(me, -code)
        code = 128 - code                 # a signal that does not end a process
    os._exit(code & 0xFF)


class _Watchdog(threading.Thread):
    """Interrupts the kernel at the deadline, kills its process group `grace` s later.

    The interrupt is SIGINT to the kernel's process group, as Jupyter's stop button sends. A
    cell still running `grace` s later (a loop inside C code, code that ignores SIGINT) gets the
    kernel and its process group killed (SIGKILL); that cell is reported as killed and the
    cells after it are not run. Labs the kernel started with `run_lab` die with it
    (labkit.runtime.guard), so nothing is left running. `before_kill()` is called first
    (`Leftovers.find`: what is below the kernel's reaper, before the reaper dies too)."""

    def __init__(self, pgid: int, timeout: float, grace: float, before_kill=None):
        super().__init__(daemon=True, name="labkit-grade-watchdog")
        self.pgid, self.timeout, self.grace = pgid, timeout, grace
        self.before_kill = before_kill
        self._cond = threading.Condition()
        self._deadline: float | None = None
        self._done = False
        self.interrupted = self.killed = False

    def arm(self) -> None:
        with self._cond:
            self._deadline = time.monotonic() + self.timeout
            self.interrupted = False
            self._cond.notify()

    def disarm(self) -> None:
        with self._cond:
            self._deadline = None

    def stop(self) -> None:
        with self._cond:
            self._done = True
            self._cond.notify()

    def run(self) -> None:
        with self._cond:
            while not self._done:
                if self._deadline is None:
                    self._cond.wait()
                    continue
                left = self._deadline - time.monotonic()
                if left > 0:
                    self._cond.wait(left)
                elif not self.interrupted:
                    self.interrupted = True
                    _signal(self.pgid, signal.SIGINT)
                    self._deadline += self.grace
                else:
                    self.killed = True
                    if self.before_kill:
                        self.before_kill()
                    _signal(self.pgid, signal.SIGKILL)
                    self._deadline = None


_SENT = {"chars": 0, "dropped": 0}     # in the kernel: stream output since take_dropped()


def bound_messages(size: int = MESSAGE_CHARS, limit: int = CELL_OUTPUT_LIMIT) -> None:
    """In the kernel: send stdout and stderr in messages of at most `size` characters, and at
    most `limit` characters between two calls of take_dropped() (the grader's, after each cell);
    the rest is counted, not sent. ipykernel alone sends what was written in 0.2 s as one
    message (50 MB from a quick loop), faster than a grader reads them. `write` becomes a
    property of the stream class, because IPython sets each stream's `write` during a cell (to
    keep a copy in its history) and puts back the one it found after it."""
    cls = type(sys.stdout)
    if isinstance(vars(cls).get("write"), property):
        return
    write = cls.write

    def chunked(self, text, *args, **kwargs):
        state = vars(self)
        for start in range(0, len(text), size) or [0]:
            piece = text[start:start + size]
            room = max(0, limit - _SENT["chars"])
            _SENT["dropped"] += max(0, len(piece) - room)
            piece = piece[:room]
            if piece or not text:
                write(self, piece, *args, **kwargs)
            _SENT["chars"] += len(piece)
            state["_labkit_unsent"] = state.get("_labkit_unsent", 0) + len(piece)
            if state["_labkit_unsent"] >= size:
                state["_labkit_unsent"] = 0
                self.flush()            # sends what is buffered: one message
        return len(text)

    def get(self):
        return vars(self).get("_labkit_write") or types.MethodType(chunked, self)

    def put(self, value):       # IPython putting back the stream's own write: keep it chunked
        vars(self)["_labkit_write"] = None if getattr(value, "__func__", None) is write else value

    cls.write = property(get, put)


def take_dropped() -> int:
    """In the kernel: characters of output not sent since the last call; starts a new count."""
    dropped = _SENT["dropped"]
    _SENT.update(chars=0, dropped=0)
    return dropped


_SETUP = f"__import__('labkit.course.kernel', fromlist=['kernel']).bound_messages({MESSAGE_CHARS})"
_DROPPED = "__import__('labkit.course.kernel', fromlist=['kernel']).take_dropped()"


def _snippet(client, code: str, expressions: dict | None = None) -> dict:
    """Run `code` silently in the kernel; the reply's content (with the expressions' values)."""
    msg_id = client.kc.execute(code, silent=True, store_history=False, allow_stdin=False,
                               stop_on_error=False, user_expressions=expressions or {})
    reply = client.wait_for_reply(msg_id)
    return (reply or {}).get("content", {})


def _snippet_value(content: dict, key: str) -> str | None:
    value = content.get("user_expressions", {}).get(key, {})
    return value.get("data", {}).get("text/plain") if value.get("status") == "ok" else None


def shorten(text: str, limit: int = ERROR_TEXT_LIMIT) -> str:
    """`text` cut to about `limit` characters, saying how much was cut."""
    text = str(text)
    if len(text) <= limit:
        return text
    return f"{text[:limit]} ... ({len(text) - limit:,} more characters)"


def _errors(cell, reply: dict | None) -> dict | None:
    """The cell's error: its error output, else the reply's when its status is not "ok"."""
    sources = [o for o in cell.get("outputs", []) if o.get("output_type") == "error"]
    if not sources and reply is not None and reply.get("status") != "ok":
        sources = [{"ename": reply.get("ename") or reply.get("status") or "no reply",
                    "evalue": reply.get("evalue", ""), "traceback": reply.get("traceback", [])}]
    for out in sources:
        return {"ename": shorten(out.get("ename", ""), 200),
                "evalue": shorten(out.get("evalue", "")),
                "traceback": clean_traceback(list(out.get("traceback", []))[-200:])}
    return None


def _output_size(content: dict) -> int:
    if "text" in content:
        return len(content["text"])
    data = content.get("data", {})
    return sum(len(v) if isinstance(v, str) else len(str(v)) for v in data.values()) + \
        len(content.get("evalue", "")) + sum(len(t) for t in content.get("traceback", []))


def _client_class():
    """NotebookClient that keeps bounded outputs and each cell's reply, and a kernel manager
    that starts the kernel through labkit.runtime.guard.

    The kernel dies with the grader, however the grader ends: the guard is Linux's parent-death
    signal (SIGKILL when the grader's process is gone, even while the kernel holds the GIL in C
    code, where ipykernel's own parent poller cannot run; on Linux the kernel runs below
    `reaper_main`, which gets that signal and takes everything below it along), and a grader
    stopped by an exception (Ctrl-C, SIGTERM turned into one by `labkit grade`) kills the
    kernel's process group before anything else, then what it left (`Leftovers`). Each cell's
    execute-reply status is kept (`CellRun.status`): an error that a cell hid from its outputs
    (IPython's set_custom_exc) still counts, with the reply's name and value."""
    from jupyter_client import AsyncKernelManager
    from nbclient import NotebookClient

    from labkit.course import verdict
    from labkit.runtime import guard

    class GuardedKernelManager(AsyncKernelManager):
        def format_kernel_cmd(self, extra_arguments=None):
            cmd = super().format_kernel_cmd(extra_arguments)
            if not guard.enabled():
                return cmd
            if sys.platform.startswith("linux"):     # the guard's parent-death signal, and more
                return reaper_command(cmd)
            return guard.guarded_command(cmd)

    class Client(NotebookClient):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, kernel_manager_class=GuardedKernelManager,
                             store_widget_state=False, **kwargs)
            self.kept: dict[int, int] = {}
            self.dropped: dict[int, int] = {}
            self.replies: dict[int, dict] = {}
            self.records: dict[int, list] = {}
            self.record_chars: dict[int, int] = {}
            self.on_cell_executed = self._keep_reply

        def _keep_reply(self, cell, cell_index, execute_reply):
            content = (execute_reply or {}).get("content", {})
            self.replies[cell_index] = {k: content.get(k) for k in ("status", "ename", "evalue")
                                        if k in content}

        def output(self, outs, msg, display_id, cell_index):
            content = msg["content"]
            record = content.get("data", {}).get(verdict.MIME) if msg["msg_type"] == \
                "display_data" else None
            if record is not None:     # a check's record: kept apart, never shown
                kept = self.records.setdefault(cell_index, [])
                size = len(record) if isinstance(record, str) else 0
                self.record_chars[cell_index] = self.record_chars.get(cell_index, 0) + size
                if len(kept) > RECORDS_PER_CELL:
                    return None
                if (len(kept) == RECORDS_PER_CELL or size > 2 * verdict.RECORD_LIMIT
                        or self.record_chars[cell_index] > RECORD_CHARS_PER_CELL):
                    kept.append({"kind": "too many"})
                    return None
                try:
                    kept.append(json.loads(record))
                except (TypeError, ValueError):
                    kept.append({"kind": "unreadable"})
                return None
            size = _output_size(content)
            if msg["msg_type"] == "error":              # kept, shortened
                content["evalue"] = shorten(content.get("evalue", ""))
                content["traceback"] = [shorten(t, 2000)
                                        for t in content.get("traceback", [])[-50:]]
                return super().output(outs, msg, display_id, cell_index)
            room = min(CELL_OUTPUT_LIMIT - self.kept.get(cell_index, 0),
                       TOTAL_OUTPUT_LIMIT - sum(self.kept.values()))
            if size > room and "text" in content and room > 0:
                self.dropped[cell_index] = self.dropped.get(cell_index, 0) + size - room
                content["text"], size = content["text"][:room], room
            elif size > room:
                self.dropped[cell_index] = self.dropped.get(cell_index, 0) + size
                return None
            self.kept[cell_index] = self.kept.get(cell_index, 0) + size
            return super().output(outs, msg, display_id, cell_index)

    return Client


def clean_traceback(lines: list[str], keep: int = 25) -> str:
    text = _ANSI.sub("", "\n".join(lines))
    rows = [r for r in text.split("\n") if r.strip() and not set(r.strip()) <= {"-"}]
    return "\n".join(rows[-keep:])


def execute(nb, *, timeout: float, cwd: Path, before: dict | None = None,
            probe: str | None = None, on_cell=None, grace: float = KILL_GRACE) -> list[CellRun]:
    """Run every code cell of `nb` (outputs land in `nb`); one CellRun per cell of `nb`.

    Around the cells the caller may run snippets of its own (`before`: code per cell index, run
    silently first; `probe`: an expression evaluated after every cell, its repr kept), and is
    told about each cell as soon as it has run (`on_cell(index, run)`)."""
    from nbclient.exceptions import DeadKernelError
    from traitlets.config import Config

    runs = [CellRun() for _ in nb.cells]
    token = uuid.uuid4().hex
    with tempfile.TemporaryDirectory(prefix="labkit-grade-") as tmp:
        config = Config()
        if os.name == "posix":  # unix sockets: no "running over TCP without encryption" warning
            config.KernelManager.transport = "ipc"
            config.KernelManager.ip = os.path.join(tmp, "kernel")
        client = _client_class()(nb, config=config, kernel_name="python3", timeout=None,
                                 allow_errors=True, record_timing=False,
                                 resources={"metadata": {"path": str(cwd)}})
        # The kernel's own stdout/stderr (its log: "KeyboardInterrupt caught in kernel" when
        # jupyter_client interrupts it before shutting it down) go to a file, not the terminal.
        log_path = os.path.join(tmp, "kernel.log")
        try:
            with open(log_path, "w") as log:
                client.create_kernel_manager()
                client.start_new_kernel(env=kernel_env(token), stdout=log, stderr=log)
                client.start_new_kernel_client()
        except Exception as exc:  # noqa: BLE001 - no ipykernel, a broken environment, ...
            Leftovers(token).sweep()
            with open(log_path) as log:
                tail = log.read()[-1500:].strip()
            raise KernelStartError(f"could not start a Python kernel for {sys.executable} "
                                   f"({exc}); run `labkit doctor`"
                                   + (f"\nthe kernel said:\n{tail}" if tail else "")) from exc
        provisioner = client.km.provisioner
        pgid = getattr(provisioner, "pgid", None) or provisioner.process.pid
        # What the kernel starts: its token, and what is below its reaper (or the kernel).
        left = Leftovers(token, root=provisioner.process.pid)
        dog = _Watchdog(pgid, timeout, grace, before_kill=left.find)
        dog.start()
        try:
            with client.setup_kernel():
                try:
                    _run_cells(client, nb, runs, dog, before or {}, probe, on_cell,
                               DeadKernelError)
                    left.find()     # before the shutdown, which may have to kill the reaper
                except BaseException:   # stopped (Ctrl-C, SIGTERM): no graceful shutdown
                    left.find()
                    _signal(pgid, signal.SIGKILL)
                    _quiet_interrupted_tasks()
                    raise
        finally:
            dog.stop()
            left.find()
            _signal(pgid, signal.SIGKILL)   # anything the kernel left in its group
            left.sweep()                    # ... and outside it (a new session, a double fork)
    return runs


def _quiet_interrupted_tasks() -> None:
    """An interrupt leaves nbclient's cell task pending in its event loop, to end with
    DeadKernelError once the kernel is killed: mark that retrieved, so that asyncio does not
    print "Task exception was never retrieved" with a traceback on the way out."""
    import asyncio

    try:
        loop = asyncio.get_event_loop_policy().get_event_loop()
    except RuntimeError:
        return
    for task in asyncio.all_tasks(loop):
        task.add_done_callback(lambda t: t.cancelled() or t.exception())


def _truncated_note(dropped: int):
    from nbformat.v4 import new_output

    return new_output("stream", name="stdout",
                      text=f"\n(output truncated: {dropped / 1e6:.1f} MB not kept)\n")


def _run_cells(client, nb, runs, dog, before, probe, on_cell, dead_error) -> None:
    _snippet(client, _SETUP)
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        run = runs[i]
        try:
            for code in before.get(i, ()):
                content = _snippet(client, code)
                if content.get("status") == "error":
                    raise KernelStartError(f"the grader's set-up failed in the kernel: "
                                           f"{content.get('ename')}: {content.get('evalue')}")
            start = time.monotonic()
            dog.arm()
            try:
                client.execute_cell(cell, i)
            finally:
                dog.disarm()
                run.seconds = time.monotonic() - start
            run.ran = True
            reply = client.replies.pop(i, None)
            run.status = (reply or {}).get("status")
            run.error = _errors(cell, reply)
            run.records = client.records.pop(i, [])
            run.timed_out = dog.interrupted
            after = _snippet(client, "", {"dropped": _DROPPED, **({"v": probe} if probe else {})})
            run.probe = _snippet_value(after, "v")
            dropped = _snippet_value(after, "dropped")
            run.dropped = client.dropped.pop(i, 0) + (int(dropped) if (dropped or "").isdigit()
                                                      else 0)
            if run.dropped:
                cell.outputs.append(_truncated_note(run.dropped))
        except dead_error:
            run.killed = dog.killed
            run.timed_out = dog.interrupted
            run.died = not dog.killed
            if on_cell:
                on_cell(i, run)
            return
        if on_cell:
            on_cell(i, run)
