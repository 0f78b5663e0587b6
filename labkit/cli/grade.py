"""`labkit grade NOTEBOOK`: grade an exercise notebook in a fresh kernel (see labkit.course.grader).

    labkit grade exercises/03_ddp.ipynb                                   # a self-paced learner
    labkit grade --reference ~/course learner-handout/exercises/03_ddp.ipynb   # an instructor

`--reference DIR`: against DIR/solutions/<same name>, the instructor's copy (a learner handout,
`labkit workshop handout`, holds none). Each check is printed as soon as it is known; --json puts
the report on stdout. Exit status: 0 all pass, 1 any fails, 2 input that cannot be graded,
128 + the signal when stopped (the kernel and its labs are stopped first). docs/runtime.md.
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
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--template", metavar="PATH", default=None,
                       help="the solutions notebook to grade against "
                            "(default: solutions/<same name> of the course)")
    which.add_argument("--reference", metavar="DIR", default=None,
                       help="the instructor's copy of the course to grade against: "
                            "DIR/solutions/<same name>; for a notebook handed in from a learner "
                            "handout (labkit workshop handout), which has no solutions")
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
                                reference=getattr(args, "reference", None), on_start=on_start,
                                on_check=lambda check: show(started[0].check_lines(check)),
                                on_judge=lambda: show([
                                    "  computing the expected values: running the solutions "
                                    "once (kept for the next grades) ..."]))
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
