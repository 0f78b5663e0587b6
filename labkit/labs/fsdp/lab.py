"""FSDP lab: FSDP2 `fully_shard` on a transformers model, measured beside its predictions.

    torchrun --nproc-per-node 4 -m labkit.labs.fsdp                     # --part compare
    labkit run fsdp -n 4 -- --part timeline --trace traces/  # unit by unit; + profiler traces
    labkit run fsdp -n 4 -- --part options --model gpt2                # every option, measured
    labkit run fsdp -n 2 -- --part fsdp1                               # FSDP1 beside FSDP2
    labkit bench fsdp                                                  # step time per option

From a notebook: `run_lab("labkit.labs.fsdp", nproc=4, args=["--part", "options"])`;
`labkit.plots.fsdp` draws the figures. Predictions: labkit.fsdp (read from torch 2.13's
fully_shard) and labkit.memory; the model and what each part measures: docs/labs.md, ## fsdp.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import time

from torch.distributed.elastic.multiprocessing.errors import record

from labkit.labs.fsdp import options as options
from labkit.labs.fsdp.build import adamw, build, mean_over_ranks, wire_payload
from labkit.labs.common.training import barrier, global_batch, median, shard
from labkit.labs.common.flags import between, check_heads, run_and_report, positive_int
from labkit.labs.common.flags import model_flags
from labkit.labs.common.tracing import check_folder, trace_steps
from labkit.labs.common.zero_stages import gathered, reference
from labkit.runtime import dist, measure

PARTS = ("compare", "timeline", "options", "fsdp1")
MODELS = ("llama", "gpt2")
TERMS = ("params", "grads", "optimizer_states")
WARMUP = 1


def full_parameters(kind, model) -> dict:
    """{name: full tensor} (collective: every rank calls it, in the same order)."""
    if kind == "zero3":
        return model.gather_full_params()
    return {n: p.full_tensor() if hasattr(p, "full_tensor") else p.detach()
            for n, p in model.named_parameters()}



def run_compare(args, ctx) -> dict:
    from labkit.comm import step_communication
    from labkit.fsdp import fsdp_communication, fsdp_memory
    from labkit.labs.common.zero_stages import build as build_stage
    from labkit.memory import estimate_memory
    from labkit.parallel.fsdp import shard_model

    base, spec = build(args, ctx.device)
    P, N = sum(p.numel() for p in base.parameters()), ctx.world_size
    zero3 = build_stage("zero3", copy.deepcopy(base), args.lr)
    fsdp = shard_model(copy.deepcopy(base))
    models = {"zero3": (zero3.model, zero3.opt, zero3.sync), "fsdp": (fsdp, adamw(fsdp, args.lr),
                                                                      None)}
    losses, times, held, counted = {k: [] for k in models}, {k: [] for k in models}, {}, {}
    for step in range(args.steps):
        ids = shard(global_batch(args, N, step), ctx)
        for kind, (model, opt, sync) in models.items():
            barrier(ctx)
            t = time.perf_counter()
            counter = measure.CollectiveCounter() if step == WARMUP else contextlib.nullcontext()
            with counter as comm:
                loss = model(ids)
                loss.backward()
                if sync is not None:
                    sync()
                opt.step()
            if step == WARMUP:
                held[kind], counted[kind] = measure.state_bytes(model, opt), comm.by_kind
            opt.zero_grad()
            losses[kind].append(loss.item())
            if step > WARMUP:
                times[kind].append(time.perf_counter() - t)
        dist.progress(step + 1, args.steps, loss=losses["fsdp"][-1])

    est = estimate_memory(P, precision="fp32", optimizer="adamw", zero_stage=3, dp=N)
    mem = fsdp_memory(spec, N)
    predicted_comm = {
        "zero3": step_communication("zero3", num_params=P, dp=N),
        "fsdp": fsdp_communication(spec, N)}
    out = dict(part="compare", rank=ctx.rank, world_size=N, backend=ctx.backend,
               device=str(ctx.device), model=args.model, num_params=P, layers=args.layers,
               hidden=args.hidden, batch=args.batch, seq=args.seq, steps=args.steps,
               impls=list(models), losses=mean_over_ranks(losses, ctx),
               step_s={k: median(v) for k, v in times.items()},
               predicted={t: getattr(est, t) for t in TERMS},
               predicted_fsdp={t: getattr(mem, t) for t in TERMS})
    out["stages"] = {}
    for kind in models:
        measured = {t: getattr(held[kind], t) for t in TERMS}
        comm = predicted_comm[kind]
        want = {op: {"calls": c, "bytes": b} for op, (c, b) in wire_payload(comm).items()}
        got = {op: {"calls": c, "bytes": b} for op, (c, b) in counted[kind].items()}
        out["stages"][kind] = dict(
            measured=measured, by_rank=gathered([measured[t] for t in TERMS], ctx),
            ratio={t: measured[t] / out["predicted"][t] for t in TERMS},
            ratio_fsdp_memory={t: measured[t] / out["predicted_fsdp"][t] for t in TERMS},
            optimizer_steps=held[kind].optimizer_steps, collectives=got,
            predicted_collectives=want,
            ratio_collectives={op: got.get(op, {"bytes": 0})["bytes"] / w["bytes"]
                               for op, w in want.items()})
        # the hand-built ZeRO-3 gathers and reduces a tied tensor once per module holding it
        extra = (P + tied(base)) / P if kind == "zero3" else 1.0
        out["stages"][kind]["ratio_collectives_tied"] = {
            op: r / extra for op, r in out["stages"][kind]["ratio_collectives"].items()}
    finals = {k: {n: t.clone() for n, t in full_parameters(k, m).items()}
              for k, (m, _, _) in models.items()}
    if ctx.rank == 0:
        ref_losses, ref = reference(base, args, N)
        out["reference_losses"] = ref_losses
        out["loss_max_diff"] = {k: max(abs(a - b) for a, b in zip(v, ref_losses))
                                for k, v in out["losses"].items()}
        out["param_max_diff"] = {k: max((finals[k][n].cpu() - p.detach().cpu()).abs().max().item()
                                        for n, p in ref.named_parameters())
                                 for k in models}
    return out


def tied(model) -> int:
    """Elements of the parameters that more than one module holds (GPT-2's wte and lm_head)."""
    owners: dict = {}
    for module in model.modules():
        for p in module._parameters.values():
            if p is not None:
                owners.setdefault(id(p), [p, 0])[1] += 1
    return sum(p.numel() for p, n in owners.values() if n > 1)



def run_timeline(args, ctx) -> dict:
    """One counted step per prefetch setting (0 and --prefetch), each unit's events in order."""
    from labkit.labs.fsdp.timeline import Timeline
    from labkit.parallel.fsdp import shard_model

    base, _ = build(args, ctx.device)
    runs = {}
    for prefetch in dict.fromkeys((0, args.prefetch)):
        model = shard_model(copy.deepcopy(base), prefetch=prefetch)
        opt = adamw(model, args.lr)
        for step in range(WARMUP + 1):
            ids = shard(global_batch(args, ctx.world_size, step), ctx)
            barrier(ctx)
            rec = Timeline(model) if step == WARMUP else None
            with rec or contextlib.nullcontext():
                model(ids).backward()
                opt.step()
                opt.zero_grad()

        def step(model=model, opt=opt, ids=ids):
            model(ids).backward()
            opt.step()
            opt.zero_grad()
        runs[f"prefetch={prefetch}"] = dict(events=rec.events, order=rec.order(),
                                            in_flight=rec.in_flight,
                                            predicted_in_flight=0 if ctx.world_size == 1
                                            else max(1, min(prefetch, args.layers - 1)),
                                            trace=trace_steps(ctx, args.trace, "fsdp",
                                                              f"prefetch{prefetch}", step,
                                                              extra=dict(layers=args.layers)))
    return dict(part="timeline", rank=ctx.rank, world_size=ctx.world_size, model=args.model,
                layers=args.layers, units=[f"block{i}" for i in range(args.layers)] + ["root"],
                runs=runs)


def print_compare(r: dict) -> None:
    n = r["world_size"]
    print(f"transformers {r['model']} from config: {r['layers']} layers, h {r['hidden']}: "
          f"{r['num_params']:,} parameters (P), fp32 AdamW; {n} rank(s), {r['backend']}")
    print(f"{'impl':<7}{'params':>10}{'grads':>10}{'optim':>10}{'ratio p/g/o':>20}"
          f"  {'issued (calls, S bytes)':<46}{'S ratio':>14}{'loss diff':>11}{'step ms':>9}")
    for k in r["impls"]:
        s = r["stages"][k]
        m = s["measured"]
        ratios = "/".join(f"{s['ratio'][t]:.3f}" for t in TERMS)
        issued = ", ".join(f"{op} {c['calls']}x {c['bytes']:,}" for op, c in
                           s["collectives"].items())
        comm = "/".join(f"{v:.3f}" for v in s["ratio_collectives"].values())
        diff = r.get("loss_max_diff", {}).get(k, float("nan"))
        print(f"{k:<7}{m['params']:>10,}{m['grads']:>10,}{m['optimizer_states']:>10,}"
              f"{ratios:>20}  {issued:<46}{comm:>14}{diff:>11.1e}"
              f"{1e3 * r['step_s'][k]:>9.1f}")
    print("(ratios: measured / estimate_memory(zero_stage=3) and / step_communication: "
          "'zero3' for the hand-built one, FSDP2's per unit for fsdp)")


def print_timeline(r: dict) -> None:
    for name, run in r["runs"].items():
        print(f"{name}: {' '.join(run['order'])}")
        print(f"  all-gathers in flight at most: {run['in_flight']} "
              f"(predicted {run['predicted_in_flight']})")


PRINT = {"compare": print_compare, "timeline": print_timeline,
         "options": options.print_options, "fsdp1": options.print_fsdp1}
RUN = {"compare": run_compare, "timeline": run_timeline, "options": options.run_options,
       "fsdp1": options.run_fsdp1}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--part", choices=PARTS, default="compare", help="what to run (default compare)")
    p.add_argument("--model", choices=MODELS, default="llama",
                   help="transformers model from a config (default llama)")
    p.add_argument("--option", action="append", choices=options.OPTIONS,
                   help="--part options: an option to measure against the default (repeatable; "
                        "default all)")
    p.add_argument("--prefetch", type=positive_int, default=1,
                   help="--part timeline: blocks prefetched in the second run (default 1)")
    model_flags(p, layers=2, hidden=64, heads=4, seq=32)
    p.add_argument("--steps", type=positive_int, default=4,
                   help=f"steps (>= {WARMUP + 2}: {WARMUP} warm-up, 1 counted, the rest timed; "
                        "--part options runs one more, for FSDPMemTracker; default 4)")
    p.add_argument("--lr", type=between(1e-9, 1, "a learning rate"), default=1e-3,
                   help="AdamW learning rate (default 1e-3)")
    p.add_argument("--seed", type=int, default=0, help="seed of weights and batches (default 0)")
    p.add_argument("--trace", default=None, metavar="DIR",
                   help="--part timeline: after each counted step, profile 2 more "
                        "(torch.profiler) and write DIR/fsdp-prefetch{k}-rank{r}.json "
                        "(labkit.trace reads them; default: no trace)")
    args = p.parse_args(argv)
    if args.trace is not None and args.part != "timeline":
        p.error(f"argument --trace: --part {args.part} writes no trace; allowed: with --part "
                "timeline")
    check_folder(p, args.trace)
    args.option = list(dict.fromkeys(args.option)) if args.option else list(options.OPTIONS)
    if args.steps < WARMUP + 2:
        extra = " (options: then 1 more step for FSDPMemTracker)" if args.part == "options" else ""
        p.error(f"argument --steps: {args.steps} is too few for --part {args.part}; allowed: >= "
                f"{WARMUP + 2} ({WARMUP} warm-up, 1 counted, 1 or more timed{extra})")
    check_heads(p, args)
    return args, p


@record
def main(argv: list[str] | None = None) -> None:
    args, _ = parse_args(argv)
    run_and_report(RUN[args.part], PRINT[args.part], args)


if __name__ == "__main__":
    main()
