"""`labkit grade NOTEBOOK`: grade an exercise notebook in a fresh kernel (see labkit.course.grader).

Each check's result is printed as soon as it is known, with the seconds it took; the summary
follows. With --json the progress goes to stderr and the report, as JSON, to stdout.
Exit status: 0 when every check passes, 1 when any fails, 2 when the input cannot be graded
(missing file, not a notebook, a damaged one, a lesson instead of an exercise file, no solutions
notebook), 128 + the signal when stopped by Ctrl-C (SIGINT) or SIGTERM (what a CI timeout
sends): the kernel, and any lab it started, are stopped first. Killed by SIGKILL, the grader
takes them with it too (labkit.course.kernel).
"""
from __future__ import annotations

import argparse
import json
import signal
import sys
import threading


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from labkit.course.grader import DEFAULT_TIMEOUT
    from labkit.course.kernel import KILL_GRACE

    parser.add_argument("notebook", help="your exercise notebook, e.g. exercises/01_memory_math.ipynb")
    parser.add_argument("--template", metavar="PATH", default=None,
                        help="the solutions notebook to grade against "
                             "(default: solutions/<same name> of the course)")
    parser.add_argument("--timeout", metavar="S", type=float, default=DEFAULT_TIMEOUT,
                        help=f"seconds a cell may run before it is interrupted; {KILL_GRACE:g} s "
                             f"later the kernel is killed if it still runs "
                             f"(default {DEFAULT_TIMEOUT})")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")


def run(args: argparse.Namespace) -> int:
    from labkit.course.grader import GradeInputError, grade_notebook

    if not args.timeout > 0:
        print(f"labkit grade: --timeout={args.timeout:g} must be a number of seconds > 0",
              file=sys.stderr)
        return 2
    out = sys.stderr if args.json else sys.stdout
    started = []

    def show(lines):
        print("\n".join(lines), file=out, flush=True)

    def on_start(report):
        started.append(report)
        show(report.header())

    caught: list[int] = []
    previous = _stop_on_sigterm(caught)
    try:
        report = grade_notebook(args.notebook, template=args.template, timeout=args.timeout,
                                on_start=on_start,
                                on_check=lambda check: show(started[0].check_lines(check)))
    except GradeInputError as exc:
        print(f"labkit grade: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        sig = signal.Signals(caught[0] if caught else signal.SIGINT)
        print(f"labkit grade: stopped by {sig.name}; the kernel and any lab it started were "
              "stopped, nothing was graded", file=sys.stderr)
        return 128 + sig
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    show(report.footer())
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
    return 0 if report.ok else 1


def _stop_on_sigterm(caught: list[int]):
    """SIGTERM stops grading the way Ctrl-C does (the kernel is killed at once, temporary files
    removed), instead of ending the process where it stands. Returns the handler it replaced
    (None off the main thread, where handlers cannot be set)."""
    if threading.current_thread() is not threading.main_thread():
        return None

    def stop(signum, frame):
        caught.append(signum)
        raise KeyboardInterrupt

    return signal.signal(signal.SIGTERM, stop)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="labkit grade")
    add_arguments(parser)
    return run(parser.parse_args(argv))
