"""`labkit grade NOTEBOOK`: grade an exercise notebook in a fresh kernel (see labkit.course.grader).

Each check's result is printed as soon as it is known, with the seconds it took; the summary
follows. With --json the progress goes to stderr and the report, as JSON, to stdout.
Exit status: 0 when every check passes, 1 when any fails, 2 when the input cannot be graded
(missing file, not a notebook, a lesson instead of an exercise file, no solutions notebook).
"""
from __future__ import annotations

import argparse
import json
import sys


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

    try:
        report = grade_notebook(args.notebook, template=args.template, timeout=args.timeout,
                                on_start=on_start,
                                on_check=lambda check: show(started[0].check_lines(check)))
    except GradeInputError as exc:
        print(f"labkit grade: {exc}", file=sys.stderr)
        return 2
    show(report.footer())
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
    return 0 if report.ok else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="labkit grade")
    add_arguments(parser)
    return run(parser.parse_args(argv))
