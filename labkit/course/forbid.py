"""What an exercise's answer may not use, enforced while `labkit grade` runs it.

An exercise cell of a solutions notebook declares in its metadata the callables that *are* the
answer (``{"labkit": {"forbid": ["labkit.memory.bytes_per_param"]}}``): a module, a function, a
class or a method, by dotted name. The functions of `labkit.course.reference` (what the checks
compare with) and this module are forbidden to every exercise (`ALWAYS`). Two lines of defence:
`scan`, in the grader before anything runs, and `install`, first thing in the grading kernel.

Not a sandbox (see labkit.course.grader): it stops the shortcut a learner would reach for.
"""
from __future__ import annotations

import ast
import functools
import importlib
import inspect
import json
import os
import re
import sys
import types

from labkit.course.grading import GradingError

ALWAYS = ("labkit.course.reference", "labkit.course.forbid")   # forbidden to every exercise
_SOLUTIONS_WORD = re.compile(r"(^|[\\/])solutions([\\/]|$)")
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")


class ForbiddenCall(GradingError):
    """An exercise used what it was asked to write (or read the solutions)."""

    def _title(self) -> str:
        return "answer not accepted"


def valid_name(name) -> bool:
    return isinstance(name, str) and bool(_NAME.match(name))


# ----------------------------------------------------------------------------- 1. static scan

def python_source(source: str) -> str:
    """`source` with IPython's syntax (magics, `!cmd`) turned into Python."""
    try:
        from IPython.core.inputtransformer2 import TransformerManager
        return TransformerManager().transform_cell(source)
    except Exception:  # noqa: BLE001 - no IPython, or a cell it cannot transform: scan as is
        return source


def _dotted(node, aliases: dict[str, str]) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    parts.append(aliases.get(node.id, node.id))
    return ".".join(reversed(parts))


def _within(name: str, forbidden: set[str]) -> str | None:
    for f in forbidden:
        if name == f or name.startswith(f + "."):
            return f
    return None


class _Scanner(ast.NodeVisitor):
    def __init__(self, forbid: set[str], exercise: str, defined: set[str]):
        self.forbid = forbid | set(ALWAYS)
        self.terminal = {f.rsplit(".", 1)[-1]: f for f in forbid if "." in f}
        self.exercise, self.defined = exercise, defined
        self.aliases: dict[str, str] = {}
        self.where: list[str] = []
        self.found: str | None = None

    def _report(self, verb: str, what: str) -> None:
        if self.found is None:
            who = f"your {self.where[-1]}" if self.where else f"your exercise {self.exercise}"
            self.found = f"{who} {verb} {what}; write it yourself"

    def _function(self, node):
        self.where.append(node.name)
        self.generic_visit(node)
        self.where.pop()

    visit_FunctionDef = visit_AsyncFunctionDef = _function

    def visit_Import(self, node):
        for a in node.names:
            hit = _within(a.name, self.forbid)
            if hit:
                self._report("imports", hit)
            self.aliases[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]

    def visit_ImportFrom(self, node):
        for a in node.names:
            full = f"{node.module}.{a.name}" if node.module and not node.level else a.name
            hit = _within(full, self.forbid) or (a.name == "*" and _within(node.module or "", self.forbid))
            if hit:
                self._report("imports", hit)
            self.aliases[a.asname or a.name] = full

    def visit_Attribute(self, node):
        name = _dotted(node, self.aliases)
        root = node
        while isinstance(root, ast.Attribute):
            root = root.value
        hit = name and _within(name, self.forbid)
        if hit:
            self._report("calls", hit)
        elif (node.attr in self.terminal and node.attr not in self.defined
              and not (isinstance(root, ast.Name) and root.id in self.aliases)):
            self._report("calls", self.terminal[node.attr])   # e.g. spec.params_per_layer()
        self.generic_visit(node)

    def visit_Name(self, node):
        full = self.aliases.get(node.id)
        hit = full and _within(full, self.forbid)
        if hit:
            self._report("calls", hit)
        elif node.id in self.terminal and node.id not in self.defined and full is None:
            self._report("calls", self.terminal[node.id])

    def visit_Constant(self, node):
        if isinstance(node.value, str) and _SOLUTIONS_WORD.search(node.value):
            self._report("reads", f"the solutions ({node.value!r})")


def _defined_names(tree) -> set[str]:
    """Names the learner's own code binds (definitions, assignments, arguments), not imports."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            out.add(node.id)
        elif isinstance(node, ast.arg):
            out.add(node.arg)
    return out


def scan(source: str, forbid, exercise: str) -> str | None:
    """Why the answer `source` of `exercise` is refused (one sentence), or None when it is not.

    The first line of defence, in the grader before anything runs: the answer's source (IPython
    magics transformed to Python) must not import or name a forbidden callable, nor name the
    ``solutions`` directory (reading or exec'ing the solutions notebook)."""
    try:
        tree = ast.parse(python_source(source))
    except SyntaxError:
        return None          # it runs, and fails with Python's own message
    scanner = _Scanner(set(forbid), exercise, _defined_names(tree))
    scanner.visit(tree)
    return scanner.found


# ------------------------------------------------------------------------- 2. in the kernel

_PLAN: dict[str, set[str]] = {}      # exercise -> forbidden dotted names
_LEARNER: dict[str, str] = {}        # code file name of an exercise cell -> exercise
_TRIPS: dict[str, str] = {}          # exercise -> the first refusal
_PROTECTED: list[str] = []
_CURRENT: list[str] = []             # the exercise that ran last


def _resolve(name: str):
    """(owner, attribute, object) for a dotted name, importing the longest module prefix."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ModuleNotFoundError as exc:
            if exc.name and (name + ".").startswith(exc.name + "."):
                continue                    # not a module: the prefix is (or a missing package)
            raise                           # a module that one imports is missing
        owner, attr = None, None
        for part in parts[i:]:
            if not hasattr(obj, part):
                raise ImportError(f"forbid: {name!r} does not exist ({obj!r} has no {part!r})")
            owner, attr, obj = obj, part, getattr(obj, part)
        return owner, attr, obj
    raise ImportError(f"forbid: cannot import {name!r}")


def _refuse(exercise: str, caller: str, name: str):
    who = f"your exercise {exercise}" if caller.startswith("<") else f"your {caller}"
    message = f"{who} calls {name}; write it yourself"
    _TRIPS.setdefault(exercise, message)
    raise ForbiddenCall(message)


def _guard(original, name: str):
    @functools.wraps(original)
    def guarded(*args, **kwargs):
        code = sys._getframe(1).f_code
        exercise = _LEARNER.get(code.co_filename)
        if exercise is not None and _within(name, _PLAN.get(exercise, set()) | set(ALWAYS)):
            _refuse(exercise, code.co_name, name)
        return original(*args, **kwargs)
    guarded.__labkit_forbidden__ = name
    return guarded


def _wrap(name: str) -> None:
    owner, attr, obj = _resolve(name)
    if isinstance(obj, types.ModuleType):
        for key, value in list(vars(obj).items()):
            if (inspect.isfunction(value) and value.__module__ == obj.__name__
                    and not key.startswith("_")):
                setattr(obj, key, _guard(value, f"{name}.{key}"))
        return
    if owner is None or getattr(obj, "__labkit_forbidden__", None):
        return
    if inspect.isclass(obj):        # keep the class itself (isinstance checks), guard __init__
        obj.__init__ = _guard(obj.__init__, name)
        return
    static = inspect.getattr_static(owner, attr)
    if isinstance(static, property):
        setattr(owner, attr, property(_guard(static.fget, name), static.fset, static.fdel))
    elif isinstance(static, (staticmethod, classmethod)):
        setattr(owner, attr, type(static)(_guard(static.__func__, name)))
    else:
        guarded = _guard(obj, name)
        setattr(owner, attr, guarded)
        if isinstance(owner, types.ModuleType):     # the same function re-exported elsewhere
            for module in list(sys.modules.values()):
                if getattr(module, "__dict__", {}).get(attr) is obj:
                    setattr(module, attr, guarded)


# audit events that name a path (argument positions), and what the learner's code does by them
_PATH_EVENTS = {"open": ((0,), "reads"), "os.truncate": ((0,), "truncates"),
                "os.remove": ((0,), "deletes"), "os.rmdir": ((0,), "deletes"),
                "shutil.rmtree": ((0,), "deletes"), "os.rename": ((0, 1), "moves"),
                "shutil.move": ((0, 1), "moves"), "os.link": ((0, 1), "links"),
                "os.symlink": ((0, 1), "links"), "os.mkdir": ((0,), "writes into"),
                "os.chmod": ((0,), "changes"), "os.utime": ((0,), "changes")}


def _protected(path) -> bool:
    if isinstance(path, int):
        return False
    try:
        path = os.path.abspath(os.fsdecode(path))
    except (TypeError, ValueError):
        return False
    return any(path == d or path.startswith(d + os.sep) for d in _PROTECTED)


def _audit(event: str, args) -> None:
    """Refuse opening, changing or deleting anything under the protected (solutions) dirs."""
    if event not in _PATH_EVENTS or not _PROTECTED:
        return
    positions, verb = _PATH_EVENTS[event]
    hits = [args[i] for i in positions if i < len(args) and _protected(args[i])]
    if not hits:
        return
    if event == "open" and isinstance(args[1], str) and set(args[1]) & set("wax+"):
        verb = "writes"
    exercise = _CURRENT[-1] if _CURRENT else "?"
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_filename in _LEARNER:
            exercise = _LEARNER[frame.f_code.co_filename]
            break
        frame = frame.f_back
    message = f"your exercise {exercise} {verb} the solutions ({hits[0]}); write it yourself"
    _TRIPS.setdefault(exercise, message)
    raise ForbiddenCall(message)


def install(plan: dict, protected=()) -> None:
    """Guard every callable of `plan` ({exercise: [dotted names]}) and the protected dirs.

    The second line of defence, first thing in the grading kernel: each forbidden callable is
    replaced by a wrapper that refuses calls made directly from an exercise cell's code (raising
    ``ForbiddenCall``, a GradingError: "your f calls X; write it yourself") and passes calls
    from anywhere else (the checks, labkit, torch) through; an audit hook refuses opening,
    truncating, moving or deleting anything under the protected (solutions) directories (the
    grader also keeps its own copy of the template). ``expect(exercise, source)``, sent before
    each exercise cell, tells the kernel which code is the learner's. Refusals are remembered
    (a try/except in the answer does not hide them): ``trips()`` returns them for the grader."""
    for exercise, names in plan.items():
        _PLAN[exercise] = set(names)
    for name in sorted({n for names in plan.values() for n in names} | set(ALWAYS)):
        _wrap(name)
    for d in protected:
        _PROTECTED.extend({os.path.abspath(d), os.path.realpath(d)})
    if _PROTECTED:
        sys.addaudithook(_audit)


def expect(exercise: str, source: str) -> None:
    """The next cell is `exercise`'s answer: code compiled from it is the learner's."""
    _CURRENT.append(exercise)
    try:
        ip = sys.modules["IPython"].get_ipython()
        name = ip.compile.get_code_name(source, ip.transform_cell(source), ip.execution_count)
    except (KeyError, AttributeError):   # not IPython, or one that names cells otherwise:
        return                           # the source scan still applies
    _LEARNER[name] = exercise


def trips() -> str:
    """The refusals so far, as JSON ({exercise: message})."""
    return json.dumps(_TRIPS)
