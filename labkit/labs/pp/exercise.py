"""Your GPipe step on real ranks, next to one process: the runner of module 07's exercises.

    torchrun --nproc-per-node 4 -m labkit.labs.pp.exercise --source my.py --name gpipe_step

From a notebook (what the exercises do), pass the function itself:

    from labkit.labs.pp.exercise import run_user_gpipe
    r = run_user_gpipe(gpipe_step, nproc=4)           # r.ok, r.problems(), print(r.summary())

The model, the batch, the contract of `fn` and what is checked: `run_user_gpipe`'s docstring.
Source: GPipe (Huang et al. 2019), as labkit.pipeline.simulate("gpipe") orders it.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import inspect
import time

import torch

from labkit.labs.common import exercise as shared
from labkit.labs.pp.check import GPipeCheck
from labkit.labs.pp.check import SEED, LAYERS, HIDDEN, ROWS, MICROBATCHES  # the exercise's sizes
from labkit.labs.common.exercise import check_nproc, run_exported, stub_message, where_raised

DEFAULT_TIMEOUT = 45          # seconds; a correct run takes about a second once the pool is warm
MAX_MICROBATCHES = 32
P2P = ("send", "recv", "isend", "irecv")


def run_user_gpipe(fn, nproc: int = 2, microbatches: int = MICROBATCHES,
                   timeout: float = DEFAULT_TIMEOUT, quiet: bool = True) -> GPipeCheck:
    """Run your `fn(stage, inputs, targets, loss_fn, shape)` on `nproc` ranks.
    NotImplementedError for a stub, ValueError for bad arguments,
    labkit.runtime.launch.LabError when a rank fails outside your code or hangs.

    The model is `model()`: LAYERS blocks of Linear(HIDDEN, HIDDEN) + Tanh, the same weights on
    every rank, cut into `nproc` stages of LAYERS/nproc blocks (`stages`); rank r runs stage r.
    The batch is MICROBATCHES x ROWS rows of HIDDEN features and their targets, in float64 (the
    ranks set torch's default dtype to float64, so `torch.empty(shape)` matches and a rounding
    difference is far below any mistake's).

    On each rank your `fn(stage, inputs, targets, loss_fn, shape)` runs one training step:
    `inputs` and `targets` are the lists of micro-batches (rank 0 reads the inputs, the last rank
    the targets), `loss_fn(output, target)` the loss of one micro-batch (mean squared error) and
    `shape` the shape of the activation a stage sends to the next (and of its gradient). It
    returns the step's loss, the mean over micro-batches, on the last rank (None on the others)
    and leaves in the stage's parameters the gradients of that mean. Measured on every rank,
    against the whole model on one process: the loss, each parameter's gradient, the order of
    the stage's forwards and backwards (module and tensor hooks) against
    `labkit.pipeline.simulate("gpipe")`'s for that stage (so the micro-batches held at once: m),
    and every message sent and received. Collectives are refused while your function runs: a
    pipeline needs only point-to-point messages."""
    from labkit.validate import positive_int

    nproc = check_nproc(nproc)
    m = positive_int("microbatches", microbatches, MAX_MICROBATCHES)
    if not inspect.isfunction(fn):
        raise ValueError(f"run_user_gpipe takes a function fn(stage, inputs, targets, loss_fn, "
                         f"shape); received {fn!r} (a {type(fn).__name__})")
    parts = list(torch.randn(m, ROWS, HIDDEN))
    msg = stub_message(fn.__name__, [lambda: fn(torch.nn.Identity(), parts, parts,
                                                torch.nn.functional.mse_loss, (ROWS, HIDDEN))])
    if msg:
        raise NotImplementedError(msg)
    res = run_exported(fn, "labkit.labs.pp.exercise", nproc, timeout, quiet,
                       ["--microbatches", str(m)],
                       "a rank waits in recv for a message its neighbour never sends (every send "
                       "needs a recv on the other rank, in the same order)")
    return GPipeCheck.from_reports([res.results[r] for r in range(nproc)], name=fn.__name__,
                                   microbatches=m, output=res.output)


# ---------------------------------------------------------------------------------------------
# inside a rank

def model() -> torch.nn.Sequential:
    """The exercise's model, the same on every rank (seeded), in the default dtype."""
    torch.manual_seed(SEED)
    return torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(HIDDEN, HIDDEN),
                                                     torch.nn.Tanh()) for _ in range(LAYERS)])


def stages(whole: torch.nn.Sequential, n: int) -> list[torch.nn.Sequential]:
    """`whole` cut into n stages of consecutive blocks (copies)."""
    per = len(whole) // n
    return [copy.deepcopy(whole[i * per:(i + 1) * per]) for i in range(n)]


def batch(m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets) of m micro-batches, [m, ROWS, HIDDEN] each."""
    g = torch.Generator().manual_seed(SEED + 1)
    return (torch.randn(m, ROWS, HIDDEN, generator=g),
            torch.randn(m, ROWS, HIDDEN, generator=g))


@contextlib.contextmanager
def p2p_log(log: list):
    """While inside, every send/recv/isend/irecv of torch.distributed appends
    [kind, peer, numel] to `log` (and still runs)."""
    import torch.distributed as tdist
    from torch.distributed import distributed_c10d

    inside = []                 # torch's send calls isend: log the outer call only

    def counted(kind, original):
        def call(tensor, *args, **kwargs):
            if not inside:
                peer = args[0] if args else kwargs.get("dst", kwargs.get("src", kwargs.get(
                    "group_dst", kwargs.get("group_src"))))
                log.append([kind, peer, int(getattr(tensor, "numel", lambda: 0)())])
            inside.append(kind)
            try:
                return original(tensor, *args, **kwargs)
            finally:
                inside.pop()
        return call

    saved = [(m, n, vars(m)[n]) for m in (tdist, distributed_c10d) for n in P2P if n in vars(m)]
    originals = {n: vars(distributed_c10d)[n] for n in P2P}
    try:
        wrapped = {n: counted(n, originals[n]) for n in P2P}
        for owner, name, _ in saved:
            setattr(owner, name, wrapped[name])
        yield
    finally:
        for owner, name, original in saved:
            setattr(owner, name, original)


def _order_hooks(stage, order: list) -> list:
    """Hooks that note ("F", j) when the stage's forward of micro-batch j ends and ("B", j)
    when the gradient of that output arrives (the start of its backward)."""
    def forward(module, args, output):
        j = sum(1 for k, _ in order if k == "F")
        order.append(("F", j))
        if isinstance(output, torch.Tensor) and output.requires_grad:
            output.register_hook(lambda grad: order.append(("B", j)))
    return [stage.register_forward_hook(forward)]


def _grad_report(stage, ref_stage) -> dict:
    """Max relative difference of the stage's gradients from the reference's, their scale
    (<g, ref> / <ref, ref>: m for a loss summed over micro-batches), and the missing ones."""
    missing, worst, num, den = [], 0.0, 0.0, 0.0
    for (name, p), q in zip(stage.named_parameters(), ref_stage.parameters()):
        if p.grad is None:
            missing.append(name)
            continue
        worst = max(worst, float((p.grad - q.grad).abs().max() / q.grad.abs().max()))
        num += float((p.grad * q.grad).sum())
        den += float((q.grad * q.grad).sum())
    return {"diff": worst, "scale": num / den if den else 0.0, "missing": missing}


def _expected_order(rank: int, world: int, m: int) -> list:
    from labkit.pipeline import simulate

    return [[e.kind, e.microbatch] for e in simulate("gpipe", world, m).events
            if e.stage == rank]


def _gpipe_task(fn, ctx, m: int, out: dict) -> None:
    rank, world = ctx.rank, ctx.world_size
    whole = model()
    inputs, targets = batch(m)
    loss_fn = torch.nn.functional.mse_loss
    ref_loss = loss_fn(whole(inputs.reshape(-1, HIDDEN)), targets.reshape(-1, HIDDEN))
    ref_loss.backward()
    stage = stages(whole, world)[rank]
    stage.zero_grad(set_to_none=True)
    per = LAYERS // world
    ref_stage = whole[rank * per:(rank + 1) * per]        # the reference's blocks and .grad
    order, log, refusals = [], [], []
    hooks = _order_hooks(stage, order)
    out.update(ref_loss=float(ref_loss), order=order, want_order=_expected_order(rank, world, m),
               p2p=log, refusals=refusals)
    start = time.perf_counter()
    try:
        with shared.point_to_point_only(fn.__name__, refusals), p2p_log(log):
            loss = fn(stage, list(inputs), list(targets), loss_fn, (ROWS, HIDDEN))
    except shared.Refused:
        out["error"] = refusals[0]
        return
    finally:
        for h in hooks:
            h.remove()
    out["seconds"] = time.perf_counter() - start
    out["loss_type"] = type(loss).__name__
    number = loss.item() if isinstance(loss, torch.Tensor) and loss.numel() == 1 else loss
    out["loss"] = float(number) if isinstance(number, (int, float)) else None
    out["grads"] = _grad_report(stage, ref_stage)
    out["order"] = [list(o) for o in order]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description="check a learner's GPipe step on ranks")
    p.add_argument("--source", required=True, help="a .py file defining the function")
    p.add_argument("--name", required=True, help="the function: fn(stage, inputs, targets, "
                                                 "loss_fn, shape)")
    p.add_argument("--microbatches", type=int, default=MICROBATCHES)
    args = p.parse_args(argv)

    from labkit.runtime import dist
    ctx = dist.setup()
    torch.set_num_threads(1)
    torch.set_default_dtype(torch.float64)
    out = {"error": "", "rank": ctx.rank}
    try:
        _gpipe_task(shared.load_source(args.source, args.name), ctx, args.microbatches, out)
    except Exception as exc:  # noqa: BLE001 - the learner's code may raise anything
        out["error"] = f"your {args.name} raised {where_raised(exc, args.source)}"
    shared.note_refusal(out)         # the rank guard's (labkit.course.forbid), if any
    dist.report(**out)
    dist.print0(f"gpipe on {ctx.world_size} ranks: {'raised' if out['error'] else 'ran'}")
    dist.shutdown()


__all__ = ["run_user_gpipe", "model", "stages", "batch", "p2p_log", "main"]

if __name__ == "__main__":
    main()
