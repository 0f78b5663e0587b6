"""The compile lab's --part ddp and --part fsdp: the same seeded Llama trained eagerly and
compiled, in the order each wrapper wants (DDP: wrap, then compile the DDP module, so that
DDPOptimizer splits the graph at bucket boundaries; FSDP2, as torchtitan: compile each block,
then fully_shard each block, then the root). Losses, step times, compile time and dynamo's
counts of each run are reported side by side.
"""
from __future__ import annotations

import copy

import torch

from labkit.labs.common.training import global_batch, shard, torch_buckets, torch_ddp
from labkit.labs.compile.tools import Counting, dynamo_stats, reset, train


def batches(args, ctx, seq=None) -> list:
    """This rank's shard of each step's batch (seq: tokens per sequence of each step)."""
    seqs = seq or [args.seq] * args.steps
    out = []
    for step, s in enumerate(seqs):
        ids = global_batch(args, ctx.world_size, step)
        if s > ids.shape[1]:
            ids = ids.repeat(1, -(-s // ids.shape[1]))
        out.append(shard(ids[:, :s].contiguous(), ctx))
    return out


def build(args, device, use_cache: bool = False):
    """The seeded Llama, for training: no KV cache (transformers builds one by default, even in
    training; dynamo guards on each block's cache state, so it recompiles every block: --part
    order's kv_cache case)."""
    from labkit.labs.common.zero_stages import build_model

    model = build_model(args, device)
    model.lm.config.use_cache = use_cache
    return model


def sgd(model, args):
    return torch.optim.SGD(model.parameters(), lr=args.lr)


def parity(eager: list, compiled: list, tol: float) -> dict:
    diff = max((abs(a - b) for a, b in zip(eager, compiled)), default=float("nan"))
    return dict(loss_max_diff=diff, tolerance=tol, parity_ok=bool(diff <= tol))


def run_ddp(args, ctx) -> dict:
    base = build(args, ctx.device)
    data = batches(args, ctx)
    runs = {}
    ddp = torch_ddp(copy.deepcopy(base), bucket_cap_mb=args.bucket_mb)
    runs["eager"] = train(ddp, sgd(ddp, args), data, ctx)
    runs["eager"]["ddp_buckets"] = torch_buckets(ddp)
    dist_progress(runs)
    reset()
    ddp = torch_ddp(copy.deepcopy(base), bucket_cap_mb=args.bucket_mb)
    counting = Counting(args.backend)
    compiled = torch.compile(ddp, backend=counting)
    runs["compiled"] = train(compiled, sgd(ddp, args), data, ctx, counting)
    runs["compiled"]["ddp_buckets"] = torch_buckets(ddp)
    runs["compiled"].update(dynamo_stats(counting))
    dist_progress(runs)
    n_params = sum(p.numel() for p in base.parameters())
    return dict(part="ddp", runs=runs, param_bytes=4 * n_params, num_params=n_params,
                bucket_mb=args.bucket_mb, optimize_ddp=str(torch._dynamo.config.optimize_ddp),
                **parity(runs["eager"]["losses"], runs["compiled"]["losses"], args.tol))


def fsdp_wrap(model, compile_blocks=None):
    """fully_shard each block, then the root; with compile_blocks (a backend), each block is
    compiled first (torchtitan's order: compile, then shard, block by block)."""
    from torch.distributed.fsdp import fully_shard

    for block in model.lm.model.layers:
        if compile_blocks is not None:
            block.compile(backend=compile_blocks)
        fully_shard(block)
    fully_shard(model)
    return model


def run_fsdp(args, ctx) -> dict:
    base = build(args, ctx.device)
    data = batches(args, ctx)
    runs = {}
    model = fsdp_wrap(copy.deepcopy(base))
    runs["eager"] = train(model, sgd(model, args), data, ctx)
    dist_progress(runs)
    reset()
    counting = Counting(args.backend)
    model = fsdp_wrap(copy.deepcopy(base), compile_blocks=counting)
    runs["compiled"] = train(model, sgd(model, args), data, ctx, counting)
    runs["compiled"].update(dynamo_stats(counting))
    dist_progress(runs)
    return dict(part="fsdp", runs=runs, blocks=args.layers,
                **parity(runs["eager"]["losses"], runs["compiled"]["losses"], args.tol))


def dist_progress(runs) -> None:
    from labkit.runtime import dist

    name, r = list(runs.items())[-1]
    dist.progress(len(runs), 2, run=name, loss=r["losses"][-1])
