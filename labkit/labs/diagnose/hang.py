"""Fixture lab of module 09's "diagnose this run" cases (labkit.labs.diagnose): data parallelism
with a hand-written data split that is uneven, so one rank skips the last gradient all-reduce
and the others wait for it.

    torchrun --nproc-per-node 2 -m labkit.labs.diagnose.hang --samples 15
    labkit run labkit.labs.diagnose.hang -n 2 -- --samples 15 --batch 2 --timeout 3

How the ranks part ways and why gloo's timeout ends the run: docs/labs.md, ## diagnose.
"""
from __future__ import annotations

import argparse
import datetime
import time

import torch
import torch.distributed as tdist
from torch.distributed.elastic.multiprocessing.errors import record

from labkit.labs.common.flags import between, check_heads, positive_int
from labkit.labs.common.training import build_model, trainable
from labkit.runtime import dist


def my_samples(samples: int, world: int, rank: int) -> list[int]:
    """This rank's sample indices: every world-th from its rank, no padding."""
    return list(range(rank, samples, world))


def run(args, ctx) -> None:
    from labkit.labs.diagnose.ddp import clock

    # The training collectives run in a process group with --timeout (the launcher's default is
    # far longer, so that a real hang is reported by the launcher instead).
    group = tdist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=args.timeout))
    mine = my_samples(args.samples, ctx.world_size, ctx.rank)
    steps = len(mine) // args.batch
    model = build_model(args, ctx.device)
    params = trainable(model)
    opt = torch.optim.SGD(params, lr=args.lr)
    data = torch.randint(0, args.vocab, (args.samples, args.seq),
                         generator=torch.Generator().manual_seed(args.seed))
    print(f"{len(mine)} samples of {args.samples}: {steps} steps of {args.batch}", flush=True)
    dist.report(samples=len(mine), steps=steps, batch=args.batch, timeout=args.timeout)
    now = clock(ctx)                     # a barrier (default group): every rank built its model
    entered, allreduce_s, losses = [], [], []

    # Every rank keeps a record of the collectives it entered (step, kind, when: what NCCL's
    # flight recorder keeps) and reports it before each one, so the failed run's result says
    # where each rank was when it stopped.
    def collective(kind: str, step: int, fn) -> None:
        entered.append(dict(kind=kind, step=step, start=now()))
        dist.report(collectives=entered, allreduce_s=allreduce_s, losses=losses)
        fn()
        entered[-1]["end"] = now()

    for step in range(1, steps + 1):
        ids = data[mine[(step - 1) * args.batch:step * args.batch]]
        loss = model(ids)
        loss.backward()
        losses.append(loss.item())
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        t = time.perf_counter()
        collective("all_reduce", step, lambda: tdist.all_reduce(flat, group=group))
        allreduce_s.append(time.perf_counter() - t)
        flat /= ctx.world_size
        offset = 0
        for p in params:
            p.grad.copy_(flat[offset:offset + p.numel()].view_as(p.grad))
            offset += p.numel()
        opt.step()
        opt.zero_grad()
        print(f"step {step}/{steps}: loss {loss.item():.4f}, gradient all-reduce "
              f"{1e3 * allreduce_s[-1]:.1f} ms", flush=True)
    print(f"finished my {steps} steps; saving a checkpoint and waiting for the other ranks",
          flush=True)
    collective("barrier", steps, lambda: tdist.barrier(group=group))
    dist.report(collectives=entered, allreduce_s=allreduce_s, losses=losses)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--samples", type=positive_int, default=15,
                   help="samples in the dataset (default 15)")
    p.add_argument("--batch", type=positive_int, default=2, help="samples per step (default 2)")
    p.add_argument("--timeout", type=between(0.1, 600, "seconds"), default=3.0,
                   help="collective timeout of the training process group (default 3 s)")
    p.add_argument("--layers", type=positive_int, default=2, help="GPT-2 layers (default 2)")
    p.add_argument("--hidden", type=positive_int, default=64, help="hidden size (default 64)")
    p.add_argument("--heads", type=positive_int, default=4, help="attention heads (default 4)")
    p.add_argument("--vocab", type=positive_int, default=1024, help="vocabulary (default 1024)")
    p.add_argument("--seq", type=positive_int, default=32, help="tokens per sequence (default 32)")
    p.add_argument("--lr", type=between(1e-9, 10, "a learning rate"), default=0.1)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    check_heads(p, args, kv=False)
    return args


@record
def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    ctx = dist.setup()
    run(args, ctx)
    dist.shutdown()


if __name__ == "__main__":
    main()
