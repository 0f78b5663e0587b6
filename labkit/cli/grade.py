"""`labkit grade NOTEBOOK`: grade an exercise notebook in a fresh kernel (see labkit.course.grader).

Exit status: 0 when every check passes, 1 when any fails, 2 when the input cannot be graded
(missing file, not a notebook, no solutions notebook to grade against).
"""
from __future__ import annotations

import argparse
import json
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from labkit.course.grader import DEFAULT_TIMEOUT

    parser.add_argument("notebook", help="your exercise notebook, e.g. exercises/01_memory_math.ipynb")
    parser.add_argument("--template", metavar="PATH", default=None,
                        help="the solutions notebook to grade against "
                             "(default: solutions/<same name> of the course)")
    parser.add_argument("--timeout", metavar="S", type=float, default=DEFAULT_TIMEOUT,
                        help=f"seconds a cell may run before it is interrupted "
                             f"(default {DEFAULT_TIMEOUT})")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")


def run(args: argparse.Namespace) -> int:
    from labkit.course.grader import GradeInputError, grade_notebook

    if not args.timeout > 0:
        print(f"labkit grade: --timeout={args.timeout:g} must be a number of seconds > 0",
              file=sys.stderr)
        return 2
    try:
        report = grade_notebook(args.notebook, template=args.template, timeout=args.timeout)
    except GradeInputError as exc:
        print(f"labkit grade: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        print(report.format())
    return 0 if report.ok else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="labkit grade")
    add_arguments(parser)
    return run(parser.parse_args(argv))
