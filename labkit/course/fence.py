"""What an answer may not touch while it is graded, in the grading kernel and in the ranks.

An audit hook refuses, with ForbiddenCall: reading or writing the protected directories (the
solutions, the judge's cache), also through /proc/self/root or a link (paths are resolved);
writing labkit's own files; an answer starting a program (even through labkit), using ctypes or
gc's object walks, compiling code that names INTROSPECTION; running a loaded labkit module's
code again (an unguarded copy). labkit's modules are frozen (`freeze`): answers may not set or
delete their attributes, read private names or __dict__; nor set those of SET_FROZEN modules.
Whose code is the answer's is labkit.course.forbid's to say (`install`). Not a sandbox.
"""
from __future__ import annotations

import os
import sys
import types

from labkit.course.grading import GradingError

_STDLIB = os.path.dirname(os.__file__) + os.sep
_LABKIT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_LIBRARY: dict[str, bool] = {}       # file name -> Python's own library (cache)
_PROTECTED: tuple = ()               # no reading nor writing under these
_WRITE: tuple = ()                   # no writing under these (labkit's own files)
_HOOKED: list = []
_WHO: list = []                      # [learner_file(filename) -> label | None, learner_thread()]
_NOTE: list = []                     # [note(label, message)]
_CURRENT: list = []                  # [current() -> the exercise that ran last]
_TRUST: list = []                    # [trusted(filename) -> a cell the grader sent, as sent]
_PROCESS_EVENTS = ("subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.spawn",
                   "pty.spawn", "os.startfile")
_GC_EVENTS = ("gc.get_objects", "gc.get_referrers", "gc.get_referents")
_CTYPES_EVENTS = ("ctypes.dlopen", "ctypes.dlsym", "ctypes.dlsym/handle")
# audit events that name a path (argument positions), what they do, and whether they write
_PATH_EVENTS = {"open": ((0,), "reads", False), "os.truncate": ((0,), "truncates", True),
                "os.remove": ((0,), "deletes", True), "os.rmdir": ((0,), "deletes", True),
                "shutil.rmtree": ((0,), "deletes", True), "os.rename": ((0, 1), "moves", True),
                "shutil.move": ((0, 1), "moves", True), "os.link": ((0, 1), "links", True),
                "os.symlink": ((0, 1), "links", True), "os.mkdir": ((0,), "writes into", True),
                "os.chmod": ((0,), "changes", True), "os.utime": ((0,), "changes", True),
                "shutil.copyfile": ((1,), "writes", True)}
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND


class ForbiddenCall(GradingError):
    """An exercise used what it was asked to write, read the solutions, or reached into the
    grader."""

    def _title(self) -> str:
        return "answer not accepted"


def library(filename: str) -> bool:
    """Python's own library (functools, threading, ...): code that only passes a call on."""
    hit = _LIBRARY.get(filename)
    if hit is None:
        hit = _LIBRARY[filename] = filename.startswith("<frozen ") or (
            filename.startswith(_STDLIB) and "-packages" not in filename)
    return hit


def _refuse(label: str, message: str):
    if _NOTE:
        _NOTE[0](label, message)
    raise ForbiddenCall(message)


def _learner(frame, direct: bool = False) -> str | None:
    """The exercise whose code is on the stack from `frame` outwards (or whose thread this is);
    None when none is. direct: the first frame outside Python's library decides."""
    if not _WHO:
        return None
    learner_file, learner_thread = _WHO
    while frame is not None:
        filename = frame.f_code.co_filename
        label = learner_file(filename)
        if label is not None:
            return label
        if direct and not library(filename):
            return None
        frame = frame.f_back
    return learner_thread()


def _under(path, dirs) -> bool:
    if isinstance(path, int) or not dirs:
        return False
    try:
        text = os.fsdecode(path)
        seen = {os.path.abspath(text), os.path.realpath(text)}
    except (TypeError, ValueError, OSError):
        return False
    return any(p == d or p.startswith(d + os.sep) for p in seen for d in dirs)


def _writes(event: str, args) -> bool:
    if event != "open":
        return _PATH_EVENTS[event][2]
    mode, flags = (args[1] if len(args) > 1 else None), (args[2] if len(args) > 2 else 0)
    return bool((isinstance(mode, str) and set(mode) & set("wax+"))
                or (isinstance(flags, int) and flags & _WRITE_FLAGS))


def _bytecode(path, frame) -> bool:
    """Python's import system writing a .pyc (under __pycache__) for an import."""
    name = os.fsdecode(path) if isinstance(path, (str, bytes)) else ""
    if os.sep + "__pycache__" + os.sep not in name:
        return False
    while frame is not None:
        if frame.f_code.co_filename == "<frozen importlib._bootstrap_external>":
            return True
        frame = frame.f_back
    return False


def _audit(event: str, args) -> None:
    if event in _PROCESS_EVENTS:
        label = _learner(sys._getframe(1))          # labkit between does not launder it
        if label is not None:
            what = args[1] if event == "subprocess.Popen" and len(args) > 1 else args[0]
            _refuse(label, f"your exercise {label} starts a program ({str(what)[:80]}); answers "
                           "may not while they are graded: write it in Python")
        return
    if event in _CTYPES_EVENTS or event in _GC_EVENTS:
        label = _learner(sys._getframe(1), direct=event in _CTYPES_EVENTS)
        if label is not None:
            _refuse(label, f"your exercise {label} uses {event.split('.')[0]} ({event}), a way "
                           "around the grader's guards; write it yourself")
        return
    if event == "exec":
        _second_copy(args[0] if args else None)
        return
    if event == "compile":
        _introspecting(args[0] if args else None)
        return
    if event not in _PATH_EVENTS:
        return
    positions, verb, _ = _PATH_EVENTS[event]
    paths = [args[i] for i in positions if i < len(args)]
    writes = _writes(event, args)
    verb = "writes" if event == "open" and writes else verb
    hits = [p for p in paths if _under(p, _PROTECTED)]
    if hits:
        label = _learner(sys._getframe(1)) or "?"
        _refuse(label, f"your exercise {label} {verb} the solutions ({os.fsdecode(hits[0])}); "
                       "write it yourself")
    if writes and _WRITE:
        hits = [p for p in paths if _under(p, _WRITE)]
        frame = sys._getframe(1)
        if hits and not _bytecode(hits[0], frame):
            label = _learner(frame)
            if label is not None:
                _refuse(label, f"your exercise {label} {verb} labkit's own files "
                               f"({os.fsdecode(hits[0])}); answers may not change the grader")


def _second_copy(code) -> None:
    """Refuse running the code of a labkit module that is loaded already: a second, unguarded
    copy of it (importlib's spec_from_file_location, runpy), however it is started."""
    filename = getattr(code, "co_filename", "")
    if not isinstance(filename, str) or not filename.startswith(_LABKIT + os.sep):
        return
    name = "labkit." + os.path.relpath(os.path.splitext(filename)[0], _LABKIT).replace(os.sep, ".")
    name = name.removesuffix(".__init__")
    if isinstance(sys.modules.get(name), FrozenModule):
        label = _learner(sys._getframe(2)) or (_CURRENT[0]() if _CURRENT else "?")
        _refuse(label, f"your exercise {label} runs a second copy of {name}, labkit's own (a "
                       "way around the grader's guards); write it yourself")


INTROSPECTION = ("__wrapped__", "__closure__", "__globals__", "cell_contents")


def _introspecting(source) -> None:
    """Refuse an answer compiling code (eval, exec, compile of a string it built) that reaches
    past a guard: what the grader's scan refuses when it is spelled in the answer."""
    if isinstance(source, bytes):
        source = source.decode("utf-8", "replace")
    if not isinstance(source, str):
        return
    hit = next((n for n in INTROSPECTION if n in source), None)
    if hit is not None:
        label = _learner(sys._getframe(2), direct=True)     # not torch's own code generation
        if label is not None:
            _refuse(label, f"your exercise {label} compiles code that reads {hit} (a way "
                           "around the grader's guards); write it yourself")


# ------------------------------------------------------------------------------- the freeze

def _reach(module, name: str, verb: str) -> None:
    """Refuse reading a private name of (or changing) a frozen module: reading, when the
    learner's code is anywhere on the stack; changing, unless labkit's own code or Python's
    import system does it (a callback handed to IPython or functools does not launder it)."""
    frame = sys._getframe(2)
    caller = frame.f_code.co_filename
    if verb != "reads" and caller.startswith("<frozen importlib"):
        return                          # an import binds a submodule to its package
    label = _learner(frame)
    if label is None and verb != "reads" and not caller.startswith(_LABKIT + os.sep):
        label = _CURRENT[0]() if _CURRENT else "?"
    if label is not None:
        _refuse(label, f"your exercise {label} {verb} {module.__name__}.{name}, labkit's own "
                       "(a way around the grader's guards); write it yourself")


def _private(name: str) -> bool:
    return name == "__dict__" or (name[:1] == "_" and not (name[:2] == "__" == name[-2:]))


class FrozenModule(types.ModuleType):
    """A labkit module while an answer is graded: the answer may not change it, nor read its
    private names or its __dict__ (labkit's own code may)."""

    def __setattr__(self, name, value):
        _reach(self, name, "changes")
        types.ModuleType.__setattr__(self, name, value)

    def __delattr__(self, name):
        _reach(self, name, "deletes")
        types.ModuleType.__delattr__(self, name)

    def __getattribute__(self, name):
        if _private(name):
            _reach(self, name, "reads")
        return types.ModuleType.__getattribute__(self, name)


class SetFrozenModule(types.ModuleType):
    """A module an answer could patch under a lab's or a check's feet (torch, json, numpy,
    math, ...): while graded, the answer may not set or delete its attributes."""

    def __setattr__(self, name, value):
        _patch(self, name, "changes")
        types.ModuleType.__setattr__(self, name, value)

    def __delattr__(self, name):
        _patch(self, name, "deletes")
        types.ModuleType.__delattr__(self, name)


def _patch(module, name: str, verb: str) -> None:
    frame = sys._getframe(2)
    if frame.f_code.co_filename.startswith("<frozen importlib"):
        return
    label = _learner(frame, direct=True)    # torch patching itself (torch._dynamo) is torch's
    if label is not None:
        _refuse(label, f"your exercise {label} {verb} {module.__name__}.{name} (the checks and "
                       "the labs rely on it); write it yourself")


# modules whose attributes answers may not change while graded (not sys: an answer may
# redirect sys.stdout)
SET_FROZEN = ("torch", "json", "numpy", "math", "operator", "functools", "builtins", "os",
              "io", "struct", "time")


def _labkit_name(name: str) -> bool:
    return name == "labkit" or name.startswith("labkit.")


class _FreezingLoader:
    """A labkit module's loader that freezes the module once its code has run."""

    def __init__(self, loader):
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        self.loader.exec_module(module)
        if type(module) is types.ModuleType:
            module.__class__ = FrozenModule

    def __getattr__(self, name):        # get_source, get_code, resource readers, ...
        return getattr(self.loader, name)


class _FreezingFinder:
    """First on sys.meta_path while answers are graded: labkit modules imported from then on
    are frozen as they finish loading (an answer cannot read one before it is)."""

    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if not _labkit_name(name):
            return None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            if finder is cls or find is None:
                continue
            spec = find(name, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _FreezingLoader(spec.loader)
                return spec
        return None


def freeze() -> None:
    """Freeze every loaded labkit module (again after imports: new ones are frozen too)."""
    for name, module in list(sys.modules.items()):
        if type(module) is not types.ModuleType:
            continue
        frozen = FrozenModule if _labkit_name(name) else (
            SetFrozenModule if name.split(".")[0] in SET_FROZEN else None)
        if frozen is not None:
            try:
                module.__class__ = frozen
            except TypeError:
                pass


def trust(trusted) -> None:
    """`trusted(filename)`: whether a cell's code is one the grader sent (labkit.course.seal
    checks it as it runs); the first one given stands."""
    if not _TRUST:
        _TRUST.append(trusted)


def trusted(filename: str) -> bool:
    return bool(_TRUST) and _TRUST[0](filename)


def install(protected=(), *, learner_file, learner_thread, note, current=lambda: "?") -> None:
    """Refuse what the module docstring says, for the learner's code as `learner_file`
    (a code file name -> its exercise, or None) and `learner_thread` (this thread's exercise,
    or None) tell; `note(label, message)` remembers each refusal. Labkit's files are
    write-protected; `protected` directories are closed."""
    global _PROTECTED, _WRITE
    if not _WHO:
        _WHO.extend((learner_file, learner_thread))
        _NOTE.append(note)
        _CURRENT.append(current)
    dirs = {p for d in protected for p in (os.path.abspath(d), os.path.realpath(d))}
    _PROTECTED = tuple(sorted(set(_PROTECTED) | dirs))
    _WRITE = tuple(sorted({_LABKIT, os.path.realpath(_LABKIT)}))
    if not _HOOKED:
        _HOOKED.append(True)
        sys.addaudithook(_audit)
        sys.meta_path.insert(0, _FreezingFinder)
    freeze()


def protected() -> list[str]:
    """The closed directories (for the ranks of a lab: LABKIT_RANK_PROTECTED)."""
    return list(_PROTECTED)
