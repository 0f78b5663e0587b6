"""`labkit doctor [--json] [--no-launch] [-n N]`: is this machine ready for the course?
Exit code 0 when ready, 1 when a piece is missing (each listed with how to fix it)."""
from __future__ import annotations

import json
import sys


def add_arguments(parser) -> None:
    parser.add_argument("--json", action="store_true", help="print the report as JSON (for scripts)")
    parser.add_argument("--no-launch", action="store_true", help="skip starting local ranks (faster)")
    parser.add_argument("-n", "--nproc", type=int, default=2, help="ranks to start for the launch check (default 2)")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds the launch check may take (default 120)")


def run(args) -> int:
    from labkit.course.doctor import run_checks

    if args.nproc < 2:
        print(f"labkit doctor: --nproc={args.nproc} is too small; a collective needs at least 2 ranks",
              file=sys.stderr)
        return 2
    report = run_checks(launch=not args.no_launch, nproc=args.nproc, timeout=args.timeout)
    print(json.dumps(report.to_dict(), indent=2) if args.json else report.text())
    return 0 if report.ok else 1
