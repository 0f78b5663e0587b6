"""Old module paths, importable for one release (0.2) with a DeprecationWarning.

labkit 0.1 kept every module at the top level; 0.2 groups them by layer (see labkit/__init__.py).
`import labkit.launch`, `from labkit.launch import run_lab` and `from labkit import grading` still
work and warn, naming the new path (`python -m` needs the new name). An alias is the new
module object itself (not a copy), so patching either name patches both. Remove in 0.3.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

MOVED = {
    "labkit.launch": "labkit.runtime.launch",
    "labkit.teardown": "labkit.runtime.teardown",
    "labkit.postmortem": "labkit.runtime.postmortem",
    "labkit.dist": "labkit.runtime.dist",
    "labkit.measure": "labkit.runtime.measure",
    "labkit.magic": "labkit.runtime.magic",
    "labkit.system": "labkit.runtime.system",
    "labkit._bootstrap": "labkit.runtime.bootstrap",
    "labkit.grader": "labkit.course.grader",
    "labkit.grading": "labkit.course.grading",
    "labkit.exercises": "labkit.course.exercises",
    "labkit.doctor": "labkit.course.doctor",
    "labkit.commands": "labkit.cli",
    "labkit.commands.bench": "labkit.cli.bench",
    "labkit.commands.course": "labkit.cli.course",
    "labkit.commands.doctor": "labkit.cli.doctor",
    "labkit.commands.grade": "labkit.cli.grade",
    "labkit.commands.mem": "labkit.cli.mem",
    "labkit.commands.run": "labkit.cli.run",
    "labkit.bench_collectives": "labkit.cli.bench_collectives",
    "labkit.bench_launcher": "labkit.cli.bench_launcher",
}


def _warn(old: str, new: str) -> None:
    warnings.warn(f"{old} moved to {new} in labkit 0.2; the old name goes in 0.3",
                  DeprecationWarning, stacklevel=3)


def resolve(attr: str):
    """`labkit.<attr>` for an old top-level module name (e.g. `from labkit import grading`)."""
    old = f"labkit.{attr}"
    if old not in MOVED:
        return None
    _warn(old, MOVED[old])
    module = importlib.import_module(MOVED[old])
    sys.modules.setdefault(old, module)
    setattr(sys.modules["labkit"], attr, module)    # found directly next time: one warning
    return module


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        if fullname not in MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec):
        return None     # a placeholder module; exec_module swaps in the real one

    def exec_module(self, module):
        old = module.__name__
        new = MOVED[old]
        _warn(old, new)
        # The import system returns whatever sys.modules holds under the old name after this
        # call, so the real module (its __spec__ untouched) is what the caller gets.
        sys.modules[old] = importlib.import_module(new)


_FINDER = _Alias()


def install() -> None:
    # First in line: otherwise `labkit.commands.grade` would be found again through the aliased
    # package's __path__ and loaded a second time under the old name.
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)
