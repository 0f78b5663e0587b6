"""Your DDP code on real ranks, next to torch's DistributedDataParallel and a single process
trained on the whole batch: the runner of module 03's exercises.

    torchrun --nproc-per-node 2 -m labkit.labs.ddp.exercise --source my_ddp.py --name NaiveDDP
    torchrun --nproc-per-node 2 -m labkit.labs.ddp.exercise --source my_step.py \
        --name train_step --task accumulate --micro 4

From a notebook (what the exercises do; each task's contract and checks: `run_user_ddp`):
    from labkit.labs.ddp.exercise import run_user_ddp
    r = run_user_ddp(NaiveDDP, task="wrapper", nproc=2)
    r.ok, r.problems(), print(r.summary())
"""
from __future__ import annotations

import argparse
import inspect

import torch
from torch import nn

from labkit.labs.common import exercise as shared
from labkit.labs.common.checks import ATOL
from labkit.labs.ddp.check import DDPCheck
from labkit.labs.common.exercise import counted_calls, relative_diff, state_of, where_raised, run_exported, stub_message
from labkit.labs.common.tiny_lm import LR, ROWS, SEED, TinyLM, lm_batch, tiny_lm

TASKS = ("wrapper", "accumulate")
DEFAULT_TIMEOUT = 45          # seconds; a correct run takes ~1 s once the pool is warm
BUCKET_MB = 0.004             # torch DDP's buckets in "accumulate": 4 KiB, so several



# ---------------------------------------------------------------------------------------------
# from the notebook: the definition's cell to a file


def _stub_message(obj, task: str) -> str | None:
    """Call the stub's entry points without a process group: a stub raises NotImplementedError
    at once, and then there is no point starting ranks."""
    if task == "wrapper":
        calls = [lambda: obj(TinyLM()),
                 lambda: obj.finish_gradient_synchronization(object.__new__(obj))]
    else:
        calls = [lambda: obj(None, None, [])]
    return stub_message(obj.__name__, calls)



def run_user_ddp(obj, task: str = "wrapper", nproc: int = 2, steps: int = 3, micro: int = 4,
                 timeout: float = DEFAULT_TIMEOUT, quiet: bool = True) -> DDPCheck:
    """Run `obj` (a class for task "wrapper", a function for "accumulate", defined in a notebook
    cell or a module) on `nproc` ranks. Raises NotImplementedError for a stub, ValueError for bad
    arguments or a definition whose source cannot be found, and labkit.runtime.launch.LabError
    when a rank fails outside the learner's code or the run passes `timeout` seconds.

    It reaches the ranks as source, like labkit.labs.ring's collectives: the cell that defined
    it, reduced to its imports, definitions and constant assignments, is imported by every rank.

    Tasks:
    - "wrapper": `cls(module)` must behave like labkit.parallel.ddp.NaiveDDP: broadcast rank 0's
      parameters and buffers at construction, keep the model as `.module`, forward calls to it,
      and after `loss.backward()`, `finish_gradient_synchronization()` must leave every gradient
      equal to the average over ranks. Each step the rank compares the gradients with torch
      DDP's (same model, same shard), the parameters after an SGD step with torch DDP's and with
      one process trained on the whole batch, and counts the collectives of the step
      (CollectiveCounter).
    - "accumulate": `fn(model, optimizer, micro_batches)` is one optimizer step of gradient
      accumulation on a torch DDP model (each micro-batch a (tokens, targets) pair;
      `model(tokens, targets)` returns the mean loss). Checked: the all-reduces of the step (one
      backward's worth: DDP syncs every backward outside `no_sync()`), and the parameters after
      the step against one process trained on all ranks' micro-batches at once.

    The model, `TinyLM`, has what a DDP must handle: an embedding tied to the output head (one
    Parameter used twice), a frozen layer (requires_grad=False), a buffer; each rank builds it
    from its own seed, so a wrapper that does not broadcast leaves the ranks apart."""
    from labkit.validate import choice, positive_int

    choice("task", task, TASKS)
    nproc, steps = positive_int("nproc", nproc), positive_int("steps", steps, 100)
    micro = positive_int("micro", micro, 64)
    if nproc < 2:
        raise ValueError(f"nproc={nproc} must be >= 2: data parallelism needs two ranks")
    want = "a class" if task == "wrapper" else "a function"
    if inspect.isclass(obj) != (task == "wrapper") or not callable(obj):
        raise ValueError(f"task={task!r} takes {want}; received {obj!r} "
                         f"(a {type(obj).__name__})")
    stub = _stub_message(obj, task)
    if stub:
        raise NotImplementedError(stub)
    res = run_exported(obj, "labkit.labs.ddp.exercise", nproc, timeout, quiet,
                       ["--task", task, "--steps", str(steps), "--micro", str(micro)],
                       "the ranks did not issue the same collectives in the same order (one "
                       "all-reduce per parameter on every rank, none that only some ranks call)")
    return DDPCheck.from_reports([res.results[r] for r in range(nproc)], task=task,
                                 name=obj.__name__, steps=steps, micro=micro, output=res.output)


# ---------------------------------------------------------------------------------------------
# inside a rank



def _trainable(model) -> dict:
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


def _ratio(got: dict, want: dict) -> float:
    num = sum(float((got[k].double() * want[k].double()).sum()) for k in want)
    den = sum(float((want[k].double() ** 2).sum()) for k in want)
    return num / den if den else float("nan")


def _refused(wrapper, name: str) -> str:
    from torch.nn.parallel import DistributedDataParallel as DDP
    parts = list(wrapper.modules()) if isinstance(wrapper, nn.Module) else [wrapper]
    if any(isinstance(m, DDP) or any(c.__module__.startswith("labkit.parallel")
                                     for c in type(m).__mro__) for m in parts):
        return (f"your {name} wraps torch's DistributedDataParallel (or labkit's); write it "
                "yourself with dist.broadcast and dist.all_reduce")
    return ""


def _wrapper_task(user, args, ctx, out: dict) -> None:
    from torch.nn.parallel import DistributedDataParallel as DDP
    n, dev = ctx.world_size, ctx.device
    initial = state_of(tiny_lm(SEED, dev))                      # rank 0's model before training
    model, kinds = tiny_lm(SEED + ctx.rank, dev), []
    wrapper = counted_calls(lambda: user(model), kinds)
    out["construct_collectives"] = kinds.pop()
    out["refused"] = _refused(wrapper, args.name)
    if out["refused"]:
        return
    module = getattr(wrapper, "module", None)
    out["has_module"] = isinstance(module, nn.Module)
    module = module if out["has_module"] else model
    start = state_of(module)
    out["construct_diff"], out["construct_where"] = relative_diff(start, initial)
    torch_ddp = DDP(tiny_lm(SEED + ctx.rank, dev), forward_sync_buffers=False)
    single = tiny_lm(SEED, dev)
    opts = [torch.optim.SGD(m.parameters(), lr=LR) for m in (module, torch_ddp, single)]
    frozen = {k: v for k, v in start.items() if k.startswith("frozen.")}
    for step in range(args.steps):
        x, y = lm_batch(step, ROWS * n, single.embed.num_embeddings, dev)
        mine = slice(ctx.rank * ROWS, (ctx.rank + 1) * ROWS)
        for opt in opts:
            opt.zero_grad(set_to_none=True)

        def backward_and_sync():
            wrapper(x[mine], y[mine]).backward()
            local = {k: p.grad.clone() for k, p in _trainable(module).items() if p.grad is not None}
            wrapper.finish_gradient_synchronization()
            return local
        local = counted_calls(backward_and_sync, kinds)
        torch_kinds: list = []
        counted_calls(lambda: torch_ddp(x[mine], y[mine]).backward(), torch_kinds)
        out["torch_all_reduces"].append(torch_kinds[0].get("all_reduce", (0, 0)))
        single(x, y).backward()
        mine_g = {k: p.grad for k, p in _trainable(module).items()}
        want_g = {k: p.grad for k, p in _trainable(torch_ddp.module).items()}
        missing = [k for k, g in mine_g.items() if g is None]
        if missing:
            out["error"] = (f"after finish_gradient_synchronization(), {missing} have no "
                            "gradient (p.grad is None): average the gradients in place")
            return
        for key, value in zip(("grad_diff", "grad_where"), relative_diff(mine_g, want_g)):
            out[key].append(value)
        out["grad_ratio"].append(_ratio(mine_g, want_g))
        out["grad_unsynced"].append(relative_diff(mine_g, local)[0] <= ATOL and n > 1)
        before = state_of(single)
        for opt in opts:
            opt.step()
        mine_p, single_p = state_of(module), state_of(single)
        out["diff_ddp"].append(relative_diff(mine_p, state_of(torch_ddp.module))[0])
        out["diff_single"].append(relative_diff(mine_p, single_p)[0])
        out["update_ratio"].append(_ratio({k: mine_p[k] - before[k] for k in before},
                                          {k: single_p[k] - before[k] for k in before}))
        out["frozen_diff"] = max(float((mine_p[k] - v).abs().max()) for k, v in frozen.items())
    out["collectives"] = kinds


def _accumulate_task(user, args, ctx, out: dict) -> None:
    from torch.nn.parallel import DistributedDataParallel as DDP
    n, dev, m = ctx.world_size, ctx.device, args.micro
    model = DDP(tiny_lm(SEED + ctx.rank, dev), bucket_cap_mb=BUCKET_MB, forward_sync_buffers=False)
    single = tiny_lm(SEED, dev)
    vocab = single.embed.num_embeddings
    warm: list = []          # plain backwards: DDP rebuilds its buckets at the second
    for _ in range(2):
        counted_calls(lambda: model(*lm_batch(-1, ROWS, vocab, dev)).backward(), warm)
    out["per_backward"] = warm[-1].get("all_reduce", (0, 0))
    opt, opt_single, kinds = (torch.optim.SGD(model.parameters(), lr=LR),
                              torch.optim.SGD(single.parameters(), lr=LR), [])
    for step in range(args.steps):
        x, y = lm_batch(step, ROWS * m * n, vocab, dev)
        mine = [slice((ctx.rank * m + i) * ROWS, (ctx.rank * m + i + 1) * ROWS) for i in range(m)]
        micro = [(x[rows], y[rows]) for rows in mine]
        opt.zero_grad(set_to_none=True)
        opt_single.zero_grad(set_to_none=True)
        before, mine_before = state_of(single), state_of(model.module)
        counted_calls(lambda: user(model, opt, micro), kinds)
        single(x, y).backward()
        opt_single.step()
        mine_p, single_p = state_of(model.module), state_of(single)
        out["diff_single"].append(relative_diff(mine_p, single_p)[0])
        out["update_ratio"].append(_ratio({k: mine_p[k] - mine_before[k] for k in before},
                                          {k: single_p[k] - before[k] for k in before}))
        out["frozen_diff"] = max(float((mine_p[k] - mine_before[k]).abs().max())
                                 for k in before if k.startswith("frozen."))
    out["collectives"] = kinds


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description="check a learner's DDP code against torch's DDP")
    p.add_argument("--source", required=True, help="a .py file defining the class or function")
    p.add_argument("--name", required=True, help="its name")
    p.add_argument("--task", default="wrapper", choices=TASKS)
    p.add_argument("--steps", type=int, default=3, help="training steps (default 3)")
    p.add_argument("--micro", type=int, default=4, help="accumulate: micro-batches per step")
    args = p.parse_args(argv)

    from labkit.runtime import dist
    ctx = dist.setup()
    user = shared.load_source(args.source, args.name)
    probe = tiny_lm(0)
    trainable = {id(q): q for q in probe.parameters() if q.requires_grad}
    out = {"error": "", "refused": "", "has_module": True, "construct_diff": 0.0,
           "construct_where": "", "construct_collectives": {}, "collectives": [],
           "torch_all_reduces": [], "per_backward": (0, 0), "frozen_diff": 0.0,
           "trainable_bytes": sum(q.numel() * q.element_size() for q in trainable.values()),
           "trainable_tensors": len(trainable),
           **{k: [] for k in ("grad_diff", "grad_where", "grad_ratio", "grad_unsynced", "diff_ddp",
                              "diff_single", "update_ratio")}}
    try:
        (_wrapper_task if args.task == "wrapper" else _accumulate_task)(user, args, ctx, out)
    except Exception as exc:  # noqa: BLE001 - the learner's code may raise anything
        out["error"] = f"your {args.name} raised {where_raised(exc, args.source)}"
    shared.note_refusal(out)         # the rank guard's (labkit.course.forbid), if any
    dist.report(**out)
    dist.print0(f"{args.name} ({args.task}) on {ctx.world_size} ranks: "
                f"{'raised' if out['error'] else 'ran'}")
    dist.shutdown()


if __name__ == "__main__":
    main()
