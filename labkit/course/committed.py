"""What git has of a file, and copies kept before overwriting one: exercises/ is where learners
write their answers, so the exercise generator and its sync check (labkit.course.exercises) judge
an exercise file by its committed copies, never by the learner's working copy alone, and never
overwrite a file with edits of its own without keeping a copy first.

Outside a git checkout (a downloaded archive), or where git is missing or refuses the
repository, every function here answers "nothing committed" and the callers fall back to the
working files.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

BACKUP_DIR = ".backup"


def _git(directory: Path, *args: str) -> str | None:
    """git's stdout for `args` run in `directory`, or None when git fails or is missing."""
    try:
        out = subprocess.run(["git", "-C", str(directory), *args], capture_output=True,
                             timeout=20, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return None
    try:
        return out.stdout.decode("utf-8")
    except UnicodeDecodeError:
        return None


def committed_versions(path: Path | str, source: Path | str | None = None) -> list[str]:
    """The texts of `path` as committed at HEAD and, when `source` is given, in the last commit
    that changed `source` (where a maintainer regenerated `path` from it): a learner who commits
    answers moves HEAD, not that commit. Empty outside git or for an untracked file."""
    path = Path(path).resolve()
    versions = []
    head = _git(path.parent, "show", f"HEAD:./{path.name}")
    if head is not None:
        versions.append(head)
    if source is not None:
        source = Path(source).resolve()
        commit = (_git(source.parent, "log", "-1", "--format=%H", "--", source.name) or "").strip()
        if commit:
            then = _git(path.parent, "show", f"{commit}:./{path.name}")
            if then is not None and then not in versions:
                versions.append(then)
    return versions


def tracked_names(directory: Path | str, source_dir: Path | str | None = None) -> set[str] | None:
    """Names of the files directly in `directory` as committed in the last commit that changed
    `source_dir` (at HEAD when none is given or it has no commit): files a learner adds later,
    committed or not, are not among them. None outside a git checkout."""
    commit = "HEAD"
    if source_dir is not None:
        commit = (_git(Path(source_dir), "log", "-1", "--format=%H", "--", ".") or "").strip() \
            or "HEAD"
    out = _git(Path(directory), "ls-tree", "-z", "--name-only", commit, ".")
    if out is None:
        return None
    return {name for name in out.split("\0") if name and "/" not in name}


def keep_copy(path: Path | str) -> Path:
    """Copy `path` to `.backup/<stem>.<YYYYmmdd-HHMMSS>.ipynb` beside it (a folder git ignores)
    and return the copy's path."""
    path = Path(path)
    folder = path.parent / BACKUP_DIR
    ignore = folder / ".gitignore"
    for link in (folder, ignore):      # never write through a link: it may leave the course
        if link.is_symlink():
            raise ValueError(f"{link} is a link (to {os.readlink(link)}); labkit writes backups "
                             f"only into a real folder {BACKUP_DIR}/ beside the exercise: remove "
                             "the link and try again")
    folder.mkdir(exist_ok=True)
    if not ignore.exists():
        ignore.write_text("# copies of edited exercise files, kept before regenerating them\n*\n")
    stamp = time.strftime("%Y%m%d-%H%M%S")
    target = folder / f"{path.stem}.{stamp}{path.suffix}"
    n = 1
    while os.path.lexists(target):
        n += 1
        target = folder / f"{path.stem}.{stamp}-{n}{path.suffix}"
    shutil.copy2(path, target)
    return target
