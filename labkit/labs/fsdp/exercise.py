"""Your FSDP2 code on real ranks, measured: the runner of module 05's exercises.

    torchrun --nproc-per-node 2 -m labkit.labs.fsdp.exercise --task wrap --source my.py --name shard
    torchrun --nproc-per-node 2 -m labkit.labs.fsdp.exercise --task policy --param-dtype bf16
    torchrun --nproc-per-node 2 -m labkit.labs.fsdp.exercise --task resume --source my.py \
        --name save_checkpoint --load-name load_checkpoint --ckpt-dir /tmp/ckpt

From a notebook, pass the functions or the policy themselves (the model: docs/labs.md, ## fsdp;
each task's contract and checks: its run_user_* function's docstring):
    from labkit.labs.fsdp.exercise import run_user_wrap, run_user_policy, run_user_resume
    r = run_user_wrap(shard_per_block, nproc=4)          # r.ok, r.problems(), print(r.summary())
"""
from __future__ import annotations

import argparse
import inspect
import os
import tempfile

import torch

from labkit.labs.common import exercise as shared
from labkit.labs.fsdp.check import ResumeCheck, WrapCheck
from labkit.labs.common.exercise import where_raised, run_exported, stub_message
from labkit.labs.common.exercise import check_nproc, collectives_of
from labkit.labs.common.tiny_llama import LR, ROWS, SEED, SGD_LR, SPEC, plain_step, batch, build, full_params, max_diff

TASKS = ("wrap", "policy", "resume")
DEFAULT_TIMEOUT = 60          # seconds; a correct run takes a few seconds once the pool is warm
DTYPE_NAMES = {None: "none", torch.float32: "fp32", torch.bfloat16: "bf16",
               torch.float16: "fp16"}



def _stub(fn, *args) -> None:
    msg = stub_message(fn.__name__, [lambda: fn(*args)])
    if msg:
        raise NotImplementedError(msg)


def _function(name: str, fn) -> None:
    if not inspect.isfunction(fn):
        raise ValueError(f"{name} takes a function defined in a notebook cell or a .py file; "
                         f"received {fn!r} (a {type(fn).__name__})")


def run_user_wrap(fn, nproc: int = 4, timeout: float = DEFAULT_TIMEOUT,
                  quiet: bool = True) -> WrapCheck:
    """Run `fn(model)` (your function that applies fully_shard) on `nproc` ranks.
    NotImplementedError for a stub, ValueError for bad arguments,
    labkit.runtime.launch.LabError when a rank fails outside your code or runs out of time.

    `fn(model)` applies FSDP2 (`fully_shard`) to the model in place (the model and its SGD
    training: docs/labs.md, ## fsdp). Measured: the FSDP units (module names), each rank's
    parameter bytes, the collectives of a step after a warm-up one (CollectiveCounter: count,
    payload bytes, dtype of every all-gather and reduce-scatter), and, after 3 steps, the full
    parameters against one process trained on the whole batch."""
    nproc = check_nproc(nproc)
    _function("run_user_wrap", fn)
    _stub(fn, torch.nn.Linear(2, 2))
    res = run_exported(fn, "labkit.labs.fsdp.exercise", nproc, timeout, quiet,
                       ["--task", "wrap"],
                       "the ranks did not shard the same modules in the same order")
    return WrapCheck.from_reports([res.results[r] for r in range(nproc)], name=fn.__name__,
                                  output=res.output)


def run_user_policy(policy, nproc: int = 2, timeout: float = DEFAULT_TIMEOUT,
                    quiet: bool = True) -> WrapCheck:
    """labkit's shard_model with `policy`'s param_dtype and reduce_dtype (a
    torch.distributed.fsdp.MixedPrecisionPolicy) on `nproc` ranks: what each collective sends.

    labkit's `shard_model` (per block, then the root) with your MixedPrecisionPolicy's
    param_dtype and reduce_dtype; the same measurements as `run_user_wrap`."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from labkit.runtime.launch import run_lab

    nproc = check_nproc(nproc)
    if not isinstance(policy, MixedPrecisionPolicy):
        raise ValueError(f"run_user_policy takes a torch.distributed.fsdp.MixedPrecisionPolicy; "
                         f"received {policy!r} (a {type(policy).__name__})")
    names = []
    for field in ("param_dtype", "reduce_dtype"):
        value = getattr(policy, field)
        if value not in DTYPE_NAMES:
            raise ValueError(f"policy.{field}={value}: allowed None, torch.float32, "
                             "torch.bfloat16, torch.float16")
        names.append(DTYPE_NAMES[value])
    res = run_lab("labkit.labs.fsdp.exercise", nproc=nproc, timeout=timeout, quiet=quiet,
                  args=["--task", "policy", "--param-dtype", names[0], "--reduce-dtype", names[1]])
    return WrapCheck.from_reports([res.results[r] for r in range(nproc)], name="your policy",
                                  output=res.output)


def run_user_resume(save, load, nproc: int = 2, steps: int = 6, save_at: int = 3,
                    timeout: float = DEFAULT_TIMEOUT, quiet: bool = True) -> ResumeCheck:
    """Run your `save(model, optimizer, path)` and `load(model, optimizer, path)` (defined in
    one cell) on `nproc` ranks.

    The ranks train `steps` steps (AdamW); then again from the start, saving after `save_at`
    steps, and a model built from other weights (and a fresh AdamW) is loaded and trained on.
    Measured: the losses after the resume against the uninterrupted run's, the parameters right
    after the load against those saved, and the files the save wrote."""
    from labkit.validate import positive_int

    nproc = check_nproc(nproc)
    steps, save_at = positive_int("steps", steps, 50), positive_int("save_at", save_at, 50)
    if save_at >= steps:
        raise ValueError(f"save_at={save_at} must be below steps={steps}: some steps must "
                         "follow the resume")
    _function("run_user_resume", save)
    _function("run_user_resume", load)
    if save.__code__.co_filename != load.__code__.co_filename:
        raise ValueError(f"define {save.__name__} and {load.__name__} in the same cell: the "
                         "ranks import that cell")
    for fn in (save, load):
        _stub(fn, torch.nn.Linear(2, 2), None, "/nonexistent")
    with tempfile.TemporaryDirectory(prefix="labkit-ckpt-") as tmp:
        res = run_exported(save, "labkit.labs.fsdp.exercise", nproc, timeout, quiet,
                           ["--task", "resume", "--load-name", load.__name__, "--ckpt-dir",
                            os.path.join(tmp, "step"), "--steps", str(steps),
                            "--save-at", str(save_at)],
                           "a rank skipped a collective the others issued (call dcp.save and "
                           "dcp.load on every rank, not only on rank 0)")
    return ResumeCheck.from_reports([res.results[r] for r in range(nproc)], name=save.__name__,
                                    load_name=load.__name__, save_at=save_at,
                                    output=res.output)


# ---------------------------------------------------------------------------------------------
# inside a rank


def train_step(model, opt, step: int, rank: int, world: int, whole: bool = False) -> float:
    """One AdamW step on this rank's rows (`whole`: on every rank's rows, in one process); the
    loss averaged over the ranks."""
    import torch.distributed as dist

    tokens = batch(step, ROWS * world)
    if whole:
        return plain_step(model, opt, tokens)
    loss = plain_step(model, opt, tokens[rank * ROWS:(rank + 1) * ROWS])
    mean = torch.tensor(loss)
    dist.all_reduce(mean)
    return float(mean) / world



def _wrap_task(shard, args, ctx, out: dict) -> None:
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    from labkit.parallel.fsdp import shard_model, transformer_blocks

    model = build(SEED)
    names = {id(m): n for n, m in model.named_modules()}
    out["blocks"] = [names[id(b)] for b in transformer_blocks(model)]
    out["params"] = sum(p.numel() for p in model.parameters())
    if shard is None:
        shard_model(model, param_dtype=args.param_dtype, reduce_dtype=args.reduce_dtype)
    else:
        shard(model)
    out["units"] = [n for n, m in model.named_modules() if isinstance(m, FSDPModule)]
    out["local_bytes"] = sum((p.to_local() if isinstance(p, DTensor) else p).numel()
                             * p.element_size() for p in model.parameters())
    out["unsharded"] = [n for n, p in model.named_parameters() if not isinstance(p, DTensor)]
    single = build(SEED)
    # SGD: AdamW's normalised first steps would turn rounding into 1e-4 differences
    opt = torch.optim.SGD(model.parameters(), lr=SGD_LR)
    opt1 = torch.optim.SGD(single.parameters(), lr=SGD_LR)
    for step in range(3):
        if step == 1:
            out["collectives"] = collectives_of(
                lambda: train_step(model, opt, step, ctx.rank, ctx.world_size))
        else:
            train_step(model, opt, step, ctx.rank, ctx.world_size)
        train_step(single, opt1, step, 0, ctx.world_size, whole=True)
    out["diff_single"] = max_diff(full_params(model), full_params(single))


def _resume_task(save, load, args, ctx, out: dict) -> None:
    import torch.distributed as dist

    from labkit.parallel.fsdp import shard_model

    def fresh(seed):
        model = shard_model(build(seed))
        return model, torch.optim.AdamW(model.parameters(), lr=LR)

    rank, world = ctx.rank, ctx.world_size
    model, opt = fresh(SEED)
    out["uninterrupted"] = [train_step(model, opt, s, rank, world) for s in range(args.steps)]
    model, opt = fresh(SEED)
    out["before"] = [train_step(model, opt, s, rank, world) for s in range(args.save_at)]
    saved = full_params(model)
    save(model, opt, args.ckpt_dir)
    dist.barrier()
    out["files"] = sorted(os.listdir(args.ckpt_dir)) if os.path.isdir(args.ckpt_dir) else []
    model, opt = fresh(SEED + 1)               # other weights, no optimizer state
    load(model, opt, args.ckpt_dir)
    out["loaded_diff"] = max_diff(full_params(model), saved)
    out["resumed"] = [train_step(model, opt, s, rank, world)
                      for s in range(args.save_at, args.steps)]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description="check a learner's FSDP2 code on ranks")
    p.add_argument("--task", choices=TASKS, required=True)
    p.add_argument("--source", help="a .py file defining the function(s)")
    p.add_argument("--name", help="the function: wrap's shard, resume's save")
    p.add_argument("--load-name", help="resume's load function")
    p.add_argument("--param-dtype", default="none", choices=("none", "fp32", "bf16", "fp16"))
    p.add_argument("--reduce-dtype", default="none", choices=("none", "fp32", "bf16", "fp16"))
    p.add_argument("--ckpt-dir", help="resume: where the checkpoint goes")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--save-at", type=int, default=3)
    args = p.parse_args(argv)
    args.param_dtype, args.reduce_dtype = (None if d == "none" else d
                                           for d in (args.param_dtype, args.reduce_dtype))

    from labkit.runtime import dist
    ctx = dist.setup()
    torch.set_num_threads(1)
    out = {"error": ""}
    try:
        if args.task == "policy":
            _wrap_task(None, args, ctx, out)
        elif args.task == "wrap":
            _wrap_task(shared.load_source(args.source, args.name), args, ctx, out)
        else:
            _resume_task(shared.load_source(args.source, args.name),
                         shared.load_source(args.source, args.load_name), args, ctx, out)
    except Exception as exc:  # noqa: BLE001 - the learner's code may raise anything
        who = " / ".join(n for n in (args.name, args.load_name) if n) or "policy"
        out["error"] = f"your {who} raised {where_raised(exc, args.source)}"
    shared.note_refusal(out)         # the rank guard's (labkit.course.forbid), if any
    dist.report(**out)
    dist.print0(f"{args.task} on {ctx.world_size} ranks: {'raised' if out['error'] else 'ran'}")
    dist.shutdown()


__all__ = ["run_user_wrap", "run_user_policy", "run_user_resume", "SPEC", "build", "main"]

if __name__ == "__main__":
    main()
