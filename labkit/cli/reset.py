"""`labkit reset exercises/NN_name.ipynb [--yes]`: give a learner a fresh exercise notebook.

    labkit reset exercises/03_ddp.ipynb          # asks first; your file is kept in a backup
    labkit reset exercises/03_ddp.ipynb --yes    # no question (scripts, a room of machines)

The learner's file is copied to exercises/.backup/NN_name.<YYYYmmdd-HHMMSS>.ipynb (a folder git
ignores), then replaced by the exercise generated from solutions/NN_name.ipynb (the same bytes
`python -m labkit.course.exercises` writes), or, where that cannot be rendered, by the copy git
has committed. Only the course's exercise files can be reset: a path outside exercises/ or a
name without a solutions notebook is refused, with the allowed names. Exit status: 0 done (or
nothing to do), 1 nothing to restore from, 2 refused.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("notebook", help="the exercise notebook to reset, e.g. "
                                         "exercises/03_ddp.ipynb")
    parser.add_argument("--yes", "-y", action="store_true",
                        help="do not ask (the backup is kept all the same)")
    parser.add_argument("--course", default=None,
                        help="the course folder holding exercises/ and solutions/ (default: "
                             "the checkout labkit runs from)")


def _allowed(solutions: Path) -> list[str]:
    from labkit.course.exercises import solution_files
    return [p.name for p in solution_files(solutions)] if solutions.is_dir() else []


def resolve(notebook: str, course: Path) -> Path:
    """The exercise file `notebook` names, inside course/exercises/; ValueError saying what is
    allowed otherwise."""
    exercises, solutions = (course / "exercises").resolve(), (course / "solutions").resolve()
    names = _allowed(solutions)
    allowed = ("allowed: " + ", ".join(f"exercises/{n}" for n in names)) if names else \
        f"no solutions notebooks found in {solutions}"
    given = Path(notebook).expanduser()
    candidates = [given.resolve()] + ([] if given.is_absolute() else [(course / given).resolve()])
    inside = next((p for p in candidates if p.parent == exercises), None)
    if inside is None:
        raise ValueError(f"{notebook!r} is not a file in the course's exercises folder "
                         f"({exercises}); {allowed}")
    if inside.name not in names:
        raise ValueError(f"{notebook!r} is not one of the course's exercise notebooks; {allowed}")
    return inside


def fresh_text(target: Path, course: Path) -> tuple[str | None, str]:
    """(the exercise as it should be, where it came from); (None, why) when neither the
    generator nor git can give it."""
    from labkit.course import committed
    from labkit.course.exercises import NotebookFormatError, render_path

    sol = course / "solutions" / target.name
    try:
        return render_path(sol), f"generated from {sol}"
    except (OSError, NotebookFormatError, ValueError) as exc:
        why = f"{sol} could not be rendered ({exc})"
    versions = committed.committed_versions(target, sol)
    if versions:
        return versions[0], f"git's committed copy ({why})"
    return None, f"{why}, and git has no committed copy"


def run(args) -> int:
    from labkit.course import committed
    from labkit.course.exercises import REPO_ROOT

    course = Path(args.course).expanduser().resolve() if args.course else REPO_ROOT
    try:
        target = resolve(args.notebook, course)
    except ValueError as exc:
        print(f"labkit reset: {exc}", file=sys.stderr)
        return 2
    text, source = fresh_text(target, course)
    if text is None:
        print(f"labkit reset: nothing to restore {target} from: {source}", file=sys.stderr)
        return 1
    current = target.read_text(encoding="utf-8") if target.exists() else None
    if current == text:
        print(f"{target} is already the fresh exercise ({source}); nothing to do")
        return 0
    if current is not None and not args.yes:
        if not sys.stdin.isatty():
            print(f"labkit reset: {target} holds your work; add --yes to reset it (a copy is "
                  f"kept in {target.parent / committed.BACKUP_DIR}/)", file=sys.stderr)
            return 2
        answer = input(f"Reset {target}? Your version is kept in "
                       f"{target.parent / committed.BACKUP_DIR}/. [y/N] ")
        if answer.strip().lower() not in ("y", "yes"):
            print("labkit reset: left as it was")
            return 0
    try:
        backup = committed.keep_copy(target) if current is not None else None
    except ValueError as exc:
        print(f"labkit reset: {exc}; {target.name} was left as it was", file=sys.stderr)
        return 2
    target.write_text(text, encoding="utf-8")
    if backup is not None:
        print(f"kept your version of {target.name} in {backup}")
    print(f"wrote {target} afresh ({source})")
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m labkit.cli.reset ...` (the same as `labkit reset ...`)."""
    parser = argparse.ArgumentParser(prog="labkit reset", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
