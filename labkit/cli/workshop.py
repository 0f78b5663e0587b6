"""`labkit workshop check|budget|handout`: an instructor's preflight for a room of machines, its
budget, and the learners' copy of the course.

    labkit workshop check                     # every check, one run of each lab program
    labkit workshop check --quick             # the machine, GPUs and 3 short labs (~30 s on CPU)
    labkit workshop check --labs all --json > $(hostname).json   # or --labs ddp,05,ddp:compare
    labkit workshop budget --learners 30 --gpus-per-learner 4 --times room/gpu-node.json
    labkit workshop handout ../learner-handout    # the course without solutions/ (nor answers)

`check` exits 0 ready, 1 not ready, 2 bad arguments; `handout DIR` writes the course without
solutions/, tests/, git history or reference answers (`labkit grade --reference`): docs/runtime.md.
"""
from __future__ import annotations

import argparse
import json
import sys
import time


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", metavar="ACTION")
    c = sub.add_parser("check", help="preflight this machine for a workshop (--json for a room)",
                       description="Preflight this machine: GPUs, NCCL, interconnect, all-reduce "
                                   "busbw, disk, and the course's labs with their times.")
    c.add_argument("--json", action="store_true", help="print the report as JSON")
    c.add_argument("--quick", action="store_true",
                   help="run only the short labs (hello, memory, semantics)")
    c.add_argument("--labs", default=None,
                   help="comma-separated: 'all', a lab (ddp), a module (05) or a run "
                        "(ddp:compare); default: one run of each lab program")
    c.add_argument("--nproc", type=int, default=None,
                   help="ranks for every lab instead of the notebooks' (the 3D lab keeps 8)")
    c.add_argument("--timeout", type=float, default=600.0,
                   help="seconds each lab may take (default 600)")
    b = sub.add_parser("budget", help="GPU-hours for N learners from measured lab times",
                       description="GPU-hours = learners x GPUs per learner x the labs' "
                                   "seconds x repeats / 3600.")
    b.add_argument("--learners", type=int, required=True, help="learners in the room")
    b.add_argument("--gpus-per-learner", type=int, default=1,
                   help="GPUs each learner holds (default 1)")
    b.add_argument("--times", required=True,
                   help="a `labkit workshop check --json` file measured on the workshop's "
                        "machine (its lab_seconds are used)")
    b.add_argument("--repeats", type=float, default=1.0,
                   help="times each learner runs each lab (default 1)")
    b.add_argument("--session-hours", type=float, default=None,
                   help="hours each learner holds the machine (the billed GPU-hours)")
    b.add_argument("--price", type=float, default=None, help="price of one GPU-hour")
    b.add_argument("--json", action="store_true", help="print the budget as JSON")
    h = sub.add_parser("handout", help="a learner's copy of the course: no solutions, no answers",
                       description="Write a learner's copy of the course to DIR (new or empty): "
                                   "the lessons, labs and exercises, without solutions/, tests/, "
                                   "git history or the checks' reference answers. Grade what "
                                   "learners hand in with `labkit grade --reference COURSE "
                                   "NOTEBOOK`.")
    h.add_argument("dir", metavar="DIR", help="where to write it: a new or empty folder outside "
                                              "the course")
    h.add_argument("--course", metavar="PATH", default=None,
                   help="the course copy to hand out (default: the one this labkit belongs to)")
    h.add_argument("--no-git", action="store_true",
                   help="no .git at all (default: a fresh repository whose one commit is the "
                        "handout, so a learner can `git checkout` an exercise afresh)")


def _check(args) -> int:
    from labkit.course import workshop

    if args.nproc is not None and not 2 <= args.nproc <= 64:
        print(f"labkit workshop check: --nproc={args.nproc}; allowed: 2 to 64 (a collective "
              "needs 2 ranks)", file=sys.stderr)
        return 2
    if not args.timeout > 0:
        print(f"labkit workshop check: --timeout={args.timeout}; allowed: seconds > 0",
              file=sys.stderr)
        return 2
    try:
        runs = workshop.select_labs(args.labs, quick=args.quick)
    except ValueError as exc:
        print(f"labkit workshop check: {exc}", file=sys.stderr)
        return 2

    def progress(run):
        if not args.json:
            print(f"  ... {run.name} ({run.nproc} ranks)", file=sys.stderr, flush=True)

    t0 = time.monotonic()
    try:
        report = workshop.preflight(runs, nproc=args.nproc, timeout=args.timeout,
                                    progress=progress)
    except Exception as exc:      # still a report (and valid --json) that says so
        report = workshop.failed_preflight(exc, time.monotonic() - t0)
    print(json.dumps(report.to_dict(), indent=2) if args.json else report.text())
    return 0 if report.ok else 1


def _budget(args) -> int:
    from dataclasses import asdict
    from labkit.course import workshop

    try:
        with open(args.times, encoding="utf-8") as f:
            measured = json.load(f)
        times = measured["lab_seconds"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        print(f"labkit workshop budget: --times={args.times!r} is not a `labkit workshop check "
              f"--json` report ({type(exc).__name__}: {exc}); allowed: the JSON that command "
              "prints", file=sys.stderr)
        return 2
    try:
        b = workshop.gpu_hours(args.learners, times, args.gpus_per_learner, args.repeats,
                               args.session_hours, args.price)
    except ValueError as exc:
        print(f"labkit workshop budget: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(asdict(b), indent=2))
    else:
        print(f"lab times from {args.times} ({measured.get('host', '?')}, "
              f"{measured.get('gpus', 0)} GPU(s))")
        print(workshop.format_budget(b))
    return 0


def _handout(args) -> int:
    from labkit.course import workshop

    try:
        made = workshop.make_handout(args.dir, args.course, git=not args.no_git)
    except ValueError as exc:
        print(f"labkit workshop handout: {exc}", file=sys.stderr)
        return 2
    print(made.text())
    return 0


def run(args) -> int:
    if args.action == "check":
        return _check(args)
    if args.action == "budget":
        return _budget(args)
    if args.action == "handout":
        return _handout(args)
    print("labkit workshop: say what to do; allowed: check, budget, handout (labkit workshop "
          "check --help)", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    """`python -m labkit.cli.workshop ...` (the same as `labkit workshop ...`)."""
    parser = argparse.ArgumentParser(prog="labkit workshop", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
