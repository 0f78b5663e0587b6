"""DDP lab: the three reference DDPs beside torch's DistributedDataParallel, measured in one run;
torch DDP's flags; a straggler; DistributedSampler on real ranks.

    python -m labkit.labs.ddp                                        # one process (nothing sent)
    torchrun --nproc-per-node 2 -m labkit.labs.ddp --part compare     # 2 ranks: gloo on CPU
    torchrun --nproc-per-node 4 -m labkit.labs.ddp --part flags --caps 0.25,1,25
    labkit run ddp -n 2 -- --part straggler --trace traces/          # + profiler traces
    labkit run ddp -n 4 -- --part sampler --samples 10
    labkit bench ddp                                                 # throughput, bucketed vs torch

From a notebook: `run_lab("labkit.labs.ddp", nproc=2, args=["--part", "flags"])`. Each part's
measurements and predictions (labkit.comm, labkit.scaling after Li et al. 2020): docs/labs.md."""
from __future__ import annotations

import argparse
import copy
import time

import torch
import torch.distributed as tdist
from torch.distributed.elastic.multiprocessing.errors import record

from labkit.runtime import dist, measure
from labkit.labs.common.flags import between, check_heads, positive_int
from labkit.labs.common.tracing import check_folder, trace_steps
from labkit.labs.common.training import barrier, build_model, global_batch, median, shard, torch_ddp, train_step, trainable
from labkit.labs.common.training import torch_buckets
from labkit.labs.ddp.torch_parts import FLAGS

PARTS = ("compare", "flags", "straggler", "sampler")
REFERENCES = ("naive", "overlapped", "bucketed")
KINDS = ("local", *REFERENCES, "torch")
# Steps before the counted one: torch DDP records the order gradients arrive in during the first
# backward and rebuilds its buckets, broadcasting rank 0's order, in the second forward.
WARMUP = 2


# ---------------------------------------------------------------------------------------------
# model and data (shared by every part)


# ---------------------------------------------------------------------------------------------
# --part compare

def wrap(kind: str, module, args):
    from labkit.parallel.ddp import BucketedDDP, NaiveDDP, OverlappedDDP

    if kind == "naive":
        return NaiveDDP(module)
    if kind == "overlapped":
        return OverlappedDDP(module)
    if kind == "bucketed":
        return BucketedDDP(module, bucket_size_mb=args.bucket_mb)
    if kind == "torch":
        return torch_ddp(module, bucket_cap_mb=args.bucket_mb)
    return module




def planned_calls(kind: str, model, args) -> int:
    """All-reduces per step each implementation plans (what the counted step is compared to):
    one per parameter tensor (naive, overlapped), assign_buckets' buckets (bucketed), the
    buckets torch's reducer reports (torch), none (local)."""
    from labkit.parallel.ddp import assign_buckets

    if kind == "bucketed":
        return len(assign_buckets(trainable(model.module), args.bucket_mb))
    if kind == "torch":
        return len(torch_buckets(model))
    return len(trainable(model.module)) if kind in REFERENCES else 0


def run_compare(args, ctx) -> dict:
    from labkit.comm import step_communication
    from labkit.labs.common.ddp_measure import Timeline, link_figures, predicted_step
    from labkit.plots.timeline import summarize

    base = build_model(args, ctx.device)
    n_params = sum(p.numel() for p in trainable(base))
    n_tensors = len(trainable(base))
    models, opts, syncs = {}, {}, {}
    for kind in KINDS:
        module = copy.deepcopy(base)
        models[kind] = model = wrap(kind, module, args)
        opts[kind] = torch.optim.SGD(model.parameters(), lr=args.lr)
        syncs[kind] = model.finish_gradient_synchronization if kind in REFERENCES else None
    losses = {k: [] for k in KINDS}
    times = {k: [] for k in KINDS}
    counted, timeline, instrumented = {}, {}, {}
    for step in range(args.steps):
        ids = shard(global_batch(args, ctx.world_size, step), ctx)
        for kind in KINDS:
            model, opt, sync = models[kind], opts[kind], syncs[kind]
            barrier(ctx)
            if step == WARMUP:
                with measure.CollectiveCounter() as counted[kind]:
                    losses[kind].append(train_step(model, opt, ids, sync))
            elif step == WARMUP + 1:
                module = model.module if kind != "local" else model
                with Timeline(module) as tl:
                    losses[kind].append(train_step(model, opt, ids, sync, tl.mark))
                timeline[kind], instrumented[kind] = tl.events, tl.events["step_end"]
            else:
                t = time.perf_counter()
                losses[kind].append(train_step(model, opt, ids, sync))   # .item() waits
                if step > WARMUP + 1:
                    times[kind].append(time.perf_counter() - t)
        dist.progress(step + 1, args.steps, loss=losses["torch"][-1])

    # the loss over the whole batch is the mean of the ranks' (equal-size shards, mean losses)
    table = torch.tensor([losses[k] for k in KINDS], dtype=torch.float64)
    if ctx.world_size > 1:
        tdist.all_reduce(table)
    table /= ctx.world_size
    mean_loss = {k: table[i].tolist() for i, k in enumerate(KINDS) if k != "local"}
    replica = {}
    for kind in REFERENCES + ("torch",):
        flat = torch.cat([p.detach().reshape(-1) for p in models[kind].parameters()])
        mine = flat.clone()
        if ctx.world_size > 1:
            tdist.broadcast(flat, 0)
        diff = torch.tensor([(mine - flat).abs().max().item()])
        if ctx.world_size > 1:
            tdist.all_reduce(diff, op=tdist.ReduceOp.MAX)
        replica[kind] = diff.item()

    out = dict(part="compare", rank=ctx.rank, world_size=ctx.world_size, backend=ctx.backend,
               device=str(ctx.device), num_params=n_params, param_tensors=n_tensors,
               batch=args.batch, seq=args.seq, global_batch=args.batch * ctx.world_size,
               layers=args.layers, hidden=args.hidden, steps=args.steps, lr=args.lr,
               bucket_mb=args.bucket_mb, impls=list(KINDS),
               losses=mean_loss, replica_max_diff=replica)
    if ctx.rank == 0:
        ref_losses, ref = reference(base, args, ctx.world_size)
        out["reference_losses"] = ref_losses
        out["loss_max_diff"] = {k: max(abs(a - b) for a, b in zip(v, ref_losses))
                                for k, v in mean_loss.items()}
        out["param_max_diff"] = {k: max((p.detach() - q.detach()).abs().max().item() for p, q in
                                        zip(models[k].parameters(), ref.parameters()))
                                 for k in mean_loss}

    comm = step_communication("ddp", num_params=n_params, dp=ctx.world_size, grad_bytes=4)
    predicted_bytes = comm.payload["all_reduce"][1]
    compute = median(times["local"])
    link = link_figures(args, ctx, int(predicted_bytes))
    allreduce, other, calls, step_s, pred_step = {}, {}, {}, {}, {}
    for kind in KINDS:
        by_kind = counted[kind].by_kind
        allreduce[kind] = dict(zip(("calls", "bytes"), by_kind.pop("all_reduce", (0, 0))))
        other[kind] = by_kind
        calls[kind] = planned_calls(kind, models[kind], args)
        step_s[kind] = median(times[kind])
        pred_step[kind] = predicted_step(kind, n_params, calls[kind], compute, link, args,
                                         ctx.world_size)
    refs = [k for k in KINDS if k != "local"]
    out.update(
        allreduce=allreduce, other_collectives=other, link=link,
        predicted=dict(bytes=predicted_bytes, calls=calls, step_s=pred_step,
                       wire_bytes=comm.by_op["all_reduce"][1]),
        ratio=dict(bytes={k: allreduce[k]["bytes"] / predicted_bytes for k in refs},
                   calls={k: allreduce[k]["calls"] / calls[k] for k in refs},
                   step_s={k: step_s[k] / pred_step[k] for k in KINDS}),
        step_s=step_s, step_times=times, instrumented_step_s=instrumented,
        samples_per_s={k: args.batch * ctx.world_size / step_s[k] for k in KINDS},
        timeline=timeline, timeline_summary={k: summarize(timeline[k]) for k in KINDS})
    if args.trace is not None:      # after every measurement: the traced steps change nothing
        out["traces"] = trace_compare(args, ctx, base, models, opts, syncs)
    return out


ONE_BUCKET_MB = 1e4     # torch DDP with every gradient in one bucket: nothing overlaps backward


def trace_compare(args, ctx, base, models, opts, syncs) -> list[str]:
    """--trace: each DDP's profiled steps (labkit.labs.common.tracing), and torch DDP with one
    bucket, whose single all-reduce can only start once the backward has ended."""
    models, opts = dict(models), dict(opts)
    one = models["torch-onebucket"] = torch_ddp(copy.deepcopy(base), bucket_cap_mb=ONE_BUCKET_MB)
    opts["torch-onebucket"] = torch.optim.SGD(one.parameters(), lr=args.lr)
    ids = shard(global_batch(args, ctx.world_size, args.steps), ctx)
    for _ in range(WARMUP):             # its buckets rebuilt, as the others' are
        train_step(one, opts["torch-onebucket"], ids)
    paths = []
    for kind in (*REFERENCES, "torch", "torch-onebucket"):
        model, opt, sync = models[kind], opts[kind], syncs.get(kind)
        plan = len(torch_buckets(model)) if kind == "torch-onebucket" else \
            planned_calls(kind, model, args)
        paths.append(trace_steps(ctx, args.trace, "ddp", kind,
                                 lambda: train_step(model, opt, ids, sync),  # noqa: B023
                                 extra=dict(planned_all_reduce=plan, bucket_mb=args.bucket_mb
                                            if kind != "torch-onebucket" else ONE_BUCKET_MB)))
    return paths


def trace_straggler(args, ctx, sleep: float) -> list[str]:
    """--trace with --part straggler: torch DDP steps in which --slow-rank sleeps `sleep` s
    between forward and backward; the others wait for it in the all-reduce."""
    model = torch_ddp(build_model(args, ctx.device), bucket_cap_mb=args.bucket_mb)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    ids = shard(global_batch(args, ctx.world_size, 0), ctx)
    for _ in range(WARMUP):
        train_step(model, opt, ids)

    def step():
        loss = model(ids)
        if ctx.rank == args.slow_rank:
            time.sleep(sleep)
        loss.backward()
        opt.step()
        opt.zero_grad()
    return [trace_steps(ctx, args.trace, "ddp", "straggler", step,
                        extra=dict(sleep=sleep, slow_rank=args.slow_rank,
                                   planned_all_reduce=len(torch_buckets(model))))]


def reference(base, args, world: int):
    """Rank 0 alone: the same model trained on the whole batch (losses, final model)."""
    model = copy.deepcopy(base)
    device = next(model.parameters()).device
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    losses = [train_step(model, opt, global_batch(args, world, step).to(device))
              for step in range(args.steps)]
    return losses, model


def print_compare(r: dict) -> None:
    print(f"transformers GPT-2 from config: {r['layers']} layers, h {r['hidden']}: "
          f"{r['num_params']:,} parameters in {r['param_tensors']} tensors, fp32, SGD; "
          f"{r['world_size']} rank(s) x {r['batch']} x {r['seq']} tokens, {r['backend']} on "
          f"{r['device']}; buckets of {r['bucket_mb']:g} MiB")
    link = r["link"]
    print(f"step times predicted by labkit.scaling.ddp_step_time from the compute-only step and "
          f"link {link['name']!r}: latency {1e6 * link['latency']:.0f} us, bandwidth "
          f"{link['bandwidth'] / 1e9:.2f} GB/s per direction")
    p, ratio = r["predicted"], r["ratio"]
    print(f"{'impl':<11}{'loss diff':>10}{'param diff':>11}{'all-reduces':>12}{'planned':>8}"
          f"{'bytes/step':>12}{'predicted':>11}{'ratio':>7}{'step ms':>9}{'predicted':>10}"
          f"{'ratio':>7}{'hidden':>7}")
    for k in r["impls"]:
        s = r["timeline_summary"][k]
        if k == "local":
            print(f"{k:<11}{'':>10}{'':>11}{'':>12}{'':>8}{'':>12}{'':>11}{'':>7}"
                  f"{1e3 * r['step_s'][k]:>9.1f}{'(compute only)':>24}")
            continue
        a = r["allreduce"][k]
        print(f"{k:<11}{r['loss_max_diff'][k]:>10.1e}{r['param_max_diff'][k]:>11.1e}"
              f"{a['calls']:>12}{p['calls'][k]:>8}{a['bytes']:>12,}{p['bytes']:>11,.0f}"
              f"{ratio['bytes'][k]:>7.3f}{1e3 * r['step_s'][k]:>9.1f}"
              f"{1e3 * p['step_s'][k]:>10.1f}{ratio['step_s'][k]:>7.2f}"
              f"{100 * s['overlap']:>6.0f}%")
    print(f"(loss/param diff: largest over the steps / parameters against rank 0's 1-process "
          f"reference on the whole batch; hidden: share of all-reduce time under the backward "
          f"in the instrumented step; on the wire a ring sends {p['wire_bytes']:,.0f} B per rank)")


# ---------------------------------------------------------------------------------------------
# the command line

def sizes(text: str) -> list[float]:
    """'0.25,1,25' -> [0.25, 1.0, 25.0] (MiB, > 0)."""
    try:
        values = [float(x) for x in str(text).split(",") if x.strip()]
    except ValueError:
        values = []
    if not values or any(not (0 < v < 1e6) for v in values):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a list of bucket sizes; allowed: comma-separated MiB > 0, e.g. "
            "0.25,1,25")
    return values



def parse_args(argv=None):
    from labkit.hardware import LINKS

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--part", choices=PARTS, default="compare", help="what to run (default compare)")
    p.add_argument("--layers", type=positive_int, default=4, help="GPT-2 layers (default 4)")
    p.add_argument("--hidden", type=positive_int, default=128, help="hidden size (default 128)")
    p.add_argument("--heads", type=positive_int, default=8, help="attention heads (default 8)")
    p.add_argument("--vocab", type=positive_int, default=1024, help="vocabulary (default 1024)")
    p.add_argument("--seq", type=positive_int, default=64, help="tokens per sequence (default 64)")
    p.add_argument("--batch", type=positive_int, default=4, help="sequences per rank (default 4)")
    p.add_argument("--steps", type=positive_int, default=None,
                   help="compare: steps in all (>= 5: 2 warm-up, 1 counted, 1 timeline, the "
                        "rest timed; default 8); flags/straggler: timed steps (default 3)")
    p.add_argument("--lr", type=between(1e-9, 10, "a learning rate"), default=0.1,
                   help="SGD learning rate (default 0.1)")
    p.add_argument("--bucket-mb", type=sizes, default=[1.0],
                   help="MiB per bucket, BucketedDDP and torch DDP (default 1)")
    p.add_argument("--link", choices=["measured", *sorted(LINKS)], default="measured",
                   help="link figures for the step-time prediction: 'measured' (default: "
                        "latency and bandwidth fitted to this run's all-reduces) or a "
                        "labkit.hardware.LINKS name")
    p.add_argument("--caps", type=sizes, default=[0.25, 1.0, 25.0],
                   help="flags: bucket_cap_mb values to compare (default 0.25,1,25)")
    p.add_argument("--flag", action="append", choices=FLAGS,
                   help="flags: run only this flag's measurements (repeatable; default all)")
    p.add_argument("--buffer-elements", type=positive_int, default=1024,
                   help="flags: float32 buffer added for broadcast_buffers (default 1024)")
    p.add_argument("--micro", type=positive_int, default=4,
                   help="flags: micro-batches per optimizer step for no_sync (default 4)")
    p.add_argument("--sleep", type=between(0, 3600, "a number of seconds"), default=0.05,
                   help="straggler: seconds the slow rank sleeps per step (default 0.05)")
    p.add_argument("--sleep-steps", type=between(0.01, 1000, "a number of healthy steps"),
                   default=None,
                   help="straggler: sleep this many healthy steps instead (the warm-up's median "
                        "step of the slowest rank), so the straggler shows however busy the "
                        "machine is")
    p.add_argument("--slow-rank", type=int, default=1, help="straggler: the slow rank (default 1)")
    p.add_argument("--samples", type=positive_int, default=10,
                   help="sampler: dataset length (default 10)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--trace", default=None, metavar="DIR",
                   help="compare, straggler: after the measured steps, profile 2 more steps per "
                        "DDP (torch.profiler) and write DIR/ddp-{variant}-rank{r}.json "
                        "(labkit.trace reads them; default: no trace)")
    args = p.parse_args(argv)
    if args.trace is not None and args.part not in ("compare", "straggler"):
        p.error(f"argument --trace: --part {args.part} writes no trace; allowed: with --part "
                "compare or straggler")
    check_folder(p, args.trace)
    if len(args.bucket_mb) != 1:
        p.error(f"argument --bucket-mb: give one size, not {len(args.bucket_mb)}")
    args.bucket_mb = args.bucket_mb[0]
    if args.steps is None:
        args.steps = 8 if args.part == "compare" else 3
    if args.part == "compare" and args.steps < WARMUP + 3:
        p.error(f"argument --steps: {args.steps} is too few for --part compare; allowed: "
                f">= {WARMUP + 3} ({WARMUP} warm-up, 1 counted, 1 timeline, 1 or more timed)")
    check_heads(p, args, kv=False)
    return args, p


@record
def main(argv: list[str] | None = None) -> None:
    args, parser = parse_args(argv)
    ctx = dist.setup()
    if args.part == "compare":
        result = run_compare(args, ctx)
        if ctx.rank == 0:
            print_compare(result)
    else:
        from labkit.labs.ddp import torch_parts as parts

        if args.part == "straggler" and not 0 <= args.slow_rank < ctx.world_size:
            parser.error(f"argument --slow-rank: {args.slow_rank} is not a rank of this run; "
                         f"allowed: 0 to {ctx.world_size - 1}")
        result = getattr(parts, f"run_{args.part}")(args, ctx)
        if args.part == "straggler" and args.trace is not None:
            result["traces"] = trace_straggler(args, ctx, result["sleep"])
        if ctx.rank == 0:
            getattr(parts, f"print_{args.part}")(result)
    dist.report(**result)
    dist.shutdown()


if __name__ == "__main__":
    main()
