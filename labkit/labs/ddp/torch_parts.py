"""Parts of the DDP lab (`python -m labkit.labs.ddp --part flags|straggler|sampler`) on torch's
own DistributedDataParallel and DistributedSampler; the model, data and step are labkit.labs.ddp's.

    torchrun --nproc-per-node 4 -m labkit.labs.ddp --part flags --caps 0.25,1,25
    labkit run ddp -n 2 -- --part straggler --sleep 0.05     # or --sleep-steps 2
    labkit run ddp -n 4 -- --part sampler --samples 10

labkit.labs.ddp.lab calls run_flags, run_straggler, run_sampler (args, ctx) and their print_*.
Predictions: labkit.scaling and labkit.comm; what each part measures: docs/labs.md, ## ddp.
"""
from __future__ import annotations

import contextlib
import copy
import time

import torch
import torch.distributed as tdist

from labkit.labs.common.training import (CausalLM, barrier, build_model, global_batch, median, shard,
                                         synchronize, torch_buckets, torch_ddp, trainable)
from labkit.runtime import measure

FLAGS = ("bucket_cap_mb", "gradient_as_bucket_view", "find_unused_parameters", "static_graph",
         "broadcast_buffers", "no_sync")         # what --part flags measures, one at a time
WARMUP = 3
USED_MAP_BYTES = 4         # the reducer's used-parameter map: one int32 per parameter tensor
TIMING_ROUNDS = 6          # interleaved steps per setting where a step-time ratio is reported


def trial(args, ctx, module, *, micro: int = 1, no_sync: bool = False, wrapper=None,
          capture: bool = False, set_to_none: bool = True, sleep_rank: int | None = None,
          **ddp_kwargs) -> dict:
    """Train `module` under torch DDP (or `wrapper(module)`, a reference DDP): WARMUP steps, one
    counted, args.steps timed. Each optimizer step runs `micro` backward passes (no_sync():
    all but the last inside it), then zero_grad(set_to_none). capture: the counted step's
    gradient and bucket storages, and the copies between them (`copies`). sleep_rank sleeps
    args.sleep before every other timed step's backward (reported apart as slow_s); with
    args.sleep_steps set, it sleeps that many healthy steps instead (the warm-up's median step,
    the slowest rank's), so the straggler shows on any machine however busy (out["sleep"])."""
    model = torch_ddp(module, **ddp_kwargs) if wrapper is None else wrapper(module)
    sync = getattr(model, "finish_gradient_synchronization", None)
    buffers: list = []
    if capture:
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        def keep_buffer(state, bucket):
            buffers.append(bucket.buffer())
            return allreduce_hook(state, bucket)
        model.register_comm_hook(None, keep_buffer)
        accumulated: dict = {}     # each gradient's storage when autograd accumulated it
        for p in trainable(model):
            p.register_post_accumulate_grad_hook(
                lambda p: accumulated.__setitem__(p, p.grad.untyped_storage().data_ptr()))
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    out: dict = {}
    times, slow, warm = [], [], []
    sleep = args.sleep
    counted = measure.CollectiveCounter()
    for step in range(WARMUP + 1 + (2 if sleep_rank is not None else 1) * args.steps):
        buffers.clear()
        sleeping = sleep_rank is not None and step > WARMUP and (step - WARMUP) % 2 == 0
        if sleep_rank is not None and step == WARMUP and getattr(args, "sleep_steps", None):
            sleep = args.sleep_steps * slowest(ctx, median(warm))
        barrier(ctx)
        t = time.perf_counter()
        with counted if step == WARMUP else contextlib.nullcontext():
            for j in range(micro):
                ids = shard(global_batch(args, ctx.world_size, step * micro + j), ctx)
                quiet = no_sync and j < micro - 1
                with model.no_sync() if quiet else contextlib.nullcontext():
                    loss = model(ids) / micro
                    if sleeping and ctx.rank == sleep_rank:
                        time.sleep(sleep)
                    loss.backward()
                    if sync is not None:
                        sync()
            if step == WARMUP:
                grads = [p.grad for p in model.parameters() if p.grad is not None]
                seen: set = set()      # unique storages: a gradient viewing a bucket counts once
                out["grads_and_buckets"] = (measure.storage_bytes(grads, seen)
                                            + measure.storage_bytes(buffers, seen))
                out["grad_norm"] = torch.cat([g.reshape(-1) for g in grads]).norm().item()
                if capture:
                    out["copies"] = copies(accumulated.values(), grads, buffers)
            opt.step()
            opt.zero_grad(set_to_none=set_to_none)
        synchronize(ctx.device)
        if step > WARMUP:
            (slow if sleeping else times).append(time.perf_counter() - t)
        elif step < WARMUP:
            warm.append(time.perf_counter() - t)
    by_kind = counted.by_kind
    calls, nbytes = by_kind.pop("all_reduce", (0, 0))
    out.update(calls=calls, bytes=nbytes, other=by_kind, step_s=median(times), times=times)
    if sleep_rank is not None:
        out.update(slow_s=median(slow), slow_times=slow, sleep=sleep)
    if wrapper is None:
        out["buckets"] = torch_buckets(model)
    return out


def copies(accumulated, grads, buffers) -> dict:
    """Gradient tensors copied into their bucket ("in": autograd wrote the gradient outside
    every bucket, so the reducer copies it in) and out of it ("out": after the backward the
    gradient still lies outside, so the reducer copied the average back), by storage."""
    inside = {b.untyped_storage().data_ptr() for b in buffers}
    return {"in": sum(ptr not in inside for ptr in accumulated),
            "out": sum(g.untyped_storage().data_ptr() not in inside for g in grads)}


def slowest(ctx, seconds: float) -> float:
    """The largest of every rank's `seconds` (all ranks call it)."""
    t = torch.tensor([seconds], dtype=torch.float64, device=ctx.device)
    if ctx.world_size > 1:
        tdist.all_reduce(t, op=tdist.ReduceOp.MAX)
    return t.item()


def interleaved(args, ctx, settings: dict, rounds: int = TIMING_ROUNDS) -> dict:
    """Step times of torch DDP under each setting ({label: (module, ddp_kwargs)}), the settings
    taking turns step by step after WARMUP steps each (the order reversed every other round):
    load from other work slows whichever setting runs at that moment, so taking turns spreads
    it over all of them, and the shortest step of each (timeit's rule) is the least disturbed.
    Two settings timed one after the other instead (2 steps each) once put
    find_unused_parameters=True at 0.68x the default: noise. {label: [seconds per step]}"""
    models = {k: torch_ddp(module, **kw) for k, (module, kw) in settings.items()}
    opts = {k: torch.optim.SGD(m.parameters(), lr=args.lr) for k, m in models.items()}
    times: dict = {k: [] for k in models}
    order = list(models)
    for step in range(WARMUP + rounds):
        ids = shard(global_batch(args, ctx.world_size, step), ctx)
        for k in (order if step % 2 == 0 else order[::-1]):
            barrier(ctx)
            t = time.perf_counter()
            models[k](ids).backward()
            opts[k].step()
            opts[k].zero_grad()
            synchronize(ctx.device)
            if step >= WARMUP:
                times[k].append(time.perf_counter() - t)
    return times


def ratio_spread(base: list, other: list) -> dict:
    """other against base: the ratio of their shortest steps, and the ratios of the steps taken
    side by side (round by round): their median and range, the spread a reader needs to tell
    a cost from noise."""
    pairs = sorted(b / a for a, b in zip(base, other))
    return dict(rounds=len(pairs), base_s=base, other_s=other, ratio_min=min(other) / min(base),
                ratio_median=median(pairs), ratio_low=pairs[0], ratio_high=pairs[-1])


def run_flags(args, ctx) -> dict:
    from labkit.comm import step_communication
    from labkit.parallel.ddp import BucketedDDP, assign_buckets
    from labkit.scaling import accumulation_communication, buckets

    base = build_model(args, ctx.device)
    P, T = sum(p.numel() for p in trainable(base)), len(trainable(base))
    G = step_communication("ddp", num_params=P, dp=ctx.world_size,
                           grad_bytes=4).payload["all_reduce"][1]
    flags = args.flag or FLAGS
    out: dict = dict(part="flags", rank=ctx.rank, world_size=ctx.world_size, num_params=P,
                     param_tensors=T, gradient_bytes=G, steps=args.steps, flags=list(flags))

    def row(value, r, predicted_bytes=G, predicted_calls=None, **extra):
        """One configuration's figures; calls predicted: the buckets torch reports."""
        if predicted_calls is None:
            predicted_calls = len(r["buckets"])
        return dict(value=value, calls=r["calls"], bytes=r["bytes"], other=r["other"],
                    step_s=r["step_s"], predicted_calls=predicted_calls,
                    predicted_bytes=predicted_bytes, ratio_bytes=r["bytes"] / predicted_bytes,
                    **extra)

    def fresh(**extra):
        if not extra:
            return copy.deepcopy(base)
        return CausalLM(copy.deepcopy(base.lm), **extra).to(ctx.device)

    if "bucket_cap_mb" in flags:
        out["bucket_cap_mb"] = [
            row(cap, r, bucket_sizes=r["buckets"], model_buckets=buckets(G, cap)[0])
            for cap in args.caps
            for r in [trial(args, ctx, fresh(), bucket_cap_mb=cap)]]
    if "gradient_as_bucket_view" in flags:
        def view_row(v, set_to_none):
            """Memory (2G without views, G with) and copies per step: T in unless the gradients
            stay views from step to step (views, zero_grad(set_to_none=False)), T out
            without views."""
            r = trial(args, ctx, fresh(), capture=True, set_to_none=set_to_none,
                      gradient_as_bucket_view=v)
            return row(v, r, memory=r["grads_and_buckets"], predicted_memory=G if v else 2 * G,
                       memory_ratio=r["grads_and_buckets"] / (G if v else 2 * G),
                       set_to_none=set_to_none, copies=r["copies"],
                       predicted_copies={"in": 0 if v and not set_to_none else T,
                                         "out": 0 if v else T})
        # the lab's default zero_grad(set_to_none=True), then views zeroed in place
        out["gradient_as_bucket_view"] = [view_row(v, True) for v in (False, True)]
        out["bucket_view_zeroed_in_place"] = view_row(True, False)
    if "find_unused_parameters" in flags:
        used = [row(v, r, predicted_bytes=G + (USED_MAP_BYTES * T if v else 0),
                    predicted_calls=len(r["buckets"]) + v)
                for v in (False, True)
                for r in [trial(args, ctx, fresh(), find_unused_parameters=v)]]
        lm = fresh(unused=True)
        extra = list(lm.unused.parameters())
        u = sum(p.numel() for p in extra)
        r = trial(args, ctx, lm, find_unused_parameters=True)
        out["find_unused_parameters"] = used + [row(
            True, r, predicted_bytes=G + 4 * u + USED_MAP_BYTES * (T + len(extra)),
            predicted_calls=len(r["buckets"]) + 1, unused_params=u)]
        out["unused_error"] = unused_error(args, ctx, fresh(unused=True))
        # the flag's cost is time (a walk of the autograd graph after every forward): measured
        # with the two settings taking turns, so that noise cannot pass for it
        times = interleaved(args, ctx, {False: (fresh(), {}),
                                        True: (fresh(), {"find_unused_parameters": True})})
        out["find_unused_time"] = ratio_spread(times[False], times[True])
    if "static_graph" in flags:
        out["static_graph"] = [row(v, r) for v in (False, True)
                               for r in [trial(args, ctx, fresh(), static_graph=v)]]
    if "broadcast_buffers" in flags:
        rows = []
        for elements, v in ((0, True), (args.buffer_elements, True), (args.buffer_elements, False)):
            r = trial(args, ctx, fresh(buffer=elements) if elements else fresh(),
                      forward_sync_buffers=v)
            b = r["other"].get("broadcast", (0, 0))
            nbytes = 4 * elements if v else 0
            rows.append(row(v, r, buffer_bytes=4 * elements, broadcasts=b[0],
                            broadcast_bytes=b[1], predicted_broadcasts=int(nbytes > 0),
                            predicted_broadcast_bytes=nbytes))
        out["broadcast_buffers"] = rows
    if "no_sync" in flags:
        rows = []
        for impl in ("torch", "bucketed"):
            for v in (False, True):
                wrapper = (None if impl == "torch" else
                           lambda m: BucketedDDP(m, bucket_size_mb=args.bucket_mb))
                r = trial(args, ctx, fresh(), micro=args.micro, no_sync=v, wrapper=wrapper,
                          **({"bucket_cap_mb": args.bucket_mb} if impl == "torch" else {}))
                k = (len(r["buckets"]) if impl == "torch" else
                     len(assign_buckets(trainable(base), args.bucket_mb)))
                pred = accumulation_communication(P, ctx.world_size, args.micro, no_sync=v)
                rows.append(row(v, r, predicted_bytes=pred.total_payload,
                                predicted_calls=k * (1 if v else args.micro), impl=impl,
                                micro=args.micro, grad_norm=r["grad_norm"]))
        out["no_sync"] = rows
    return out


def unused_error(args, ctx, module) -> str:
    """The first line of what torch DDP raises when a parameter gets no gradient and
    find_unused_parameters is off ('' if it does not raise)."""
    model = torch_ddp(module)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    try:
        for step in range(2):
            ids = shard(global_batch(args, ctx.world_size, step), ctx)
            model(ids).backward()
            opt.step()
            opt.zero_grad()
    except RuntimeError as exc:
        return str(exc).strip().splitlines()[0]
    return ""


def print_flags(r: dict) -> None:
    G = r["gradient_bytes"]
    print(f"torch DDP on {r['world_size']} rank(s), {r['num_params']:,} parameters in "
          f"{r['param_tensors']} tensors: gradients G = {G:,.0f} B; per step, after {WARMUP} "
          f"warm-up steps; time: median of {r['steps']}")
    head = (f"{'flag':<30}{'value':>7}{'all-reduces':>12}{'predicted':>10}{'bytes':>12}"
            f"{'predicted':>12}{'ratio':>7}{'step ms':>9}")
    print(head)
    for flag in FLAGS:
        for x in r.get(flag, []):
            label = flag if flag != "no_sync" else f"no_sync ({x['impl']}, {x['micro']} micro)"
            print(f"{label:<30}{str(x['value']):>7}{x['calls']:>12}{x['predicted_calls']:>10}"
                  f"{x['bytes']:>12,}{x['predicted_bytes']:>12,.0f}{x['ratio_bytes']:>7.3f}"
                  f"{1e3 * x['step_s']:>9.1f}")
            if "memory" in x:
                print(f"{'':<37}gradients + buckets {x['memory']:,} B, predicted "
                      f"{x['predicted_memory']:,.0f} B, ratio {x['memory_ratio']:.3f}")
                print_copies(x)
            if "broadcasts" in x:
                print(f"{'':<37}buffers {x['buffer_bytes']:,} B: {x['broadcasts']} broadcast(s) "
                      f"of {x['broadcast_bytes']:,} B per forward, predicted "
                      f"{x['predicted_broadcasts']} of {x['predicted_broadcast_bytes']:,} B")
            if "unused_params" in x:
                print(f"{'':<37}(a model with {x['unused_params']} unused parameters)")
    if "bucket_view_zeroed_in_place" in r:
        x = r["bucket_view_zeroed_in_place"]
        print(f"gradient_as_bucket_view=True, zero_grad(set_to_none=False): gradients + buckets "
              f"{x['memory']:,} B")
        print_copies(x)
    if "find_unused_time" in r:
        t = r["find_unused_time"]
        print(f"find_unused_parameters=True / default, step time, {t['rounds']} interleaved steps "
              f"each: shortest {t['ratio_min']:.3f}x; step by step median {t['ratio_median']:.3f}x, "
              f"range {t['ratio_low']:.2f}-{t['ratio_high']:.2f}x")
    if "unused_error" in r:
        print(f"an unused parameter without find_unused_parameters: {r['unused_error']}")


def print_copies(x: dict) -> None:
    c, p = x["copies"], x["predicted_copies"]
    print(f"{'':<37}gradient tensors copied into the buckets {c['in']} (predicted {p['in']}), "
          f"out {c['out']} (predicted {p['out']})")


# ---------------------------------------------------------------------------------------------
# --part straggler

def run_straggler(args, ctx) -> dict:
    from labkit.scaling import straggler, throughput_loss

    r = trial(args, ctx, build_model(args, ctx.device), sleep_rank=args.slow_rank,
              bucket_cap_mb=args.bucket_mb)
    # each rank's shortest healthy and shortest straggling step (timeit's rule: the two kinds
    # take turns, and a busy machine only lengthens a step; every straggling step still holds
    # the whole sleep, which the all-reduce makes every rank wait for)
    mine = [min(r["times"]), min(r["slow_times"])]
    every = [None] * ctx.world_size
    if ctx.world_size > 1:
        tdist.all_gather_object(every, mine)
    else:
        every = [mine]
    base = [b for b, _ in every]
    slow = [s for _, s in every]
    t_base, t_slow = median(base), median(slow)
    work = [b + (r["sleep"] if rank == args.slow_rank else 0.0) for rank, b in enumerate(base)]
    predicted = straggler(work, baseline=t_base)
    increase = t_slow / t_base - 1
    return dict(part="straggler", rank=ctx.rank, world_size=ctx.world_size, sleep=r["sleep"],
                sleep_steps=args.sleep_steps,
                slow_rank=args.slow_rank, steps=args.steps, base_s=base, slow_s=slow,
                my_base_times=r["times"], my_slow_times=r["slow_times"],
                predicted_slow_s=predicted.step_time,
                ratio=[s / predicted.step_time for s in slow],
                step_time_increase=increase, throughput_loss=throughput_loss(max(0.0, increase)),
                predicted_throughput_loss=predicted.throughput_loss)


def print_straggler(r: dict) -> None:
    asked = (f" ({r['sleep_steps']:g} healthy warm-up steps)" if r.get("sleep_steps") else "")
    print(f"torch DDP, {r['world_size']} ranks; rank {r['slow_rank']} sleeps {r['sleep']:.3g} s"
          f"{asked} per step in alternate steps (shortest of {r['steps']} each)")
    print(f"{'rank':<6}{'base ms':>9}{'slow ms':>9}{'predicted':>11}{'ratio':>7}")
    for rank, (b, s, q) in enumerate(zip(r["base_s"], r["slow_s"], r["ratio"])):
        print(f"{rank:<6}{1e3 * b:>9.1f}{1e3 * s:>9.1f}{1e3 * r['predicted_slow_s']:>11.1f}"
              f"{q:>7.3f}")
    print(f"step time +{100 * r['step_time_increase']:.1f}%: throughput lost "
          f"{100 * r['throughput_loss']:.1f}% (= 1 - t_base / t_slow), predicted "
          f"{100 * r['predicted_throughput_loss']:.1f}%")


# ---------------------------------------------------------------------------------------------
# --part sampler

def run_sampler(args, ctx) -> dict:
    from torch.utils.data import DistributedSampler

    from labkit.scaling import distributed_sampler_indices

    n, R = args.samples, ctx.world_size
    rows = []
    for shuffle in (False, True):
        for drop_last in (False, True):
            sampler = DistributedSampler(range(n), num_replicas=R, rank=ctx.rank,
                                         shuffle=shuffle, seed=args.seed, drop_last=drop_last)
            for epoch in (0, 1):
                sampler.set_epoch(epoch)
                order = (torch.randperm(n, generator=torch.Generator().manual_seed(
                    args.seed + epoch)).tolist() if shuffle else list(range(n)))
                predicted = [order[i] for i in distributed_sampler_indices(n, R, ctx.rank,
                                                                            drop_last)]
                got = list(sampler)
                rows.append(dict(shuffle=shuffle, drop_last=drop_last, epoch=epoch,
                                 indices=got, predicted=predicted, match=got == predicted))
    every = [None] * R
    if R > 1:
        tdist.all_gather_object(every, rows)
    else:
        every = [rows]
    out = dict(part="sampler", rank=ctx.rank, world_size=R, samples=n, seed=args.seed,
               sampler=rows)
    if ctx.rank == 0:
        out["all_ranks"] = every
    return out


def print_sampler(r: dict) -> None:
    every = r["all_ranks"]
    print(f"DistributedSampler over {r['samples']} samples on {r['world_size']} ranks "
          f"(seed {r['seed']}): each rank's indices, then whether they equal the prediction")
    for i, row in enumerate(every[0]):
        per_rank = [ranks[i]["indices"] for ranks in every]
        flat = [x for idx in per_rank for x in idx]
        repeated = sorted({x for x in flat if flat.count(x) > 1})
        ok = all(ranks[i]["match"] for ranks in every)
        print(f"shuffle={str(row['shuffle']):<5} drop_last={str(row['drop_last']):<5} "
              f"epoch {row['epoch']}: " + "  ".join(f"r{k}={v}" for k, v in enumerate(per_rank))
              + f"  repeated {repeated}, dropped {sorted(set(range(r['samples'])) - set(flat))}"
              + f"  {'= predicted' if ok else '!= predicted'}")
