"""What an exercise's answer may not use, enforced while `labkit grade` runs it.

An exercise cell of a solutions notebook declares in its metadata the callables that *are* the
answer (``{"labkit": {"forbid": ["labkit.memory.bytes_per_param"]}}``): a module, a function, a
class or a method, by dotted name. The functions of `labkit.course.reference` (what the checks
compare with) and this module are forbidden to every exercise (`ALWAYS`). Three lines of
defence: `scan` in the grader, `install` in the grading kernel, `install_ranks` in each rank a
check starts on the learner's code (with `rank_plan`'s list). A guard keeps no way back to what
it guards (`_vault`). Not a sandbox: it stops the shortcut a learner would reach for.
"""
from __future__ import annotations

import _thread
import ast
import builtins
import enum
import importlib
import inspect
import json
import os
import re
import sys
import types

from labkit.course import fence
from labkit.course.fence import ForbiddenCall  # noqa: F401 (the refusal, raised here too)

# forbidden to every exercise: the checks' answers, the grader's guards, the quizzes' answers
ALWAYS = ("labkit.course.reference", "labkit.course.forbid", "labkit.quiz")
RANK_PROTECTED = "LABKIT_RANK_PROTECTED"   # labkit.labs.common.exercise's: the closed dirs (JSON)
_SOLUTIONS_WORD = re.compile(r"(^|[\\/])solutions([\\/]|$)")
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")
# what reaches past a guard to the function it guards (or to where the guards keep it)
INTROSPECTION = fence.INTROSPECTION


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
        if node.attr in INTROSPECTION:
            self._report("reads", f"{node.attr} (a way around the grader's guards)")
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
        hit = (isinstance(node.value, str) and "." in node.value and valid_name(node.value)
               and _within(node.value, self.forbid))
        if hit:                             # sys.modules["labkit.course.reference"], ...
            self._report("imports", hit)


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
_CURRENT: list[str] = []             # the exercise that ran last
_WHOLE: dict[str, set[str]] = {}     # exercise -> source files of the modules it forbids whole
_WHOLE_ANY: set[str] = set()         # ... of any exercise
_REPLACED: dict[int, tuple] = {}     # id(original) -> (original, guard), until install() ends
_RANKS: list[str] = []               # in a rank (install_ranks): the learner's definition
_THREADS: set[int] = set()           # in a rank: threads that the learner's code started


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


def _refuse(exercise: str, message: str):
    _TRIPS.setdefault(exercise, message)
    raise ForbiddenCall(message)


def _learner_frame(frame):
    """The innermost frame of the learner's code on the stack from `frame` up, or None."""
    while frame is not None and frame.f_code.co_filename not in _LEARNER:
        frame = frame.f_back
    return frame


def _police(name: str, frame) -> None:
    """Refuse the call of the forbidden `name` from `frame` (its caller) when the learner's code
    is anywhere on the stack (labkit, torch, functools or a callback between do not launder
    it), or started this thread; in the grading kernel, unless it passes through a module that
    the exercise forbids no part of (`_WHOLE`: that module's own calls)."""
    if _RANKS:
        f = _learner_frame(frame)
        if f is None and _thread.get_ident() not in _THREADS:
            return
        caller = "<thread>" if f is None else getattr(f.f_code, "co_qualname", f.f_code.co_name)
        who = f"your {_RANKS[0]}" if caller.startswith("<") else f"your {caller}"
        _refuse(_RANKS[0], f"{who} calls {name}; write it yourself")
    f, skipped = frame, []
    while f is not None and f.f_code.co_filename not in _LEARNER:
        if f.f_code.co_filename in _WHOLE_ANY:
            skipped.append(f.f_code.co_filename)
        f = f.f_back
    if f is None:
        if _thread.get_ident() not in _THREADS:
            return
        exercise, caller = _current(), "<thread>"
    else:
        exercise, caller = _LEARNER[f.f_code.co_filename], f.f_code.co_name
    if any(s not in _WHOLE.get(exercise, ()) for s in skipped):
        return                          # through a module this exercise may use
    if _within(name, _PLAN.get(exercise, set()) | set(ALWAYS)):
        who = f"your exercise {exercise}" if caller.startswith("<") else f"your {caller}"
        _refuse(exercise, f"{who} calls {name}; write it yourself")


def _vault():
    """(keep, enter). The originals the guards stand for live in this closure only: a guard
    holds a number (its `__closure__`), its `__globals__` hold `enter` alone, and it has no
    `__wrapped__`, so no attribute of a guard, nor of what it holds, is the original; `enter`
    answers a guard only (its caller's code is the guards'), after `_police` let its caller
    through."""
    originals: dict[int, tuple] = {}

    def keep(original, name: str) -> int:
        key = len(originals)
        originals[key] = (original, name)
        return key

    def enter(key: int):
        guard = sys._getframe(1)
        if guard.f_code is not _GUARD_CODE:
            who = _learner_frame(guard)
            exercise = _LEARNER[who.f_code.co_filename] if who is not None else "?"
            _refuse(exercise, f"your exercise {exercise} reaches into the grader's guards; "
                              "write it yourself")
        original, name = originals[key]
        _police(name, guard.f_back)
        return original

    return keep, enter


_keep, _enter = _vault()


def _guard_template(key):
    def guarded(*args, **kwargs):
        return _enter(key)(*args, **kwargs)
    return guarded


_GUARD_CODE = _guard_template(0).__code__
_GUARD_GLOBALS = {"__builtins__": builtins, "_enter": _enter}


def _guard(original, name: str):
    """A function standing for `original` that refuses the learner's calls of it (`_police`):
    its name, qualified name, module, doc and signature are `original`'s, not `original`."""
    guarded = types.FunctionType(_GUARD_CODE, _GUARD_GLOBALS,
                                 str(getattr(original, "__name__", name.rsplit(".", 1)[-1])),
                                 None, (types.CellType(_keep(original, name)),))
    for attr in ("__qualname__", "__module__", "__doc__"):
        try:
            setattr(guarded, attr, getattr(original, attr))
        except (AttributeError, TypeError):
            pass
    try:
        guarded.__signature__ = inspect.signature(original)
    except (TypeError, ValueError, RuntimeError):
        pass
    guarded.__labkit_forbidden__ = name
    return guarded


def _is_guard(obj) -> bool:
    return isinstance(obj, types.FunctionType) and obj.__code__ is _GUARD_CODE


def _setattr(owner, attr: str, value) -> None:
    try:
        setattr(owner, attr, value)
    except (AttributeError, TypeError):   # a built-in or extension type
        pass


def _wrap_class(cls, name: str) -> None:
    """Keep the class itself (isinstance checks), guard its construction and its methods."""
    if (issubclass(cls, (BaseException, enum.Enum)) or getattr(cls, "_is_protocol", False)
            or _is_guard(vars(cls).get("__init__"))):
        return
    init = cls.__init__             # its own, or inherited (a base's guard too: named anew)
    if inspect.isfunction(init):
        _setattr(cls, "__init__", _guard(init, name))
    for key, value in list(vars(cls).items()):
        if key.startswith("__") and key != "__call__":
            continue
        if isinstance(value, (staticmethod, classmethod)) and inspect.isfunction(value.__func__):
            _setattr(cls, key, type(value)(_guard(value.__func__, f"{name}.{key}")))
        elif inspect.isfunction(value) and not _is_guard(value):
            _setattr(cls, key, _guard(value, f"{name}.{key}"))


def _function_like(value) -> bool:
    """A Python function, or one wrapped by a decorator object (functools.lru_cache)."""
    return inspect.isfunction(value) or (
        callable(value) and not inspect.isclass(value)
        and inspect.isfunction(getattr(value, "__wrapped__", None)))


def _wrap_module(module, name: str) -> set[str]:
    """Guard the functions, classes and methods of `module` and its loaded submodules (those
    they define, not what they import); the files of those modules."""
    base = module.__name__
    modules = [module] + [m for key, m in list(sys.modules.items())
                          if key.startswith(base + ".") and isinstance(m, types.ModuleType)]
    files = set()
    for m in modules:
        if getattr(m, "__file__", None):
            files.add(m.__file__)
        ours = m.__name__ == __name__          # this module: its public functions only
        for key, value in list(vars(m).items()):
            home = getattr(value, "__module__", None)
            if (key.startswith("__") or (ours and key.startswith("_"))
                    or not isinstance(home, str) or not _within(home, {base})):
                continue
            label = f"{name}{home[len(base):]}.{getattr(value, '__qualname__', key)}"
            if inspect.isclass(value):
                if not ours:
                    _wrap_class(value, label)
            elif _function_like(value) and not _is_guard(value):
                guarded = _guard(value, label)
                _REPLACED[id(value)] = (value, guarded)
                _setattr(m, key, guarded)
    return files


def _wrap(name: str) -> set[str]:
    """Guard `name`; the files of the modules it names whole (none for a function or class)."""
    owner, attr, obj = _resolve(name)
    if isinstance(obj, types.ModuleType):
        return _wrap_module(obj, name)
    if owner is None or _is_guard(obj):
        return set()
    if inspect.isclass(obj):
        _wrap_class(obj, name)
        return set()
    static = inspect.getattr_static(owner, attr)
    if isinstance(static, property):
        setattr(owner, attr, property(_guard(static.fget, name), static.fset, static.fdel))
    elif isinstance(static, (staticmethod, classmethod)):
        setattr(owner, attr, type(static)(_guard(static.__func__, name)))
    else:
        guarded = _guard(obj, name)
        setattr(owner, attr, guarded)
        if isinstance(owner, types.ModuleType):     # the same function re-exported elsewhere
            _REPLACED[id(obj)] = (obj, guarded)
    return set()


def _replace_everywhere() -> None:
    """Every module that imported a guarded function by name gets the guard."""
    for module in list(sys.modules.values()):
        if not isinstance(module, types.ModuleType):
            continue
        for key, value in list(vars(module).items()):
            hit = _REPLACED.get(id(value))
            if hit is not None and hit[0] is value:
                _setattr(module, key, hit[1])
    _REPLACED.clear()


def _current() -> str:
    return _RANKS[0] if _RANKS else (_CURRENT[-1] if _CURRENT else "?")


def _learner_file(filename: str) -> str | None:
    """The exercise whose code the file `filename` is (fence's view of the learner). In the
    grading kernel, code of a cell that is neither an answer nor the template's (the template's
    runs through labkit.course.seal, under its own names) is the learner's too: what an input
    transformer or another of IPython's hooks made of a cell."""
    label = _LEARNER.get(filename)
    if label is not None:
        return _RANKS[0] if _RANKS else label
    if not _RANKS and _CURRENT and _cell_file(filename) and not fence.trusted(filename):
        return _current()               # once answers run: a cell the grader did not send
    return None


def _cell_file(filename: str) -> bool:
    """A file name IPython gives a cell's code (ipykernel: <tmp>/ipykernel_<pid>/<hash>.py)."""
    return (os.path.basename(os.path.dirname(filename)).startswith("ipykernel_")
            or filename.startswith("<ipython-input-"))


def _learner_thread() -> str | None:
    """The exercise whose code started this thread, or None."""
    return _current() if _thread.get_ident() in _THREADS else None


def _note(label: str, message: str) -> None:
    _TRIPS.setdefault(label, message)


def _fence(protected) -> None:
    fence.install(protected, learner_file=_learner_file, learner_thread=_learner_thread,
                  note=_note, current=_current)


def install(plan: dict, protected=()) -> None:
    """Guard every callable of `plan` ({exercise: [dotted names]}) and the protected dirs.

    The second line of defence, first thing in the grading kernel: each forbidden callable is
    replaced by a wrapper that refuses calls made directly from an exercise cell's code (raising
    ``ForbiddenCall``, a GradingError: "your f calls X; write it yourself") and passes calls
    from anywhere else (the checks, labkit, torch) through; an audit hook refuses opening,
    truncating, moving or deleting anything under the protected (solutions) directories (the
    grader also keeps its own copy of the template). ``expect(exercise, source)``, sent before
    each exercise cell, tells the kernel which code is the learner's. Refusals are remembered
    (a try/except in the answer does not hide them): ``trips()`` returns them for the grader.

    A name guards: a function or method (a property's getter); a class (its construction and
    its methods: the class itself is kept, for isinstance checks); a module (the functions,
    classes and methods it and its loaded submodules define). A guard keeps the original's
    name, doc and signature but not the original (no ``__wrapped__``; see `_vault`), and
    modules that imported a guarded function by name get the guard. "Directly": the caller, or
    the first caller outside Python's own library (functools, ...), the modules the exercise
    forbids whole and code that only calls what it was handed (`_names`). Code that the learner's runs on ranks (labkit.labs) is guarded there by
    `install_ranks`, with the list `rank_plan` gives."""
    for exercise, names in plan.items():
        _PLAN[exercise] = set(names)
    files = {name: _wrap(name)
             for name in sorted({n for names in plan.values() for n in names} | set(ALWAYS))}
    _replace_everywhere()
    for exercise, names in _PLAN.items():
        _WHOLE[exercise] = set().union(*(files.get(n, set()) for n in names | set(ALWAYS)))
        _WHOLE_ANY.update(_WHOLE[exercise])
    _watch_threads()
    _fence(protected)


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


# --------------------------------------------------------------------------- 3. in the ranks

def rank_plan(objects) -> tuple[str, list[str]] | None:
    """In the grading kernel, for the learner's `objects` (functions or classes, the one being
    checked first) that a check ships to ranks (labkit.labs): (the exercise they answer, the
    names its ranks guard: the exercise's list, those of the exercises the others answer, and
    ALWAYS); None outside grading. The exercise: of the cell that defined an object, else the
    one that ran last."""
    if not _PLAN:
        return None
    found = [_LEARNER[f] for obj in objects for f in _code_files(obj) if f in _LEARNER]
    exercises = list(dict.fromkeys(found)) or _CURRENT[-1:]
    if not exercises:
        return None
    names = set(ALWAYS).union(*(_PLAN.get(e, set()) for e in exercises))
    return exercises[0], sorted(names)


def _code_files(obj) -> list[str]:
    if inspect.isfunction(obj):
        return [obj.__code__.co_filename]
    if not inspect.isclass(obj):
        return []
    out = []
    for value in vars(obj).values():
        fn = getattr(value, "__func__", value)
        if isinstance(value, property):
            fn = value.fget
        if inspect.isfunction(fn):
            out.append(fn.__code__.co_filename)
    return out


def note(exercise: str, message: str) -> None:
    """In the grading kernel: a refusal in the ranks (rank_refusal's), remembered as the
    exercise's own."""
    _TRIPS.setdefault(exercise, str(message))


def install_ranks(names, source: str, label: str) -> None:
    """In a rank, before the learner's code (the file `source`, defining `label`) is loaded:
    guard `names` (what rank_plan gave) as `install` does, but refuse every call made while
    the learner's code is anywhere on the stack (not only directly: torch, labkit or functools
    between do not matter), and every call in a thread that code started. A refusal raises
    ForbiddenCall ("your NaiveDDP.__init__ calls torch.nn.parallel.DistributedDataParallel;
    write it yourself") and is remembered (`rank_refusal`) even if the learner's code catches
    it. Calls from the lab itself (nothing of the learner's on the stack) pass."""
    if not _RANKS:
        _RANKS.append(label)
        _PLAN[label] = set(names) | set(ALWAYS)
        for name in sorted(_PLAN[label]):
            _wrap(name)
        _replace_everywhere()
        _watch_threads()
    _LEARNER[os.fspath(source)] = _RANKS[0]
    _fence(json.loads(os.environ.get(RANK_PROTECTED, "[]")))


def _watch_threads() -> None:
    """Threads started while the learner's code is on the stack are the learner's."""
    import threading

    if getattr(_thread.start_new_thread, "labkit_watched", False):
        return

    def watched(start):
        def start_thread(function, *args, **kwargs):
            if _learner_frame(sys._getframe(1)) is None:
                return start(function, *args, **kwargs)

            def run(*a, **k):
                _THREADS.add(_thread.get_ident())
                try:
                    return function(*a, **k)
                finally:
                    _THREADS.discard(_thread.get_ident())
            return start(run, *args, **kwargs)
        start_thread.labkit_watched = True
        return start_thread

    for owner, attr in ((_thread, "start_new_thread"), (_thread, "start_new"),
                        (_thread, "start_joinable_thread"), (threading, "_start_new_thread"),
                        (threading, "_start_joinable_thread")):
        start = getattr(owner, attr, None)
        if start is not None:
            setattr(owner, attr, watched(start))


def rank_refusal() -> str:
    """In a rank: the first refusal (install_ranks, refuse_borrowed), or ""."""
    return next(iter(_TRIPS.values()), "")


def _forbidden_in(value, depth: int = 4) -> str | None:
    """The guarded name that `value` (a class attribute) is or stands for, or None."""
    if depth == 0:
        return None
    if _is_guard(value):
        return value.__labkit_forbidden__
    if isinstance(value, (staticmethod, classmethod, types.MethodType)):
        return _forbidden_in(value.__func__, depth - 1)
    if isinstance(value, property):
        return next(filter(None, (_forbidden_in(f, depth - 1)
                                  for f in (value.fget, value.fset, value.fdel))), None)
    try:
        func = getattr(value, "func", None)         # functools.partial, partialmethod
    except Exception:  # noqa: BLE001 - any object can sit in a class
        func = None
    if func is not None and callable(func):
        return _forbidden_in(func, depth - 1)
    if inspect.isclass(value):
        init = vars(value).get("__init__")
        return init.__labkit_forbidden__ if _is_guard(init) else None
    return None


def refuse_borrowed(module) -> None:
    """In a rank, after the learner's file `module` is loaded: refuse (ForbiddenCall, remembered)
    a class of it that subclasses a guarded class or holds a guarded function as a method (the
    lab, not the learner's code, would call it)."""
    label = _RANKS[0] if _RANKS else module.__name__
    for cls in list(vars(module).values()):
        if not (inspect.isclass(cls) and cls.__module__ == module.__name__):
            continue
        for base in cls.__mro__[1:]:
            for value in list(vars(base).values()):
                hit = _forbidden_in(value)
                if hit:
                    whose = _forbidden_in(base) or f"{base.__module__}.{base.__qualname__}"
                    _refuse(label, f"your {cls.__name__} subclasses {whose}; write it yourself")
        for key, value in list(vars(cls).items()):
            hit = _forbidden_in(value)
            if hit:
                _refuse(label, f"your {cls.__name__}.{key} is {hit}; write it yourself")
