"""Your tensor-parallel pieces on real ranks, next to one device: module 06's exercise runner.

    torchrun --nproc-per-node 2 -m labkit.labs.tp.exercise --task conjugates --source my.py \
        --name F --g-name G
    torchrun --nproc-per-node 4 -m labkit.labs.tp.exercise --task column --source my.py \
        --name MyColumn

From a notebook, pass the classes themselves (each task's contract: its run_user_* function):
    from labkit.labs.tp.exercise import run_user_conjugates, run_user_column, run_user_row
    r = run_user_conjugates(F, G, nproc=2)            # r.ok, r.problems(), print(r.summary())
    r = run_user_column(MyColumn, uses=(F,), nproc=4) # uses: what its cell takes from others
"""
from __future__ import annotations

import argparse
import ast
import inspect
import linecache
import os
import tempfile

import torch

from labkit.labs.common import exercise as shared
from labkit.labs.tp.check import ConjugateCheck, LinearCheck
from labkit.labs.tp.check import FFN, HIDDEN, ROWS, SEED, SEQ, SHAPES  # noqa: F401  (the exercise's sizes; notebooks import them from here)
from labkit.labs.common.exercise import check_nproc, collectives_of, stub_message, where_raised

TASKS = ("conjugates", "column", "row")
DEFAULT_TIMEOUT = 45          # seconds; a correct run takes about a second once the pool is warm


def _autograd_function(name: str, cls) -> None:
    if not (inspect.isclass(cls) and issubclass(cls, torch.autograd.Function)):
        raise ValueError(f"{name} takes a subclass of torch.autograd.Function (with static "
                         f"forward(ctx, x) and backward(ctx, grad)); received {cls!r} "
                         f"(a {type(cls).__name__})")


def run_user_conjugates(F, G, nproc: int = 2, timeout: float = DEFAULT_TIMEOUT,
                        quiet: bool = True) -> ConjugateCheck:
    """Run your `F` and `G` (torch.autograd.Function subclasses defined in one cell) on `nproc`
    ranks. NotImplementedError for a stub, ValueError for bad arguments,
    labkit.runtime.launch.LabError when a rank fails outside your code.

    `F.apply(x)` and `G.apply(x)`, Megatron's f and g (Shoeybi et al. 2019, §3), each rank with
    its own x and its own upstream gradient dy. By definition f returns x and its backward gives
    the sum of every rank's dy; g returns the sum of every rank's x and its backward gives dy.
    Measured: both against the definition, and the collectives of each forward and backward
    (CollectiveCounter). Layout [s, b, h] (Megatron's): SEQ x ROWS x width. Every value is a
    small whole number (the inputs, the upstream gradients, the Linear's weights and bias), so
    every sum is exact in fp32 whatever its order, and "equal" means equal."""
    nproc = check_nproc(nproc)
    _autograd_function("run_user_conjugates's F", F)
    _autograd_function("run_user_conjugates's G", G)
    if source_file(F) != source_file(G):
        raise ValueError(f"define {F.__name__} and {G.__name__} in the same cell: the ranks "
                         "import that cell")
    for cls in (F, G):
        x = torch.ones(2, requires_grad=True)
        msg = stub_message(cls.__name__, [lambda: cls.apply(x),
                                          lambda: cls.apply(x).sum().backward()])
        if msg:
            raise NotImplementedError(msg)
    res = _launch(F, (), nproc, timeout, quiet, ["--task", "conjugates", "--g-name", G.__name__],
                  "every rank must call the same all-reduces")
    return ConjugateCheck.from_reports([res.results[r] for r in range(nproc)],
                                       names=(F.__name__, G.__name__), output=res.output)


def run_user_column(cls, uses=(), nproc: int = 2, timeout: float = DEFAULT_TIMEOUT,
                    quiet: bool = True) -> LinearCheck:
    """Run your column-parallel `cls(linear)` on `nproc` ranks. `uses`: the
    classes or functions from other cells that cls's cell calls (your F and G).

    `cls(linear)` on an nn.Linear(HIDDEN, FFN), the same on every rank (an MLP's fc1): `.weight`
    must be this rank's FFN/N rows, `.bias` its FFN/N entries; `layer(x)` on the whole x returns
    this rank's FFN/N output columns (gather_output=False). Checked against nn.Linear on one
    process: the output, the input's gradient (whole, on every rank), the weight and bias
    gradients (this rank's slice), each rank's parameter bytes and the collectives. Values are
    small whole numbers, as in `run_user_conjugates`: every comparison is exact."""
    return _run_linear("column", cls, uses, nproc, timeout, quiet)


def run_user_row(cls, uses=(), nproc: int = 2, timeout: float = DEFAULT_TIMEOUT,
                 quiet: bool = True) -> LinearCheck:
    """Run your row-parallel `cls(linear)` on `nproc` ranks.

    `cls(linear)` on an nn.Linear(FFN, HIDDEN) (fc2): `.weight` this rank's FFN/N input columns,
    `.bias` whole; `layer(x)` takes this rank's FFN/N input columns (input_is_parallel=True) and
    returns the whole output on every rank, the bias added once."""
    return _run_linear("row", cls, uses, nproc, timeout, quiet)


def source_file(obj) -> str:
    """The file (a notebook cell's code name) that defined `obj`: a function, or a class by its
    first method (static ones included, as torch.autograd.Function's)."""
    if inspect.isfunction(obj):
        return obj.__code__.co_filename
    for value in vars(obj).values():
        fn = getattr(value, "__func__", value)
        if inspect.isfunction(fn):
            return fn.__code__.co_filename
    return ""


def exported_source(obj) -> str:
    """The cell that defined `obj`, reduced to its imports and definitions
    (labkit.labs.common.exercise.reduced_source)."""
    text = "".join(linecache.getlines(source_file(obj)))
    if not text:
        raise ValueError(f"cannot find the source of {obj.__name__}: define it in a notebook "
                         "cell or a .py file and run that cell again")
    kinds = ast.ClassDef if inspect.isclass(obj) else (ast.FunctionDef, ast.AsyncFunctionDef)
    return shared.reduced_source(text, obj.__name__, kinds, obj.__name__)


def _launch(obj, uses, nproc, timeout, quiet, args, hang):
    """run_lab on `nproc` ranks with the cells of `uses` and of `obj` exported to a file."""
    from labkit.runtime.launch import LabError, run_lab

    sources = dict.fromkeys(exported_source(o) for o in (*uses, obj))
    env, exercise = shared.rank_guard(obj, *uses)
    with tempfile.TemporaryDirectory(prefix="labkit-user-") as tmp:
        path = os.path.join(tmp, f"user_{obj.__name__}.py")
        with open(path, "w", encoding="utf-8") as f:
            f.write("\n\n".join(sources))
        try:
            res = run_lab("labkit.labs.tp.exercise", nproc=nproc, timeout=timeout, quiet=quiet,
                          env=env, args=["--source", path, "--name", obj.__name__, *args])
            shared.remember_refusal(res, exercise)
            return res
        except LabError as exc:
            if exc.reason == "timeout":
                exc.args = (f"{obj.__name__} did not finish within {timeout:.0f} s on {nproc} "
                            f"ranks: a rank waits for a collective the others never issue "
                            f"({hang}).\n\n{exc}",)
            raise


def _run_linear(kind, cls, uses, nproc, timeout, quiet) -> LinearCheck:
    nproc = check_nproc(nproc)
    label = f"run_user_{kind}"
    if not (inspect.isclass(cls) and issubclass(cls, torch.nn.Module)):
        raise ValueError(f"{label} takes a torch.nn.Module subclass (your layer, built as "
                         f"cls(linear)); received {cls!r} (a {type(cls).__name__})")
    if not isinstance(uses, (tuple, list)) or not all(
            inspect.isclass(u) or inspect.isfunction(u) for u in uses):
        raise ValueError(f"{label}'s uses= takes a tuple of the classes or functions cls's cell "
                         f"calls from other cells, e.g. uses=(F, G); received {uses!r}")
    msg = stub_message(cls.__name__, [lambda: cls(torch.nn.Linear(*SHAPES[kind]))])
    if msg:
        raise NotImplementedError(msg)
    res = _launch(cls, tuple(uses), nproc, timeout, quiet, ["--task", kind],
                  "every rank must call the same all-reduces")
    return LinearCheck.from_reports([res.results[r] for r in range(nproc)], kind=kind,
                                    name=cls.__name__, uses=[u.__name__ for u in uses],
                                    output=res.output)


# ---------------------------------------------------------------------------------------------
# inside a rank

def whole(tag: str, shape, rank: int = 0) -> torch.Tensor:
    """Small whole numbers in fp32 (-3..3), the same for the same (tag, rank) on every rank."""
    g = torch.Generator().manual_seed(SEED + 1000 * rank + sum(map(ord, tag)))
    return torch.randint(-3, 4, tuple(shape), generator=g).float()


def full_linear(kind: str) -> torch.nn.Linear:
    """The exercise's nn.Linear for `kind`, with whole-number weights and bias."""
    n_in, n_out = SHAPES[kind]
    linear = torch.nn.Linear(n_in, n_out)
    with torch.no_grad():
        linear.weight.copy_(whole("weight", (n_out, n_in)))
        linear.bias.copy_(whole("bias", (n_out,)))
    return linear


def _measure(fn) -> tuple:
    box = []
    return collectives_of(lambda: box.append(fn())), box[0] if box else None


def _conjugates_task(F, G, ctx, out: dict) -> None:
    rank, world = ctx.rank, ctx.world_size
    shape = (SEQ, ROWS, HIDDEN)
    xs = [whole("x", shape, r) for r in range(world)]
    dys = [whole("dy", shape, r) for r in range(world)]
    # (forward's output, input's gradient) by definition, then what the other operator gives
    identity, summed = (xs[rank], dys[rank]), (sum(xs), sum(dys))
    want = {"F": (identity[0], summed[1]), "G": (summed[0], identity[1])}
    for name, op in (("F", F), ("G", G)):
        other = "G" if name == "F" else "F"
        x = xs[rank].clone().requires_grad_()
        fwd, y = _measure(lambda: op.apply(x))
        row = {"fwd": fwd, "bwd": {}, "y": _compare(y, want[name][0], want[other][0]),
               "grad": None}
        out[name] = row
        if not (isinstance(y, torch.Tensor) and y.requires_grad):
            continue
        row["bwd"], _ = _measure(lambda: y.backward(dys[rank]))
        row["grad"] = _compare(x.grad, want[name][1], want[other][1])


def _compare(got, want, alt=None) -> dict:
    """{"shape", "want_shape", "diff", "alt"}: max |got - want| (nan when the shapes differ or
    `got` is no tensor: "what" says what it is); "alt": whether got equals `alt` (a usual
    mistake's result)."""
    if not isinstance(got, torch.Tensor):
        return {"shape": None, "want_shape": list(want.shape), "diff": float("nan"),
                "what": type(got).__name__, "alt": False}
    got = got.detach()
    same = tuple(got.shape) == tuple(want.shape)
    return {"shape": list(got.shape), "want_shape": list(want.shape),
            "diff": float((got - want).abs().max()) if same else float("nan"),
            "alt": alt is not None and same and bool(torch.equal(got, alt))}


def _linear_task(cls, kind, ctx, out: dict) -> None:
    rank, world = ctx.rank, ctx.world_size
    n_in, n_out = SHAPES[kind]
    ref = full_linear(kind)
    x_full = whole("x", (SEQ, ROWS, n_in))
    dy_full = whole("dy", (SEQ, ROWS, n_out))
    xr = x_full.clone().requires_grad_()
    ref(xr).backward(dy_full)
    wanted = ref(x_full).detach()
    column = kind == "column"
    mine = slice(rank * (n_out if column else n_in) // world,
                 (rank + 1) * (n_out if column else n_in) // world)
    layer = cls(full_linear(kind))
    params = {id(p): p for p in layer.parameters()}
    out["local_bytes"] = sum(p.numel() * p.element_size() for p in params.values())
    w, b = getattr(layer, "weight", None), getattr(layer, "bias", None)
    out["weight"] = _compare(w, ref.weight[mine] if column else ref.weight[:, mine])
    out["bias"] = _compare(b, ref.bias[mine] if column else ref.bias)
    x = (x_full if column else x_full[..., mine]).clone().requires_grad_()
    out["fwd"], y = _measure(lambda: layer(x))
    bias = ref.bias.detach()
    # row: this rank's partial sum (no all-reduce), or the bias added on every rank
    partial = x_full[..., mine] @ ref.weight[:, mine].detach().T + bias
    out["output"] = _compare(y, wanted[..., mine] if column else wanted,
                             None if column else partial)
    out["bias_added_n_times"] = (not column and out["output"]["diff"] > 0 and
                                 bool(torch.equal(y.detach(), wanted + (world - 1) * bias)))
    out["bwd"] = {}
    if out["output"]["shape"] != out["output"]["want_shape"]:
        out["skipped"] = "not checked: the output's shape is wrong, so no backward ran"
        return
    if not y.requires_grad:
        out["error"] = (f"the output of your {cls.__name__} does not require grad: no gradient "
                        "reaches the input or the weights")
        return
    dy = dy_full[..., mine] if column else dy_full
    out["bwd"], _ = _measure(lambda: y.backward(dy))
    out["input_grad"] = _compare(x.grad, xr.grad if column else xr.grad[..., mine],
                                 dy @ ref.weight[mine].detach() if column else None)
    grads = (ref.weight.grad[mine], ref.bias.grad[mine]) if column else (
        ref.weight.grad[:, mine], ref.bias.grad)
    out["weight_grad"] = _compare(getattr(w, "grad", None), grads[0])
    out["bias_grad"] = _compare(getattr(b, "grad", None), grads[1])


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description="check a learner's tensor-parallel code on ranks")
    p.add_argument("--task", choices=TASKS, required=True)
    p.add_argument("--source", required=True, help="a .py file defining the class(es)")
    p.add_argument("--name", required=True, help="conjugates: f's class; else the layer class")
    p.add_argument("--g-name", help="conjugates: g's class")
    args = p.parse_args(argv)

    from labkit.runtime import dist
    ctx = dist.setup()
    torch.set_num_threads(1)
    out = {"error": ""}
    try:
        if args.task == "conjugates":
            _conjugates_task(shared.load_source(args.source, args.name),
                             shared.load_source(args.source, args.g_name), ctx, out)
        else:
            _linear_task(shared.load_source(args.source, args.name), args.task, ctx, out)
    except Exception as exc:  # noqa: BLE001 - the learner's code may raise anything
        who = " / ".join(n for n in (args.name, args.g_name) if n)
        out["error"] = f"your {who} raised {where_raised(exc, args.source)}"
    shared.note_refusal(out)         # the rank guard's (labkit.course.forbid), if any
    dist.report(**out)
    dist.print0(f"{args.task} on {ctx.world_size} ranks: {'raised' if out['error'] else 'ran'}")
    dist.shutdown()


__all__ = ["run_user_conjugates", "run_user_column", "run_user_row", "full_linear", "whole",
           "main"]

if __name__ == "__main__":
    main()
