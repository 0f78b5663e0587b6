"""`labkit bench NAME` / `labkit bench all`: benchmarks that print figures (not timed tests).

A benchmark is a function `main(argv: list[str]) -> int` that prints its figures. It is found
in one of two ways, both without editing this file:
- a module `labkit/cli/bench_<name>.py` defining `main(argv)` (its docstring's first line is
  the help), e.g. labkit/cli/bench_launcher.py is `labkit bench launcher`;
- `register(name, func, help)` from code that runs before the command.
`labkit bench all` runs every benchmark in name order and fails if any fails.
"""
from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys
from typing import Callable

_REGISTRY: dict[str, tuple[Callable[[list[str]], int], str]] = {}


def register(name: str, func: Callable[[list[str]], int], help: str = "") -> None:
    """Make `labkit bench <name>` call func(argv)."""
    _REGISTRY[name] = (func, help)


def _discover() -> dict[str, tuple[Callable[[list[str]], int] | str, str]]:
    import labkit.cli
    found: dict = {}
    for mod in pkgutil.iter_modules(labkit.cli.__path__):
        if mod.name.startswith("bench_"):
            found[mod.name[len("bench_"):]] = (f"labkit.cli.{mod.name}", _first_line(mod))
    found.update(_REGISTRY)
    return dict(sorted(found.items()))


def _first_line(mod) -> str:
    """A benchmark module's help: its docstring's first line, read without importing it (the
    benchmarks import torch)."""
    import ast
    from pathlib import Path

    try:
        source = Path(mod.module_finder.find_spec(mod.name).origin).read_text(encoding="utf-8")
        doc = ast.get_docstring(ast.parse(source)) or ""
    except (OSError, SyntaxError, AttributeError):
        return ""
    return doc.strip().splitlines()[0] if doc.strip() else ""


def benchmarks() -> dict[str, Callable[[list[str]], int]]:
    """name -> function, registered or discovered (modules are imported here)."""
    out = {}
    for name, (target, _help) in _discover().items():
        if isinstance(target, str):
            target = importlib.import_module(target).main
        out[name] = target
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    names = ", ".join(_discover()) or "none"
    parser.add_argument("name", nargs="?", default=None,
                        help=f"a benchmark ({names}) or 'all'; none: list the benchmarks")
    parser.add_argument("bench_args", nargs=argparse.REMAINDER,
                        help="arguments for the benchmark (after --)")


def run(args) -> int:
    available = _discover()
    if args.name is None:
        print("benchmarks (labkit bench NAME [-- ARGS], or labkit bench all):")
        width = max((len(n) for n in available), default=0)
        for name, (_target, help_) in available.items():
            print(f"  {name:<{width}}  {help_}")
        return 0
    argv = [a for a in args.bench_args if a != "--"]
    if args.name != "all" and args.name not in available:
        print(f"labkit bench: unknown benchmark {args.name!r}; allowed: "
              f"{', '.join([*available, 'all'])}", file=sys.stderr)
        return 2
    funcs = benchmarks()
    names = list(funcs) if args.name == "all" else [args.name]
    status = 0
    for name in names:
        print(f"== labkit bench {name}", flush=True)
        code = int(funcs[name](argv if args.name != "all" else []) or 0)
        if code:
            print(f"labkit bench: {name} failed (exit {code})", file=sys.stderr)
            status = 1
    return status
