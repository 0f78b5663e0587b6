"""Fixture lab of module 09's "diagnose this run" cases (labkit.labs.diagnose): torch DDP on the
DDP lab's GPT-2 (labkit.labs.ddp: model, data, step), with a fault injected, measured as a
learner would see it, the healthy configuration beside it in the same run.

    torchrun --nproc-per-node 2 -m labkit.labs.diagnose.ddp --part straggler
    labkit run labkit.labs.diagnose.ddp -n 2 -- --part straggler --slow-rank 1 --sleep 0.05
    labkit run labkit.labs.diagnose.ddp -n 2 -- --part buckets --bucket-mb 0.001

What each part injects and reports (labkit.runtime.measure.CollectiveCounter,
labkit.labs.common.ddp_measure, labkit.scaling.ddp_step_time): docs/labs.md, ## diagnose.
"""
from __future__ import annotations

import argparse
import copy
import time

import torch
from torch.distributed.elastic.multiprocessing.errors import record

from labkit.labs.common.training import barrier, global_batch, shard, torch_ddp, train_step, trainable
from labkit.labs.common.flags import between, positive_int
from labkit.labs.common.training import build_model, torch_buckets
from labkit.runtime import dist, measure

PARTS = ("straggler", "buckets")
DEFAULT_CAP_MB = 25.0          # torch DDP's bucket_cap_mb default
WARMUP = 2                     # torch DDP rebuilds its buckets in the second forward


def clock(ctx):
    """A clock the ranks agree on: seconds since rank 0's reading after a barrier (one host:
    CLOCK_MONOTONIC is shared by its processes; labkit.labs.common.pipeline.origin)."""
    from labkit.labs.common.pipeline import origin

    t0 = origin() if ctx.world_size > 1 else time.perf_counter()
    return lambda: time.perf_counter() - t0


# ---------------------------------------------------------------------------------------------
# --part straggler

def straggler_step(model, opt, ids, now, extra: float) -> dict:
    """One DDP step, its phases timed on `now`: forward, extra (a sleep of `extra` s, on the slow
    rank only), backward (includes the wait for the gradient all-reduce), optimizer."""
    t = {"start": now()}
    loss = model(ids)
    t["forward"] = now()
    if extra:
        time.sleep(extra)
    t["extra"] = now()
    loss.backward()
    t["backward"] = now()
    opt.step()
    opt.zero_grad()
    t["end"] = now()
    return t


def run_straggler(args, ctx) -> dict:
    model = torch_ddp(build_model(args, ctx.device), bucket_cap_mb=DEFAULT_CAP_MB)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    now = clock(ctx)
    step = 0
    for _ in range(WARMUP):
        straggler_step(model, opt, shard(global_batch(args, ctx.world_size, step), ctx), now, 0)
        step += 1
    steps, calls = [], {}
    for phase in ("healthy", "straggler"):
        extra = args.sleep if phase == "straggler" and ctx.rank == args.slow_rank else 0.0
        with measure.CollectiveCounter() as counter:      # one untimed step, counted
            straggler_step(model, opt, shard(global_batch(args, ctx.world_size, step), ctx),
                           now, extra)
        step += 1
        calls[phase] = dict(zip(("calls", "bytes"), counter.by_kind.get("all_reduce", (0, 0))))
        for _ in range(args.steps):
            t = straggler_step(model, opt, shard(global_batch(args, ctx.world_size, step), ctx),
                               now, extra)
            steps.append(dict(t, phase=phase, step=step))
            step += 1
    per_rank = [None] * ctx.world_size
    if ctx.world_size > 1:
        torch.distributed.all_gather_object(per_rank, steps)
    else:
        per_rank = [steps]
    return dict(part="straggler", rank=ctx.rank, world_size=ctx.world_size, sleep=args.sleep,
                slow_rank=args.slow_rank, steps=args.steps, allreduce=calls,
                num_params=sum(p.numel() for p in trainable(model.module)),
                timings=per_rank if ctx.rank == 0 else None)


SHOWN = {"healthy": "before", "straggler": "after"}    # phase names as the log shows them


def print_straggler(r: dict) -> None:
    # The log is a diagnosis case's evidence: it says what was measured, never the cause
    # (which rank sleeps, and that it is a straggler, is the answer the learner works out).
    print(f"torch DDP, {r['world_size']} ranks, {r['num_params']:,} parameters; {r['steps']} "
          f"steps ('before'), then {r['steps']} more after the job changed ('after')")
    for rank, steps in enumerate(r["timings"]):
        for s in steps:
            print(f"rank {rank} step {s['step']:>2} ({SHOWN[s['phase']]:<6}): step "
                  f"{1e3 * (s['end'] - s['start']):6.1f} ms = forward "
                  f"{1e3 * (s['forward'] - s['start']):5.1f} + other work "
                  f"{1e3 * (s['extra'] - s['forward']):5.1f} + backward incl. all-reduce wait "
                  f"{1e3 * (s['backward'] - s['extra']):5.1f} + optimizer "
                  f"{1e3 * (s['end'] - s['backward']):4.1f}")


# ---------------------------------------------------------------------------------------------
# --part buckets

def run_buckets(args, ctx) -> dict:
    from types import SimpleNamespace

    from labkit.labs.common.ddp_measure import Timeline, link_figures
    from labkit.plots.timeline import summarize

    base = build_model(args, ctx.device)
    n_params = sum(p.numel() for p in trainable(base))
    caps = {"small": args.bucket_mb, "default": DEFAULT_CAP_MB}
    models = {k: torch_ddp(copy.deepcopy(base), bucket_cap_mb=cap) for k, cap in caps.items()}
    models["local"] = copy.deepcopy(base)
    opts = {k: torch.optim.SGD(m.parameters(), lr=args.lr) for k, m in models.items()}
    times = {k: [] for k in models}
    counted, timeline = {}, {}
    for step in range(WARMUP + 2 + args.steps):
        ids = shard(global_batch(args, ctx.world_size, step), ctx)
        for kind, model in models.items():
            barrier(ctx)
            if step == WARMUP:
                with measure.CollectiveCounter() as counted[kind]:
                    train_step(model, opts[kind], ids)
            elif step == WARMUP + 1:
                module = model if kind == "local" else model.module
                with Timeline(module) as tl:
                    train_step(model, opts[kind], ids, mark=tl.mark)
                timeline[kind] = tl.events
            else:
                t = time.perf_counter()
                train_step(model, opts[kind], ids)
                if step > WARMUP:
                    times[kind].append(time.perf_counter() - t)
    calls = {k: dict(zip(("calls", "bytes"), counted[k].by_kind.get("all_reduce", (0, 0))))
             for k in models}
    # fitted to this run's all-reduces; labkit.hardware's loopback when the fit fails
    link = link_figures(SimpleNamespace(link="measured"), ctx, 4 * n_params)
    return dict(part="buckets", rank=ctx.rank, world_size=ctx.world_size, num_params=n_params,
                param_tensors=len(trainable(base)), gradient_bytes=4 * n_params, caps=caps,
                allreduce=calls, torch_buckets={k: torch_buckets(models[k]) for k in caps},
                # the shortest step of each configuration (timeit's rule: the configurations take
                # turns each step, and a busy machine only lengthens a step)
                step_times=times, step_s={k: min(v) for k, v in times.items()},
                timeline=timeline, timeline_summary={k: summarize(v) for k, v in
                                                     timeline.items()}, link=link)


def print_buckets(r: dict) -> None:
    print(f"torch DDP, {r['world_size']} ranks, {r['num_params']:,} parameters in "
          f"{r['param_tensors']} tensors: {r['gradient_bytes']:,} B of fp32 gradients per step")
    for kind in ("small", "default", "local"):
        s = r["timeline_summary"][kind]
        cap = f"bucket_cap_mb={r['caps'][kind]:g}" if kind in r["caps"] else "no DDP"
        print(f"{cap:<22} all-reduces/step {r['allreduce'][kind]['calls']:>3}  step "
              f"{1e3 * r['step_s'][kind]:6.1f} ms  all-reduce busy {1e3 * s['comm_busy']:5.1f} ms,"
              f" exposed after the backward {1e3 * s['exposed']:5.1f} ms")


# ---------------------------------------------------------------------------------------------
# the command line

def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--part", choices=PARTS, required=True)
    p.add_argument("--layers", type=positive_int, default=2, help="GPT-2 layers (default 2)")
    p.add_argument("--hidden", type=positive_int, default=64, help="hidden size (default 64)")
    p.add_argument("--heads", type=positive_int, default=4, help="attention heads (default 4)")
    p.add_argument("--vocab", type=positive_int, default=1024, help="vocabulary (default 1024)")
    p.add_argument("--seq", type=positive_int, default=32, help="tokens per sequence (default 32)")
    p.add_argument("--batch", type=positive_int, default=2, help="sequences per rank (default 2)")
    p.add_argument("--steps", type=positive_int, default=4,
                   help="timed steps per phase (straggler) or configuration (buckets); default 4")
    p.add_argument("--lr", type=between(1e-9, 10, "a learning rate"), default=0.1)
    p.add_argument("--sleep", type=between(0, 10, "a number of seconds"), default=0.05,
                   help="straggler: the slow rank's extra seconds per step (default 0.05)")
    p.add_argument("--slow-rank", type=int, default=1, help="straggler: the slow rank (default 1)")
    p.add_argument("--bucket-mb", type=between(1e-6, 1e6, "MiB"), default=0.001,
                   help="buckets: the small bucket_cap_mb (default 0.001)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.hidden % args.heads:
        p.error(f"argument --heads: {args.heads} does not divide --hidden {args.hidden}; "
                f"allowed: a divisor of {args.hidden}")
    return args, p


@record
def main(argv: list[str] | None = None) -> None:
    args, parser = parse_args(argv)
    ctx = dist.setup()
    if args.part == "straggler" and not 0 <= args.slow_rank < ctx.world_size:
        parser.error(f"argument --slow-rank: {args.slow_rank} is not a rank of this run; "
                     f"allowed: 0 to {ctx.world_size - 1}")
    run, show = {"straggler": (run_straggler, print_straggler),
                 "buckets": (run_buckets, print_buckets)}[args.part]
    result = run(args, ctx)
    if ctx.rank == 0:
        show(result)
    dist.report(**result)
    dist.shutdown()


if __name__ == "__main__":
    main()
