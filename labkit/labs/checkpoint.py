"""Crash lab: train with FSDP2, checkpoint every K steps, kill a rank, resume: the same losses.

    labkit run checkpoint -n 4 -- --steps 8 --save-every 2 --ckpt-dir /tmp/ck              # clean
    labkit run checkpoint -n 4 -- --steps 8 --save-every 2 --ckpt-dir /tmp/ck2 --crash-at-step 5
    labkit run checkpoint -n 4 -- --steps 8 --save-every 2 --ckpt-dir /tmp/ck2 --resume
    labkit run checkpoint -n 2 -- --steps 8 --save-every 2 --ckpt-dir /tmp/ck2 --resume  # 4 -> 2

From a notebook: `run_lab("labkit.labs.checkpoint", nproc=4, args=[...])`; the crash run raises
LabError naming the killed rank and its signal; `err.result.results[0]["losses"]` holds what
rank 0 reported before. --resume skips a damaged checkpoint and says so. Built on
labkit.parallel.fsdp and labkit.parallel.checkpoint (DCP); more: docs/labs.md, ## checkpoint.
"""
from __future__ import annotations

import argparse
import os
import signal

from torch.distributed.elastic.multiprocessing.errors import record

from labkit.labs.common.flags import positive_int, unwritable
from labkit.parallel import checkpoint
from labkit.runtime import dist
from labkit.labs.common.fsdp_lm import (batch, check_model_flags, check_world, finish_step,
                                        killed_rank, model_flags, sharded)
from labkit.labs.common.resume import LoadError, config, intact, other_flags, resume


def run(args, ctx) -> dict:
    check_world(args, ctx)
    crash_rank = killed_rank(args.crash_rank, "--crash-rank", args.crash_at_step, ctx)
    model, opt = sharded(args)
    n_params = sum(p.numel() for p in model.parameters())
    start, losses, saves = 0, [], []
    if args.resume:
        if getattr(args, "skipped", None):
            many = "s" * (len(args.skipped) > 1)
            dist.print0(f"--resume: skipped the damaged checkpoint{many} of " + "; ".join(
                f"step {s} ({why})" for s, why in args.skipped) + "; resuming "
                f"from step {args.resume_from[0]}, the newest intact one")
        start, losses = resume(args, model, opt)
        dist.print0(f"resumed from step {start} (saved by "
                    f"{checkpoint.info(checkpoint.step_dir(args.ckpt_dir, start))['world_size']}"
                    f" ranks) on {ctx.world_size} ranks")
    out = {"world_size": ctx.world_size, "num_params": n_params, "resumed_from":
           start if args.resume else None, "saves": saves, "losses": losses}
    for step in range(start + 1, args.steps + 1):
        loss = model(input_ids=batch(args, step, ctx), labels=batch(args, step, ctx)).loss
        if step == args.crash_at_step and ctx.rank == crash_rank:
            print(f"rank {ctx.rank}: killing myself with SIGKILL at step {step}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        losses.append([step, finish_step(loss, opt, ctx)])
        if args.ckpt_dir and step % args.save_every == 0:
            checkpoint.save(model, opt, step, args.ckpt_dir,
                            extra={"losses": losses, "config": config(args)})
            saves.append(step)
        dist.progress(step, args.steps, loss=losses[-1][1])
        if ctx.rank == 0:
            dist.report(**out)
    return out


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=positive_int, default=8, help="steps in all (default 8)")
    p.add_argument("--save-every", type=positive_int, default=None,
                   help="checkpoint after every K-th step (default 2 with --ckpt-dir)")
    p.add_argument("--ckpt-dir", default=None, help="where checkpoints go (default: none saved)")
    p.add_argument("--crash-at-step", type=positive_int, default=None,
                   help="kill --crash-rank with SIGKILL during this step, after its forward")
    p.add_argument("--crash-rank", type=int, default=None,
                   help="the rank killed (default: the last rank)")
    p.add_argument("--resume", action="store_true",
                   help="load the newest intact checkpoint in --ckpt-dir and go on")
    model_flags(p)
    return p


def parse_args(argv=None):
    """The flags, checked before any work: the ranks of this run (WORLD_SIZE), --ckpt-dir
    writable, --resume's checkpoint intact and of the same flags."""
    p = _parser()
    args = p.parse_args(argv)
    check_model_flags(p, args)
    world = dist.world_size()
    if args.global_batch % world:
        p.error(f"argument --global-batch: {args.global_batch} does not split across {world} "
                f"ranks; allowed: a multiple of {world}")
    if args.crash_at_step is not None and args.crash_at_step > args.steps:
        p.error(f"argument --crash-at-step: {args.crash_at_step} is after the last step; "
                f"allowed: 1 to --steps ({args.steps})")
    if args.crash_rank is not None and args.crash_rank < 0:
        p.error(f"argument --crash-rank: {args.crash_rank} is not a rank; allowed: 0 or more")
    if args.crash_at_step is not None and (args.crash_rank or 0) >= world:
        p.error(f"argument --crash-rank: {args.crash_rank} is not a rank of this run ({world} "
                f"ranks); allowed: 0 to {world - 1}")
    if args.ckpt_dir is None and (args.resume or args.save_every is not None):
        p.error("argument --ckpt-dir: needed by --resume and --save-every; allowed: a folder")
    if args.ckpt_dir is not None and unwritable(args.ckpt_dir):
        p.error(f"argument --ckpt-dir: {unwritable(args.ckpt_dir)}; allowed: a folder this user "
                "can write (made if missing)")
    if args.save_every is None:
        args.save_every = 2
    if args.resume:
        found, args.skipped = intact(args.ckpt_dir)
        if found is None and args.skipped:
            p.error(f"argument --resume: no intact checkpoint in {args.ckpt_dir!r}: " + "; ".join(
                f"step {s} ({why})" for s, why in args.skipped) + "; allowed: a folder with an "
                "intact one, or run without --resume (the damaged ones are left as they are)")
        if found is None:
            p.error(f"argument --resume: no complete checkpoint in {args.ckpt_dir!r} (a "
                    "step_XXXXXX folder with .metadata and labkit.json); run without --resume "
                    "first, with --save-every K smaller than the crash step")
        args.resume_from = found
        if other_flags(found[1], args):
            p.error(f"argument --resume: the checkpoint {found[1]!r} was saved by a run with "
                    f"other flags ({other_flags(found[1], args)}); allowed: the same flags (the "
                    "world size may differ)")
        if found[0] >= args.steps:
            p.error(f"argument --steps: {args.steps} steps are done already (the checkpoint is "
                    f"of step {found[0]}); allowed: more than {found[0]}")
    return args


@record
def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    ctx = dist.setup()
    try:
        run(args, ctx)
    except LoadError as exc:     # every rank: one line, no traceback
        p = _parser()
        p.exit(2, f"{p.prog}: error: {exc}\n")
    dist.shutdown()


if __name__ == "__main__":
    main()
