"""Your ZeRO-1 optimizer on real ranks, next to a single process trained on the whole batch with
the same optimizer: the runner of module 04's ZeRO-1 exercise.

    torchrun --nproc-per-node 2 -m labkit.labs.zero.exercise --source my_zero.py --name ZeRO1

From a notebook (what the exercise does; the contract and the checks: `run_user_zero1`):
    from labkit.labs.zero.exercise import run_user_zero1
    r = run_user_zero1(ZeRO1, nproc=2)
    r.ok, r.problems(), print(r.summary())
"""
from __future__ import annotations

import argparse
import inspect

import torch

from labkit.labs.common import exercise as shared
from labkit.labs.zero.check import REDUCE_KINDS, SEND_KINDS, ZeroCheck
from labkit.labs.common.tiny_lm import ROWS, SEED, lm_batch, tiny_lm
from labkit.labs.common.exercise import counted_calls, relative_diff, state_of, where_raised, run_exported, stub_message

DEFAULT_TIMEOUT = 45          # seconds; a correct run takes ~1 s once the pool is warm
LR = 1e-2                     # AdamW's learning rate


def _stub_message(cls) -> str | None:
    """Construct and step the class without a process group: a stub raises NotImplementedError
    at once, and then there is no point starting ranks."""
    return stub_message(cls.__name__, [
        lambda: cls([torch.nn.Parameter(torch.zeros(2))], torch.optim.AdamW, lr=LR),
        lambda: cls.step(object.__new__(cls))])


def run_user_zero1(cls, nproc: int = 2, steps: int = 3, timeout: float = DEFAULT_TIMEOUT,
                   quiet: bool = True) -> ZeroCheck:
    """Run `cls` (a class defined in a notebook cell or a module) on `nproc` ranks. Raises
    NotImplementedError for a stub, ValueError for bad arguments or a class whose source cannot
    be found, and labkit.runtime.launch.LabError when a rank fails outside the learner's code or
    the run passes `timeout` seconds.

    The class reaches the ranks as source, like module 03's DDP classes
    (labkit.labs.ddp.exercise): the cell that defined it, reduced to its imports, definitions
    and constant assignments.

    `cls(params, optimizer_class, **defaults)` gets the trainable parameters of module 03's
    `TinyLM` (an embedding tied to the output head: one Parameter used twice, listed once), the
    same on every rank, and `torch.optim.AdamW` with its learning rate. Each rank runs the
    backward on its own rows of the batch, so the gradients it holds are its own (not
    averaged); `step()` must average them, update only the parameters this rank owns with an
    optimizer that holds state for those only, and send every updated parameter to every rank.
    Checked after every step: the parameters against one process trained with AdamW on the
    whole batch; the collectives of the step (CollectiveCounter: bytes of gradients reduced,
    bytes of parameters sent); after the last step, which rank's optimizers hold state for which
    parameter (each on exactly one rank) and its bytes."""
    from labkit.validate import positive_int

    nproc, steps = positive_int("nproc", nproc), positive_int("steps", steps, 100)
    if nproc < 2:
        raise ValueError(f"nproc={nproc} must be >= 2: a shard per rank needs two ranks")
    if not inspect.isclass(cls):
        raise ValueError(f"run_user_zero1 takes a class (your optimizer); received {cls!r} "
                         f"(a {type(cls).__name__})")
    stub = _stub_message(cls)
    if stub:
        raise NotImplementedError(stub)
    res = run_exported(cls, "labkit.labs.zero.exercise", nproc, timeout, quiet,
                       ["--steps", str(steps)],
                       "the ranks did not issue the same collectives in the same order (every "
                       "rank must call each reduce and broadcast, the owner and the others alike)")
    return ZeroCheck.from_reports([res.results[r] for r in range(nproc)], name=cls.__name__,
                                  steps=steps, output=res.output)


# ---------------------------------------------------------------------------------------------
# inside a rank

def _optimizers(obj, depth: int = 2) -> list:
    """The torch optimizers `obj` holds (itself, its attributes, lists/dicts of them)."""
    if isinstance(obj, torch.optim.Optimizer):
        return [obj]
    if depth == 0:
        return []
    if isinstance(obj, dict):
        items = list(obj.values())
    elif isinstance(obj, (list, tuple)):
        items = list(obj)
    else:
        items = list(getattr(obj, "__dict__", {}).values())
    return [o for item in items for o in _optimizers(item, depth - 1)]


def _refused(obj, name: str) -> str:
    from torch.distributed.optim import ZeroRedundancyOptimizer

    for o in [obj, *_optimizers(obj)]:
        if isinstance(o, ZeroRedundancyOptimizer) or any(
                c.__module__.startswith("labkit.parallel") for c in type(o).__mro__):
            return (f"your {name} uses torch's ZeroRedundancyOptimizer (or labkit's); write it "
                    "yourself with dist.reduce / dist.broadcast (or reduce_scatter / all_gather)")
    return ""


def _held_state(obj, params: list) -> tuple[list, int]:
    """(indices of `params` with optimizer state in `obj`'s optimizers, bytes of that state:
    the tensors shaped like their parameter, e.g. AdamW's exp_avg and exp_avg_sq)."""
    index = {id(p): i for i, p in enumerate(params)}
    held, nbytes = set(), 0
    for opt in _optimizers(obj):
        for p, state in opt.state.items():
            if not state:
                continue
            if id(p) in index:
                held.add(index[id(p)])
            nbytes += sum(t.numel() * t.element_size() for t in state.values()
                          if torch.is_tensor(t) and t.numel() == p.numel() and t.dim() > 0)
    return sorted(held), nbytes


def _zero1_task(user, args, ctx, out: dict) -> None:
    n, dev = ctx.world_size, ctx.device
    model, single = tiny_lm(SEED, dev), tiny_lm(SEED, dev)    # ZeRO-1 starts from equal replicas
    params = [p for p in model.parameters() if p.requires_grad]
    opt = user(params, torch.optim.AdamW, lr=LR)
    out["refused"] = _refused(opt, args.name)
    if out["refused"]:
        return
    opt_single = torch.optim.AdamW(single.parameters(), lr=LR)
    vocab, kinds = single.embed.num_embeddings, []
    for step in range(args.steps):
        x, y = lm_batch(step, ROWS * n, vocab, dev)
        mine = slice(ctx.rank * ROWS, (ctx.rank + 1) * ROWS)
        for p in model.parameters():
            p.grad = None
        opt_single.zero_grad(set_to_none=True)
        model(x[mine], y[mine]).backward()          # this rank's own gradient
        single(x, y).backward()
        counted_calls(opt.step, kinds)
        opt_single.step()
        out["diff_single"].append(relative_diff(state_of(model), state_of(single))[0])
    out["collectives"] = kinds
    out["held"], out["state_bytes"] = _held_state(opt, params)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description="check a learner's ZeRO-1 optimizer on ranks")
    p.add_argument("--source", required=True, help="a .py file defining the class")
    p.add_argument("--name", required=True, help="its name")
    p.add_argument("--steps", type=int, default=3, help="training steps (default 3)")
    args = p.parse_args(argv)

    from labkit.runtime import dist
    ctx = dist.setup()
    user = shared.load_source(args.source, args.name)
    trainable = [q for q in tiny_lm(0).parameters() if q.requires_grad]
    out = {"error": "", "refused": "", "diff_single": [], "collectives": [], "held": [],
           "state_bytes": 0, "sizes": [q.numel() * q.element_size() for q in trainable]}
    try:
        _zero1_task(user, args, ctx, out)
    except Exception as exc:  # noqa: BLE001 - the learner's code may raise anything
        out["error"] = f"your {args.name} raised {where_raised(exc, args.source)}"
    shared.note_refusal(out)         # the rank guard's (labkit.course.forbid), if any
    dist.report(**out)
    dist.print0(f"{args.name} on {ctx.world_size} ranks: {'raised' if out['error'] else 'ran'}")
    dist.shutdown()


__all__ = ["run_user_zero1", "REDUCE_KINDS", "SEND_KINDS", "main"]

if __name__ == "__main__":
    main()
