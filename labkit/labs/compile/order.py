"""The compile lab's --part order: what goes wrong when the order is not the one each wrapper
wants, measured on this torch, each case caught and reported as data (never a crash):

  fsdp_whole        fully_shard each block and the root first, then torch.compile the whole model
  ddp_compile_first torch.compile the module, then wrap it in DDP (wrap first: --part ddp)
  small_bucket      compiled DDP with bucket_cap_mb below DDP's 1 MiB first bucket
  recompiles        a new sequence length every step: automatic dynamic shapes vs dynamic=False
                    with a recompile limit (torch._dynamo.config.recompile_limit), on one MLP
  kv_cache          each block compiled, transformers' KV cache on (its default) and off, on a
                    Llama 2 blocks deeper than that limit
"""
from __future__ import annotations

import copy

import torch

from labkit.labs.common.training import torch_buckets, torch_ddp
from labkit.labs.compile.parts import batches, build, fsdp_wrap, parity, sgd
from labkit.labs.compile.tools import Counting, dynamo_stats, first_line, reset, train
from labkit.runtime import dist


def attempt(make, data, ctx, args, loss_of=None) -> dict:
    """Build with make(backend) -> (model to call, module to optimize), train on data; an
    exception becomes data: its type and first line."""
    reset()
    counting = Counting(args.backend)
    try:
        model, module = make(counting)
        out = train(model, sgd(module, args), data, ctx, counting, loss_of)
        out["error"] = None
        out["module"] = module
    except Exception as exc:          # noqa: BLE001 (an expected failure is the measurement)
        out = dict(error=type(exc).__name__, error_line=first_line(exc), losses=[], secs=[],
                   new_graphs=[])  # no step completed
    out.update(dynamo_stats(counting))
    return out


def run_order(args, ctx) -> dict:
    base = build(args, ctx.device)
    data = batches(args, ctx)
    cases, total = {}, 9

    def step(name, r):
        cases[name] = r
        dist.progress(len(cases), total, case=name, loss=(r["losses"] or [float("nan")])[-1])

    model = fsdp_wrap(copy.deepcopy(base))
    step("fsdp_eager", train(model, sgd(model, args), data, ctx))

    def fsdp_whole(counting):
        model = fsdp_wrap(copy.deepcopy(base))
        return torch.compile(model, backend=counting), model
    step("fsdp_whole", attempt(fsdp_whole, data, ctx, args))

    ddp = torch_ddp(copy.deepcopy(base), bucket_cap_mb=args.bucket_mb)
    step("ddp_eager", dict(train(ddp, sgd(ddp, args), data, ctx), ddp_buckets=torch_buckets(ddp)))

    def compile_first(counting):
        inner = torch.compile(copy.deepcopy(base), backend=counting)
        ddp = torch_ddp(inner, bucket_cap_mb=args.bucket_mb)
        return ddp, ddp

    def small_bucket(counting):
        ddp = torch_ddp(copy.deepcopy(base), bucket_cap_mb=args.small_bucket_mb)
        return torch.compile(ddp, backend=counting), ddp

    for name, make in (("ddp_compile_first", compile_first), ("small_bucket", small_bucket)):
        step(name, attempt(make, data, ctx, args))
    for name in ("ddp_compile_first", "small_bucket"):
        module = cases[name].pop("module", None)
        cases[name]["ddp_buckets"] = torch_buckets(module) if module is not None else None

    # recompiles: the first block's MLP, fed [batch, seq, hidden] with a new seq each step
    mlp = base.lm.model.layers[0].mlp
    seqs = [args.seq + 4 * i for i in range(args.shape_steps)]
    gen = torch.Generator().manual_seed(args.seed)
    shaped = [torch.randn(args.batch, s, args.hidden, generator=gen).to(ctx.device) for s in seqs]

    def square(model, x):
        return model(x).pow(2).mean()

    step("dynamic_auto", attempt(lambda c: (torch.compile(copy.deepcopy(mlp), backend=c),) * 2,
                                 shaped, ctx, args, square))
    limit = torch._dynamo.config.recompile_limit
    torch._dynamo.config.recompile_limit = args.recompile_limit
    try:
        step("dynamic_false", attempt(
            lambda c: (torch.compile(copy.deepcopy(mlp), backend=c, dynamic=False),) * 2,
            shaped, ctx, args, square))
    finally:
        torch._dynamo.config.recompile_limit = limit

    # kv_cache: with the cache on, dynamo guards on the cache's state for the block it compiled,
    # a guard the next block fails: a recompile per block, and past the limit the blocks run eagerly
    deep = copy.copy(args)
    deep.layers = args.recompile_limit + 2
    deep_model = build(deep, ctx.device)

    def per_block(cache):
        def make(counting):
            model = copy.deepcopy(deep_model)
            model.lm.config.use_cache = cache
            for block in model.lm.model.layers:
                block.compile(backend=counting)
            return model, model
        return make

    torch._dynamo.config.recompile_limit = args.recompile_limit
    try:
        for name, cache in (("kv_cache_on", True), ("kv_cache_off", False)):
            step(name, attempt(per_block(cache), data, ctx, args))
    finally:
        torch._dynamo.config.recompile_limit = limit
    for r in cases.values():
        r.pop("module", None)
    out = dict(part="order", cases=cases, seqs=seqs, recompile_limit=args.recompile_limit,
               deep_blocks=deep.layers,
               default_recompile_limit=limit, small_bucket_mb=args.small_bucket_mb,
               bucket_mb=args.bucket_mb)
    out["fsdp_whole_parity"] = parity(cases["fsdp_eager"]["losses"],
                                      cases["fsdp_whole"]["losses"], args.tol)
    out["ddp_compile_first_parity"] = parity(cases["ddp_eager"]["losses"],
                                             cases["ddp_compile_first"]["losses"], args.tol)
    return out
