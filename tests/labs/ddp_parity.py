"""Fixture lab for tests/test_ddp.py: labkit's three reference DDPs against one process.

    torchrun --nproc-per-node 4 tests/labs/ddp_parity.py

The model has a tied weight (embedding = output layer), a frozen Linear and a buffer; every rank
initialises it with its own seed, so only the broadcast at construction makes replicas equal.
For each implementation (IMPLS), every rank reports under its name:
- train: STEPS steps of SGD (momentum, weight decay) on this rank's shard of each batch;
  `replica_diff` (max |param - rank 0's|), `frozen_diff` (frozen params vs their value after
  construction), `frozen_grads` (frozen params holding a gradient), and on rank 0 `param_diff`
  (max |param - a single process trained on the whole batch|, every parameter and buffer).
- comm: collectives of the second step, in backward and in finish (`by_kind`), and of the
  construction.
- accumulation: K micro-batches (the first K-1 in no_sync()); collectives inside no_sync and
  in the whole optimizer step, and on rank 0 `grad_diff` (max |grad - the whole batch's
  gradient in one process|).
- unused: a branch used on odd ranks only ("some") or on none ("none"): max |grad - the average
  of the local gradients| (computed with plain all-reduces).
Plus `buckets` (parameter names) of each bucketed variant.
"""
from __future__ import annotations

import argparse
import contextlib
import copy

import torch
import torch.distributed as tdist
import torch.nn.functional as F
from torch import nn

from labkit.parallel.ddp import MB, BucketedDDP, NaiveDDP, OverlappedDDP
from labkit.runtime import dist
from labkit.runtime.measure import CollectiveCounter

V, D, H = 32, 16, 24            # vocabulary, width, hidden width
BATCH, SEQ, K = 16, 4, 2        # whole batch (divides by 2 and 4 ranks), tokens, micro-batches
IMPLS = {
    "naive": NaiveDDP,
    "overlapped": OverlappedDDP,
    "bucketed": BucketedDDP,                                           # 25 MiB: one bucket
    "bucketed_1700B": lambda m: BucketedDDP(m, bucket_size_mb=1700 / MB),
    "bucketed_1B": lambda m: BucketedDDP(m, bucket_size_mb=1 / MB),    # a bucket per param
}


class Net(nn.Module):
    def __init__(self, branch: bool = False):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.fc1 = nn.Linear(D, H)
        self.fc2 = nn.Linear(H, D)
        self.frozen = nn.Linear(D, D).requires_grad_(False)
        self.branch = nn.Linear(D, D) if branch else None
        self.head = nn.Linear(D, V, bias=False)
        self.head.weight = self.emb.weight                       # tied
        self.register_buffer("scale", torch.rand(D) + 0.5)

    def forward(self, idx, use_branch: bool = False):
        h = self.emb(idx) * self.scale
        h = h + self.fc2(torch.tanh(self.fc1(h)))
        h = h + self.frozen(h)
        if use_branch:
            h = h + self.branch(h)
        return self.head(h)


def loss_fn(model, x, y, **kw):
    return F.cross_entropy(model(x, **kw).flatten(0, 1), y.flatten())   # mean over tokens


def batch(step: int):
    g = torch.Generator().manual_seed(1000 + step)        # the same batch on every rank
    return torch.randint(V, (BATCH, SEQ), generator=g), torch.randint(V, (BATCH, SEQ), generator=g)


def sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01)


def fresh(ctx, impl, branch=False):
    """A model initialised with this rank's own seed, rank 0's copy of it, and the wrapper."""
    torch.manual_seed(100 + ctx.rank)
    model = Net(branch)
    ref = copy.deepcopy(model)
    with CollectiveCounter() as comm:
        ddp = IMPLS[impl](model)
    return model, ref, ddp, comm.by_kind


def max_diff(a: dict, b: dict) -> float:
    return max((a[k].detach() - b[k].detach()).abs().max().item() for k in a)


def replica_diff(model) -> float:
    mine = torch.cat([t.detach().reshape(-1) for t in model.state_dict().values()])
    rank0 = mine.clone()
    tdist.broadcast(rank0, src=0)
    return (mine - rank0).abs().max().item()


def train(ctx, impl, steps):
    model, ref, ddp, construct = fresh(ctx, impl)
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    opt, ref_opt = sgd(ddp), sgd(ref)
    rows = slice(ctx.rank * BATCH // ctx.world_size, (ctx.rank + 1) * BATCH // ctx.world_size)
    for step in range(steps):
        x, y = batch(step)
        loss = loss_fn(ddp, x[rows], y[rows])
        with CollectiveCounter() as in_backward:
            loss.backward()
        with CollectiveCounter() as in_finish:
            ddp.finish_gradient_synchronization()
        opt.step()
        opt.zero_grad()
        if step == 1:                                   # after one warm-up step
            comm = {"construct": construct, "backward": in_backward.by_kind,
                    "finish": in_finish.by_kind}
        if ctx.rank == 0:
            loss_fn(ref, x, y).backward()
            ref_opt.step()
            ref_opt.zero_grad()
    named = dict(model.named_parameters())
    out = {"comm": comm, "replica_diff": replica_diff(model),
           "frozen_diff": max_diff({n: named[n] for n in frozen}, frozen),
           "frozen_grads": sum(named[n].grad is not None for n in frozen)}
    if ctx.rank == 0:
        out["param_diff"] = max_diff(model.state_dict(), ref.state_dict())
    return out


def accumulation(ctx, impl):
    model, ref, ddp, _ = fresh(ctx, impl)
    x, y = batch(99)
    per_rank = BATCH // ctx.world_size
    inside = []
    with CollectiveCounter() as per_step:
        for j in range(K):
            rows = slice(ctx.rank * per_rank + j * per_rank // K,
                         ctx.rank * per_rank + (j + 1) * per_rank // K)
            last = j == K - 1
            with contextlib.nullcontext() if last else ddp.no_sync():
                loss = loss_fn(ddp, x[rows], y[rows]) / K      # K equal micro-batches: a mean
                with CollectiveCounter() as comm:
                    loss.backward()
                    if not last:
                        ddp.finish_gradient_synchronization()  # inside no_sync: does nothing
                if not last:
                    inside.append(comm.by_kind)
        ddp.finish_gradient_synchronization()
    out = {"no_sync_comm": inside, "step_comm": per_step.by_kind}
    if ctx.rank == 0:
        loss_fn(ref, x, y).backward()
        out["grad_diff"] = max((p.grad - q.grad).abs().max().item()
                               for p, q in zip(model.parameters(), ref.parameters())
                               if p.requires_grad)
    return out


def unused(ctx, impl, who):
    model, _, ddp, _ = fresh(ctx, impl, branch=True)
    plain = Net(branch=True)
    plain.load_state_dict(model.state_dict())            # the broadcast weights, no hooks
    use = who == "some" and ctx.rank % 2 == 1
    x, y = batch(7)
    rows = slice(ctx.rank * 2, ctx.rank * 2 + 2)          # any rows: compared with the average
    loss_fn(ddp, x[rows], y[rows], use_branch=use).backward()
    ddp.finish_gradient_synchronization()
    loss_fn(plain, x[rows], y[rows], use_branch=use).backward()
    diff = 0.0
    for p, q in zip(model.parameters(), plain.parameters()):
        if not p.requires_grad:
            continue
        expected = torch.zeros_like(q) if q.grad is None else q.grad.clone()
        tdist.all_reduce(expected)
        diff = max(diff, (p.grad - expected / ctx.world_size).abs().max().item())
    return diff


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args(argv)
    ctx = dist.setup("gloo")
    dist.report(world_size=ctx.world_size)
    for impl in IMPLS:
        result = {"train": train(ctx, impl, args.steps), "accumulation": accumulation(ctx, impl),
                  "unused": {who: unused(ctx, impl, who) for who in ("some", "none")}}
        if impl.startswith("bucketed"):
            result["buckets"] = fresh(ctx, impl)[2].buckets
        dist.report(**{impl: result})
    dist.shutdown()


if __name__ == "__main__":
    main()
