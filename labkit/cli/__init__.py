"""The `labkit` command (layer 7; also `python -m labkit`).

Each subcommand is a module here (`labkit.cli.<name>`) providing `add_arguments(parser)` and
`run(args) -> int`, holding its own command-line logic; the machinery it drives lives in the
layer it belongs to (the grader and doctor in course/, the launcher in runtime/). Modules are
imported only when their command runs, so `labkit --help` and `labkit mem` stay fast (no torch).
`bench_<name>.py` modules are the benchmarks `labkit bench <name>` finds.

May import: anything in labkit. Nothing in labkit imports cli/.
"""
from __future__ import annotations

import argparse
import importlib
import sys

from labkit import __version__

# name -> (module under labkit.cli, one-line help)
COMMANDS = {
    "doctor": ("doctor", "check that this machine is ready for the course (--json for scripts)"),
    "mem": ("mem", "per-GPU training memory of a model: labkit mem llama2-70b --zero 3 --dp 64"),
    "plan": ("plan", "lay a model out on a cluster: labkit plan llama3-405b --gpus 16384"),
    "run": ("run", "run a lab under torchrun: labkit run hello -n 2"),
    "bench": ("bench", "benchmarks that print figures: labkit bench collectives"),
    "quiz": ("quiz", "interview questions in the terminal: labkit quiz --topic pp --count 10"),
    "grade": ("grade", "grade an exercise notebook: labkit grade exercises/01_memory_math.ipynb"),
    "course": ("course", "start JupyterLab on the course"),
    "calculators": ("calculators", "the course's calculators as a standalone web app (Voila)"),
    "workshop": ("workshop", "instructors: preflight, GPU-hour budget, a learner handout without answers"),
    "reset": ("reset", "restore a fresh exercise notebook, keeping a backup: labkit reset exercises/03_ddp.ipynb"),
}


def _load(module: str):
    return importlib.import_module(f"labkit.cli.{module}")


def build_parser(commands: list[str] | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="labkit",
        description="The Distributed Training Lab: calculators, labs and grading.",
    )
    parser.add_argument("--version", action="version", version=f"labkit {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_) in COMMANDS.items():
        p = sub.add_parser(name, help=help_, description=help_)
        # Only the command being run gets its full argument set (its module is imported then).
        if commands is not None and name in commands:
            _load(module).add_arguments(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    name = next((a for a in argv if not a.startswith("-")), None)
    if name is not None and name not in COMMANDS:
        allowed = ", ".join(COMMANDS)
        print(f"labkit: unknown command {name!r}; allowed: {allowed}", file=sys.stderr)
        return 2
    try:
        parser = build_parser([name] if name else [])
    except ModuleNotFoundError as exc:
        print(f"labkit: command {name!r} is not available in this version ({exc})", file=sys.stderr)
        return 2
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    return int(_load(COMMANDS[args.command][0]).run(args) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
