"""What an answer cannot change under a check: the grading kernel's side of labkit.course.grader.

Answers and checks share one kernel, so an answer could change what a check sees (issue 11):
a name a check uses (`grading`, a reference), a labkit function a reference calls, a check
function, `math.isclose`, or how IPython reports errors. The grader runs every template cell
that is not an exercise through `run()`, which protects names, code (recorded by `install()`)
and the verdict; `run` says how.

Not a sandbox: code written against this module itself can defeat it. It stops what works
against any notebook kernel.
"""
from __future__ import annotations

import ast
import builtins
import hashlib
import importlib
import inspect
import json
import linecache
import re
import sys
import types

from labkit.course import fence

STANDARD = ("builtins", "math", "numbers", "operator", "functools")
_IPYTHON_OWNED = {"_", "__", "___", "exit", "quit", "get_ipython", "display", "__IPYTHON__"}
_TABLE = re.compile(r"^[A-Z][A-Z0-9_]*$")
_CODE_KINDS = (types.FunctionType, types.BuiltinFunctionType, types.ModuleType, type,
               staticmethod, classmethod, property)
_MISSING = object()

_LEARNER: set[str] = set()          # names the template's exercise cells bind
_TRUSTED: dict[str, object] = {}    # names the template's other cells bound, as they bound them
_ATTRS: list[tuple[str, object, str, object]] = []      # (label, owner, attribute, value)
_CODE: list[tuple[str, types.FunctionType, types.CodeType, tuple | None, dict | None]] = []
_TABLES: list[tuple[str, object, object]] = []          # (label, container, copy)
_METHODS: list[tuple[str, object, set[str]]] = []       # (label, object or class, its own keys)
_HOOKS: dict[str, object] = {}
_SEEN: set[str] = set()             # modules recorded
_CHANGED: set[str] = set()          # what answers changed and run() put back


# ------------------------------------------------------------------- the grader's side (static)

def bound_names(source: str) -> set[str]:
    """Names a cell binds at its top level (assignments, imports, definitions, loop targets)."""
    from labkit.course.forbid import python_source

    try:
        tree = ast.parse(python_source(source))
    except SyntaxError:
        return set()
    names: set[str] = set()
    todo = list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
            continue
        if isinstance(node, (ast.Lambda, ast.ListComp, ast.SetComp, ast.DictComp,
                             ast.GeneratorExp)):
            continue
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {a.asname or a.name.split(".")[0] for a in node.names if a.name != "*"}
        elif isinstance(node, ast.ExceptHandler) and node.name:
            names.add(node.name)
        todo.extend(ast.iter_child_nodes(node))
    return names


def imported_modules(source: str) -> set[str]:
    """Modules a cell imports by absolute name."""
    from labkit.course.forbid import python_source

    try:
        tree = ast.parse(python_source(source))
    except SyntaxError:
        return set()
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out.add(node.module)
    return out


# ---------------------------------------------------------------------------- recording state

def _record_function(label: str, fn) -> None:
    if isinstance(fn, (staticmethod, classmethod)):
        fn = fn.__func__
    elif isinstance(fn, property):
        fn = fn.fget
    if isinstance(fn, types.FunctionType):
        kw = dict(fn.__kwdefaults__) if fn.__kwdefaults__ is not None else None
        _CODE.append((label, fn, fn.__code__, fn.__defaults__, kw))


def _record_class(cls, label: str) -> None:
    for attr, value in list(vars(cls).items()):
        if isinstance(value, _CODE_KINDS) or _TABLE.match(attr):
            _ATTRS.append((f"{label}.{attr}", cls, attr, value))
            _record_function(f"{label}.{attr}", value)
    _METHODS.append((label, cls, set(vars(cls))))


def _record_module(module) -> None:
    name = module.__name__
    ours = name == "labkit" or name.startswith("labkit.")
    for attr, value in list(vars(module).items()):
        table = ours and bool(_TABLE.match(attr))
        if (name == "builtins" and attr in _IPYTHON_OWNED) or not (
                isinstance(value, _CODE_KINDS) or table):
            continue
        label = f"{name}.{attr}"
        _ATTRS.append((label, module, attr, value))
        _record_function(label, value)
        if ours and inspect.isclass(value) and value.__module__ == name:
            _record_class(value, label)
        if table and isinstance(value, (dict, list, set)):
            _TABLES.append((label, value, value.copy()))
            items = value.values() if isinstance(value, dict) else value
            for item in items:
                if type(item).__module__.startswith("labkit") and hasattr(item, "__dict__"):
                    _TABLES.append((label, item.__dict__, dict(item.__dict__)))


def _record_ipython(ip) -> None:
    for obj, label in ((ip, "IPython's shell"), (getattr(ip, "kernel", None), "the kernel")):
        if obj is None:
            continue
        for cls in type(obj).__mro__:
            if cls.__module__.split(".")[0] in ("IPython", "ipykernel"):
                _record_class(cls, f"{label} ({cls.__name__})")
        _METHODS.append((label, obj, set(vars(obj))))
    for attr in ("custom_exceptions", "CustomTB"):     # what set_custom_exc sets
        _ATTRS.append((f"IPython's {attr}", ip, attr, vars(ip).get(attr, _MISSING)))
    _HOOKS.update(trace=sys.gettrace(), profile=sys.getprofile())


def _record_new_modules() -> None:
    """Record the labkit and standard modules loaded since the last call."""
    for name, module in sorted(sys.modules.items()):
        if name not in _SEEN and isinstance(module, types.ModuleType) and (
                name in STANDARD or name == "labkit" or name.startswith("labkit.")):
            _SEEN.add(name)
            _record_module(module)


def _same(container, saved) -> bool:
    if isinstance(container, dict):
        return container.keys() == saved.keys() and all(container[k] is v
                                                        for k, v in saved.items())
    if isinstance(container, list):
        return len(container) == len(saved) and all(a is b for a, b in zip(container, saved))
    return container == saved


def _sweep(fix: bool) -> list[str]:
    """Labels of what differs from the records; with `fix`, put each back."""
    out = []
    for label, owner, attr, value in _ATTRS:
        if vars(owner).get(attr, _MISSING) is not value:
            out.append(label)
            if fix and value is _MISSING:
                delattr(owner, attr)
            elif fix:
                setattr(owner, attr, value)
    for label, fn, code, defaults, kw in _CODE:
        if fn.__code__ is not code or fn.__defaults__ is not defaults or not (
                _same(fn.__kwdefaults__, kw) if kw is not None else fn.__kwdefaults__ is None):
            out.append(label)
            if fix:
                fn.__code__, fn.__defaults__ = code, defaults
                fn.__kwdefaults__ = dict(kw) if kw is not None else None
    for label, container, saved in _TABLES:
        if not _same(container, saved):
            out.append(label)
            if fix:
                container.clear()
                (container.extend if isinstance(container, list) else container.update)(saved)
    for label, obj, keys in _METHODS:   # a function set on a class or on IPython's objects
        for attr in set(vars(obj)) - keys:
            if callable(vars(obj)[attr]):
                out.append(f"{label}.{attr}")
                if fix:
                    delattr(obj, attr)
    if _HOOKS and (sys.gettrace() is not _HOOKS["trace"]
                   or sys.getprofile() is not _HOOKS["profile"]):
        out.append("sys.settrace/sys.setprofile")
        if fix:
            sys.settrace(_HOOKS["trace"])
            sys.setprofile(_HOOKS["profile"])
    return out


# ------------------------------------------------------------------------------ in the kernel

def cell_text(index: int, source: str, check: bool) -> str:
    """The code the grader sends for template cell `index` (`run` checks that it is what ran)."""
    return f"__import__('labkit.course.seal', fromlist=['seal']).run({index}, {source!r}, " \
           f"check={check})"


def _verdict():
    """(expect, done, listed): the cells' digests and the checks done live in this closure
    only (no module attribute an answer could change holds them)."""
    digests: dict[int, str] = {}
    finished: set[int] = set()
    trusted: set[str] = set()       # code files of the cells that ran as the grader sent them

    def expect(cells: dict) -> None:
        if not digests:
            digests.update({int(k): v for k, v in cells.items()})

    def done(index: int, source: str, check: bool, caller, mark: bool = False) -> None:
        """Raise GradingError unless `source` is cell `index`'s and `caller` ran its text
        (`cell_text`); `mark`: record the check as done."""
        from labkit.course.grading import GradingError

        if digests and digests.get(index) != hashlib.sha256(source.encode()).hexdigest():
            raise GradingError(f"the template's cell {index} was changed before it ran (an "
                               "IPython input transformer or hook?): answers may not")
        if digests:
            want = compile(cell_text(index, source, check), caller.co_filename, "single",
                           dont_inherit=True)
            if (want.co_code, want.co_consts, want.co_names) != (
                    caller.co_code, caller.co_consts, caller.co_names):
                raise GradingError(f"the template's cell {index} did not run as the grader sent "
                                   "it (an IPython input transformer or hook?): answers may not")
            trusted.add(caller.co_filename)
        if mark is True and check is True:
            finished.add(index)

    fence.trust(trusted.__contains__)
    return expect, done, lambda: sorted(finished)


_expect, _done, _listed = _verdict()


def install(learner=(), modules=(), cells=None) -> None:
    """Record what the checks rely on; run before any answer. `learner`: the names the
    template's exercise cells bind; `modules`: what the template's other cells import;
    `cells`: {index: sha256 of the source} of the template cells the grader sends (`run`
    refuses any other).

    Recorded: the labkit modules, the standard modules the checks use (STANDARD: builtins,
    math, numbers, operator, functools), the trace function and IPython's error reporting
    (sys.excepthook plays no part in it): functions (their code and defaults too), classes
    (their methods), labkit's tables (GPUS, LINKS, ...: upper-case names)."""
    _LEARNER.update(learner)
    _expect(cells or {})
    for name in ("labkit.course.grading", "labkit.course.reference", *sorted(modules), *STANDARD):
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - the cell that imports it will say why
            pass
    _record_new_modules()
    ip = sys.modules["IPython"].get_ipython() if "IPython" in sys.modules else None
    if ip is not None:
        _record_ipython(ip)


def _compile(index: int, source: str):
    from labkit.course.forbid import python_source

    filename = f"<labkit template cell {index}>"
    text = python_source(source)
    linecache.cache[filename] = (len(text), None, text.splitlines(True), filename)
    tree = ast.parse(text, filename)
    last = None
    if tree.body and isinstance(tree.body[-1], ast.Expr):   # shown, as IPython shows it
        last = compile(ast.Interactive(body=[tree.body.pop()]), filename, "single")
    return compile(tree, filename, "exec"), last


def run(index: int, source: str, check: bool = False) -> None:
    """Run a template cell that is not an exercise (a set-up or check cell), protecting:

    1. Names. What those cells bind is recorded, and the records are put back before each of
       them runs, except the names the template's exercise cells bind (the answers the checks
       read, such as `model_state_bytes`). A check runs in a copy of the namespace, so a
       function of the learner's that it calls cannot rebind names under it either.
    2. Code. Everything `install()` recorded is put back before each cell (`status()` lists
       what was), and a check during which any of it changes fails.
    3. The verdict. The cell must be the one the grader sent (its digest, given to `install`,
       and the code that called this function: an input transformer changes them); a check is
       recorded as done only when its code ran to its end. The grader decides each check from
       what it recorded (labkit.course.judge) and passes it only when it is done, too.
    """
    _done(index, source, check, sys._getframe(1).f_code)
    _CHANGED.update(_sweep(fix=True))
    user = sys.modules["IPython"].get_ipython().user_ns
    ns = dict(user) if check else user
    ns.update({k: v for k, v in _TRUSTED.items() if k not in _LEARNER})
    ns["__builtins__"] = builtins
    before = dict(ns)
    body, last = _compile(index, source)
    try:
        exec(body, ns)
        if last is not None:
            exec(last, ns)
    finally:
        for key, value in ns.items():
            if not key.startswith("__") and before.get(key, _MISSING) is not value:
                _TRUSTED[key] = user[key] = value
    changed = _sweep(fix=True) if check else []
    _record_new_modules()               # loaded by this cell: recorded as it left them
    fence.freeze()                      # ... and frozen (labkit.course.fence)
    if changed:
        from labkit.course.grading import GradingError

        _CHANGED.update(changed)
        raise GradingError(f"this check cannot be trusted: {', '.join(changed[:5])} changed "
                           "while it ran (does your code change what the checks use?)")
    if check:
        _done(index, source, check, sys._getframe(1).f_code, mark=True)


def status() -> str:
    """JSON for the grader: refusals (labkit.course.forbid), checks done, what was put back."""
    from labkit.course import forbid

    return json.dumps({"trips": json.loads(forbid.trips()), "done": _listed(),
                       "changed": sorted(_CHANGED)})
