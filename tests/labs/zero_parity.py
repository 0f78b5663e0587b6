"""Fixture lab for tests/test_zero.py: labkit's ZeRO stages against one process.

    torchrun --nproc-per-node 4 tests/labs/zero_parity.py

The model has a tied weight (embedding = output layer), a LayerNorm (replicated under ZeRO-3)
and a 25-wide hidden layer, so the parameter count (1,385) does not divide by 2 or 4: padding
shows. Every rank initialises it with its own seed; only the broadcast at construction makes
replicas equal. The reference is one process (rank 0's initial weights) trained with AdamW on
the whole batch; each rank trains on its shard of each batch. For each variant (VARIANTS), every
rank reports under its name: `param_diff` (max |param - the reference's| after STEPS steps, every
parameter name, tied ones under both), `replica_diff` (max |param - rank 0's|), `state` (its
measure.state_bytes after the last step, before zero_grad), `comm` (collectives of the second
step by phase: forward, backward, finish, step), `grad_dtypes` and `shard_dtypes`.
"""
from __future__ import annotations

import argparse

import torch
import torch.distributed as tdist
import torch.nn.functional as F
from torch import nn

from labkit.parallel.ddp import NaiveDDP
from labkit.parallel.zero import FullyShardedModel, ShardedGradientOptimizer, ShardedOptimizer
from labkit.runtime import dist
from labkit.runtime.measure import CollectiveCounter, state_bytes

V, D, H = 32, 16, 25            # vocabulary, width, hidden width (odd: padding)
BATCH, SEQ = 16, 4              # whole batch (divides by 2 and 4 ranks), tokens
LR, DECAY = 1e-2, 0.1
VARIANTS = ("zero1", "zero1_reduce", "zero2", "zero3", "zero3_bf16", "torch_zero")


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.fc1 = nn.Linear(D, H)
        self.fc2 = nn.Linear(H, D)
        self.norm = nn.LayerNorm(D)
        self.head = nn.Linear(D, V, bias=False)
        self.head.weight = self.emb.weight                       # tied

    def forward(self, idx):
        h = self.emb(idx)
        h = self.norm(h + self.fc2(torch.tanh(self.fc1(h))))
        return self.head(h)


def loss_fn(model, x, y):
    return F.cross_entropy(model(x).float().flatten(0, 1), y.flatten())   # mean over tokens


def batch(step: int):
    g = torch.Generator().manual_seed(1000 + step)        # the same batch on every rank
    return torch.randint(V, (BATCH, SEQ), generator=g), torch.randint(V, (BATCH, SEQ), generator=g)


def adamw(params):
    return torch.optim.AdamW(params, lr=LR, weight_decay=DECAY)


def build(variant, model):
    """(what forward runs, the optimizer, finish(): gradient synchronisation after backward)."""
    if variant == "zero1":
        ddp = NaiveDDP(model)
        return ddp, ShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=LR,
                                     weight_decay=DECAY), ddp.finish_gradient_synchronization
    if variant == "zero1_reduce":
        return model, ShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=LR,
                                       weight_decay=DECAY, reduce_gradients=True), lambda: None
    if variant == "zero2":
        return model, ShardedGradientOptimizer(model.parameters(), torch.optim.AdamW, lr=LR,
                                               weight_decay=DECAY), lambda: None
    if variant.startswith("zero3"):
        dtype = torch.bfloat16 if variant.endswith("bf16") else None
        fsdp = FullyShardedModel(model, compute_dtype=dtype)
        return fsdp, adamw(fsdp.parameters()), fsdp.finish_gradient_synchronization
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel
    ddp = DistributedDataParallel(model, broadcast_buffers=False)
    return ddp, ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, lr=LR,
                                        weight_decay=DECAY), lambda: None


def full_params(variant, wrapped, model) -> dict:
    if variant.startswith("zero3"):
        return wrapped.gather_full_params()
    return {n: p.detach() for n, p in model.named_parameters(remove_duplicate=False)}


def run(ctx, variant, steps):
    torch.manual_seed(100 + ctx.rank)
    model = Net()
    torch.manual_seed(100)                                 # rank 0's initial weights
    ref = Net()
    ref_opt = adamw(ref.parameters())
    wrapped, opt, finish = build(variant, model)
    rows = slice(ctx.rank * BATCH // ctx.world_size, (ctx.rank + 1) * BATCH // ctx.world_size)
    comm = {}
    for step in range(steps):
        x, y = batch(step)
        phases = {k: CollectiveCounter() for k in ("forward", "backward", "finish", "step")}
        with phases["forward"]:
            loss = loss_fn(wrapped, x[rows], y[rows])
        with phases["backward"]:
            loss.backward()
        with phases["finish"]:
            finish()
        with phases["step"]:
            opt.step()
        if step == steps - 1:
            state = state_bytes(wrapped, opt)
            grad_dtypes = sorted({str(p.grad.dtype) for p in wrapped.parameters()
                                  if p.grad is not None})
        opt.zero_grad()
        if step == 1:                                      # after one warm-up step
            comm = {k: c.by_kind for k, c in phases.items()}
        loss_fn(ref, x, y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    full = full_params(variant, wrapped, model)
    expected = dict(ref.named_parameters(remove_duplicate=False))
    mine = torch.cat([full[n].reshape(-1).float() for n in sorted(full)])
    rank0 = mine.clone()
    tdist.broadcast(rank0, src=0)
    return {"param_diff": max((full[n].float() - expected[n]).abs().max().item() for n in expected),
            "names": sorted(full) == sorted(expected),
            "replica_diff": (mine - rank0).abs().max().item(),
            "state": state.__dict__, "comm": comm, "grad_dtypes": grad_dtypes,
            "shard_dtypes": sorted({str(p.dtype) for p in wrapped.parameters()})}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    args = parser.parse_args(argv)
    ctx = dist.setup("gloo")
    dist.report(world_size=ctx.world_size)
    for variant in args.variants.split(","):
        dist.report(**{variant: run(ctx, variant, args.steps)})
    dist.shutdown()


if __name__ == "__main__":
    main()
