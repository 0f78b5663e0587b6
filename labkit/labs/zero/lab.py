"""ZeRO lab: DDP, ZeRO-1/2/3 by hand and torch's ZeroRedundancyOptimizer, measured side by side.

    python -m labkit.labs.zero                                   # one process (nothing sharded)
    torchrun --nproc-per-node 4 -m labkit.labs.zero               # 4 ranks: gloo on CPU
    torchrun --nproc-per-node 2 -m labkit.labs.zero --impl zero3 --layers 4 --hidden 256
    labkit run zero -n 4 -- --hidden 66 --heads 6      # shards that need padding
    labkit run zero -n 4                                          # via labkit

From a notebook: `run_lab("labkit.labs.zero", nproc=4)`, then
`labkit.plots.zero.measured_bars(result.results[0]["stages"])` draws the memory. Sources:
Rajbhandari et al. 2020 (ZeRO); what is measured and predicted: docs/labs.md, ## zero.
"""
from __future__ import annotations

import argparse
import copy
import time

import torch
import torch.distributed as tdist
from torch.distributed.elastic.multiprocessing.errors import record

from labkit.labs.common.zero_stages import (EXTRA, IMPLS, TERMS, build, padding, predicted_comm,
                                      predicted_memory, wire_expected)
from labkit.labs.common.wire import bytes_written
from labkit.labs.common.training import barrier, global_batch, median, shard
from labkit.labs.common.flags import between, check_heads, run_and_report, positive_int
from labkit.labs.common.flags import model_flags
from labkit.runtime import dist, measure
from labkit.labs.common.zero_stages import build_model, gathered, reference

PARTS = ("compare",)
WARMUP = 2     # torch DDP rebuilds its buckets after the first step; ZeRO's states exist after one



def train_step(stage, ids, after=None) -> float:
    loss = stage.model(ids)
    loss.backward()
    if stage.sync is not None:
        stage.sync()
    stage.opt.step()
    if after is not None:
        after()
    stage.opt.zero_grad()
    return loss.item()



def run_compare(args, ctx) -> dict:
    base = build_model(args, ctx.device)
    n_params = sum(p.numel() for p in base.parameters())
    sizes = [p.numel() for p in base.parameters() if p.requires_grad]
    stages = {k: build(k, copy.deepcopy(base), args.lr) for k in args.impl}
    losses = {k: [] for k in args.impl}
    times = {k: [] for k in args.impl}
    held, counted, written = {}, {}, {}
    for step in range(args.steps):
        ids = shard(global_batch(args, ctx.world_size, step), ctx)
        for kind, stage in stages.items():
            barrier(ctx)
            if step == WARMUP:
                w0 = bytes_written()
                with measure.CollectiveCounter() as counted[kind]:
                    losses[kind].append(train_step(
                        stage, ids, lambda s=stage, k=kind: held.__setitem__(
                            k, measure.state_bytes(s.model, s.opt))))
                w1 = bytes_written()
                written[kind] = None if w0 is None or ctx.backend != "gloo" else w1 - w0
            else:
                t = time.perf_counter()
                losses[kind].append(train_step(stage, ids))
                if step > WARMUP:
                    times[kind].append(time.perf_counter() - t)
        dist.progress(step + 1, args.steps, loss=losses[args.impl[0]][-1])

    table = torch.tensor([losses[k] for k in args.impl], dtype=torch.float64)
    if ctx.world_size > 1:
        tdist.all_reduce(table)
    table /= ctx.world_size
    mean_loss = {k: table[i].tolist() for i, k in enumerate(args.impl)}
    finals = {k: {n: t.clone() for n, t in s.full_parameters().items()}
              for k, s in stages.items()}

    out = dict(part="compare", rank=ctx.rank, world_size=ctx.world_size, backend=ctx.backend,
               device=str(ctx.device), num_params=n_params, layers=args.layers,
               hidden=args.hidden, batch=args.batch, seq=args.seq, steps=args.steps, lr=args.lr,
               impls=list(args.impl), losses=mean_loss)
    out["stages"] = {k: figures(k, held[k], counted[k].by_kind, written[k], sizes, ctx)
                     for k in args.impl}
    step_s = {k: median(times[k]) for k in args.impl}
    ddp = step_s.get("ddp")
    out["step_s"] = step_s
    out["step_vs_ddp"] = {k: v / ddp for k, v in step_s.items()} if ddp else {}
    if ctx.rank == 0:
        ref_losses, ref = reference(base, args, ctx.world_size)
        out["reference_losses"] = ref_losses
        out["loss_max_diff"] = {k: max(abs(a - b) for a, b in zip(v, ref_losses))
                                for k, v in mean_loss.items()}
        out["param_max_diff"] = {k: max((finals[k][n].cpu() - p.detach().cpu()).abs().max().item()
                                        for n, p in ref.named_parameters())
                                 for k in args.impl}
    return out


def figures(kind, state, by_kind, written, sizes, ctx) -> dict:
    """One implementation's memory, communication and wire figures, with predictions and
    ratios (measured / predicted); `padding` / `payload_padding`: the bytes padding adds to
    the predictions, and `ratio_padded` / `ratio_payload_padded` against the sums (1.000
    whatever the sizes)."""
    n_params = sum(sizes)
    measured = {t: getattr(state, t) for t in TERMS}
    predicted = predicted_memory(kind, n_params, ctx.world_size)
    pad_memory, pad_comm = padding(kind, sizes, ctx.world_size)
    everyone = gathered([measured[t] for t in TERMS], ctx)
    summed = {t: sum(r[i] for r in everyone) for i, t in enumerate(TERMS)}
    comm, ring_sent = predicted_comm(kind, n_params, ctx.world_size)
    issued = {op: {"calls": c, "bytes": b} for op, (c, b) in by_kind.items()}
    ratio_comm = {op: issued.get(op, {"bytes": 0})["bytes"] / b for op, b in comm.items() if b}
    out = dict(measured=measured, predicted=predicted,
               ratio={t: measured[t] / predicted[t] if predicted[t] else None for t in TERMS},
               by_rank=everyone, summed_ratio={t: summed[t] / (ctx.world_size * predicted[t])
                                               if predicted[t] else None for t in TERMS},
               padding=pad_memory,
               ratio_padded={t: measured[t] / (predicted[t] + pad_memory[t]) if predicted[t]
                             else None for t in TERMS},
               optimizer_steps=state.optimizer_steps,
               collectives=issued, predicted_collectives=comm, ratio_collectives=ratio_comm,
               payload=sum(b for _, b in by_kind.values()), predicted_payload=sum(comm.values()))
    out["ratio_payload"] = out["payload"] / out["predicted_payload"] if comm else None
    out["payload_padding"] = sum(pad_comm.values())
    out["ratio_payload_padded"] = (out["payload"] / (out["predicted_payload"] + sum(
        pad_comm.values())) if comm else None)
    expected = wire_expected(by_kind, ctx.world_size)
    out["wire"] = dict(predicted_ring=ring_sent, issued_ring=expected["ring"],
                       issued_gloo=expected["gloo"], sent=None)
    if written is not None:
        total = sum(w for w in gathered(written, ctx))
        out["wire"].update(sent=total / ctx.world_size,
                           vs_ring=total / ctx.world_size / ring_sent if ring_sent else None,
                           vs_gloo=(total / ctx.world_size / expected["gloo"]
                                    if expected["gloo"] else None))
    return out



def print_compare(r: dict) -> None:
    n = r["world_size"]
    print(f"transformers Llama from config: {r['layers']} layers, h {r['hidden']}: "
          f"{r['num_params']:,} parameters (P), fp32, AdamW; {n} rank(s) x {r['batch']} x "
          f"{r['seq']} tokens, {r['backend']} on {r['device']}")
    print("per-rank model states (bytes on rank 0; ratio = measured / estimate_memory; "
          "sum = all ranks / (N x predicted))")
    print(f"{'impl':<11}{'params':>10}{'grads':>10}{'optim':>10}{'predicted':>11}"
          f"{'ratios p/g/o':>20}{'sum ratios':>20}{'padding':>9}{'ratio':>7}")
    for k in r["impls"]:
        s = r["stages"][k]
        m, p = s["measured"], s["predicted"]
        ratios = "/".join(f"{s['ratio'][t]:.3f}" for t in TERMS)
        sums = "/".join(f"{s['summed_ratio'][t]:.3f}" for t in TERMS)
        pad = sum(s["padding"].values())
        print(f"{k:<11}{m['params']:>10,}{m['grads']:>10,}{m['optimizer_states']:>10,}"
              f"{sum(p.values()):>11,.0f}{ratios:>20}{sums:>20}{pad:>9,.0f}"
              f"{sum(m.values()) / (sum(p.values()) + pad):>7.3f}")
    print(f"communication of one step (payload S in bytes; 4P = {4 * r['num_params']:,})")
    print(f"{'impl':<11}{'issued':<44}{'payload':>11}{'predicted':>11}{'ratio':>7}"
          f"{'wire/rank':>11}{'ring':>11}{'gloo':>11}")
    for k in r["impls"]:
        s = r["stages"][k]
        issued = ", ".join(f"{op} {c['calls']}x" for op, c in s["collectives"].items())
        w = s["wire"]
        sent = f"{w['sent']:>11,.0f}" if w["sent"] is not None else f"{'-':>11}"
        print(f"{k:<11}{issued:<44}{s['payload']:>11,}{s['predicted_payload']:>11,.0f}"
              f"{s['ratio_payload']:>7.3f}{sent}{w['predicted_ring']:>11,.0f}"
              f"{w['issued_gloo']:>11,.0f}")
    print("(wire/rank: bytes this lab's processes wrote, averaged over ranks; ring: what "
          "step_communication says a ring sends; gloo: the same for what was issued, with "
          "gloo's reduce_scatter sent as an all_reduce)")
    if "loss_max_diff" in r:
        print(f"{'impl':<11}{'loss diff':>10}{'param diff':>11}{'step ms':>9}{'vs DDP':>8}")
        for k in r["impls"]:
            vs = r["step_vs_ddp"].get(k, float("nan"))
            print(f"{k:<11}{r['loss_max_diff'][k]:>10.1e}{r['param_max_diff'][k]:>11.1e}"
                  f"{1e3 * r['step_s'][k]:>9.1f}{vs:>8.2f}")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--part", choices=PARTS, default="compare", help="what to run (default compare)")
    p.add_argument("--impl", action="append", choices=IMPLS + EXTRA,
                   help="an implementation to run (repeatable; default: "
                        f"{', '.join(IMPLS)}; also {', '.join(EXTRA)})")
    model_flags(p, layers=2, hidden=128, heads=8, seq=64)
    p.add_argument("--steps", type=positive_int, default=5,
                   help=f"steps in all (>= {WARMUP + 2}: {WARMUP} warm-up, 1 counted, the rest "
                        "timed; default 5)")
    p.add_argument("--lr", type=between(1e-9, 1, "a learning rate"), default=1e-3,
                   help="AdamW learning rate (default 1e-3)")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the weights and of the batches (default 0)")
    args = p.parse_args(argv)
    args.impl = list(dict.fromkeys(args.impl)) if args.impl else list(IMPLS)
    if args.steps < WARMUP + 2:
        p.error(f"argument --steps: {args.steps} is too few; allowed: >= {WARMUP + 2} "
                f"({WARMUP} warm-up, 1 counted, 1 or more timed)")
    check_heads(p, args)
    return args, p


@record
def main(argv: list[str] | None = None) -> None:
    args, _ = parse_args(argv)
    run_and_report(run_compare, print_compare, args)


if __name__ == "__main__":
    main()
