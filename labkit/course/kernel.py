"""Run a notebook's code cells in a fresh kernel of this interpreter, one at a time, under a hard
time limit: the engine of labkit.course.grader.

Each cell may run `timeout` seconds. At the limit the kernel is interrupted (SIGINT to its
process group, as Jupyter's stop button does). A cell still running `grace` seconds later (a loop
inside C code, code that ignores SIGINT) gets the kernel and its process group killed (SIGKILL);
that cell is reported as killed and the cells after it are not run. Labs the kernel started
with `run_lab` die with it (labkit.runtime.guard), so nothing is left running.

Around the cells the caller may run snippets of its own (``before``: code per cell index, run
silently first; ``probe``: an expression evaluated after every cell, its repr kept), and is told
about each cell as soon as it has run (``on_cell(index, run)``).
"""
from __future__ import annotations

import os
import re
import signal
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

KILL_GRACE = 5.0  # seconds between the interrupt at the limit and killing the kernel
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


def kernel_env() -> dict:
    env = dict(os.environ)
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


class _Watchdog(threading.Thread):
    """Interrupts the kernel at the deadline, kills its process group `grace` s later."""

    def __init__(self, pgid: int, timeout: float, grace: float):
        super().__init__(daemon=True, name="labkit-grade-watchdog")
        self.pgid, self.timeout, self.grace = pgid, timeout, grace
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
                    _signal(self.pgid, signal.SIGKILL)
                    self._deadline = None


def _snippet(client, code: str, expression: str | None = None) -> dict:
    """Run `code` silently in the kernel; the reply's content (with `expression`'s value)."""
    kwargs = {"user_expressions": {"v": expression}} if expression else {}
    msg_id = client.kc.execute(code, silent=True, store_history=False, allow_stdin=False,
                               stop_on_error=False, **kwargs)
    reply = client.wait_for_reply(msg_id)
    return (reply or {}).get("content", {})


def _snippet_value(content: dict) -> str | None:
    value = content.get("user_expressions", {}).get("v", {})
    return value.get("data", {}).get("text/plain") if value.get("status") == "ok" else None


def _errors(cell) -> dict | None:
    for out in cell.get("outputs", []):
        if out.get("output_type") == "error":
            return {"ename": out.get("ename", ""), "evalue": out.get("evalue", ""),
                    "traceback": clean_traceback(out.get("traceback", []))}
    return None


def clean_traceback(lines: list[str], keep: int = 25) -> str:
    text = _ANSI.sub("", "\n".join(lines))
    rows = [r for r in text.split("\n") if r.strip() and not set(r.strip()) <= {"-"}]
    return "\n".join(rows[-keep:])


def execute(nb, *, timeout: float, cwd: Path, before: dict | None = None,
            probe: str | None = None, on_cell=None, grace: float = KILL_GRACE) -> list[CellRun]:
    """Run every code cell of `nb` (outputs land in `nb`); one CellRun per cell of `nb`."""
    from nbclient import NotebookClient
    from nbclient.exceptions import DeadKernelError
    from traitlets.config import Config

    runs = [CellRun() for _ in nb.cells]
    with tempfile.TemporaryDirectory(prefix="labkit-grade-") as tmp:
        config = Config()
        if os.name == "posix":  # unix sockets: no "running over TCP without encryption" warning
            config.KernelManager.transport = "ipc"
            config.KernelManager.ip = os.path.join(tmp, "kernel")
        client = NotebookClient(nb, config=config, kernel_name="python3", timeout=None,
                                allow_errors=True, record_timing=False,
                                resources={"metadata": {"path": str(cwd)}})
        # The kernel's own stdout/stderr (its log: "KeyboardInterrupt caught in kernel" when
        # jupyter_client interrupts it before shutting it down) go to a file, not the terminal.
        log_path = os.path.join(tmp, "kernel.log")
        try:
            with open(log_path, "w") as log:
                client.create_kernel_manager()
                client.start_new_kernel(env=kernel_env(), stdout=log, stderr=log)
                client.start_new_kernel_client()
        except Exception as exc:  # noqa: BLE001 - no ipykernel, a broken environment, ...
            with open(log_path) as log:
                tail = log.read()[-1500:].strip()
            raise KernelStartError(f"could not start a Python kernel for {sys.executable} "
                                   f"({exc}); run `labkit doctor`"
                                   + (f"\nthe kernel said:\n{tail}" if tail else "")) from exc
        provisioner = client.km.provisioner
        pgid = getattr(provisioner, "pgid", None) or provisioner.process.pid
        dog = _Watchdog(pgid, timeout, grace)
        dog.start()
        try:
            with client.setup_kernel():
                _run_cells(client, nb, runs, dog, before or {}, probe, on_cell, DeadKernelError)
        finally:
            dog.stop()
            _signal(pgid, signal.SIGKILL)   # anything the kernel left in its group
    return runs


def _run_cells(client, nb, runs, dog, before, probe, on_cell, dead_error) -> None:
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
            run.error = _errors(cell)
            run.timed_out = dog.interrupted
            if probe:
                run.probe = _snippet_value(_snippet(client, "", probe))
        except dead_error:
            run.killed = dog.killed
            run.timed_out = dog.interrupted
            run.died = not dog.killed
            if on_cell:
                on_cell(i, run)
            return
        if on_cell:
            on_cell(i, run)
