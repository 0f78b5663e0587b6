"""What a benchmark that runs one lab needs (`labkit bench ddp`, `labkit bench zero`): the
common flags (--nproc, --steps, --timeout; every other flag goes to the lab) and the run.

    parser = lab_bench_parser("labkit bench zero", __doc__, steps=12, least=4,
                              why="2 warm-up, 1 counted, then the timed ones")
    args, lab_args = parse(parser, argv)
    result = run_bench_lab(parser.prog, "labkit.labs.zero", args, ["--steps", str(args.steps),
                                                                   *lab_args])
    if result is None: return 1         # the lab failed; what happened is printed
"""
from __future__ import annotations

import argparse


def lab_bench_parser(prog: str, doc: str, steps: int, least: int,
                     why: str) -> argparse.ArgumentParser:
    """A parser with --nproc (default: one per GPU, else 2), --steps (default `steps`, at least
    `least`, `why` says what the first ones are for) and --timeout."""
    parser = argparse.ArgumentParser(prog=prog, description=doc,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=None,
                        help="ranks (default: one per GPU, else 2)")
    parser.add_argument("--steps", type=int, default=steps,
                        help=f"steps in all, >= {least}: {why} (default {steps})")
    parser.add_argument("--timeout", type=float, default=600,
                        help="seconds before the ranks are stopped (default 600)")
    parser.set_defaults(_least=least, _why=why)
    return parser


def parse(parser: argparse.ArgumentParser, argv) -> tuple[argparse.Namespace, list[str]]:
    """(the bench's flags, the lab's flags); --steps below its least is refused, with why."""
    args, lab_args = parser.parse_known_args(argv or [])
    if args.steps < args._least:
        parser.error(f"argument --steps: {args.steps} is too few; allowed: >= {args._least} "
                     f"({args._why})")
    return args, lab_args


def run_bench_lab(prog: str, lab: str, args, lab_args: list[str]):
    """run_lab(lab) on --nproc ranks (default: one per GPU when there are 2 or more, else 2);
    None, with the failure printed, if the lab failed."""
    from labkit.runtime import system
    from labkit.runtime.launch import LabError, run_lab

    gpus = system.cuda_device_count()
    nproc = args.nproc or (gpus if gpus >= 2 else 2)
    try:
        return run_lab(lab, nproc=nproc, timeout=args.timeout, quiet=True, args=lab_args)
    except LabError as exc:
        print(f"{prog}: {exc}")
        return None
