"""What every exercise runner shares: the learner's function exported with only the code it
needs (`function_source`, `reduced_source`, `export_function`, `definition_source`), loaded
again inside the ranks (`load_source`), a guard that refuses ready-made collectives
(`point_to_point_only`), the stub's message, the lab run and where an error points in the
learner's code (`run_exported`, `where_raised`), and the comparisons the checks print.
"""
from __future__ import annotations

import ast
import contextlib
import importlib.util
import inspect
import json
import linecache
import os
import sys
import tempfile

import traceback

import torch

from labkit.labs.common.checks import ATOL

# What the learner's function may not call in the ranks (torch.distributed's module functions,
# its functional collectives, and the process group's methods): everything but send/recv.
COLLECTIVES = ("all_reduce", "all_reduce_coalesced", "all_gather", "all_gather_into_tensor",
               "all_gather_object", "all_gather_coalesced", "all_gather_tensor",
               "_all_gather_base", "reduce_scatter", "reduce_scatter_tensor",
               "_reduce_scatter_base", "all_to_all", "all_to_all_single", "broadcast",
               "broadcast_object_list", "reduce", "gather", "gather_object", "scatter",
               "scatter_object_list")



PG_COLLECTIVES = ("allreduce", "allreduce_coalesced", "allgather", "allgather_coalesced",
                  "allgather_into_tensor_coalesced", "_allgather_base", "all_gather_single",
                  "all_gather_single_coalesced", "reduce_scatter", "reduce_scatter_single",
                  "reduce_scatter_single_coalesced", "reduce_scatter_tensor_coalesced",
                  "_reduce_scatter_base", "alltoall", "alltoall_base", "all_to_all_single",
                  "broadcast", "reduce", "gather", "scatter")


_KEEP = (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)


def _has_call(node) -> bool:
    return any(isinstance(n, (ast.Call, ast.Await)) for n in ast.walk(node))


def function_source(fn) -> str:
    """The source of the cell or module that defined `fn`, reduced to what defining it needs:
    imports, function and class definitions, and assignments that call nothing."""
    name = getattr(fn, "__name__", None)
    code = getattr(fn, "__code__", None)
    if code is None or name is None:
        raise TypeError(f"expected a Python function, got {type(fn).__name__}")
    text = "".join(linecache.getlines(code.co_filename))
    if not text:
        try:
            text = inspect.getsource(fn)
        except (OSError, TypeError):
            raise ValueError(f"cannot find the source of {name}(): define it in a notebook cell "
                             "or a .py file and run that cell again") from None
    return reduced_source(text, name, (ast.FunctionDef, ast.AsyncFunctionDef), f"{name}()")


def reduced_source(text: str, name: str, kinds, label: str) -> str:
    """`text` (a cell or a module) reduced to what defining `name` (a top-level node of one of
    `kinds`) needs: imports, function and class definitions, assignments that call nothing.
    label: how messages name it ("ring_all_reduce()", "class MyDDP")."""
    try:
        tree = ast.parse(text)
    except SyntaxError as exc:
        raise ValueError(f"the cell that defines {label} does not parse: {exc}") from None
    if not any(isinstance(n, kinds) and n.name == name for n in tree.body):
        raise ValueError(f"{label} must be defined at the top level of its cell (not inside "
                         "another function or an if-block), so that the ranks can import it")
    lines = text.splitlines()
    kept = []
    for node in tree.body:
        if isinstance(node, _KEEP) or (isinstance(node, (ast.Assign, ast.AnnAssign))
                                       and not _has_call(node)):
            first = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
            kept.append("\n".join(lines[first - 1:node.end_lineno]))   # whole lines: comments too
    return "\n\n".join(kept) + "\n"


def export_function(fn, directory: str | None = None) -> str:
    """Write `function_source(fn)` to a .py file in `directory` (a new temp dir by default)."""
    directory = directory or tempfile.mkdtemp(prefix="labkit-user-")
    path = os.path.join(directory, f"user_{fn.__name__}.py")
    with open(path, "w", encoding="utf-8") as f:
        f.write(function_source(fn))
    return path


# Set by the grading kernel (rank_guard) for the ranks of a lab that checks an answer: the names
# (JSON) the learner's code may not call there, and the module that guards them (the grader's
# labkit.course.forbid: named, not imported here, as labs sit below the course layer).
RANK_FORBID = "LABKIT_RANK_FORBID"
RANK_GUARD = "LABKIT_RANK_GUARD"


def load_source(source: str, func: str):
    """`func` of the file `source` (the learner's, exported). While grading (RANK_FORBID set),
    what the exercise may not call is guarded in this rank before the file runs, and a class of
    it that subclasses or borrows from it is refused: then `func` is a function that raises
    that ForbiddenCall, for the lab to report where it calls the learner's code."""
    names = os.environ.get(RANK_FORBID)
    forbid = None
    if names:
        forbid = importlib.import_module(os.environ[RANK_GUARD])
        forbid.install_ranks(json.loads(names), source, func)
    spec = importlib.util.spec_from_file_location("user_collective", source)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
        if forbid is not None:
            forbid.refuse_borrowed(module)
    except Exception as exc:
        if forbid is None or not isinstance(exc, forbid.ForbiddenCall):
            raise
        refusal = exc

        def refused(*args, **kwargs):   # raised where the lab calls it, which it reports
            raise refusal
        return refused
    if not hasattr(module, func):
        raise SystemExit(f"{source} defines no function {func!r}")
    return getattr(module, func)


def rank_guard(*objs) -> tuple[dict, str | None]:
    """In the grading kernel, for the learner's `objs` (the one checked first) about to be run on
    ranks: (run_lab's env= that guards the ranks, the exercise they answer); ({}, None) when
    nothing is graded (labkit.course.forbid.rank_plan)."""
    forbid = sys.modules.get("labkit.course.forbid")
    plan = forbid.rank_plan(objs) if forbid is not None else None
    if plan is None:
        return {}, None
    exercise, names = plan
    return {RANK_FORBID: json.dumps(names), RANK_GUARD: forbid.__name__,
            forbid.RANK_PROTECTED: json.dumps(forbid.fence.protected())}, exercise


def note_refusal(out: dict) -> None:
    """In a rank, before it reports `out`: the guard's first refusal (even one the learner's
    code caught) becomes its error (and "refused", where the lab has one), and "forbidden" for
    the grading kernel (remember_refusal)."""
    forbid = sys.modules.get("labkit.course.forbid")
    message = forbid.rank_refusal() if forbid is not None and os.environ.get(RANK_FORBID) else ""
    if message:
        out["error"] = out["forbidden"] = message
        if "refused" in out:
            out["refused"] = message


def remember_refusal(res, exercise: str | None) -> None:
    """In the grading kernel, after the lab: a rank's refusal is the exercise's (its status is
    "refused", as for a refusal in the kernel)."""
    if exercise is None:
        return
    results = getattr(res, "results", None) or []
    for result in (results.values() if isinstance(results, dict) else results):
        message = result.get("forbidden") if isinstance(result, dict) else None
        if message:
            sys.modules["labkit.course.forbid"].note(exercise, message)
            return


class Refused(Exception):
    """The learner's function called a collective."""


@contextlib.contextmanager
def point_to_point_only(func: str, refusals: list):
    """While inside, every collective of torch.distributed (module functions, functional
    collectives, process-group methods) raises Refused naming `func`, noted in `refusals`."""
    import torch.distributed as tdist
    from torch.distributed import distributed_c10d

    def refuse(what):
        def refused(*args, **kwargs):
            message = (f"your {func} calls {what}; write it yourself with dist.isend/dist.irecv "
                       "(only point-to-point messages)")
            refusals.append(message)
            raise Refused(message)
        return refused

    modules = [tdist, distributed_c10d, sys.modules.get("torch.distributed._functional_collectives")]
    targets = [(m, n, f"{m.__name__}.{n}") for m in modules if m is not None
               for n in COLLECTIVES if n in vars(m)]
    targets += [(tdist.ProcessGroup, n, f"ProcessGroup.{n}") for n in PG_COLLECTIVES
                if n in vars(tdist.ProcessGroup)]
    saved = [(owner, name, vars(owner)[name]) for owner, name, _ in targets]
    try:
        for owner, name, what in targets:
            setattr(owner, name, refuse(what.replace("torch.distributed.distributed_c10d",
                                                     "torch.distributed")))
        yield
    finally:
        for owner, name, original in saved:
            setattr(owner, name, original)


def definition_source(obj) -> str:
    """The source of the cell that defined `obj` (a function or a class), reduced as
    function_source reduces a function's."""
    if not inspect.isclass(obj):
        return function_source(obj)
    code = next((f.__code__ for f in vars(obj).values() if inspect.isfunction(f)), None)
    text = "".join(linecache.getlines(code.co_filename)) if code else ""
    if not text:
        raise ValueError(f"cannot find the source of class {obj.__name__}: define it in a "
                         "notebook cell or a .py file (with at least one method) and run it again")
    return reduced_source(text, obj.__name__, ast.ClassDef, f"class {obj.__name__}")



def stub_message(name: str, calls) -> str | None:
    """The message for a stub, or None: each call (no process group exists here) either raises
    NotImplementedError (a stub), or fails for want of ranks, or runs."""
    for call in calls:
        try:
            with torch.random.fork_rng():     # the learner's kernel keeps its random state
                call()
        except NotImplementedError as exc:
            return f"{name} is not written yet (it raised NotImplementedError: {exc})"
        except Exception:  # noqa: BLE001 - expected: it needs a process group
            pass
    return None



def run_exported(obj, lab: str, nproc: int, timeout: float, quiet: bool, args: list[str],
                 hang: str):
    """Run `lab` on `nproc` ranks with the source that defines `obj` (exported to a file:
    --source PATH --name NAME, then `args`); a timeout's message starts with `hang`, the usual
    cause for this exercise."""
    from labkit.runtime.launch import LabError, run_lab

    env, exercise = rank_guard(obj)
    with tempfile.TemporaryDirectory(prefix="labkit-user-") as tmp:
        path = f"{tmp}/user_{obj.__name__}.py"
        with open(path, "w", encoding="utf-8") as f:
            f.write(definition_source(obj))
        try:
            res = run_lab(lab, nproc=nproc, timeout=timeout, quiet=quiet, env=env,
                          args=["--source", path, "--name", obj.__name__, *args])
            remember_refusal(res, exercise)
            return res
        except LabError as exc:
            if exc.reason != "timeout":
                raise
            raise LabError(
                f"{obj.__name__} did not finish within {timeout:.0f} s on {nproc} ranks. A usual "
                f"cause: {hang}, so one waits forever for a partner.\n\n" + str(exc),
                reason=exc.reason, rank=exc.rank, exc_type=exc.exc_type,
                exc_message=exc.exc_message, traceback=exc.traceback,
                result=exc.result) from None



def where_raised(exc: BaseException, source: str) -> str:
    """'X: msg (in function: the line)' for an exception from the learner's code (the line's
    text, not its number: the exported source is the cell without its calls)."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if f.filename == source]
    at = f" (in {frames[-1].name}: {(frames[-1].line or '').strip()})" if frames else ""
    hint = ("; parameters that do not require gradients have p.grad None: skip them"
            if "NoneType" in str(exc) else "")
    return f"{type(exc).__name__}: {' '.join(str(exc).split())}{at}{hint}"



def relative_diff(got: dict, want: dict) -> tuple[float, str]:
    """Largest |got - want| relative to want's largest value, and the name where it is."""
    worst, where = 0.0, ""
    for k, w in want.items():
        d = float((got[k].double() - w.double()).abs().max()) / max(float(w.abs().max()), 1e-12)
        if d > worst + ATOL:
            worst, where = d, k
    return worst, where



def counted_calls(fn, kinds: list):
    from labkit.runtime.measure import CollectiveCounter
    with CollectiveCounter() as c:
        out = fn()
    kinds.append(c.by_kind)
    return out



def state_of(model) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def check_nproc(nproc) -> int:
    from labkit.validate import positive_int

    nproc = positive_int("nproc", nproc, 8)
    if nproc < 2 or 4 % nproc and nproc != 8:
        raise ValueError(f"nproc={nproc}: allowed 2, 4 or 8 (the model's dimensions divide by "
                         "them, so every shard is exactly 1/N)")
    return nproc



def collectives_of(fn) -> dict:
    """{kind: [count, payload bytes, dtypes]} of what `fn()` issues."""
    from labkit.runtime.measure import CollectiveCounter

    with CollectiveCounter() as c:
        fn()
    out: dict = {}
    for e in c.events:
        row = out.setdefault(e.kind, [0, 0, []])
        row[0] += 1
        row[1] += e.bytes
        if e.dtype not in row[2]:
            row[2].append(e.dtype)
    return out
