"""Live progress of a long call (a lab, a diagnosis case), so a running lab never looks hung.

    with progress.task("lab pp --part torch on 4 ranks", expected=40.2):
        ...

In a Jupyter kernel: one line, updated in place about once a second (IPython display_id) by a
thread, with what runs, the seconds so far and the seconds on a 2-core laptop (lab_times); at
the end replaced by the total time. A task inside another (the labs of a diagnosis case) shows
on its parent's line. In a terminal: one updating line, erased at the end, if stdout is a TTY
and the caller asks (run_lab with quiet=True), else nothing.
"""
from __future__ import annotations

import contextlib
import sys
import threading
import time
import uuid

UPDATE_EVERY = 1.0      # seconds between two updates of the line
SLOW = 1.5              # a run this many times its laptop time (+ 5 s) says so, and why

_here = threading.local()      # per thread: .line, the outermost task's _Line, or None


def _kernel_shell():
    ipython = sys.modules.get("IPython")   # never imported here: not loaded, not a kernel
    shell = ipython.get_ipython() if ipython is not None else None
    return shell if getattr(shell, "kernel", None) is not None else None


def _isatty(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):     # replaced or closed streams
        return False


def _about(seconds: float, expected: float | None) -> str:
    if expected is None:
        return f"{seconds:.0f} s"
    if seconds > SLOW * expected + 5:
        return (f"{seconds:.0f} s, longer than the {expected:.0f} s of a 2-core laptop (a busy "
                "machine, or the warm pool starting)")
    return f"{seconds:.0f} s (about {expected:.0f} s on a 2-core laptop)"


class _Task:
    def __init__(self, label: str, expected: float | None):
        self.label, self.expected = label, expected
        self.t0 = time.monotonic()
        self.done: list[str] = []           # finished sub-tasks' total lines

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def running(self) -> str:
        return f"{self.label}: {_about(self.elapsed(), self.expected)}"


class _Line:
    """The outermost task's line and the tasks running inside it: shown in a kernel's display or
    on a TTY (else nowhere), redrawn every UPDATE_EVERY s by a thread while the tasks run."""

    def __init__(self, terminal: bool):
        self.shell = _kernel_shell()
        self.tty = self.shell is None and terminal and _isatty(sys.stdout)
        self.stack: list[_Task] = []
        self.id = f"labkit-progress-{uuid.uuid4().hex}"
        self.shown = False
        self.lock = threading.Lock()
        self.stopped = threading.Event()
        self.ticker = None
        if self.shell is not None or self.tty:
            self.ticker = threading.Thread(target=self._tick, daemon=True,
                                           name="labkit-progress")

    def text(self) -> str:
        outer, inner = self.stack[0], self.stack[1:]
        text = "running " + outer.running()
        if inner:
            text += " | now " + " > ".join(t.running() for t in inner)
        elif outer.done:
            text += f" | last: {outer.done[-1]}"
        return text

    def redraw(self) -> None:
        with self.lock:
            if self.stack and not self.stopped.is_set():
                self._show(self.text())

    def close(self, text: str) -> None:
        with self.lock:
            self.stopped.set()
            self._show(text, final=True)
        if self.ticker is not None and self.ticker.is_alive():
            self.ticker.join(timeout=2 * UPDATE_EVERY)

    def _tick(self) -> None:
        while not self.stopped.wait(UPDATE_EVERY):
            self.redraw()

    def _show(self, text: str, final: bool = False) -> None:
        try:
            if self.shell is not None:
                from IPython.display import display, update_display
                bundle = {"text/plain": text}
                if self.shown:
                    update_display(bundle, raw=True, display_id=self.id)
                else:
                    display(bundle, raw=True, display_id=self.id)
                    self.shown = True
            elif self.tty:           # the line goes at the end: a terminal's output stays as it was
                sys.stdout.write("\r" + ("" if final else text) + "\x1b[K")
                sys.stdout.flush()
        except Exception:          # noqa: BLE001 - a progress line never stops a lab
            self.shell, self.tty = None, False


def tick() -> None:
    """Redraw this thread's line now (it is redrawn every second anyway)."""
    line = getattr(_here, "line", None)
    if line is not None:
        line.redraw()


@contextlib.contextmanager
def task(label: str, expected: float | None = None, *, terminal: bool = True):
    """Show `label` running for the duration of the `with`, then one line with its total time
    (or how it ended: failed, timed out, stopped). expected: seconds on a 2-core laptop, if
    known. terminal: also show an updating line when stdout is a TTY (not in a kernel)."""
    me = _Task(label, expected)
    line = getattr(_here, "line", None)
    outermost = line is None
    if outermost:
        line = _here.line = _Line(terminal)
    with line.lock:
        line.stack.append(me)
    line.redraw()
    if outermost and line.ticker is not None:
        line.ticker.start()
    ended = "done in"
    try:
        yield me
    except KeyboardInterrupt:
        ended = "stopped after"
        raise
    except BaseException as exc:
        ended = "timed out after" if getattr(exc, "reason", None) == "timeout" else "failed after"
        raise
    finally:
        total = f"{label}: {ended} {me.elapsed():.1f} s"
        with line.lock:
            line.stack.pop()
            if not outermost:
                line.stack[-1].done.append(total)
        if outermost:
            _here.line = None
            labs = f" ({len(me.done)} labs)" if len(me.done) > 1 else ""
            line.close(total + labs)
        else:
            line.redraw()
